"""Issue 3's acceptance through EngineCore.add_request / step, against transformers itself."""

from __future__ import annotations

import functools
import itertools
from pathlib import Path

import numpy as np
import pytest
import torch

from shmvllm.engine.arg_utils import EngineArgs
from shmvllm.engine.core import EngineCore
from shmvllm.boundary.messages import EngineCoreOutput, EngineCoreRequest, FinishReason
from shmvllm.sampling_params import SamplingParams

MAX_TOKENS = 10
_ids = itertools.count()


# ---- helpers -------------------------------------------------------------------------------

def make_engine(model_dir: Path, **engine_args) -> EngineCore:
    config = EngineArgs(model=str(model_dir), device="cpu", dtype="float32", **engine_args).create_engine_config()
    return EngineCore(config)


@functools.lru_cache(maxsize=None)
def hf_model(model_dir: Path):
    from conftest import hf_causal_lm

    return hf_causal_lm(model_dir, torch.float32)


def eos_of(model_dir: Path) -> int:
    eos = hf_model(model_dir).config.eos_token_id
    return eos[0] if isinstance(eos, list) else eos


@functools.lru_cache(maxsize=None)
def hf_greedy(model_dir: Path, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    """transformers' greedy continuation; it stops after EOS, which it keeps, as the engine does."""
    model = hf_model(model_dir)
    eos = eos_of(model_dir)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos,
        )
    return out[0, len(prompt):].tolist()


def greedy_params(model_dir: Path, max_tokens: int = MAX_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, eos_token_id=eos_of(model_dir), **kw)


def make_request(prompt: list[int], params: SamplingParams, req_id: str | None = None) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=req_id or f"req-{next(_ids)}",
        prompt_token_ids=EngineCoreRequest.pack_token_ids(prompt),
        sampling_params=params,
    )


def run(engine: EngineCore, requests: list[EngineCoreRequest], max_steps: int = 2000) -> dict[str, list[EngineCoreOutput]]:
    """Adds all requests at once, then steps until every one finished."""
    for request in requests:
        engine.add_request(request)
    outputs: dict[str, list[EngineCoreOutput]] = {r.request_id: [] for r in requests}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return outputs
        for output in engine.step().all_outputs():
            outputs[output.request_id].append(output)
    raise AssertionError(f"requests unfinished after {max_steps} steps")


def tokens_of(outputs: list[EngineCoreOutput]) -> list[int]:
    assert outputs and outputs[-1].finished and all(not o.finished for o in outputs[:-1])
    return [t for o in outputs for t in o.new_token_ids]


def random_prompts(lengths: list[int], seed: int = 0, vocab: int = 49152) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=n).tolist() for n in lengths]


def assert_greedy_matches_hf(model_dir: Path, engine: EngineCore, prompts: list[list[int]], max_tokens: int = MAX_TOKENS):
    requests = [make_request(p, greedy_params(model_dir, max_tokens)) for p in prompts]
    outputs = run(engine, requests)
    for request, prompt in zip(requests, prompts):
        got = tokens_of(outputs[request.request_id])
        assert got == hf_greedy(model_dir, tuple(prompt), max_tokens), f"prompt of {len(prompt)} tokens"
        final = outputs[request.request_id][-1]
        expected_reason = FinishReason.STOP if got[-1] == eos_of(model_dir) else FinishReason.LENGTH
        assert final.finish_reason == expected_reason
    return outputs


TINY = ["tiny_llama_dir", "tiny_qwen2_dir"]
MIXED_LENGTHS = [1, 5, 17, 33, 8, 64, 3, 40, 24]


@pytest.fixture(params=TINY)
def tiny_dir(request) -> Path:
    return request.getfixturevalue(request.param)


# ---- greedy equality -------------------------------------------------------------------------

def test_greedy_batch_matches_transformers_tiny(tiny_dir):
    engine = make_engine(tiny_dir, num_kv_blocks=64)
    assert_greedy_matches_hf(tiny_dir, engine, random_prompts(MIXED_LENGTHS))
    assert engine.get_stats()["num_free_blocks"] == engine.num_kv_blocks
    engine.shutdown()


