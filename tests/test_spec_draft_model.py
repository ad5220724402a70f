"""Speculative decoding with a draft model: the config's checks at the boundary, rejection
sampling with the draft's full distribution q, and greedy outputs equal to those without it
(single, batched, under preemption, with structured outputs); a draft that is the target itself
has every proposal accepted, which proves the mechanics (the draft's KV, its catch-up, the
rollback)."""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest
import torch

from shmvllm import LLM, SamplingParams
from shmvllm.model.sampler import Sampler, SamplingMetadata, race_sample, seeded_generator
from shmvllm.spec_decode.config import SpeculativeConfig
from shmvllm.spec_decode.ngram_proposer import TokenArrays
from shmvllm.spec_decode.rejection_sampler import verify

PROMPTS = [
    "Repeat exactly: the cat sat on the mat, the cat sat on the mat,",
    "1 2 3 4 5 6 7 8 9 10",
    "def add(a, b):\n    return a + b\n",
    "Once upon a time",
]


def draft(model: Path, k: int = 3) -> dict:
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def tiny_draft_dir(tmp_path_factory, smollm2_dir) -> Path:
    """A 1-layer random Llama with the target's (SmolLM2's) tokenizer: proposals mostly rejected."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    config = LlamaConfig(
        vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=1024, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    target = tmp_path_factory.mktemp("tiny-draft")
    model.save_pretrained(target)
    AutoTokenizer.from_pretrained(smollm2_dir).save_pretrained(target)
    return target


# ---- config, at the boundary ---------------------------------------------------------------

@pytest.mark.parametrize("value, error, match", [
    ({"method": "draft_model", "num_speculative_tokens": 2}, ValueError, "'model'"),
    ({"method": "draft_model", "model": 3, "num_speculative_tokens": 2}, TypeError, "'model'"),
    ({"method": "draft_model", "model": "x", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2},
     ValueError, "draft_tensor_parallel_size"),
    ({"method": "draft_model", "model": "x", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
     ValueError, "prompt_lookup_max"),
    ({"method": "draft_model", "model": "x", "num_speculative_tokens": 2, "max_model_len": 64}, ValueError, "max_model_len"),
])
def test_config_refuses_naming_the_key(value, error, match):
    with pytest.raises(error, match=match):
        SpeculativeConfig.from_user(value)


def test_config_accepts_vllms_keys():
    config = SpeculativeConfig.from_user(
        {"method": "draft_model", "model": "m", "num_speculative_tokens": 4, "draft_tensor_parallel_size": 1,
         "quantization": None}
    )
    assert (config.method, config.model, config.num_speculative_tokens, config.uses_draft_model) == ("draft_model", "m", 4, True)


def test_llm_refuses_a_draft_of_another_vocabulary_or_too_short(tiny_llama_dir, tmp_path):
    from tiny_models import VOCAB, build_tiny

    other = build_tiny("llama", tmp_path / "other-vocab")
    with pytest.raises(ValueError, match=f"vocab_size {VOCAB}.*has 49152"):
        LLM(model=str(tiny_llama_dir), speculative_config=draft(other))
    short = build_tiny("llama", tmp_path / "short", vocab_size=49152, max_position_embeddings=64)
    with pytest.raises(ValueError, match="64 positions.*max_model_len=512"):
        LLM(model=str(tiny_llama_dir), max_model_len=512, speculative_config=draft(short))
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        LLM(model=str(tiny_llama_dir), tensor_parallel_size=2, speculative_config=draft(tiny_llama_dir))
    with pytest.raises(ValueError, match="'quantization'"):
        LLM(model=str(tiny_llama_dir), speculative_config={**draft(tiny_llama_dir), "quantization": "awq"})


# ---- rejection sampling with a full q ------------------------------------------------------

def test_rejection_sampling_with_a_draft_distribution_keeps_the_target_distribution():
    """The proposal is drawn from q (not a point mass), accepted with min(1, p/q), else the
    token comes from max(p - q, 0): the emitted token's frequencies match p (chi-square)."""
    from scipy.stats import chisquare

    vocab = 6
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5], [0.0] * vocab])
    p = torch.softmax(logits[0].double(), dim=-1).numpy()
    q = torch.tensor([[0.05, 0.4, 0.3, 0.05, 0.15, 0.05]])  # far from p: many rejections
    draws = 4000
    counts = np.zeros(vocab)
    accepted = 0
    cpu = torch.device("cpu")
    for seed in range(draws):
        proposal = int(race_sample(q.clone(), {0: seeded_generator(seed, 1 << 40, cpu)}, None)[0])
        meta = SamplingMetadata(temperature=torch.ones(2), all_greedy=False, all_random=True,
                                generators={0: seeded_generator(seed, 0, cpu), 1: seeded_generator(seed, 1, cpu)})
        emitted, _ = verify(Sampler(), logits.clone(), meta, [[proposal]], [q])
        counts[emitted[0][0]] += 1
        accepted += len(emitted[0]) == 2
    assert chisquare(counts, p / p.sum() * draws).pvalue > 0.01, (counts, p * draws)
    # the acceptance rate is sum(min(p, q))
    expected = float(np.minimum(p, q[0].numpy()).sum())
    assert abs(accepted / draws - expected) < 0.03, (accepted / draws, expected)


