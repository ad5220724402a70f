"""A model on GGML blocks end to end: the shipped SmolLM2 GGUF (Q4_1 layers, Q8_0 tied
embedding) against transformers' own dequantization of the same file, the native decode step
against the layer-by-layer modules, the quantization knob, and Q8_0 at load for safetensors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from shmvllm.engine.arg_utils import EngineArgs
from shmvllm.model.kernels import quant_isas_supported, quant_kernels
from shmvllm.model.linear import Linear, VocabEmbedding
from shmvllm.model.loader import get_model
from shmvllm.model.quant import FORMAT_IDS, Q4_1_R8, quantize
from shmvllm.model.registry import gguf_source

from test_engine_core import assert_greedy_matches_hf, make_engine, random_prompts
from test_model_llama import PagedModel, _tokens, native_and_layered

pytestmark = pytest.mark.skipif(not quant_isas_supported(), reason="the quantized kernels could not be built")


def _blocks_as_fp32(module) -> torch.Tensor:
    if isinstance(module, VocabEmbedding):
        return module.blocks.dequantize()
    return torch.cat([part.dequantize() for _, part in module.blocks])


def test_gguf_blocks_hold_transformers_dequantized_weights(smollm2_dir):
    """Names, fused shards and the q/k row permutation: every weight the kernels see equals,
    bit for bit, what transformers' GGUF loader makes of the same file."""
    from conftest import hf_causal_lm

    model = get_model(EngineArgs(model=str(smollm2_dir), max_model_len=64).create_engine_config().model_config)
    reference = hf_causal_lm(smollm2_dir).state_dict()
    layer = model.model.layers[3]
    attn, mlp = layer.self_attn, layer.mlp
    prefix = "model.layers.3."
    expected = {
        "qkv": torch.cat([reference[prefix + f"self_attn.{p}_proj.weight"] for p in "qkv"]),
        "o": reference[prefix + "self_attn.o_proj.weight"],
        "gate_up": torch.cat([reference[prefix + f"mlp.{p}_proj.weight"] for p in ("gate", "up")]),
        "down": reference[prefix + "mlp.down_proj.weight"],
        "embed": reference["model.embed_tokens.weight"],
    }
    got = {
        "qkv": _blocks_as_fp32(attn.qkv_proj), "o": _blocks_as_fp32(attn.o_proj),
        "gate_up": _blocks_as_fp32(mlp.gate_up_proj), "down": _blocks_as_fp32(mlp.down_proj),
        "embed": _blocks_as_fp32(model.model.embed_tokens),
    }
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    assert torch.equal(layer.input_layernorm.weight, reference[prefix + "input_layernorm.weight"])
    # the tied lm_head runs on the embedding's own blocks, no second copy
    assert model.lm_head.blocks[0][1] is model.model.embed_tokens.blocks


def test_gguf_model_keeps_no_fp32_weights(smollm2_dir):
    model = get_model(EngineArgs(model=str(smollm2_dir), max_model_len=64).create_engine_config().model_config)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.blocks is not None and m.weight.numel() == 0 for m in linears)
    block_bytes = sum(
        part.data.numel() for m in linears if m is not model.lm_head for _, part in m.blocks
    ) + model.model.embed_tokens.blocks.data.numel()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    file_bytes = gguf_source(smollm2_dir).stat().st_size
    assert 0.95 * file_bytes < block_bytes + param_bytes <= file_bytes
    # the layers' Q4_1 rows are repacked into the 8-row pass's interleave where the build has it
    repacks = quant_kernels().shm_qrepack_type(FORMAT_IDS["Q4_1"], 8) == Q4_1_R8
    layer_types = {part.qtype for m in linears if m is not model.lm_head for _, part in m.blocks}
    assert layer_types == ({Q4_1_R8} if repacks else {FORMAT_IDS["Q4_1"]})


@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("which", ["smollm2", "tiny_llama", "tiny_qwen2"])  # qwen2: qkv bias, untied
def test_native_decode_step_equals_the_layer_path(request, which, rows):
    model_dir = request.getfixturevalue(f"{which}_dir")
    paged = PagedModel(model_dir)
    assert paged.model.model.decode_step is not None
    prompts = [_tokens(9 + 4 * i, i) for i in range(rows)]
    tables = [paged.blocks_for(len(p) + 3) for p in prompts]
    paged.step([(p, 0, len(p), t) for p, t in zip(prompts, tables)])  # prefill: the layer path
    seqs = [(p + [7], len(p), 1, t) for p, t in zip(prompts, tables)]
    fused = paged.step(seqs)
    step, paged.model.model.decode_step = paged.model.model.decode_step, None
    layered = paged.step(seqs)  # rewrites the same cache slots with the same values
    for a, b in zip(fused, layered):
        assert torch.equal(a, b)


