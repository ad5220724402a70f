"""Engine arguments and models the engine could not run are refused by the frontend before
anything starts: a ValueError naming the argument or the file, in well under 2 s, with no engine
process started and nothing written to the cache (SHMVLLM_CACHE)."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from shmvllm import LLM
from shmvllm.engine.arg_utils import EngineArgs
from shmvllm.engine.validation import kv_cache_bytes_per_block


@pytest.fixture
def refused_early(tmp_path, monkeypatch):
    """Runs `LLM(*args, **kwargs)` expecting a ValueError matching `match` within 2 s, with no
    process started and the cache left empty; returns the error."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("SHMVLLM_CACHE", str(cache))

    def no_process(*args, **kwargs):
        raise AssertionError(f"a process was started: {args[0] if args else kwargs.get('args')}")

    monkeypatch.setattr(subprocess, "Popen", no_process)

    def check(match: str, *args, **kwargs) -> ValueError:
        started = time.monotonic()
        with pytest.raises(ValueError, match=match) as raised:
            LLM(*args, **kwargs)
        elapsed = time.monotonic() - started
        assert elapsed < 2.0, f"refused after {elapsed:.2f} s"
        assert sorted(cache.rglob("*")) == []
        return raised.value

    return check


def test_a_kv_cache_below_one_block_is_refused(refused_early, tiny_llama_dir):
    refused_early(r"kv_cache_memory=100 bytes holds no KV-cache block", str(tiny_llama_dir), kv_cache_memory=100)
    refused_early(r"kv_cache_memory=100 bytes", str(tiny_llama_dir), kv_cache_memory_bytes=100)


def test_a_kv_cache_below_one_block_of_a_gguf_file_is_refused_before_its_conversion(refused_early):
    """The default model (a GGUF file) on a fresh cache: the budget is checked from the file's header."""
    refused_early(r"kv_cache_memory=100 bytes holds no KV-cache block: one block of 16 tokens takes 737280 bytes",
                  kv_cache_memory=100)


def test_one_block_is_what_the_engine_needs(tiny_llama_dir):
    """The frontend's block size is the engine's: exactly one block starts (in this process)."""
    config = EngineArgs(model=str(tiny_llama_dir), max_model_len=64, dtype="float32").create_engine_config()
    per_block = kv_cache_bytes_per_block(config.model_config.hf_config, "float32", 16)
    with pytest.raises(ValueError, match="holds no KV-cache block"):
        EngineArgs(model=str(tiny_llama_dir), max_model_len=64, dtype="float32",
                   kv_cache_memory=per_block - 1).create_engine_config()
    with LLM(str(tiny_llama_dir), max_model_len=64, dtype="float32", kv_cache_memory=per_block,
             multiprocess=False) as llm:
        assert llm.llm_engine.engine_core.ready.num_kv_blocks == 1


def test_max_model_len_above_the_models_limit_is_refused(refused_early, tiny_llama_dir):
    refused_early(r"max_model_len \(1000000\)", str(tiny_llama_dir), max_model_len=1_000_000)


def test_unreadable_weights_are_refused_naming_the_file(refused_early, tiny_llama_dir, tmp_path):
    model = tmp_path / "broken"
    shutil.copytree(tiny_llama_dir, model)
    (model / "model.safetensors").write_bytes(b"this is not a safetensors file")
    refused_early(r"model\.safetensors", str(model))
    (model / "model.safetensors").unlink()
    refused_early(r"no \*\.safetensors weights", str(model))


def test_an_unsupported_architecture_is_refused(refused_early, tiny_llama_dir, tmp_path):
    model = tmp_path / "falcon"
    shutil.copytree(tiny_llama_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = ["FalconForCausalLM"]
    (model / "config.json").write_text(json.dumps(config))
    refused_early(r"FalconForCausalLM.*not supported", str(model))


def _write_gguf(path: Path, architecture: str, tensor_type: str) -> Path:
    """A GGUF file with llama-style metadata and one 256 x 256 weight in `tensor_type`."""
    import gguf

    qtype = gguf.GGMLQuantizationType[tensor_type]
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_context_length(256)
    writer.add_embedding_length(256)
    writer.add_feed_forward_length(512)
    writer.add_head_count(4)
    writer.add_layer_norm_rms_eps(1e-5)
    data = np.zeros((256, 256 // block_values * block_bytes), dtype=np.uint8)
    writer.add_tensor("blk.0.attn_q.weight", data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_an_unsupported_gguf_tensor_type_is_refused(refused_early, tmp_path):
    path = _write_gguf(tmp_path / "iq2.gguf", "llama", "IQ2_XXS")
    refused_early(r"(?s)blk\.0\.attn_q\.weight.*IQ2_XXS", str(path))


def test_an_unsupported_gguf_architecture_is_refused(refused_early, tmp_path):
    path = _write_gguf(tmp_path / "falcon.gguf", "falcon", "Q8_0")
    refused_early(r"GGUF architecture 'falcon'", str(path))


def test_a_file_that_is_not_gguf_is_refused_naming_it(refused_early, tmp_path):
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"GGML but not really" * 10)
    refused_early("fake.gguf", str(path))