def test_token_arrays_append_and_drop():
    arrays = TokenArrays()
    tokens = list(range(100))
    assert arrays.update("a", tokens[:3]).tolist() == [0, 1, 2]
    assert arrays.update("a", tokens).tolist() == tokens
    arrays.drop("a")
    assert arrays.update("a", [7]).tolist() == [7]


# ---- end to end ----------------------------------------------------------------------------

def _generate(model, prompts, params, multiprocess=False, **engine_args):
    with LLM(model=str(model), multiprocess=multiprocess, max_model_len=512, **engine_args) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        metrics = {m.name: getattr(m, "value", getattr(m, "values", None)) for m in llm.get_metrics()}
        stats = llm.llm_engine.engine_core.get_stats()
    gc.collect()
    return [list(o.outputs[0].token_ids) for o in outputs], metrics, (stats["num_free_blocks"], stats["num_kv_blocks"])


@pytest.mark.parametrize("engine_args, preempts", [
    pytest.param(dict(num_kv_blocks=256), False, id="batched"),
    # chunked prompts (16-token budget: the draft catches up chunk by chunk) and a KV cache that preempts
    pytest.param(dict(num_kv_blocks=14, block_size=8, max_num_seqs=4, max_num_batched_tokens=16), True,
                 id="preemption-chunked"),
])
def test_greedy_equal_with_and_without(tiny_llama_dir, tiny_draft_dir, engine_args, preempts):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    base, _, _ = _generate(tiny_llama_dir, PROMPTS, params, **engine_args)
    # the target as its own draft: every proposal accepted
    same, metrics, (free, total) = _generate(tiny_llama_dir, PROMPTS, params, speculative_config=draft(tiny_llama_dir),
                                             **engine_args)
    assert same == base
    assert metrics["vllm:spec_decode_num_draft_tokens"] > 0
    assert metrics["vllm:spec_decode_num_accepted_tokens"] == metrics["vllm:spec_decode_num_draft_tokens"]
    per_pos = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]
    # every draft's first proposal accepted; fewer proposals only where max_tokens is near
    assert len(per_pos) == 3 and per_pos[0] == metrics["vllm:spec_decode_num_drafts"] and per_pos == sorted(per_pos)[::-1]
    assert free == total
    assert (metrics["vllm:num_preemptions"] > 0) == preempts
    # a 1-layer random draft: mostly rejected, the same tokens
    other, metrics, (free, total) = _generate(tiny_llama_dir, PROMPTS, params, speculative_config=draft(tiny_draft_dir, 4),
                                              **engine_args)
    assert other == base and free == total
    assert metrics["vllm:spec_decode_num_draft_tokens"] > metrics["vllm:spec_decode_num_accepted_tokens"]
    single, _, _ = _generate(tiny_llama_dir, PROMPTS[:1], params, speculative_config=draft(tiny_draft_dir), **engine_args)
    assert single == base[:1]


