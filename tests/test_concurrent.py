"""Many callers on one engine: threads on one LLM, each getting exactly its own results, their
requests batched into shared engine steps."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from shmvllm import LLM, SamplingParams

NUM_THREADS = 16


def run_threads(fn, args_list):
    """Runs fn(*args) in one thread per entry, all released at once; returns results in order."""
    results: list = [None] * len(args_list)
    errors: list = []
    barrier = threading.Barrier(len(args_list))

    def worker(i, args):
        try:
            barrier.wait()
            results[i] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i, a)) for i, a in enumerate(args_list)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a caller is stuck"
    assert not errors, errors
    return results


def num_steps(llm: LLM) -> int:
    return llm.llm_engine.engine_core.get_stats()["num_steps"]


@pytest.fixture(scope="module")
def gen_llm(tiny_llama_dir):
    with LLM(str(tiny_llama_dir), max_model_len=512, num_kv_blocks=512) as llm:
        yield llm


@pytest.fixture(scope="module")
def embed_llm(tiny_bert_dir):
    with LLM(str(tiny_bert_dir)) as llm:
        yield llm


def test_threads_generate_their_own_results_in_shared_steps(gen_llm):
    prompts = [[f"thread {i} prompt {j} says" for j in range(1 + i % 3)] for i in range(NUM_THREADS)]
    params = [SamplingParams(temperature=0, max_tokens=8 + i, ignore_eos=True) for i in range(NUM_THREADS)]
    before = num_steps(gen_llm)
    serial = [gen_llm.generate(p, sp, use_tqdm=False) for p, sp in zip(prompts, params)]
    serial_steps = num_steps(gen_llm) - before
    before = num_steps(gen_llm)
    concurrent = run_threads(lambda p, sp: gen_llm.generate(p, sp, use_tqdm=False), list(zip(prompts, params)))
    concurrent_steps = num_steps(gen_llm) - before
    for mine, ref in zip(concurrent, serial):
        assert [o.prompt for o in mine] == [o.prompt for o in ref]
        assert [list(o.outputs[0].token_ids) for o in mine] == [list(o.outputs[0].token_ids) for o in ref]
        assert [o.outputs[0].text for o in mine] == [o.outputs[0].text for o in ref]
    assert concurrent_steps < serial_steps / 2, (concurrent_steps, serial_steps)


def test_threads_chat_and_generate_at_once(gen_llm):
    conversations = [[{"role": "user", "content": f"question number {i}"}] for i in range(NUM_THREADS // 2)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    serial_chat = [gen_llm.chat(c, params, use_tqdm=False)[0].outputs[0].token_ids for c in conversations]
    serial_gen = [gen_llm.generate(f"text {i}", params, use_tqdm=False)[0].outputs[0].token_ids
                  for i in range(NUM_THREADS // 2)]
    calls = [("chat", c) for c in conversations] + [("gen", f"text {i}") for i in range(NUM_THREADS // 2)]

    def call(kind, arg):
        out = gen_llm.chat(arg, params, use_tqdm=False) if kind == "chat" else gen_llm.generate(arg, params, use_tqdm=False)
        return list(out[0].outputs[0].token_ids)

    results = run_threads(call, calls)
    assert results == [list(t) for t in serial_chat + serial_gen]


def test_threads_embed_their_own_results_in_shared_steps(embed_llm, embedding_texts):
    texts = [embedding_texts[i * 6 : i * 6 + 1 + i % 4] for i in range(NUM_THREADS)]
    before = num_steps(embed_llm)
    serial = [np.stack([o.outputs.numpy() for o in embed_llm.embed(t, use_tqdm=False)]) for t in texts]
    serial_steps = num_steps(embed_llm) - before
    before = num_steps(embed_llm)
    concurrent = run_threads(
        lambda t: np.stack([o.outputs.numpy() for o in embed_llm.embed(t, use_tqdm=False)]), [(t,) for t in texts]
    )
    concurrent_steps = num_steps(embed_llm) - before
    for mine, ref in zip(concurrent, serial):
        assert mine.shape == ref.shape
        np.testing.assert_allclose(mine, ref, atol=1e-5)
    assert concurrent_steps < serial_steps, (concurrent_steps, serial_steps)


def test_a_failing_call_leaves_the_others_alone(gen_llm):
    """One thread's bad input is its own ValueError; the rest get their outputs."""
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)

    def call(i):
        if i % 4 == 0:
            try:
                gen_llm.generate([f"ok {i}", {"prompt": "x", "bogus": 1}], params, use_tqdm=False)
            except (ValueError, TypeError) as exc:
                return type(exc).__name__
            return "no error"
        return len(gen_llm.generate(f"ok {i}", params, use_tqdm=False)[0].outputs[0].token_ids)

    results = run_threads(call, [(i,) for i in range(NUM_THREADS)])
    assert all(r in ("ValueError", "TypeError") if i % 4 == 0 else r == 5 for i, r in enumerate(results)), results
    assert not gen_llm.llm_engine.has_unfinished_requests()
