"""The engine in its own process: same outputs as in-process over the rings, and every way
it can end (shutdown, garbage collection, kill -9 of either side, a failing step, a failing
start, Ctrl-C) leaves no process and nothing in /dev/shm behind."""

from __future__ import annotations

import gc
import multiprocessing.util
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from conftest import leaked_shm_entries, wait_until_dead
from ipc.segment import pid_alive
from shmvllm import LLM, SamplingParams
from shmvllm.engine.arg_utils import EngineArgs
from shmvllm.boundary import channel
from shmvllm.engine.core_client import MPClient
from shmvllm.engine.exceptions import EngineDeadError, EngineStartupError, EngineUtilityError
from shmvllm.boundary.messages import EngineCoreRequest
from shmvllm.executor.uniproc import UniProcExecutor

ENGINE_ARGS = dict(max_model_len=1024, num_kv_blocks=512)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = ["Hello, my name is", "The capital of France is", "1, 2, 3,", "Once upon a time"]


pytestmark = pytest.mark.usefixtures("no_engine_left_behind")


def token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_outputs_identical_in_process_and_over_shm(tiny_llama_dir):
    """Step counts may differ: requests reach a separate engine while it is already stepping."""
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=24, ignore_eos=True)
    results = {}
    for multiprocess in (False, True):
        with LLM(str(tiny_llama_dir), multiprocess=multiprocess, **ENGINE_ARGS) as llm:
            client = llm.llm_engine.engine_core
            results[multiprocess] = (
                token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)),
                token_ids(llm.generate(PROMPTS, seeded, use_tqdm=False)),
                [o.outputs[0].text for o in llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)],
                client.ready.num_kv_blocks, client.ready.block_size, client.get_stats()["num_steps"] > 0,
                llm.llm_engine.reset_prefix_cache(),
            )
            pid = getattr(client, "engine_pid", None)
        if pid is not None:
            wait_until_dead(pid, 2.0)
    inproc = results[False]
    assert len(inproc[0]) == 4 and all(len(ids) == 24 for ids in inproc[0])
    assert results[True] == inproc


def make_client(tiny_llama_dir, engines: int = 1, **kwargs) -> MPClient:
    config = EngineArgs(model=str(tiny_llama_dir), data_parallel_size=engines, **ENGINE_ARGS).create_engine_config()
    return MPClient(config, **kwargs)


def test_utility_calls_return_results_and_exceptions(tiny_llama_dir):
    client = make_client(tiny_llama_dir)
    pid = client.engine_pid
    assert client.get_stats()["num_kv_blocks"] == client.ready.num_kv_blocks == 512
    with pytest.raises(EngineUtilityError, match="TypeError"):
        client.call_utility("abort_requests", 5)
    with pytest.raises(EngineUtilityError, match="AttributeError.*no_such_method"):
        client.call_utility("no_such_method")
    with pytest.raises(EngineUtilityError, match="no public method '_validate'"):
        client.call_utility("_validate", None)
    assert client.reset_prefix_cache() is True  # the engine still serves after failed calls
    del client  # a garbage-collected client stops its engine
    gc.collect()
    wait_until_dead(pid, 5.0)