@pytest.mark.parametrize("threads", [1, 3])
def test_native_decode_step_at_any_thread_count_and_long_context(tiny_llama_dir, threads):
    """The step's thread team splits GEMV rows and attention tasks among however many threads
    run it, and a context past one attention run (512 positions) adds the join of the runs'
    softmax pieces: still the layer path's hidden states bit for bit."""
    paged = PagedModel(tiny_llama_dir, num_blocks=200, max_model_len=1024)
    prompts = [_tokens(700, 1), _tokens(30, 2)]
    tables = [paged.blocks_for(len(p) + 3) for p in prompts]
    paged.step([(p, 0, len(p), t) for p, t in zip(prompts, tables)])
    seqs = [(p + [7], len(p), 1, t) for p, t in zip(prompts, tables)]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fused = paged.step(seqs)
        assert paged.model.model.decode_step._table.threads == threads
        paged.model.model.decode_step = None
        layered = paged.step(seqs)
    finally:
        torch.set_num_threads(before)
    for a, b in zip(fused, layered):
        assert torch.equal(a, b)


# every family's options as the native step's layer table carries them: (1 + w) norms and norms
# after the blocks, q/k norms per head and over the projection, GeGLU, soft-capping, windows and
# Gemma 3's two rope bases, Granite's scales, SmolLM3's layers without rope
FAMILY_OPTIONS = {
    "qwen3": {}, "gemma2": {}, "gemma3": {}, "phi3": {}, "olmo2": {}, "smollm3": {"no_rope_layers": [1, 0]},
    "granite": {"embedding_multiplier": 4.0, "residual_multiplier": 0.5, "attention_multiplier": 0.2, "logits_scaling": 2.0},
}


@pytest.mark.parametrize("family", sorted(FAMILY_OPTIONS))
def test_native_decode_step_equals_the_layer_path_for_every_family(family, tmp_path):
    """One and three requests, contexts shorter and longer than the tiny Gemmas' window (8) and
    than one attention run (512): the native step's hidden states are the layer path's bit for bit."""
    from tiny_models import VOCAB, build_tiny

    paged = PagedModel(build_tiny(family, tmp_path / family, **FAMILY_OPTIONS[family]), num_blocks=220, max_model_len=1024)
    for lengths in ([5], [9, 700, 21]):
        for a, b in native_and_layered(paged, lengths, VOCAB):
            assert torch.equal(a, b), (family, lengths)


def test_native_decode_step_skips_mixed_steps(tiny_llama_dir):
    """A step with a prefill in it, or more than 4 decodes, runs the layer path."""
    from shmvllm.model.attention import build_attention_metadata

    paged = PagedModel(tiny_llama_dir)
    step = paged.model.model.decode_step
    hidden = torch.zeros(3, 64)
    meta = build_attention_metadata(
        np.array([1, 2]), np.array([4, 0]), np.zeros((2, 4), np.int32), np.arange(3), 4, torch.device("cpu")
    )
    assert step.run(hidden, torch.arange(3), meta) is None
    meta = build_attention_metadata(
        np.ones(5, int), np.full(5, 3), np.zeros((5, 4), np.int32), np.arange(5), 4, torch.device("cpu")
    )
    assert step.run(torch.zeros(5, 64), torch.arange(5), meta) is None


# ---- greedy tokens on the blocks against transformers on the same file ----------------------

MIXED = [1, 5, 17, 33, 8, 40, 3, 24]


