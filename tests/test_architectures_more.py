"""Phi-3 / Phi-4-mini (fused checkpoint weights, partial rotary, LongRoPE), Granite (its four
multipliers), OLMo 2 (norms after the blocks, q/k norm over the whole projection) and SmolLM3
(layers without rope) against transformers' eager fp32 greedy tokens, as tests/test_architectures.py
runs the families of the decoder: alone, in a mixed batch, under preemption, with chunked
prefill and prefix-cache hits; the same weights as a GGUF file where transformers' GGUF loader
reads the architecture (phi3), else its early refusal; every family at tensor_parallel_size=2, from
its HF directory and (where transformers reads its GGUF files) from a Q8_0 GGUF file."""

from __future__ import annotations

from pathlib import Path

import pytest

from shmvllm.model.models import check_gguf_architecture
# the families' shared engine tests, run here on this module's family_dir (Phi-3's prompts
# past LongRoPE's 32 use long factors throughout and share their cached prefix)
from test_architectures import (  # noqa: F401
    assert_engine_matches,
    prompts_of,
    test_alone_and_in_a_mixed_batch,
    test_chunked_prefill_and_prefix_cache_hits,
    test_under_preemption,
)
from test_engine_core import make_engine
from tiny_models import GGUF_ARCH, build_tiny, write_gguf

# the tiny models' options that differ from the config defaults, so that each family's own
# arithmetic shows: Phi-4-mini's partial rotary with LongRoPE switching at 32 positions (the
# mixed prompts and their decodes cross it), Granite's four scales away from 1
HALF = 4  # rotary_dim 8 of head_dim 16: 4 frequencies
FAMILY_OVERRIDES = {
    "phi3": dict(
        max_position_embeddings=128, original_max_position_embeddings=32,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "short_factor": [1.0, 1.3, 1.9, 2.5], "long_factor": [1.5, 2.8, 4.0, 7.5]},
    ),
    "granite": dict(embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.0),
    "olmo2": dict(),
    "smollm3": dict(no_rope_layers=[1, 0]),
}
FAMILIES = list(FAMILY_OVERRIDES)


@pytest.fixture(scope="module", params=FAMILIES)
def family_dir(request, tmp_path_factory) -> Path:
    return build_tiny(request.param, tmp_path_factory.mktemp(request.param), **FAMILY_OVERRIDES[request.param])


def test_phi3_gguf_of_the_same_weights(tmp_path):
    """transformers' phi3 GGUF config reads neither rope scaling nor partial rotary: the file's
    model is a default-rope Phi-3, so is the directory it is compared with."""
    model_dir = build_tiny("phi3", tmp_path / "phi3")
    path = write_gguf(model_dir, tmp_path / "phi3.gguf")
    engine = make_engine(path, num_kv_blocks=64)
    try:
        prompts = prompts_of([1, 17, 33, 5], seed=6)
        assert_engine_matches(model_dir, engine, prompts)
        assert_engine_matches(model_dir, engine, prompts, reference_dir=tmp_path, gguf_file=path.name)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("arch", ["granite", "olmo2", "smollm3"])
def test_gguf_files_transformers_cannot_read_are_refused(arch):
    with pytest.raises(ValueError, match=f"GGUF architecture '{arch}' is not supported"):
        check_gguf_architecture(arch)


# ---- tensor parallel: every family --------------------------------------------------------------

ALL_FAMILIES = {"llama": {}, "qwen3": {}, "gemma2": {}, "gemma3": {}, **FAMILY_OVERRIDES}


# (the mixture-of-experts families' own tests, tests/test_moe.py, run them at TP 2 and from GGUF)
@pytest.mark.parametrize("family, source", [(f, "hf") for f in ALL_FAMILIES] + [(f, "gguf") for f in GGUF_ARCH if f in ALL_FAMILIES])
def test_tensor_parallel_2_gives_transformers_tokens(family, source, tmp_path):
    """tensor_parallel_size=2 (rank 1 a worker program, the all-reduces through the shared-memory
    arena), each rank loading its share: a mixed batch under preemption, greedy tokens equal to
    transformers' on the HF directory, or on the GGUF file (its matrices as Q8_0 blocks, each
    rank's rows and block columns read from the file; the families' default rope, which is what
    transformers' GGUF configs carry)."""
    from shmvllm import LLM, SamplingParams
    from tiny_models import assert_same_greedy, hf_greedy

    model_dir = build_tiny(family, tmp_path / family, **(ALL_FAMILIES[family] if source == "hf" else {}))
    model, reference, file = model_dir, model_dir, None
    if source == "gguf":
        model = write_gguf(model_dir, tmp_path / f"{family}-q8_0.gguf", qtype="Q8_0")
        reference, file = tmp_path, model.name
    prompts = prompts_of([1, 5, 17, 8, 3, 24], seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    with LLM(model=str(model), multiprocess=False, tensor_parallel_size=2, num_kv_blocks=10, block_size=4,
             skip_tokenizer_init=True) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        stats = llm.llm_engine.engine_core.get_stats()
    assert stats["num_preemptions"] > 0, stats
    for prompt, output in zip(prompts, outputs):
        expected = hf_greedy(reference, tuple(prompt), 8, file)
        assert_same_greedy(list(output.outputs[0].token_ids), expected, f"{family} {source}, prompt of {len(prompt)} tokens")
