"""Speculative decoding with n-gram proposals (the draft model's: test_spec_draft_model.py): the
config's checks, the proposer, the scheduler's rollback, rejection sampling's distribution, and
greedy outputs equal to those without it."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from shmvllm import LLM, SamplingParams
from shmvllm.config import CacheConfig, SchedulerConfig
from shmvllm.core.request import Request
from shmvllm.core.sched.output import ModelRunnerOutput
from shmvllm.core.sched.scheduler import Scheduler
from shmvllm.model.sampler import Sampler, SamplingMetadata, seeded_generator
from shmvllm.spec_decode.config import SpeculativeConfig
from shmvllm.spec_decode.ngram_proposer import NgramProposer
from shmvllm.spec_decode.rejection_sampler import verify

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}

# Prompts whose continuations repeat their own spans (what n-gram lookup finds).
PROMPTS = [
    "Repeat exactly: the cat sat on the mat, the cat sat on the mat, the cat sat on the mat,",
    "1 2 3 4 5 6 7 8 9 10 1 2 3 4 5 6 7 8 9 10 1 2 3",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a +",
    "Once upon a time",
]


# ---- config ------------------------------------------------------------------------------

@pytest.mark.parametrize("value, match", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "eagle"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "medusa"),
    ({"method": "mtp", "num_speculative_tokens": 2}, "mtp"),
    ({"method": "suffix", "num_speculative_tokens": 2}, "suffix"),
    ({"method": "bogus", "num_speculative_tokens": 2}, "bogus"),
    ({"num_speculative_tokens": 2}, "method"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 4}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 3, "acceptance_method": "typical"}, "acceptance_method"),
])
def test_config_refuses_naming_the_key(value, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_user(value)


def test_config_types_and_defaults():
    with pytest.raises(TypeError, match="num_speculative_tokens"):
        SpeculativeConfig.from_user({"method": "ngram", "num_speculative_tokens": 2.0})
    with pytest.raises(TypeError, match="speculative_config"):
        SpeculativeConfig.from_user("ngram")
    config = SpeculativeConfig.from_user({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max) == (3, 4, 4)
    config = SpeculativeConfig.from_user({"method": "ngram", "num_speculative_tokens": 2})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (3, 5)


def test_llm_refuses_before_the_engine_starts(tiny_llama_dir):
    with pytest.raises(ValueError, match="eagle"):
        LLM(model=str(tiny_llama_dir), speculative_config={"method": "eagle", "num_speculative_tokens": 2})


# ---- proposer ----------------------------------------------------------------------------

def propose(tokens, k=3, lo=1, hi=3):
    config = SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=lo, prompt_lookup_max=hi)
    return NgramProposer(config).propose(np.array(tokens), k)


def test_ngram_longest_suffix_match():
    # suffix [1, 2]: the occurrence preceded by 9 matches 3 tokens ([9, 1, 2]) and wins
    assert propose([9, 1, 2, 5, 6, 7, 1, 2, 8, 9, 9, 1, 2]) == [5, 6, 7]
    # equal lengths: the latest occurrence
    assert propose([1, 2, 5, 1, 2, 6, 1, 2], hi=2) == [6, 1, 2]
    assert propose([1, 2, 3, 4]) == []  # no earlier occurrence
    assert propose([7, 7]) == [7]  # the continuation stops at the end of the tokens
    assert propose([1, 2, 3, 1, 2], lo=3, hi=3) == []  # too short a match
    assert propose([1, 2, 3, 4, 1, 2], k=1) == [3]


# ---- scheduler: rollback and freed blocks ------------------------------------------------

def test_scheduler_rolls_back_and_frees_rejected_blocks():
    block_size = 2
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64),
        CacheConfig(block_size=block_size, enable_prefix_caching=True), num_blocks=16,
        speculative_config=SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=2),
    )
    request = Request("r", [5, 6, 7, 5, 6, 7, 5], SamplingParams(temperature=0.0, max_tokens=20))
    scheduler.add_request(request)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"r": 7}
    scheduler.update_from_output(out, ModelRunnerOutput(req_ids=["r"], sampled_token_ids=[[6]]))
    free_before = scheduler.kv_cache_manager.get_num_free_blocks()
    # 8 tokens, suffix [5, 6] last seen at 3: proposals [7, 5, 6]; positions 7..10 -> 6 blocks
    out = scheduler.schedule()
    assert out.scheduled_spec_decode_tokens == {"r": [7, 5, 6]} and out.num_scheduled_tokens == {"r": 4}
    assert scheduler.kv_cache_manager.get_num_free_blocks() == free_before - 2
    # the target rejects the first proposal and says 8: 9 tokens, 8 computed, 5 blocks kept
    scheduler.update_from_output(out, ModelRunnerOutput(req_ids=["r"], sampled_token_ids=[[8]]))
    assert request.output_token_ids == [6, 8] and request.num_computed_tokens == 8
    assert scheduler.kv_cache_manager.get_num_free_blocks() == free_before - 1
    assert scheduler.spec_stats.as_dict() == {"num_drafts": 1, "num_draft_tokens": 3, "num_accepted_tokens": 0,
                                              "num_accepted_tokens_per_pos": [0, 0, 0, 0]}
    out = scheduler.schedule()  # the runner hears that only 5 blocks are left before new ones
    assert out.kept_block_ids == {"r": 5}
    assert out.scheduled_cached_reqs.num_computed_tokens == [8]
    assert out.scheduled_spec_decode_tokens == {}  # [8] occurs nowhere before
    scheduler.update_from_output(out, ModelRunnerOutput(req_ids=["r"], sampled_token_ids=[[6]]))
    assert request.num_computed_tokens == 9 and scheduler.schedule().kept_block_ids == {}


def test_scheduler_bounds_proposals_by_max_tokens_and_budget():
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64),
        CacheConfig(block_size=4), num_blocks=16,
        speculative_config=SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=2),
    )
    request = Request("r", [5, 6, 7, 5, 6, 7, 5], SamplingParams(temperature=0.0, max_tokens=3))
    scheduler.add_request(request)
    out = scheduler.schedule()
    scheduler.update_from_output(out, ModelRunnerOutput(req_ids=["r"], sampled_token_ids=[[6]]))
    out = scheduler.schedule()  # 2 more tokens at most: one proposal and the target's next
    assert out.scheduled_spec_decode_tokens == {"r": [7]}
    penalized = Request("p", [5, 6, 7, 5, 6, 7, 5], SamplingParams(temperature=0.0, repetition_penalty=1.2))
    scheduler.add_request(penalized)
    scheduler.update_from_output(out, ModelRunnerOutput(req_ids=["r"], sampled_token_ids=[[7, 5]]))
    out = scheduler.schedule()
    scheduler.update_from_output(out, ModelRunnerOutput(req_ids=["p"], sampled_token_ids=[[6]]))
    out = scheduler.schedule()
    assert "p" not in out.scheduled_spec_decode_tokens and out.num_scheduled_tokens["p"] == 1


# ---- rejection sampling ------------------------------------------------------------------

def test_rejection_sampling_keeps_the_target_distribution():
    """Many seeded draws at one position with a proposal: the emitted token's frequencies match
    the target's probabilities (chi-square, p > 0.01), with a likely and an unlikely proposal."""
    from scipy.stats import chisquare

    vocab = 6
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5], [0.0] * vocab])
    target = torch.softmax(logits[0].double(), dim=-1).numpy()
    target /= target.sum()
    draws = 4000
    for proposal in (0, 4):
        counts = np.zeros(vocab)
        for seed in range(draws):
            meta = SamplingMetadata(temperature=torch.ones(2), all_greedy=False, all_random=True,
                                    generators={0: seeded_generator(seed, 0, torch.device("cpu")),
                                                1: seeded_generator(seed, 1, torch.device("cpu"))})
            emitted, _ = verify(Sampler(), logits.clone(), meta, [[proposal]])
            counts[emitted[0][0]] += 1
        assert chisquare(counts, target * draws).pvalue > 0.01, (proposal, counts, target * draws)


