"""kill -9 of any process of an engine's tree mid-generation (the engine of TP=1, the engine or
the worker of TP=2, the engine or either stage of PP=2, either engine of DP=2): EngineDeadError within 2 s, and by the time it is
raised no process of the tree is left and nothing any of them created is left in /dev/shm (the
frontend's channel, the TP broadcast ring, the all-reduce arena, their semaphores)."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest

from ipc.segment import pid_alive
from shmvllm import LLM, SamplingParams
from shmvllm.engine.exceptions import EngineDeadError

ENGINE_ARGS = dict(max_model_len=256, num_kv_blocks=64)
LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
# Work for seconds even on a fast machine (a tiny model decodes 200 tokens in ~0.3 s): 64 requests
# through 64 KV blocks per engine run in waves, so the kill always lands mid-generation.
PROMPTS = [f"prompt {i}" for i in range(64)]
_NAME = re.compile(r"^(?:sem\.)?ipcring-(\d+)-")

pytestmark = pytest.mark.usefixtures("no_engine_left_behind")


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
        except (OSError, IndexError):
            pass
    return found


def _segments_of(pids: set[int]) -> list[str]:
    return sorted(e.name for e in Path("/dev/shm").iterdir() if (m := _NAME.match(e.name)) and int(m.group(1)) in pids)


def _kill_mid_generate(llm: LLM, victim: int, tree: set[int]) -> None:
    killed_at: list[float] = []

    def kill() -> None:
        time.sleep(0.3)
        killed_at.append(time.monotonic())
        os.kill(victim, signal.SIGKILL)

    killer = threading.Thread(target=kill)
    killer.start()
    with pytest.raises(EngineDeadError):
        llm.generate(PROMPTS, LONG, use_tqdm=False)
    raised_at = time.monotonic()
    killer.join()
    assert killed_at, "generate ended before the kill"
    assert raised_at - killed_at[0] < 2.0, f"EngineDeadError {raised_at - killed_at[0]:.2f} s after the kill"
    # at the raise already, not after a later shutdown or the next LLM's sweep
    assert [p for p in tree if pid_alive(p)] == []
    assert _segments_of(tree | {os.getpid()}) == []
    with pytest.raises(EngineDeadError):
        llm.generate(["again"], LONG, use_tqdm=False)


@pytest.mark.parametrize("victim", ["engine", "worker"])
def test_kill_9_of_either_process_of_a_tp2_engine_leaves_nothing(tiny_llama_dir, victim):
    with LLM(str(tiny_llama_dir), tensor_parallel_size=2, **ENGINE_ARGS) as llm:
        engine = llm.llm_engine.engine_core.engine_pid
        workers = _children(engine)
        assert len(workers) == 1, workers
        assert _segments_of({engine}), "the TP=2 engine should hold its broadcast ring"
        _kill_mid_generate(llm, engine if victim == "engine" else workers[0], {engine, *workers})


@pytest.mark.parametrize("victim", [0, 1, "engine"])
def test_kill_9_of_any_process_of_a_pp2_engine_leaves_nothing(tiny_llama_dir, victim):
    with LLM(str(tiny_llama_dir), pipeline_parallel_size=2, **ENGINE_ARGS) as llm:
        engine = llm.llm_engine.engine_core.engine_pid
        # a stage's command line: python -m shmvllm.worker.pp_worker RING INDEX ...
        stages = {int(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[4]): pid for pid in _children(engine)}
        assert sorted(stages) == [0, 1], stages
        _kill_mid_generate(llm, engine if victim == "engine" else stages[victim], {engine, *stages.values()})


@pytest.mark.parametrize("victim", [0, 1])
def test_kill_9_of_either_engine_of_dp2_leaves_nothing(tiny_llama_dir, victim):
    with LLM(str(tiny_llama_dir), data_parallel_size=2, **ENGINE_ARGS) as llm:
        pids = llm.llm_engine.engine_core.engine_pids
        _kill_mid_generate(llm, pids[victim], set(pids))


def test_kill_9_of_a_tp1_engine_leaves_nothing(tiny_llama_dir):
    with LLM(str(tiny_llama_dir), **ENGINE_ARGS) as llm:
        engine = llm.llm_engine.engine_core.engine_pid
        _kill_mid_generate(llm, engine, {engine})


_STUCK_RANK0 = """
import os, sys, time
from shmvllm.engine.arg_utils import EngineArgs
from shmvllm.executor.multiproc import MultiprocExecutor

config = EngineArgs(model=sys.argv[1], tensor_parallel_size=2, max_model_len=256).create_engine_config()
executor = MultiprocExecutor(config)
print(executor.procs[0].pid, executor.ring.name, flush=True)
os.kill(executor.procs[0].pid, 9)
executor._call(time.sleep, 60)  # a collective that never hears of the death, as gloo's send can
"""


def test_a_dead_worker_ends_an_engine_stuck_in_a_collective(tiny_llama_dir, tmp_path):
    """Rank 0 blocked in a call that never fails (gloo can wait out its 60 s timeout on a send to a
    killed rank): the watchdog kills the rest and exits the engine's process within 2 s, leaving
    no worker and nothing in /dev/shm."""
    import subprocess
    import sys

    script = tmp_path / "stuck_rank0.py"
    script.write_text(_STUCK_RANK0)
    proc = subprocess.Popen([sys.executable, str(script), str(tiny_llama_dir)], stdout=subprocess.PIPE, text=True)
    worker, ring = proc.stdout.readline().split()
    killed_at = time.monotonic()
    assert proc.wait(timeout=30) == 1
    assert time.monotonic() - killed_at < 2.0
    assert not pid_alive(int(worker))
    assert _segments_of({proc.pid}) == [] and not (Path("/dev/shm") / ring.lstrip("/")).exists()


_FAILS_AFTER_START = """
import os, sys
from shmvllm.engine.arg_utils import EngineArgs
from shmvllm.engine.core import EngineCore
from shmvllm.executor.multiproc import MultiprocExecutor

class KvSizingFails(MultiprocExecutor):
    def determine_num_kv_blocks(self):
        print(" ".join(str(p.pid) for p in self.procs), self.ring.name, flush=True)
        raise RuntimeError("KV sizing failed")

config = EngineArgs(model=sys.argv[1], tensor_parallel_size=2, max_model_len=256).create_engine_config()
try:
    EngineCore(config, executor_class=KvSizingFails)
except RuntimeError as exc:
    print("raised", exc, flush=True)
os._exit(0)  # as the engine's process exits: no interpreter teardown, no finalizers
"""


def test_an_engine_whose_set_up_fails_after_its_workers_started_stops_them(tiny_llama_dir, tmp_path):
    """A failure between the executor's start and READY (here the KV cache sizing) stops the
    workers and removes the rings before the engine's process exits: no process and nothing in
    /dev/shm left."""
    import subprocess
    import sys

    script = tmp_path / "fails_after_start.py"
    script.write_text(_FAILS_AFTER_START)
    out = subprocess.run([sys.executable, str(script), str(tiny_llama_dir)], capture_output=True, text=True, timeout=120)
    lines = out.stdout.splitlines()
    assert lines[-1] == "raised KV sizing failed", out.stderr[-2000:]
    *workers, ring = lines[0].split()
    assert all(not pid_alive(int(pid)) for pid in workers)
    assert not (Path("/dev/shm") / ring.lstrip("/")).exists()
