"""Prompt logprobs end to end, in-process and multiprocess: a request the scheduler preempts
(and later recomputes from its first token) gets each prompt row once, during decode, in the
middle of a chunked prefill, and as a child of an n > 1 request; the rows agree with a run on a
cache large enough that nothing is preempted."""

from __future__ import annotations

import random

import pytest

from shmvllm import LLM, SamplingParams
from test_boundary import _rows_differ

BLOCK_SIZE = 16
MAX_MODEL_LEN = 256
SMALL_CACHE_BLOCKS = 16  # 256 tokens: a few of the requests below at a time
BUDGET = 64  # max_num_batched_tokens: the longer prompts prefill in chunks


def _prompt(rng: random.Random, n: int) -> dict:
    return {"prompt_token_ids": [rng.randrange(3, 49000) for _ in range(n)]}


def _decode_requests() -> list:
    """Six short prompts growing by 48 tokens each: together they outgrow the cache in decode."""
    rng = random.Random(1)
    return [(_prompt(rng, rng.randint(20, 60)),
             SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=2, prompt_logprobs=2))
            for _ in range(6)]


def _chunked_requests() -> list:
    """Short decoders first, then prompts of 150-200 tokens, each prefilled over 3-4 steps: the
    decoders' growth preempts the latest arrival, which is one of the long ones half-way through."""
    rng = random.Random(2)
    requests = [(_prompt(rng, rng.randint(20, 40)), SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
                for _ in range(4)]
    requests += [(_prompt(rng, rng.randint(150, 200)),
                  SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=3))
                 for _ in range(3)]
    return requests


def _n_requests() -> list:
    """Three requests of n=2 seeded children with prompt logprobs (six in the engine)."""
    rng = random.Random(3)
    return [(_prompt(rng, rng.randint(30, 50)),
             SamplingParams(n=2, temperature=1.0, seed=10 + i, max_tokens=48, ignore_eos=True, prompt_logprobs=1))
            for i in range(3)]


SCENARIOS = {"decode": _decode_requests, "chunked_prefill": _chunked_requests, "n_children": _n_requests}


def _generate(llm: LLM, requests: list) -> list:
    outputs = llm.generate([r[0] for r in requests], [r[1] for r in requests], use_tqdm=False)
    return [(o.prompt_token_ids, [list(c.token_ids) for c in o.outputs], o.prompt_logprobs) for o in outputs]


@pytest.fixture(scope="module")
def expected(tiny_llama_dir) -> dict:
    """Every scenario's outputs on a cache that holds all its requests at once, no chunking."""
    with LLM(str(tiny_llama_dir), multiprocess=False, max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE,
             num_kv_blocks=256) as llm:
        result = {name: _generate(llm, make()) for name, make in SCENARIOS.items()}
        assert llm.llm_engine.engine_core.get_stats()["num_preemptions"] == 0
    return result


@pytest.fixture(scope="module", params=[False, True], ids=["inproc", "multiprocess"])
def small_cache_llm(request, tiny_llama_dir):
    with LLM(str(tiny_llama_dir), multiprocess=request.param, max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE,
             num_kv_blocks=SMALL_CACHE_BLOCKS, max_num_batched_tokens=BUDGET, enable_chunked_prefill=True) as llm:
        yield llm


def _preempted_mid_prompt(llm: LLM, monkeypatch) -> list:
    """In-process: records (request id, computed tokens, prompt length) of every preemption."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    preempt, seen = scheduler._preempt, []

    def recording(request):
        seen.append((request.request_id, request.num_computed_tokens, request.num_prompt_tokens))
        preempt(request)

    monkeypatch.setattr(scheduler, "_preempt", recording)
    return seen


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_a_preempted_request_gets_each_prompt_logprob_row_once(small_cache_llm, expected, scenario, monkeypatch):
    requests = SCENARIOS[scenario]()
    from shmvllm.engine.core_client import InprocClient

    inproc = isinstance(small_cache_llm.llm_engine.engine_core, InprocClient)
    preemptions = _preempted_mid_prompt(small_cache_llm, monkeypatch) if inproc else None
    before = small_cache_llm.llm_engine.engine_core.get_stats()["num_preemptions"]
    got = _generate(small_cache_llm, requests)
    assert small_cache_llm.llm_engine.engine_core.get_stats()["num_preemptions"] > before, "nothing was preempted"
    if inproc and scenario == "chunked_prefill":
        # the same plan runs in the engine process: the scheduler is deterministic
        assert any(0 < computed < prompt_len for _, computed, prompt_len in preemptions), preemptions
    problems = []
    for i, ((prompt, tokens, plps), (_, tokens0, plps0)) in enumerate(zip(got, expected[scenario])):
        if tokens != tokens0:
            problems.append(f"request {i}: tokens differ")
        elif requests[i][1].prompt_logprobs is not None:
            if len(plps) != len(prompt):
                problems.append(f"request {i}: {len(plps)} prompt logprob rows for {len(prompt)} prompt tokens")
            elif (why := _rows_differ(plps, plps0)) is not None:
                problems.append(f"request {i}: {why}")
    assert not problems, problems