def test_rejection_sampling_is_reproducible_and_greedy_is_exact():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))

    def run(seed):
        meta = SamplingMetadata(temperature=torch.full((3,), 0.8), all_greedy=False, all_random=True,
                                generators={i: seeded_generator(seed, i, torch.device("cpu")) for i in range(3)})
        return verify(Sampler(), logits.clone(), meta, [[int(logits[0].argmax()), 7]])[0]

    assert run(1) == run(1)
    greedy = SamplingMetadata(temperature=torch.zeros(3), all_greedy=True, all_random=False)
    first, second = int(logits[0].argmax()), int(logits[1].argmax())
    assert verify(Sampler(), logits.clone(), greedy, [[first, second]])[0] == [[first, second, int(logits[2].argmax())]]
    assert verify(Sampler(), logits.clone(), greedy, [[first, (second + 1) % 50]])[0] == [[first, second]]


# ---- end to end: greedy equality ---------------------------------------------------------

def _generate(model, prompts, params, **engine_args):
    with LLM(model=str(model), multiprocess=False, max_model_len=512, **engine_args) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        metrics = {m.name: getattr(m, "value", getattr(m, "values", None)) for m in llm.get_metrics()}
        free = llm.llm_engine.engine_core.get_stats()["num_free_blocks"]
        total = llm.llm_engine.engine_core.get_stats()["num_kv_blocks"]
    gc.collect()
    return [list(o.outputs[0].token_ids) for o in outputs], metrics, (free, total)


