"""RoPE against transformers: inverse frequencies against `ROPE_INIT_FUNCTIONS` (bit for bit),
the rotation against the model's rotary embedding module and `apply_rotary_pos_emb` (partial
rotary included), and the length-dependent types (dynamic NTK, LongRoPE) through the engine:
greedy tokens equal to transformers' `generate` of a fresh model, for prompts below, across and
past the threshold, in one mixed batch, with chunked prefill, prefix-cache hits and preemption."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shmvllm.model.rotary import RotaryEmbedding, rope_inv_freq

_SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)
HEAD_DIM = 16


def _factors(n: int, start: float, step: float) -> list[float]:
    return [start + step * i for i in range(n)]


def _rope(rope_type: str, partial: float = 1.0) -> dict:
    half = int(HEAD_DIM * partial) // 2
    params = {
        "default": {"rope_theta": 500.0},
        "linear": {"rope_theta": 1000.0, "factor": 3.0},
        "llama3": {"rope_theta": 5000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 16},
        "yarn": {"rope_theta": 5000.0, "factor": 4.0, "original_max_position_embeddings": 16},
        "dynamic": {"rope_theta": 1000.0, "factor": 3.0},
        "longrope": {"rope_theta": 1000.0, "short_factor": _factors(half, 1.0, 0.1),
                     "long_factor": _factors(half, 2.0, 0.3), "original_max_position_embeddings": 32},
    }[rope_type]
    return {"rope_type": rope_type, **params, **({"partial_rotary_factor": partial} if partial != 1.0 else {})}


def _config(rope_type: str, partial: float = 1.0):
    from transformers import LlamaConfig, Phi3Config

    rope = _rope(rope_type, partial)
    if rope_type in ("default", "longrope"):  # the types Phi3Config accepts; it keeps the original length beside
        return Phi3Config(**_SMALL, rope_parameters=rope, pad_token_id=0, eos_token_id=2,
                          original_max_position_embeddings=rope.get("original_max_position_embeddings", 64))
    return LlamaConfig(**_SMALL, rope_parameters=rope)


TYPES = ["default", "linear", "llama3", "yarn", "dynamic", "longrope"]


@pytest.mark.parametrize("partial", [1.0, 0.5])
@pytest.mark.parametrize("rope_type", TYPES)
def test_inv_freq_equals_transformers(rope_type, partial):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    config = _config(rope_type, partial)
    init = ROPE_INIT_FUNCTIONS.get(rope_type, Phi3RotaryEmbedding.compute_default_rope_parameters)
    ref, ref_factor = init(config)
    ours, factor = rope_inv_freq(config, HEAD_DIM)
    assert ours.shape == (int(HEAD_DIM * partial) // 2,)
    assert torch.equal(ours, ref) and factor == ref_factor
    if rope_type in ("dynamic", "longrope"):  # a forward's length past the threshold: as transformers passes it
        for length in (65, 100, 1000):
            ref, ref_factor = init(config, seq_len=torch.tensor(length) if rope_type == "dynamic" else length)
            ours, factor = rope_inv_freq(config, HEAD_DIM, seq_len=length)
            assert torch.equal(ours, ref) and factor == ref_factor


def _hf_rotation(rotary, q: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """q [T, H, D] rotated by transformers' module and apply_rotary_pos_emb, one forward."""
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    x = q.transpose(0, 1)[None]  # [1, H, T, D]
    cos, sin = rotary(x, torch.tensor([positions]))
    rotated, _ = apply_rotary_pos_emb(x, x, cos, sin)
    return rotated[0].transpose(0, 1)


