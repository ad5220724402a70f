"""Data parallel: N engine processes behind one LLM(data_parallel_size=N).

Same outputs as one engine (greedy, n > 1, stop strings, embeddings), requests spread over the
engines, aborts and utility calls at the right engines, each engine on its own cores, and every
fault (kill -9 of an engine, of the frontend) ends everything within 2 s with nothing left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import leaked_shm_entries, wait_until_dead
from ipc.segment import pid_alive
from shmvllm import LLM, SamplingParams
from shmvllm.boundary.messages import SchedulerStats
from shmvllm.engine.arg_utils import EngineArgs
from shmvllm.engine.core_client import MPClient
from shmvllm.engine.dp_balancer import DPLoadBalancer
from shmvllm.engine.dp_client import plan_cpus
from shmvllm.engine.exceptions import EngineDeadError, EngineTimeoutError, EngineUtilityError

ENGINE_ARGS = dict(max_model_len=1024, num_kv_blocks=256)
LONG = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("no_engine_left_behind")


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


def mixed_requests() -> tuple[list[str], list[SamplingParams]]:
    """64 prompts of different lengths; greedy with different max_tokens, stop strings, and
    seeded n=2 / n=3 sampling."""
    words = "the cat sat on a mat river engine shared memory ring token paris quantum".split()
    rng = np.random.default_rng(0)
    prompts, params = [], []
    for i in range(64):
        prompts.append(f"{i}: " + " ".join(rng.choice(words, size=int(rng.integers(1, 40)))))
        kind = i % 4
        if kind == 0:
            params.append(SamplingParams(temperature=0.0, max_tokens=int(rng.integers(4, 33)), ignore_eos=True))
        elif kind == 1:
            params.append(SamplingParams(temperature=0.0, max_tokens=32, stop=["e", " a"], ignore_eos=True))
        elif kind == 2:
            params.append(SamplingParams(temperature=0.8, seed=i, n=2 + i % 8 // 4, max_tokens=16, ignore_eos=True))
        else:
            params.append(SamplingParams(temperature=0.0, max_tokens=24))
    return prompts, params


def completions(outputs) -> list:
    return [
        (o.prompt, [(list(c.token_ids), c.text, c.finish_reason, c.stop_reason) for c in o.outputs])
        for o in outputs
    ]


def test_dp2_outputs_equal_dp1_in_input_order_and_both_engines_serve(tiny_llama_dir):
    prompts, params = mixed_requests()
    results = {}
    for dp in (1, 2):
        with LLM(str(tiny_llama_dir), data_parallel_size=dp, **ENGINE_ARGS) as llm:
            client = llm.llm_engine.engine_core
            results[dp] = completions(llm.generate(prompts, params, use_tqdm=False))
            assert type(client) is MPClient and client.num_engines == dp
            if dp == 1:
                continue
            served = client.balancer.served
            stats = client.get_stats()
            pids = client.engine_pids
            affinities = [os.sched_getaffinity(pid) for pid in pids]
            # a program gets its thread count in its environment; a fork sets it in itself
            programs = [h.manager.start_method == "program" for h in client.handles]
            threads = [environ_of(pid).get("OMP_NUM_THREADS") for pid, program in zip(pids, programs) if program]
            plan = client.cpu_plan
        for pid in pids:
            wait_until_dead(pid, 5.0)
    assert [p for p, _ in results[2]] == prompts  # input order
    expected_requests = sum(p.n for p in params)
    assert sum(served) == expected_requests and min(served) > 0, served
    assert len(stats["engines"]) == 2 and all(e["num_steps"] > 0 for e in stats["engines"]), stats
    assert stats["num_steps"] == sum(e["num_steps"] for e in stats["engines"])
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= 2:  # each engine on its own cores, one torch thread per core of them
        assert not affinities[0] & affinities[1], affinities
        assert [sorted(a) for a in affinities] == [cpus for cpus, _ in plan]
    assert threads == [str(n) for (_, n), program in zip(plan, programs) if program], threads
    stopped = [c for _, cs in results[1] for c in cs if c[2] == "stop" and isinstance(c[3], str)]
    assert stopped, "no stop string ended a request: the test lost its stop-string case"
    assert results[2] == results[1]


def test_dp2_embeddings_equal_dp1(tiny_bert_dir, embedding_texts):
    results = {}
    for dp in (1, 2):
        with LLM(str(tiny_bert_dir), task="embed", data_parallel_size=dp) as llm:
            results[dp] = np.array([o.outputs.embedding for o in llm.embed(embedding_texts, use_tqdm=False)])
            if dp == 2:
                served = llm.llm_engine.engine_core.balancer.served
    assert min(served) > 0 and sum(served) == len(embedding_texts), served
    assert results[2].shape == (len(embedding_texts), results[1].shape[1])
    np.testing.assert_allclose(results[2], results[1], rtol=0, atol=1e-5)


def test_abort_and_utility_calls_reach_the_right_engines(tiny_llama_dir):
    with LLM(str(tiny_llama_dir), data_parallel_size=2, **ENGINE_ARGS) as llm:
        engine, client = llm.llm_engine, llm.llm_engine.engine_core
        for i in range(4):
            engine.add_request(f"r{i}", f"prompt number {i}", LONG)
        engine.add_request("family", "a shared prompt", SamplingParams(n=3, max_tokens=1000, ignore_eos=True))
        owners = {rid: client.balancer.owner.get(rid) for rid in ("r0", "r1", "r2", "r3")}
        assert sorted(owners.values()) == [0, 0, 1, 1], owners  # equal loads: round robin
        family = {client.balancer.owner.get(f"{k}_family") for k in range(3)}
        assert len(family) == 1, family  # n > 1 children stay together
        for _ in range(4):
            engine.step()
        on_zero = [rid for rid, e in owners.items() if e == 0]
        engine.abort_request(on_zero)
        per_engine = [e["num_running_reqs"] + e["num_waiting_reqs"] for e in client.get_stats()["engines"]]
        family_engine = family.pop()
        expected = [3 * (family_engine == 0), 2 + 3 * (family_engine == 1)]
        assert per_engine == expected, (per_engine, expected)
        engine.abort_request(["r0", "r1", "r2", "r3", "family"])
        stats = client.get_stats()
        assert stats["num_running_reqs"] + stats["num_waiting_reqs"] == 0, stats
        assert client.reset_prefix_cache() is True  # every engine answered True
        assert all(e["num_free_blocks"] == e["num_kv_blocks"] for e in client.get_stats()["engines"])
        with pytest.raises(EngineUtilityError, match="(?s)engine 0.*engine 1|engine 1.*engine 0"):
            client.call_utility_all("no_such_method")
        for _ in range(1000):  # what the aborted requests' last steps sent
            try:
                client.get_output(timeout=0.5)
            except EngineTimeoutError:
                break
        cpu = time.thread_time()
        with pytest.raises(EngineTimeoutError, match="no output from the 2 data-parallel engines for 1.0 s"):
            client.get_output(timeout=1.0)  # asleep on the doorbell, not spinning over the rings
        assert time.thread_time() - cpu < 0.1
        assert len(llm.generate(["still serving"], SamplingParams(max_tokens=4), use_tqdm=False)) == 1


@pytest.mark.parametrize("victim", [0, 1])
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM])
def test_kill_either_engine_mid_generate(tiny_llama_dir, victim, signum):
    """kill -9 or SIGTERM of one engine: EngineDeadError naming it, the other engine stopped, and
    nothing of the client's left in /dev/shm by the time it raised."""
    before = leaked_shm_entries()
    with LLM(str(tiny_llama_dir), data_parallel_size=2, **ENGINE_ARGS) as llm:
        client = llm.llm_engine.engine_core
        pids = client.engine_pids
        killed_at: list[float] = []

        def kill() -> None:
            time.sleep(0.5)
            killed_at.append(time.monotonic())
            os.kill(pids[victim], signum)

        killer = threading.Thread(target=kill)
        killer.start()
        why = "terminated by SIGTERM" if signum == signal.SIGTERM else "exited with code -9"
        with pytest.raises(EngineDeadError, match=f"(?s)engine {victim} of 2.*{why}"):
            llm.generate([f"prompt {i}" for i in range(8)], LONG, use_tqdm=False)
        raised_at = time.monotonic()
        killer.join()
        assert raised_at - killed_at[0] < 2.0
        assert not leaked_shm_entries() - before
        wait_until_dead(pids[1 - victim], 2.0 - (time.monotonic() - killed_at[0]))
        with pytest.raises(EngineDeadError):
            llm.generate(["again"], LONG, use_tqdm=False)


