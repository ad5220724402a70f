"""gpt-oss (a tiny seeded GptOssForCausalLM of transformers' own classes: 2 layers, one sliding
and one full, 8 experts, top-2, YaRN, attention sinks) against transformers' eager fp32 greedy
tokens: alone, in a mixed batch, under preemption, with chunked prefill and prefix-cache hits,
at tensor_parallel_size 2, and from GGUF files laid out as llama.cpp writes gpt-oss (experts
de-interleaved and stacked; F32, and MXFP4 experts run as GGML blocks against transformers on
the dequantized weights)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

# the families' shared engine tests, run here on this module's family_dir
from test_architectures import (  # noqa: F401
    assert_engine_matches,
    assert_native_step_ran,
    prompts_of,
    test_alone_and_in_a_mixed_batch,
    test_chunked_prefill_and_prefix_cache_hits,
    test_under_preemption,
)
from test_engine_core import make_engine
from test_moe import GGUF_CASES, _assert_tp2_preempted_gives, assert_gguf_case
from tiny_models import build_tiny, hf_model, quantized_copy, write_gguf


@pytest.fixture(scope="module", params=["gpt_oss"])
def family_dir(request, tmp_path_factory) -> Path:
    return build_tiny(request.param, tmp_path_factory.mktemp(request.param))


def _layer(engine, index: int):
    return engine.executor.worker.model_runner.model.model.layers[index]


def test_moe_layer_routes_and_sums_as_transformers(family_dir):
    """The router (bias, softmax over the top-k logits) picks transformers' experts with its
    weights, and the experts (biases, clamped SwiGLU, gate / up de-interleaved on load) sum as its."""
    engine = make_engine(family_dir, num_kv_blocks=16)
    try:
        ours = _layer(engine, 0).mlp
    finally:
        engine.shutdown()
    block = hf_model(family_dir).model.layers[0].mlp
    x = torch.randn(37, ours.gate.in_features, generator=torch.Generator().manual_seed(0)) * 3
    with torch.no_grad():
        _, expected_weights, expected_ids = block.router(x)
        weights, ids = ours.route(x)
        assert torch.equal(ids, expected_ids)
        torch.testing.assert_close(weights, expected_weights, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(ours(x), block(x.unsqueeze(0))[0][0], rtol=1e-5, atol=1e-5)


def test_the_native_step_names_why_it_does_not_run(family_dir):
    """gpt-oss decodes layer by layer (torch's attention with sinks, the experts op by op), and says so."""
    from shmvllm.model.decode_step import fallback_reasons

    engine = make_engine(family_dir, num_kv_blocks=16)
    try:
        model = engine.executor.worker.model_runner.model.model
        assert model.decode_step is None
        reasons = fallback_reasons(model)
        assert any("attention sinks" in r for r in reasons) and any("gpt-oss" in r for r in reasons), reasons
        assert _layer(engine, 0).self_attn.attn.sliding_window == 8 and _layer(engine, 1).self_attn.attn.sliding_window is None
    finally:
        engine.shutdown()


def test_tensor_parallel_2_gives_transformers_tokens(family_dir):
    """Each rank holds half the query heads and their sinks, and every expert's share of rows
    (biases added by rank 0): a mixed batch under preemption gives transformers' tokens."""
    _assert_tp2_preempted_gives(family_dir, family_dir, seed=7, stop_token_ids=[])


# ---- GGUF: llama.cpp's gpt-oss layout --------------------------------------------------------

@pytest.fixture(scope="module")
def mxfp4(family_dir, tmp_path_factory) -> tuple[Path, Path]:
    """(a GGUF file with MXFP4 experts, an HF directory of the weights that file holds)."""
    base = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    path = write_gguf(family_dir, base / "tiny-gpt-oss-mxfp4.gguf", qtype="MXFP4")
    return path, quantized_copy(family_dir, base / "mxfp4-weights", "MXFP4")


def test_gguf_config_and_f32_weights_give_the_hf_directory_tokens(family_dir, tmp_path):
    """The config read from the file's header is the directory's (heads' and experts' width,
    window, YaRN untruncated), and its F32 tensors (experts stacked, gate and up apart, biases
    stacked, sinks) give the directory's tokens."""
    from shmvllm.model.registry import locate_model

    path = write_gguf(family_dir, tmp_path / "tiny-gpt-oss.gguf")
    config = locate_model(str(path)).hf_config()
    expected = hf_model(family_dir).config
    for name in ("head_dim", "intermediate_size", "num_local_experts", "num_experts_per_tok", "sliding_window",
                 "layer_types", "rope_parameters", "num_key_value_heads", "vocab_size"):
        assert getattr(config, name) == getattr(expected, name), name
    engine = make_engine(path, num_kv_blocks=64)
    try:
        assert_engine_matches(family_dir, engine, prompts_of([1, 17, 33, 5], seed=9))
    finally:
        engine.shutdown()


@pytest.mark.parametrize("case", GGUF_CASES)
def test_mxfp4_experts_against_transformers_on_the_dequantized_weights(mxfp4, case):
    path, reference = mxfp4

    def check_alone(engine) -> None:
        expert = _layer(engine, 1).mlp.experts[5]
        assert expert.gate_up_proj.blocks is not None and expert.down_proj.blocks is not None

    assert_gguf_case(path, reference, case, check_alone)


def test_mxfp4_experts_tensor_parallel_2_against_transformers(mxfp4):
    """Every MXFP4 expert's rows split in whole 32-value blocks over the two ranks, under preemption."""
    path, reference = mxfp4
    _assert_tp2_preempted_gives(path, reference, seed=14, stop_token_ids=[1])