@pytest.mark.parametrize("partial", [1.0, 0.75])
@pytest.mark.parametrize("rope_type", TYPES)
def test_rotation_equals_transformers_generate(rope_type, partial):
    """A prompt forward then decode forwards, as transformers' generate runs them on one fresh
    rotary module, against ours given each token's length max(prompt, position + 1)."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    config = _config(rope_type, partial)
    for prompt_len in (10, 40, 70):  # below both thresholds, past longrope's (32), past dynamic's (64)
        hf = Phi3RotaryEmbedding(config)  # its default type honours partial_rotary_factor, Llama's does not
        ours = RotaryEmbedding(config, HEAD_DIM, 128)
        assert ours.length_dependent == (rope_type in ("dynamic", "longrope"))
        forwards = [list(range(prompt_len))] + [[p] for p in range(prompt_len, prompt_len + 30)]
        for positions in forwards:
            q = torch.randn(len(positions), 6, HEAD_DIM, generator=torch.Generator().manual_seed(positions[0]))
            expected = _hf_rotation(hf, q, positions)
            lengths = torch.tensor([max(prompt_len, p + 1) for p in positions])
            got = q.clone()
            ours(torch.tensor(positions), torch.float32, lengths).apply_(got)
            torch.testing.assert_close(got, expected, rtol=0, atol=2e-6)
            if partial != 1.0:
                rotary_dim = int(HEAD_DIM * partial)
                assert torch.equal(got[..., rotary_dim:], q[..., rotary_dim:])


def test_table_only_below_the_threshold():
    """An engine whose longest position stays within the threshold needs no lengths, and the
    native decode step may read its table by position; a partial rotation may not."""
    for rope_type in ("dynamic", "longrope"):
        embedding = RotaryEmbedding(_config(rope_type), HEAD_DIM, 32)
        assert not embedding.length_dependent and embedding.by_position_only
        with pytest.raises(ValueError, match="rope_lengths"):
            RotaryEmbedding(_config(rope_type), HEAD_DIM, 128)(torch.arange(4), torch.float32)
    assert not RotaryEmbedding(_config("default", 0.5), HEAD_DIM, 32).by_position_only


def test_unsupported_rope_parameters_are_named():
    from transformers import LlamaConfig

    config = LlamaConfig(**_SMALL, rope_parameters={"rope_type": "proportional", "rope_theta": 10000.0})
    with pytest.raises(ValueError, match="proportional"):
        rope_inv_freq(config, HEAD_DIM)
    config = LlamaConfig(**_SMALL, rope_parameters={"rope_type": "default", "rope_theta": 100.0,
                                                     "partial_rotary_factor": 0.1})
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        rope_inv_freq(config, HEAD_DIM)


# ---- through the engine ----------------------------------------------------------------------

def _tiny_llama(tmp_path, rope: dict, max_position_embeddings: int):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**{**_SMALL, "max_position_embeddings": max_position_embeddings}, rope_parameters=rope,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    with torch.no_grad():  # peaked logits: greedy tokens far from ties
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3 if "lm_head" in name else 0.15)
    model.save_pretrained(tmp_path)
    return tmp_path


def _hf_greedy(model_dir, prompt: list[int], max_tokens: int) -> list[int]:
    """A fresh model per prompt: transformers' dynamic rope keeps state across forwards."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize(
    "rope, max_positions",
    [
        ({"rope_type": "dynamic", "rope_theta": 1000.0, "factor": 3.0}, 32),
        ({"rope_type": "longrope", "rope_theta": 1000.0, "short_factor": _factors(8, 1.0, 0.2),
          "long_factor": _factors(8, 3.0, 0.5), "original_max_position_embeddings": 32}, 128),
    ],
    ids=["dynamic", "longrope"],
)
def test_length_dependent_rope_generates_transformers_tokens(tmp_path, rope, max_positions):
    from shmvllm import LLM, SamplingParams

    model_dir = _tiny_llama(tmp_path, rope, max_positions)
    rng = np.random.default_rng(0)
    # below the threshold (32) throughout, crossing it while decoding, past it from the prompt
    prompts = [rng.integers(3, 512, size=n).tolist() for n in (8, 20, 45)]
    # the same prompts grown by 20 tokens (28, 40, 65): their prefixes are cached, rotated by
    # another length where a prompt passes the threshold (the cache must not hand them out)
    longer = [p + rng.integers(3, 512, size=20).tolist() for p in prompts]
    max_tokens = 24
    expected = [_hf_greedy(model_dir, p, max_tokens) for p in prompts]
    expected_longer = [_hf_greedy(model_dir, p, max_tokens) for p in longer]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens)
    runs = {
        "batch": dict(),
        "chunked": dict(max_num_batched_tokens=16, enable_chunked_prefill=True),
        "preempted": dict(num_kv_blocks=12, block_size=8),
    }
    for name, extra in runs.items():
        with LLM(model=str(model_dir), multiprocess=False, max_model_len=96, skip_tokenizer_init=True,
                 **extra) as llm:
            requests = [{"prompt_token_ids": p} for p in prompts]
            got = [o.outputs[0].token_ids for o in llm.generate(requests, params, use_tqdm=False)]
            assert got == expected, name
            again = llm.generate(requests[::-1], params, use_tqdm=False)  # prefix-cache hits
            assert [list(o.outputs[0].token_ids) for o in again] == expected[::-1], name
            grown = llm.generate([{"prompt_token_ids": p} for p in longer], params, use_tqdm=False)
            assert [list(o.outputs[0].token_ids) for o in grown] == expected_longer, name