FRONTEND = """
from shmvllm import LLM, SamplingParams

llm = LLM({model!r}, data_parallel_size=2, max_model_len=1024, num_kv_blocks=256)
print("ENGINES", *llm.llm_engine.engine_core.engine_pids, flush=True)
llm.generate(["Hello"] * 8, SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True), use_tqdm=False)
"""


def _start_frontend(tmp_path, source: str) -> tuple[subprocess.Popen, list[int]]:
    """Runs `source` as a frontend program; returns it and the engine pids it prints first."""
    script = tmp_path / "frontend.py"
    script.write_text(textwrap.dedent(source))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    line = proc.stdout.readline()
    if not line.startswith("ENGINES"):
        proc.kill()
        raise AssertionError((line, proc.communicate()[1]))
    return proc, [int(p) for p in line.split()[1:]]


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM])
def test_kill_frontend_both_engines_exit(tmp_path, tiny_llama_dir, signum):
    """kill -9: the engines exit and remove what the frontend left; SIGTERM: the frontend removes
    it all itself before it dies."""
    proc, pids = _start_frontend(tmp_path, FRONTEND.format(model=str(tiny_llama_dir)))
    try:
        assert len(pids) == 2 and all(pid_alive(p) for p in pids)
        time.sleep(0.5)  # generating
        proc.send_signal(signum)
        assert proc.wait(timeout=10) == -signum
        killed_at = time.monotonic()
        if signum == signal.SIGTERM:
            assert not leaked_shm_entries()
        for pid in pids:
            wait_until_dead(pid, 2.0 - (time.monotonic() - killed_at))
        deadline = time.monotonic() + 2.0  # the engines remove what the frontend left
        while leaked_shm_entries() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not leaked_shm_entries()
    finally:
        proc.kill()
        proc.communicate()