def test_greedy_batch_matches_transformers_smollm2(smollm2_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    questions = ["Hi!", "What is 2+2?", "Name a colour.", "Say yes.", "Capital of France?",
                 "Reply with one word: yes or no?", "Count to three.", "Write one word."]
    prompts = [
        list(tokenizer.apply_chat_template(
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": q}],
            add_generation_prompt=True, tokenize=True, return_dict=False,
        ))
        for q in questions
    ]
    assert len({len(p) for p in prompts}) > 1
    engine = make_engine(smollm2_dir, num_kv_blocks=64)
    outputs = assert_greedy_matches_hf(smollm2_dir, engine, prompts, max_tokens=8)
    reasons = {outs[-1].finish_reason for outs in outputs.values()}
    assert reasons == {FinishReason.STOP, FinishReason.LENGTH}  # EOS really ends some, on both sides
    engine.shutdown()


def test_greedy_with_preemption_matches_transformers(tiny_dir):
    # 9 prompts needing up to (64 + 10) / 4 = 19 blocks each, in a cache of 24 blocks.
    engine = make_engine(tiny_dir, num_kv_blocks=24, block_size=4)
    assert_greedy_matches_hf(tiny_dir, engine, random_prompts(MIXED_LENGTHS))
    stats = engine.get_stats()
    assert stats["num_preemptions"] > 0
    assert stats["num_free_blocks"] == engine.num_kv_blocks


def test_greedy_with_chunked_prefill_matches_transformers(tiny_dir):
    budget = 16
    prompts = random_prompts(MIXED_LENGTHS, seed=1)
    assert max(len(p) for p in prompts) > budget  # so some prompt must be prefilled in chunks
    engine = make_engine(tiny_dir, num_kv_blocks=128, max_num_batched_tokens=budget)
    assert_greedy_matches_hf(tiny_dir, engine, prompts)


def test_greedy_with_prefix_cache_hits_matches_transformers(tiny_dir):
    system = random_prompts([40], seed=2)[0]
    prompts = [system + suffix for suffix in random_prompts([3, 9, 1, 20, 6, 12, 2, 30], seed=3)]
    engine = make_engine(tiny_dir, num_kv_blocks=128)
    outputs = assert_greedy_matches_hf(tiny_dir, engine, prompts)
    cached = [outs[-1].num_cached_tokens for outs in outputs.values()]
    assert cached[0] == 0 and all(c == 32 for c in cached[1:])  # two full blocks of 16
    # Once they finished, the blocks stay cached: the same prompts hit again.
    outputs = assert_greedy_matches_hf(tiny_dir, engine, prompts)
    assert all(outs[-1].num_cached_tokens >= 32 for outs in outputs.values())
    stats = engine.get_stats()
    assert 0 < stats["prefix_cache_hits"] < stats["prefix_cache_queries"]
    assert engine.reset_prefix_cache() is True


# ---- logprobs ----------------------------------------------------------------------------

def test_logprobs_match_transformers_log_softmax(tiny_llama_dir):
    prompt = random_prompts([12], seed=4)[0]
    engine = make_engine(tiny_llama_dir, num_kv_blocks=32, max_num_batched_tokens=8)  # prompt rows in 2 chunks
    params = greedy_params(tiny_llama_dir, max_tokens=5, logprobs=3, prompt_logprobs=2)
    (outputs,) = run(engine, [make_request(prompt, params)]).values()
    generated = tokens_of(outputs)
    with torch.no_grad():
        logits = hf_model(tiny_llama_dir)(torch.tensor([prompt + generated])).logits[0]
    reference = torch.log_softmax(logits.double(), dim=-1)

    rows = [o.new_logprobs.arrays() for o in outputs if o.new_logprobs is not None]
    assert len(rows) == len(generated)
    for step, (ids, lps, ranks) in enumerate(rows):
        position = len(prompt) - 1 + step
        assert ids[0, 0] == generated[step] and ranks[0] == 1  # greedy: the top token
        expected = reference[position, torch.from_numpy(ids[0].astype(np.int64))].numpy()
        np.testing.assert_allclose(lps[0], expected, atol=1e-4)
        np.testing.assert_allclose(lps[0, 1:], torch.topk(reference[position], 3).values.numpy(), atol=1e-4)

    prompt_rows = [o.new_prompt_logprobs.arrays() for o in outputs if o.new_prompt_logprobs is not None]
    ids = np.concatenate([r[0] for r in prompt_rows])
    lps = np.concatenate([r[1] for r in prompt_rows])
    assert ids.shape == (len(prompt) - 1, 3) and ids[:, 0].tolist() == prompt[1:]
    expected = reference[torch.arange(len(prompt) - 1)[:, None], torch.from_numpy(ids.astype(np.int64))].numpy()
    np.testing.assert_allclose(lps, expected, atol=1e-4)


# ---- seeded sampling -------------------------------------------------------------------------

def test_seeded_sampling_is_the_same_alone_and_in_a_batch(tiny_qwen2_dir):
    prompt = random_prompts([10], seed=5)[0]
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=12, eos_token_id=eos_of(tiny_qwen2_dir))
    engine = make_engine(tiny_qwen2_dir, num_kv_blocks=64)
    alone = tokens_of(run(engine, [make_request(prompt, params, "alone")])["alone"])
    others = [
        make_request(p, SamplingParams(temperature=1.0, seed=i if i % 2 else None, max_tokens=12))
        for i, p in enumerate(random_prompts([4, 30, 7, 15], seed=6))
    ]
    batched = run(engine, others[:2] + [make_request(prompt, params, "batched")] + others[2:])
    assert tokens_of(batched["batched"]) == alone
    assert len(set(alone)) > 1  # really sampled, not a constant
    # And when preemption makes it recompute part of its sequence.
    small = make_engine(tiny_qwen2_dir, num_kv_blocks=12, block_size=4)
    requests = [make_request(p, SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True))
                for p in random_prompts([20, 25, 18], seed=7)]
    preempted = run(small, requests + [make_request(prompt, params, "preempted")])
    assert small.get_stats()["num_preemptions"] > 0
    assert tokens_of(preempted["preempted"]) == alone


