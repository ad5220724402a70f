"""Prompt logprobs: the blocked computation (the fused CPU kernel and the torch path) against
torch's log_softmax reference; and end to end, in-process and multiprocess: a request the
scheduler preempts (and later recomputes from its first token) gets each prompt row once, during
decode, in the middle of a chunked prefill, and as a child of an n > 1 request; the rows agree
with a run on a cache large enough that nothing is preempted."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import shmvllm.model.prompt_logprobs as plp
from shmvllm import LLM, SamplingParams
from shmvllm.model.kernels import logprob_kernels
from shmvllm.model.sampler import gather_logprobs
from test_boundary import _rows_differ

# ---- the blocked computation against torch's reference -------------------------------------


def _reference(logits: torch.Tensor, targets: torch.Tensor, k: int):
    return [t.numpy() for t in gather_logprobs(torch.log_softmax(logits, dim=-1), targets, k)]


def _blocked_logits(compute_logits, hidden: torch.Tensor) -> torch.Tensor:
    """The logits as the blocks compute them (a GEMM's rounding depends on its row count)."""
    return torch.cat([compute_logits(hidden[s : s + plp.BLOCK_ROWS]) for s in range(0, hidden.shape[0], plp.BLOCK_ROWS)])


def _case(rows: int, vocab: int, ties: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, 16, generator=gen)
    weight = torch.randn(vocab, 16, generator=gen) * 2
    if ties:  # logits on a coarse grid: many equal values, top-k and ranks must still be right
        compute_logits = lambda h: torch.round((h @ weight.t()) * 2) / 2
    else:
        compute_logits = lambda h: h @ weight.t()
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    return compute_logits, hidden, targets


needs_kernel = pytest.mark.skipif(logprob_kernels() is None, reason="the logprob kernel cannot be built here")


@needs_kernel
@pytest.mark.parametrize("k", [0, 1, 5, 20, plp.MAX_FUSED_TOP])
@pytest.mark.parametrize("vocab,ties", [(49152, False), (1000 + 7, False), (5, False), (3000, True)])
def test_fused_kernel_matches_log_softmax(k, vocab, ties):
    """Over several blocks (rows not a multiple of BLOCK_ROWS): the target's logprob within a few
    ulp and its rank exactly (counted on the logits); the top-k values likewise, each id a token
    holding that value (among equal values the lower id first, as listed)."""
    k = min(k, vocab)
    compute_logits, hidden, targets = _case(2 * plp.BLOCK_ROWS + 3, vocab, ties)
    ids, lps, ranks = plp.prompt_logprobs(compute_logits, hidden, targets, k)
    logits = _blocked_logits(compute_logits, hidden)
    ref_ids, ref_lps, _ = _reference(logits, targets, k)
    assert ids.dtype == np.int32 and lps.dtype == np.float32 and ranks.dtype == np.int32
    assert ids.shape == lps.shape == (hidden.shape[0], 1 + k)
    np.testing.assert_array_equal(ids[:, 0], targets.numpy())
    np.testing.assert_allclose(lps, ref_lps, rtol=0, atol=2e-5)
    logit_ranks = (logits > logits.gather(1, targets[:, None])).sum(-1) + 1
    np.testing.assert_array_equal(ranks, logit_ranks.numpy())
    top_logits = logits.gather(1, torch.from_numpy(ids[:, 1:].astype(np.int64)))
    np.testing.assert_array_equal(top_logits.numpy(), logits.topk(k, dim=-1).values.numpy())
    for row in range(ids.shape[0]):  # equal values: the lower id first
        for j in range(1, k):
            if top_logits[row, j - 1] == top_logits[row, j]:
                assert ids[row, j] < ids[row, j + 1]
    if not ties:
        np.testing.assert_array_equal(ids, ref_ids)


def test_torch_path_is_the_reference(monkeypatch):
    """Without the kernel (no compiler, not the CPU, or a top-k wider than it keeps), each block
    goes through log_softmax and gather_logprobs: exactly the reference's values."""
    monkeypatch.setattr(plp, "logprob_kernels", lambda: None)
    compute_logits, hidden, targets = _case(plp.BLOCK_ROWS + 5, 4096, ties=False)
    for k in (0, 3, plp.MAX_FUSED_TOP + 1):
        got = plp.prompt_logprobs(compute_logits, hidden, targets, k)
        for a, b in zip(got, _reference(_blocked_logits(compute_logits, hidden), targets, k)):
            np.testing.assert_array_equal(a, b)


@needs_kernel
def test_fused_kernel_refuses_a_target_outside_the_vocabulary():
    compute_logits, hidden, targets = _case(4, 100, ties=False)
    targets[2] = 100
    with pytest.raises(ValueError, match=r"outside \[0, 100\)"):
        plp.prompt_logprobs(compute_logits, hidden, targets, 2)


# ---- end to end: preemption -------------------------------------------------------------------

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