def test_load_balancer_least_loaded_ties_round_robin():
    lb = DPLoadBalancer(3)
    picks = []
    for i in range(6):  # nothing reported yet: the client's own counts, round robin on ties
        engine = lb.choose()
        lb.added(f"r{i}", engine)
        picks.append(engine)
    assert sorted(picks) == [0, 0, 1, 1, 2, 2]
    lb.report(0, SchedulerStats(num_running_reqs=2, num_waiting_reqs=0, kv_cache_usage=0.5))
    lb.report(1, SchedulerStats(num_running_reqs=2, num_waiting_reqs=0, kv_cache_usage=0.1))
    assert [lb.load(e) for e in range(3)] == [2, 2, 8]  # engine 2's two are not running yet: waiting
    assert lb.choose() == 1  # loads equal, less KV in use
    for rid in [r for r, e in lb.owner.items() if e == 2]:
        assert lb.finished(rid) == 2
    assert lb.load(2) == 0 and lb.choose() == 2 and lb.served == [0, 0, 2]
    lb.added("c0", lb.choose(group="g"), group="g")
    assert all(lb.choose(group="g") == lb.owner["c0"] for _ in range(3))


def test_plan_cpus_divides_the_cores(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4})
    assert plan_cpus(2) == [([0, 1], 2), ([2, 3, 4], 3)]
    assert plan_cpus(6) == [([], 1)] * 6  # fewer cores than engines: shared, one thread each
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert plan_cpus(2) == [([0, 1], 4), ([2, 3, 4], 4)]


def test_data_parallel_size_is_checked_and_on_the_cli():
    with pytest.raises(ValueError, match="data_parallel_size must be a positive int, got 0"):
        EngineArgs(data_parallel_size=0).create_engine_config()
    with pytest.raises(ValueError, match="data_parallel_size=2 with tensor_parallel_size=2 is not supported"):
        EngineArgs(data_parallel_size=2, tensor_parallel_size=2).create_engine_config()
    import argparse

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs.from_cli_args(parser.parse_args(["--data-parallel-size", "2"])).data_parallel_size == 2