def test_gguf_greedy_mixed_batch_with_preemption(smollm2_dir, monkeypatch):
    import shmvllm.model.linear as linear

    rows_seen = []
    original = linear.block_linear

    def recording(x, *args, **kwargs):
        rows_seen.append(x.numel() // x.shape[-1])
        return original(x, *args, **kwargs)

    monkeypatch.setattr(linear, "block_linear", recording)
    engine = make_engine(smollm2_dir, num_kv_blocks=24, block_size=4)
    assert_greedy_matches_hf(smollm2_dir, engine, random_prompts(MIXED, seed=5), max_tokens=8)
    assert engine.get_stats()["num_preemptions"] > 0
    # the blocked GEMM ran: prefills, and decode steps of more than FEW_ROWS requests
    assert any(rows > linear.FEW_ROWS for rows in rows_seen) and any(5 <= rows <= len(MIXED) for rows in rows_seen)
    engine.shutdown()


def test_gguf_greedy_chunked_prefill(smollm2_dir):
    prompts = random_prompts(MIXED, seed=6)
    engine = make_engine(smollm2_dir, num_kv_blocks=128, max_num_batched_tokens=16)
    assert_greedy_matches_hf(smollm2_dir, engine, prompts, max_tokens=8)
    engine.shutdown()


def test_gguf_greedy_prefix_cache_hits(smollm2_dir):
    system = random_prompts([40], seed=7)[0]
    prompts = [system + suffix for suffix in random_prompts([3, 9, 1, 20, 6], seed=8)]
    engine = make_engine(smollm2_dir, num_kv_blocks=128)
    outputs = assert_greedy_matches_hf(smollm2_dir, engine, prompts, max_tokens=8)
    assert all(outs[-1].num_cached_tokens == 32 for outs in list(outputs.values())[1:])
    engine.shutdown()


def test_gguf_single_request_decodes_on_the_native_step(smollm2_dir):
    """One request alone: its decode steps run the native step (a token a call, or a burst of
    them in one call), and the tokens still match."""
    engine = make_engine(smollm2_dir, num_kv_blocks=64)
    step = engine.executor.worker.model_runner.model.model.decode_step
    assert step is not None
    ran, original = [], step.run
    step.run = lambda *args: ran.append(original(*args)) or ran[-1]
    outputs = assert_greedy_matches_hf(smollm2_dir, engine, random_prompts([30], seed=9), max_tokens=16)
    generated = sum(len(o.new_token_ids) for outs in outputs.values() for o in outs)
    assert ran[0] is None and all(out is not None for out in ran[1:])  # the prefill, then decodes
    assert step.steps == generated - 1  # every decoded token ran the native step
    engine.shutdown()


# ---- the knob ---------------------------------------------------------------------------------

def test_quantization_knob_is_checked(tiny_llama_dir, smollm2_dir):
    with pytest.raises(ValueError, match="quantization must be one of .* got 'int4'"):
        EngineArgs(model=str(tiny_llama_dir), quantization="int4").create_engine_config()
    with pytest.raises(ValueError, match="quantization='gguf' needs a .gguf model"):
        EngineArgs(model=str(tiny_llama_dir), quantization="gguf").create_engine_config()
    with pytest.raises(ValueError, match="already in blocks"):
        EngineArgs(model=str(smollm2_dir), quantization="q8_0").create_engine_config()
    config = EngineArgs(model=str(smollm2_dir), quantization="none", max_model_len=64).create_engine_config()
    model = get_model(config.model_config)
    assert all(m.blocks is None for m in model.modules() if isinstance(m, Linear))


def test_quantization_none_dequantizes_in_memory_to_transformers_values(smollm2_dir):
    """quantization='none' on a GGUF file: fp32 weights equal to transformers' dequantization of
    the file, made in memory (the cached directory holds no weights, and gains none)."""
    from conftest import hf_causal_lm

    model = get_model(EngineArgs(model=str(smollm2_dir), quantization="none", max_model_len=64).create_engine_config().model_config)
    reference = hf_causal_lm(smollm2_dir).state_dict()
    layer, prefix = model.model.layers[5], "model.layers.5."
    qkv = torch.cat([reference[prefix + f"self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(layer.self_attn.qkv_proj.weight, qkv)
    assert torch.equal(layer.mlp.down_proj.weight, reference[prefix + "mlp.down_proj.weight"])
    assert torch.equal(model.model.embed_tokens.weight, reference["model.embed_tokens.weight"])
    assert not list(smollm2_dir.glob("*.safetensors")) and not list(smollm2_dir.glob("*.bin"))
    assert sum(f.stat().st_size for f in smollm2_dir.iterdir()) < 8 * 2**20


def test_q8_0_at_load_matches_transformers_on_the_same_values(tiny_llama_dir, tmp_path):
    """quantization='q8_0' on a safetensors model: greedy tokens equal transformers running
    the Q8_0-dequantized linear weights (the exact values the blocks hold)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    hf.config.tie_word_embeddings = False
    with torch.no_grad():
        hf.lm_head.weight = torch.nn.Parameter(hf.model.embed_tokens.weight.clone())
        for name, module in hf.named_modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(quantize(module.weight, FORMAT_IDS["Q8_0"]).dequantize())
    reference_dir = tmp_path / "q8-reference"
    hf.save_pretrained(reference_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tiny_llama_dir / name).exists():
            (reference_dir / name).write_bytes((tiny_llama_dir / name).read_bytes())
    engine = make_engine(tiny_llama_dir, num_kv_blocks=64, quantization="q8_0")
    prompts = random_prompts([1, 5, 17, 33, 8], seed=4)
    requests_outputs = assert_greedy_matches_hf_on(reference_dir, tiny_llama_dir, engine, prompts)
    assert requests_outputs
    engine.shutdown()


def assert_greedy_matches_hf_on(reference_dir: Path, engine_dir: Path, engine, prompts):
    """assert_greedy_matches_hf with transformers loaded from another directory."""
    import test_engine_core as core

    outputs = core.run(engine, [core.make_request(p, core.greedy_params(engine_dir, 10), f"q8-{i}") for i, p in enumerate(prompts)])
    for i, prompt in enumerate(prompts):
        assert core.tokens_of(outputs[f"q8-{i}"]) == core.hf_greedy(reference_dir, tuple(prompt), 10)
    return outputs