# ---- aborts and errors -----------------------------------------------------------------------

def test_abort_of_a_running_request_frees_its_blocks(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, num_kv_blocks=32)
    start = engine.get_stats()["num_free_blocks"]
    params = greedy_params(tiny_llama_dir, max_tokens=200, ignore_eos=True)
    engine.add_request(make_request(random_prompts([40], seed=7)[0], params, "long"))
    engine.add_request(make_request(random_prompts([5], seed=8)[0], params, "waiting-too"))
    for _ in range(3):
        engine.step()
    assert engine.get_stats()["num_free_blocks"] < start
    engine.abort_requests(["long", "waiting-too"])
    assert engine.get_stats()["num_free_blocks"] == start
    assert not engine.has_unfinished_requests()
    assert engine.step().all_outputs() == []


def test_unservable_requests_finish_with_error_and_the_engine_keeps_serving(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, num_kv_blocks=32, max_model_len=64)
    params = greedy_params(tiny_llama_dir, max_tokens=4)
    good = random_prompts([6], seed=9)[0]
    requests = [
        make_request(good, params, "good"),
        make_request(list(range(3, 70)), params, "too-long"),
        make_request([], params, "empty"),
        make_request([5, 10**6], params, "bad-token"),
        make_request(good, params, "good"),  # a duplicate id
    ]
    for request in requests:
        engine.add_request(request)
    first = engine.step().all_outputs()
    errors = {o.request_id: o for o in first if o.finish_reason == FinishReason.ERROR}
    assert set(errors) == {"too-long", "empty", "bad-token", "good"}
    assert "max_model_len=64" in errors["too-long"].error and "empty" in errors["empty"].error
    assert "1000000" in errors["bad-token"].error and "already in use" in errors["good"].error
    outputs = [o for o in first if o.finish_reason != FinishReason.ERROR]
    while engine.has_unfinished_requests():
        outputs.extend(engine.step().all_outputs())
    assert tokens_of(outputs) == hf_greedy(tiny_llama_dir, tuple(good), 4)


def test_idle_engine_steps_empty_and_reports_its_size(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, num_kv_blocks=20, block_size=8)
    assert (engine.num_kv_blocks, engine.block_size) == (20, 8)
    assert not engine.has_unfinished_requests()
    assert engine.step().all_outputs() == []
    stats = engine.get_stats()
    assert stats["num_free_blocks"] == 20 and stats["num_steps"] == 0
    assert engine.reset_prefix_cache() is True
    engine.shutdown()