def test_engine_process_logprobs_and_prefix_cache(tiny_llama_dir):
    """Through the engine process (the draft's config crosses the pipe): a shared prompt prefix
    (prefix-cache hits: the draft's KV sits in the same blocks) and logprobs, as without it."""
    prefix = "The same long shared prefix of this prompt, written twice over. " * 3
    prompts = [prefix + "First", prefix + "Second"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    with LLM(model=str(tiny_llama_dir), max_model_len=512, num_kv_blocks=128) as llm:
        base = llm.generate(prompts, params, use_tqdm=False)
    with LLM(model=str(tiny_llama_dir), max_model_len=512, num_kv_blocks=128,
             speculative_config=draft(tiny_llama_dir)) as llm:
        spec = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]  # the second hits the first's blocks
        stats = llm.llm_engine.engine_core.get_stats()
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in base]
    assert spec[1].num_cached_tokens > 0
    assert stats["spec_decode"]["num_accepted_tokens"] == stats["spec_decode"]["num_draft_tokens"] > 0
    for got, want in zip(spec[1].outputs[0].logprobs, base[1].outputs[0].logprobs):
        assert got.keys() == want.keys()
        for token in got:
            assert got[token].logprob == pytest.approx(want[token].logprob, abs=1e-4)


def test_structured_outputs_equal_with_and_without(tiny_llama_dir, tiny_draft_dir):
    from shmvllm.sampling_params import StructuredOutputsParams

    pattern = r"(cat|mat|sat|on|the|[ ,])+"
    params = [SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=StructuredOutputsParams(regex=pattern)),
              SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)]
    base, _, _ = _generate(tiny_llama_dir, PROMPTS[:2], params, num_kv_blocks=128)
    for model in (tiny_llama_dir, tiny_draft_dir):
        spec, metrics, _ = _generate(tiny_llama_dir, PROMPTS[:2], params, num_kv_blocks=128,
                                     speculative_config=draft(model))
        assert spec == base
        assert metrics["vllm:spec_decode_num_draft_tokens"] > 0
    # random sampling under a grammar proposes nothing (a cut that depends on the draws would bias it)
    sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=12, structured_outputs=StructuredOutputsParams(regex=pattern))
    _, metrics, _ = _generate(tiny_llama_dir, PROMPTS[:1], sampled, num_kv_blocks=128,
                              speculative_config=draft(tiny_llama_dir))
    assert metrics["vllm:spec_decode_num_draft_tokens"] == 0


def test_seeded_sampling_is_reproducible_and_a_same_draft_is_accepted(tiny_llama_dir):
    """Random requests verify against the draft's q: with the target as its own draft p == q,
    so (up to rounding) every proposal is accepted; seeded requests repeat their tokens."""
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=s, max_tokens=24, ignore_eos=True) for s in (1, 2)]
    runs = [_generate(tiny_llama_dir, PROMPTS[:2], params, num_kv_blocks=128, speculative_config=draft(tiny_llama_dir))
            for _ in range(2)]
    assert runs[0][0] == runs[1][0]
    metrics = runs[0][1]
    assert metrics["vllm:spec_decode_num_accepted_tokens"] >= 0.95 * metrics["vllm:spec_decode_num_draft_tokens"] > 0


def test_gguf_drafts(tmp_path):
    """A draft given as a GGUF file (the loader's other format): the target's own weights as
    GGUF are accepted every time, a 1-layer GGUF draft changes no token."""
    from tiny_models import build_tiny, write_gguf

    target = build_tiny("llama", tmp_path / "target")
    same = write_gguf(target, tmp_path / "same.gguf")
    small = write_gguf(build_tiny("llama", tmp_path / "small", seed=1, num_hidden_layers=1), tmp_path / "small.gguf")
    prompts = [{"prompt_token_ids": [2, 40, 41, 42, 40, 41, 42, 40]}, {"prompt_token_ids": [2, 100, 7, 9]}]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    base, _, _ = _generate(target, prompts, params, num_kv_blocks=64)
    got, metrics, _ = _generate(target, prompts, params, num_kv_blocks=64, speculative_config=draft(same))
    assert got == base
    assert metrics["vllm:spec_decode_num_accepted_tokens"] == metrics["vllm:spec_decode_num_draft_tokens"] > 0
    got, metrics, _ = _generate(target, prompts, params, num_kv_blocks=64, speculative_config=draft(small))
    assert got == base and metrics["vllm:spec_decode_num_draft_tokens"] > 0