def test_async_llm_and_threads_over_two_engines(tiny_llama_dir):
    """AsyncLLM's reader thread and the threads of one LLM (its OutputRouter) drive the DP client
    as they drive one engine: each stream / caller gets exactly its own greedy outputs."""
    import asyncio

    from shmvllm import AsyncLLM, RequestOutputKind

    prompts = [f"stream {i}: the quick brown fox number {i * 7}" for i in range(16)]
    params = [SamplingParams(temperature=0.0, max_tokens=8 + i % 5, ignore_eos=True) for i in range(16)]
    with LLM(str(tiny_llama_dir), **ENGINE_ARGS) as llm:
        reference = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]

    async def stream_all(engine) -> list[list[int]]:
        async def one(i: int) -> list[int]:
            final = None
            p = SamplingParams(temperature=0.0, max_tokens=params[i].max_tokens, ignore_eos=True,
                               output_kind=RequestOutputKind.FINAL_ONLY)
            async for out in engine.generate(prompts[i], p, f"req-{i}"):
                final = out
            return list(final.outputs[0].token_ids)

        return list(await asyncio.gather(*(one(i) for i in range(16))))

    engine = AsyncLLM.from_engine_args(EngineArgs(model=str(tiny_llama_dir), data_parallel_size=2, **ENGINE_ARGS))
    try:
        assert asyncio.run(stream_all(engine)) == reference
        assert min(engine.engine.engine_core.balancer.served) > 0
    finally:
        engine.shutdown()

    with LLM(str(tiny_llama_dir), data_parallel_size=2, **ENGINE_ARGS) as llm:
        results: list = [None] * 4
        barrier = threading.Barrier(4)

        def caller(k: int) -> None:
            barrier.wait()
            outs = llm.generate(prompts[k::4], params[k::4], use_tqdm=False)
            results[k] = [list(o.outputs[0].token_ids) for o in outs]

        threads = [threading.Thread(target=caller, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads)
        assert all(results[k] == reference[k::4] for k in range(4)), results


def test_data_parallel_needs_engine_processes(tiny_llama_dir):
    with pytest.raises(ValueError, match="data_parallel_size=2 needs the engines in processes of their own"):
        LLM(str(tiny_llama_dir), data_parallel_size=2, multiprocess=False, **ENGINE_ARGS)


CTRL_C_FRONTEND = """
import signal
from shmvllm import LLM, SamplingParams

signal.signal(signal.SIGINT, signal.default_int_handler)
llm = LLM({model!r}, data_parallel_size=2, max_model_len=1024, num_kv_blocks=256)
client = llm.llm_engine.engine_core
print("ENGINES", *client.engine_pids, flush=True)
try:
    llm.generate(["Hello"] * 8, SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True), use_tqdm=False)
except KeyboardInterrupt:
    print("INTERRUPTED", *[e["num_running_reqs"] + e["num_waiting_reqs"] for e in client.get_stats()["engines"]], flush=True)
    raise
"""


def test_ctrl_c_during_generate_aborts_in_both_engines(tmp_path, tiny_llama_dir):
    proc, pids = _start_frontend(tmp_path, CTRL_C_FRONTEND.format(model=str(tiny_llama_dir)))
    try:
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert "INTERRUPTED 0 0" in out, err  # neither engine holds any of the requests
    assert "KeyboardInterrupt" in err
    for pid in pids:
        wait_until_dead(pid, 5.0)


def test_tiny_rings_two_engines_long_prompts_and_logprobs(tiny_llama_dir, monkeypatch):
    """4 KiB rings to and from both engines: long prompts travel in ring fragments, prompt
    logprobs come back in pieces, each piece rings the doorbell; same tokens and logprobs as
    one engine on the default rings."""
    rng = np.random.default_rng(1)
    prompts = [{"prompt_token_ids": rng.integers(3, 40000, size=int(rng.integers(8, 700))).tolist()} for _ in range(24)]
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3,
                             prompt_logprobs=3 if i % 6 == 0 else None) for i in range(24)]

    def run(dp: int):
        # KV for all 24 at once: no preemption in either run (test_prompt_logprobs has those)
        with LLM(str(tiny_llama_dir), data_parallel_size=dp, max_model_len=1024, num_kv_blocks=1024) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
            if dp == 2:
                assert min(llm.llm_engine.engine_core.balancer.served) > 0
        # the sampled tokens' logprobs (a top-k member at a near-tie may differ between batchings)
        return [(list(o.outputs[0].token_ids), len(o.prompt_logprobs or []),
                 [step[t].logprob for t, step in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]) for o in outs]

    expected = run(1)
    monkeypatch.setenv("SHMVLLM_RING_CAPACITY", "4096")
    got = run(2)
    assert [(ids, rows) for ids, rows, _ in got] == [(ids, rows) for ids, rows, _ in expected]
    np.testing.assert_allclose([lp for *_, lps in got for lp in lps], [lp for *_, lps in expected for lp in lps],
                               rtol=0, atol=1e-4)