def add_many(client: MPClient, count: int, prompt_len: int = 100, max_tokens: int = 2) -> None:
    """Adds `count` requests, pausing now and then so the engine steps meanwhile."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompt = EngineCoreRequest.pack_token_ids(list(range(5, 5 + prompt_len)))
    for i in range(count):
        if i % 20 == 0:
            time.sleep(0.002)
        client.add_request(EngineCoreRequest(request_id=str(i), prompt_token_ids=prompt, sampling_params=params))


def test_full_rings_both_ways_do_not_deadlock(tiny_llama_dir, monkeypatch):
    """The frontend adds while nobody reads the outputs: the engine's outputs wait in its outbox
    (backlogged, it stops stepping) while it keeps draining its input, so the frontend's blocked
    sends complete. A deadlock makes the watchdog kill the engine (EngineDeadError)."""
    monkeypatch.setattr(channel, "RING_CAPACITY", 1 << 16)
    client = make_client(tiny_llama_dir)
    # ~6 s alone, ~35 s beside one CPU-bound process on 2 cores (before and after the nap
    # phase): a deadlock never ends, so the watchdog's bound needs no tightness
    watchdog = threading.Timer(120, os.kill, args=(client.engine_pid, signal.SIGKILL))
    watchdog.start()
    try:
        add_many(client, 6000)
        finished = set()
        while len(finished) < 6000:
            finished.update(o.request_id for o in client.get_output().outputs if o.finished)
    finally:
        watchdog.cancel()
        client.shutdown()
    assert finished == {str(i) for i in range(6000)}


def test_shutdown_with_a_full_output_ring_is_clean(tiny_llama_dir, monkeypatch):
    """The engine holds outputs nobody read: it drains its input all the same, so it reads
    SHUTDOWN and exits by itself (code 0) instead of being terminated after a timeout."""
    monkeypatch.setattr(channel, "RING_CAPACITY", 1 << 14)
    client = make_client(tiny_llama_dir)
    add_many(client, 64, prompt_len=10, max_tokens=500)  # ~6 KiB in, ~600 B out per step
    time.sleep(1.0)  # the engine fills the output ring and blocks
    started = time.monotonic()
    client.shutdown()
    assert time.monotonic() - started < 3.0
    assert client.handles[0].manager.exitcode == 0


def test_a_forked_child_exiting_leaves_the_engine_alone(tiny_llama_dir):
    """A child forked from the frontend runs multiprocessing's exit finalizers when it exits; they
    must not stop (or close the rings of) the engine, which belongs to the parent."""
    client = make_client(tiny_llama_dir)
    try:
        ring = client.handles[0].endpoint._send_ring
        pid = os.fork()
        if pid == 0:
            try:
                ring.close()
                multiprocessing.util._run_finalizers(0)
            finally:
                os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
        assert client.reset_prefix_cache() is True
        assert client.handles[0].manager.is_alive()
    finally:
        client.shutdown()


class EngineFailure(BaseException):
    """Not an Exception: what a step cannot recover from (the engine reports it and exits)."""


class FailingExecutor(UniProcExecutor):
    """Fails fatally in the third model step: an engine failure in the middle of serving. (An
    Exception there only fails that step's requests: see test_engine_fault_isolation.)"""

    def execute_model(self, scheduler_output):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == 3:
            raise EngineFailure("boom in execute_model")
        return super().execute_model(scheduler_output)


@pytest.mark.parametrize("engines", [1, 2])
def test_exception_in_step_raises_engine_dead_error(tiny_llama_dir, engines):
    """A fatal failure in a step: EngineDeadError with the engine's error; with two engines
    (both fail at their third step) naming the one found first, the other shut down."""
    client = make_client(tiny_llama_dir, engines, executor_class=FailingExecutor)
    try:
        pids = client.engine_pids
        for i in range(engines):  # one request each
            request = EngineCoreRequest(
                request_id=f"r{i}", prompt_token_ids=EngineCoreRequest.pack_token_ids([1, 2, 3 + i]),
                sampling_params=SamplingParams(max_tokens=50, ignore_eos=True),
            )
            client.add_request(request)
        which = "engine process" if engines == 1 else "engine [01] of 2"
        with pytest.raises(EngineDeadError, match=f"(?s){which} .*it failed: .*EngineFailure: boom in execute_model"):
            for _ in range(100):
                client.get_output()
        with pytest.raises(EngineDeadError):  # and every later call
            client.add_request(request)
        for pid in pids:
            wait_until_dead(pid, 2.0)
    finally:
        client.shutdown()


def kill_engine_during_generate(tiny_llama_dir) -> float:
    with LLM(str(tiny_llama_dir), **ENGINE_ARGS) as llm:
        pid = llm.llm_engine.engine_core.engine_pid
        killed_at: list[float] = []

        def kill() -> None:
            time.sleep(0.3)
            killed_at.append(time.monotonic())
            os.kill(pid, signal.SIGKILL)

        killer = threading.Thread(target=kill)
        killer.start()
        params = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
        with pytest.raises(EngineDeadError):
            llm.generate(PROMPTS, params, use_tqdm=False)
        raised_at = time.monotonic()
        killer.join()
        assert not llm.llm_engine.has_unfinished_requests()
    return raised_at - killed_at[0]


def test_kill_engine_during_generate_raises_within_2s(tiny_llama_dir):
    for _ in range(3):
        assert kill_engine_during_generate(tiny_llama_dir) < 2.0


@pytest.mark.slow
def test_kill_engine_during_generate_20_trials(tiny_llama_dir):
    delays = [kill_engine_during_generate(tiny_llama_dir) for _ in range(20)]
    assert max(delays) < 2.0, delays


def channel_segments(client: MPClient) -> set[str]:
    """The client's two rings (and their semaphores, where the rings use them) in /dev/shm."""
    names = {client.addresses.to_engine.lstrip("/"), client.addresses.to_frontend.lstrip("/")}
    return {entry.name for entry in Path("/dev/shm").iterdir() if any(name in entry.name for name in names)}


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_to_the_engine_is_engine_dead_error_and_leaves_nothing(tiny_llama_dir, signum):
    """The engine says why it stops, closes its side and dies of the signal; the frontend raises
    EngineDeadError saying so, and by then the engine is reaped and the channel removed."""
    name = signal.Signals(signum).name
    with LLM(str(tiny_llama_dir), **ENGINE_ARGS) as llm:
        client = llm.llm_engine.engine_core
        pid = client.engine_pid
        assert channel_segments(client)
        signalled_at: list[float] = []

        def terminate() -> None:
            time.sleep(0.3)
            signalled_at.append(time.monotonic())
            os.kill(pid, signum)

        killer = threading.Thread(target=terminate)
        killer.start()
        params = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
        with pytest.raises(EngineDeadError, match=f"terminated by {name}"):
            llm.generate(PROMPTS, params, use_tqdm=False)
        raised_at = time.monotonic()
        killer.join()
        assert raised_at - signalled_at[0] < 2.0
        assert not channel_segments(client), "the dead engine's channel stayed in /dev/shm"
        wait_until_dead(pid, 2.0)
        client.handles[0].manager.join(1.0)
        assert client.handles[0].manager.exitcode == -signum
        with pytest.raises(EngineDeadError, match=f"terminated by {name}"):
            llm.generate(["again"], params, use_tqdm=False)


def run_script(tmp_path: Path, body: str) -> subprocess.Popen:
    script = tmp_path / "frontend.py"
    script.write_text(textwrap.dedent(body))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


FRONTEND = """
import signal
import sys
from shmvllm import LLM, SamplingParams

if __name__ == "__main__":
    # Ctrl-C as in a terminal, even when the test runs where SIGINT is ignored (a shell's
    # background job): Python leaves an inherited SIG_IGN in place.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    llm = LLM({model!r}, max_model_len=1024, num_kv_blocks=512)
    client = llm.llm_engine.engine_core
    print("ENGINE", client.engine_pid, client.addresses.to_engine, flush=True)
    params = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
    print("GENERATING", flush=True)
    try:
        llm.generate(["Hello"] * 8, params, use_tqdm=False)
    except KeyboardInterrupt:
        stats = client.get_stats()
        print("INTERRUPTED", stats["num_running_reqs"], stats["num_waiting_reqs"], flush=True)
        raise
"""


def start_frontend(tmp_path: Path, tiny_llama_dir) -> tuple[subprocess.Popen, int, str]:
    proc = run_script(tmp_path, FRONTEND.format(model=str(tiny_llama_dir)))
    _, pid, address = proc.stdout.readline().split()
    assert proc.stdout.readline().strip() == "GENERATING"
    time.sleep(0.5)
    return proc, int(pid), address


def test_kill_frontend_engine_exits_within_2s(tmp_path, tiny_llama_dir):
    proc, engine_pid, _ = start_frontend(tmp_path, tiny_llama_dir)
    try:
        assert pid_alive(engine_pid)
        proc.kill()
        proc.wait(timeout=10)
        assert wait_until_dead(engine_pid, 2.0) < 2.0
        deadline = time.monotonic() + 2.0  # the engine removes what the frontend left
        left = lambda: {name for name in leaked_shm_entries() if f"-{proc.pid}-" in name}  # noqa: E731
        while left() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not left(), f"the dead frontend's segments stayed: {sorted(left())}"
    finally:
        proc.kill()
        proc.communicate()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_to_the_frontend_removes_its_rings_before_it_dies(tmp_path, tiny_llama_dir, signum):
    """The frontend dies of the signal as without shmvllm (exit status -signum), but first removes
    its rings and stops its engine: nothing of it is left once it is gone, not even for the
    engine's sweep."""
    proc, engine_pid, _ = start_frontend(tmp_path, tiny_llama_dir)
    try:
        proc.send_signal(signum)
        assert proc.wait(timeout=10) == -signum
        left = {name for name in leaked_shm_entries() if f"-{proc.pid}-" in name}
        assert not left, f"the frontend's segments outlived it: {sorted(left)}"
        assert wait_until_dead(engine_pid, 2.0) < 2.0
    finally:
        proc.kill()
        proc.communicate()


def test_ctrl_c_during_generate_aborts_and_leaves_nothing(tmp_path, tiny_llama_dir):
    proc, engine_pid, _ = start_frontend(tmp_path, tiny_llama_dir)
    try:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert "INTERRUPTED 0 0" in out, err  # the engine holds none of its requests any more
    assert "KeyboardInterrupt" in err
    wait_until_dead(engine_pid, 2.0)


class FailingLoadExecutor(UniProcExecutor):
    def __init__(self, config) -> None:
        raise FileNotFoundError(2, "no such weights", "/nowhere/model.safetensors")


@pytest.mark.parametrize("engines", [1, 2])
def test_a_failing_load_names_its_type_and_message_in_the_first_line(tiny_llama_dir, engines):
    """The first line of the error says why (a log line or a test summary shows only it); the
    engine's traceback follows; every engine is stopped (no_engine_left_behind)."""
    with pytest.raises(EngineStartupError) as raised:
        make_client(tiny_llama_dir, engines, executor_class=FailingLoadExecutor)
    first, *rest = str(raised.value).splitlines()
    assert first.endswith("failed to start: FileNotFoundError: [Errno 2] no such weights: '/nowhere/model.safetensors'"), first
    assert rest[0].startswith("Traceback (most recent call last)") and "test_multiprocess.py" in "\n".join(rest)


def test_a_new_shm_channel_sweeps_rings_of_dead_runs(tmp_path):
    """Both processes of a run killed with kill -9: the next run's start removes their rings."""
    code = "import os, signal\nfrom ipc import RingBuffer\nr = RingBuffer.create(4096)\nprint(r.name, flush=True)\nos.kill(os.getpid(), signal.SIGKILL)\n"
    dead = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout.strip()
    left = Path("/dev/shm") / dead.lstrip("/")
    assert left.exists()
    endpoint, _ = channel.open_frontend()
    endpoint.close()
    assert not left.exists()


def test_transport_is_no_knob(tiny_llama_dir):
    """The shared-memory rings are the channel; ZeroMQ is only the benchmark's peer."""
    with pytest.raises(TypeError, match="transport"):
        LLM(str(tiny_llama_dir), transport="zmq", **ENGINE_ARGS)


@pytest.mark.parametrize(
    "omp, cores, napping",
    [("1", 2, True), (None, 2, False), ("2", 2, False), ("1", 1, False), ("4", 8, True), ("x", 2, False)],
)
def test_frontend_naps_only_when_the_engine_leaves_it_a_core(monkeypatch, omp, cores, napping):
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert channel.frontend_nap_window() == (channel.FRONTEND_NAP_WINDOW_S if napping else 0.0)

