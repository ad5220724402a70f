"""AsyncLLM: many coroutines streaming from one engine over the rings, cancellation aborts in the
engine, a killed engine ends every stream with EngineDeadError, nothing left behind."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

from conftest import wait_until_dead
from shmvllm import LLM, AsyncLLM, EngineArgs, EngineDeadError, PoolingParams, RequestOutputKind, SamplingParams

ENGINE_ARGS = dict(max_model_len=512, num_kv_blocks=512)
NUM_STREAMS = 32


@pytest.fixture(autouse=True)
def nothing_left_behind(no_engine_left_behind):
    """conftest's check (no engine process, nothing in /dev/shm), and no thread of AsyncLLM's left."""
    threads_before = set(threading.enumerate())
    yield
    assert not [t for t in set(threading.enumerate()) - threads_before if t.is_alive()], "a thread outlived its test"


def prompts() -> list[str]:
    return [f"stream {i}: the quick brown fox number {i * 7}" for i in range(NUM_STREAMS)]


def params(i: int, kind: RequestOutputKind) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=10 + i % 7, ignore_eos=True, output_kind=kind)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    with LLM(str(tiny_llama_dir), **ENGINE_ARGS) as llm:
        outs = llm.generate(prompts(), [params(i, RequestOutputKind.FINAL_ONLY) for i in range(NUM_STREAMS)], use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].text) for o in outs]


def make_async(model_dir, **engine_args) -> AsyncLLM:
    return AsyncLLM.from_engine_args(EngineArgs(model=str(model_dir), **(engine_args or ENGINE_ARGS)))


async def consume(llm, i, kind):
    pieces, ids, count, last = [], [], 0, None
    async for out in llm.generate(prompts()[i], params(i, kind), f"req-{i}"):
        count += 1
        last = out
        if kind == RequestOutputKind.DELTA:
            pieces.append(out.outputs[0].text)
            ids += out.outputs[0].token_ids
    assert last.finished
    if kind != RequestOutputKind.DELTA:
        ids, pieces = list(last.outputs[0].token_ids), [last.outputs[0].text]
    return ids, "".join(pieces), count


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY])
def test_streams_match_llm_generate(tiny_llama_dir, reference, kind):
    async def main():
        llm = make_async(tiny_llama_dir)
        try:
            return await asyncio.gather(*(consume(llm, i, kind) for i in range(NUM_STREAMS)))
        finally:
            llm.shutdown()

    results = asyncio.run(main())
    for (ids, text, count), (ref_ids, ref_text) in zip(results, reference):
        assert ids == ref_ids
        assert text == ref_text
    counts = [count for _, _, count in results]
    if kind == RequestOutputKind.FINAL_ONLY:
        assert counts == [1] * NUM_STREAMS
    else:
        assert sum(counts) > 3 * NUM_STREAMS  # it streamed


def test_cancelling_half_aborts_them_in_the_engine(tiny_llama_dir, reference):
    async def main():
        llm = make_async(tiny_llama_dir)
        try:
            long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
            started = asyncio.Event()
            seen = 0

            async def endless(i):
                nonlocal seen
                async for _ in llm.generate(prompts()[i], long, f"long-{i}"):
                    seen += 1
                    if seen >= NUM_STREAMS // 2 * 2:
                        started.set()

            cancelled = [asyncio.create_task(endless(i)) for i in range(NUM_STREAMS // 2)]
            finishing = [asyncio.create_task(consume(llm, i, RequestOutputKind.DELTA)) for i in range(NUM_STREAMS // 2, NUM_STREAMS)]
            await asyncio.wait_for(started.wait(), 60)
            running = (await asyncio.to_thread(llm.engine.engine_core.get_stats))["num_running_reqs"]
            for task in cancelled:
                task.cancel()
            await asyncio.gather(*cancelled, return_exceptions=True)
            after = (await asyncio.to_thread(llm.engine.engine_core.get_stats))["num_running_reqs"]
            results = await asyncio.gather(*finishing)
            final = await asyncio.to_thread(llm.engine.engine_core.get_stats)
            return running, after, results, final, llm.get_num_unfinished_requests()
        finally:
            llm.shutdown()

    running, after, results, final, unfinished = asyncio.run(main())
    assert after <= running - NUM_STREAMS // 2, (running, after)
    for (ids, text, _), (ref_ids, ref_text) in zip(results, reference[NUM_STREAMS // 2 :]):
        assert ids == ref_ids and text == ref_text
    assert final["num_running_reqs"] == 0 and final["num_waiting_reqs"] == 0
    assert unfinished == 0


def test_abort_ends_the_stream_and_encode_embeds(tiny_llama_dir, tiny_bert_dir):
    async def main():
        llm = make_async(tiny_llama_dir)
        try:
            long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
            outs = []
            async for out in llm.generate("hello", long, "a"):
                outs.append(out)
                if len(outs) == 3:
                    await llm.abort("a")
            with pytest.raises(ValueError, match="max_tokens"):
                async for _ in llm.generate("hello", SamplingParams(max_tokens=0), "bad"):
                    pass
            # the engine goes on serving
            async for out in llm.generate("hello", SamplingParams(temperature=0, max_tokens=3), "b"):
                pass
            return len(outs), out.finished, llm.get_num_unfinished_requests()
        finally:
            llm.shutdown()

    n, finished, unfinished = asyncio.run(main())
    # An output the reader had handed to the event loop before the abort is still delivered (a
    # closed stream ends after what it holds): one at most, the newest (CUMULATIVE keeps one).
    assert n in (3, 4) and finished and unfinished == 0

    async def embed():
        llm = make_async(tiny_bert_dir, max_model_len=256)
        try:
            one = await llm.embed("some text")
            outs = [o async for o in llm.encode("some text", PoolingParams(), "e1")]
            return one, outs
        finally:
            llm.shutdown()

    one, outs = asyncio.run(embed())
    with LLM(str(tiny_bert_dir)) as ref:
        expected = ref.embed("some text", use_tqdm=False)[0].outputs.numpy()
    import numpy as np

    np.testing.assert_allclose(one.outputs.numpy(), expected, atol=1e-5)
    assert len(outs) == 1 and outs[0].finished
    np.testing.assert_allclose(outs[0].outputs.data, expected, atol=1e-5)


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM])
def test_a_killed_engine_ends_every_stream_with_engine_dead_error(tiny_llama_dir, signum):
    """kill -9, or SIGTERM (after which the engine says why it stops, then closes its side)."""
    async def main():
        llm = make_async(tiny_llama_dir)
        try:
            long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
            got_some = asyncio.Event()
            ended: list[float] = []

            async def stream(i):
                try:
                    async for _ in llm.generate(f"prompt {i}", long, f"k-{i}"):
                        got_some.set()
                except EngineDeadError:
                    ended.append(time.monotonic())
                    return "dead"
                return "finished"

            tasks = [asyncio.create_task(stream(i)) for i in range(NUM_STREAMS)]
            await asyncio.wait_for(got_some.wait(), 60)
            killed = time.monotonic()
            pid = llm.engine.engine_core.engine_pid
            os.kill(pid, signum)
            results = await asyncio.wait_for(asyncio.gather(*tasks), 10)
            with pytest.raises(EngineDeadError, match="terminated by SIGTERM" if signum == signal.SIGTERM else None):
                async for _ in llm.generate("after", long, "after"):
                    pass
            wait_until_dead(pid, 2.0)
            return results, max(ended) - killed, llm.errored
        finally:
            llm.shutdown()

    results, seconds, errored = asyncio.run(main())
    assert results == ["dead"] * NUM_STREAMS
    assert seconds < 2.0, seconds
    assert errored