@pytest.mark.parametrize("engine_args, preempts", [
    pytest.param(dict(num_kv_blocks=256), False, id="batched"),
    pytest.param(dict(num_kv_blocks=12, block_size=8, max_num_seqs=4), True, id="preemption"),
])
def test_tiny_model_greedy_equal_with_and_without(tiny_llama_dir, engine_args, preempts):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    base, _, _ = _generate(tiny_llama_dir, PROMPTS, params, **engine_args)
    spec, metrics, (free, total) = _generate(tiny_llama_dir, PROMPTS, params, speculative_config=NGRAM, **engine_args)
    assert spec == base
    assert metrics["vllm:spec_decode_num_draft_tokens"] > 0 and metrics["vllm:spec_decode_num_accepted_tokens"] > 0
    per_pos = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert len(per_pos) == 4 and per_pos == sorted(per_pos, reverse=True)
    assert free == total  # every block back, the rolled-back ones included
    assert (metrics["vllm:num_preemptions"] > 0) == preempts
    single, _, _ = _generate(tiny_llama_dir, PROMPTS[:1], params, speculative_config=NGRAM, **engine_args)
    assert single == base[:1]


def test_tiny_model_logprobs_and_stops_with_speculation(tiny_llama_dir):
    """The target's logprobs for every accepted token; max_tokens and a stop string that falls
    inside an accepted run end the output where they would without speculation."""
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)]
    engine_args = dict(model=str(tiny_llama_dir), multiprocess=False, max_model_len=512, num_kv_blocks=128)
    with LLM(**engine_args) as llm:
        base = llm.generate(PROMPTS[:2], params, use_tqdm=False)
        text = base[0].outputs[0].text
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        with_stop = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop])
        base_stop = llm.generate(PROMPTS[:1], with_stop, use_tqdm=False)[0].outputs[0]
    with LLM(**engine_args, speculative_config=NGRAM) as llm:
        spec = llm.generate(PROMPTS[:2], params, use_tqdm=False)
        spec_stop = llm.generate(PROMPTS[:1], with_stop, use_tqdm=False)[0].outputs[0]
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in base]
    assert len(spec[1].outputs[0].token_ids) == 7
    for got, want in zip(spec[0].outputs[0].logprobs, base[0].outputs[0].logprobs):
        assert got.keys() == want.keys()
        for token in got:
            assert got[token].logprob == pytest.approx(want[token].logprob, abs=1e-4)
    assert (spec_stop.text, spec_stop.finish_reason, spec_stop.stop_reason) == (base_stop.text, "stop", stop)
    assert list(spec_stop.token_ids) == list(base_stop.token_ids)


def test_smollm2_greedy_equal_with_and_without():
    prompts = [
        "<|im_start|>user\nCopy this sentence and change 'red' to 'blue': The red car stopped at the red light "
        "near the red house.<|im_end|>\n<|im_start|>assistant\n",
        "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
    ]
    params = SamplingParams(temperature=0.0, max_tokens=32)
    base, _, _ = _generate("smollm2-135m-instruct", prompts, params)
    spec, metrics, _ = _generate("smollm2-135m-instruct", prompts, params, speculative_config=NGRAM)
    assert spec == base
    assert metrics["vllm:spec_decode_num_accepted_tokens"] > 0


def test_tiny_model_structured_outputs_equal_with_and_without(tiny_llama_dir):
    """The grammar mask applies at every verified position: proposals the grammar forbids are
    cut, and greedy outputs equal those without speculation, within the grammar."""
    import re

    from shmvllm.sampling_params import StructuredOutputsParams

    pattern = r"(cat|mat|sat|on|the|[ ,])+"
    params = [SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=pattern)),
              SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)]
    base, _, _ = _generate(tiny_llama_dir, PROMPTS[:2], params, num_kv_blocks=128)
    spec, metrics, _ = _generate(tiny_llama_dir, PROMPTS[:2], params, num_kv_blocks=128, speculative_config=NGRAM)
    assert spec == base
    assert metrics["vllm:spec_decode_num_accepted_tokens"] > 0
    with LLM(model=str(tiny_llama_dir), multiprocess=False, max_model_len=512, num_kv_blocks=128,
             speculative_config=NGRAM) as llm:
        text = llm.generate(PROMPTS[:1], params[0], use_tqdm=False)[0].outputs[0].text
        stats = llm.llm_engine.engine_core.get_stats()["spec_decode"]
    assert re.fullmatch(r"[catmsheon ,]+", text), text  # cut by max_tokens: only the alphabet is certain
    assert stats["num_draft_tokens"] > 0
