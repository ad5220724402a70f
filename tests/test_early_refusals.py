"""Engine arguments and models the engine could not run are refused by the frontend before
anything starts: a ValueError naming the argument or the file, in well under 2 s, with no engine
process started and nothing written to the cache (SHMVLLM_CACHE)."""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest

from shmvllm import LLM
from shmvllm.config import EngineArgs
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
        assert not cache.exists() or not any(cache.iterdir()), sorted(cache.rglob("*"))
        return raised.value

    return check


def test_a_kv_cache_below_one_block_is_refused(refused_early, tiny_llama_dir):
    refused_early(r"kv_cache_memory=100 bytes holds no KV-cache block", str(tiny_llama_dir), kv_cache_memory=100)
    refused_early(r"kv_cache_memory=100 bytes", str(tiny_llama_dir), kv_cache_memory_bytes=100)


def test_one_block_is_what_the_engine_needs(tiny_llama_dir):
    """The frontend's block size is the engine's: exactly one block starts (in this process)."""
    config = EngineArgs(model=str(tiny_llama_dir), max_model_len=64, dtype="float32").create_engine_config()
    per_block = kv_cache_bytes_per_block(config.model_config.hf_config, "float32", 16)
    with pytest.raises(ValueError, match="holds no KV-cache block"):
        EngineArgs(model=str(tiny_llama_dir), max_model_len=64, dtype="float32",
                   kv_cache_memory=per_block - 1).create_engine_config()
    with LLM(str(tiny_llama_dir), max_model_len=64, dtype="float32", kv_cache_memory=per_block,
             multiprocess=False) as llm:
        assert llm.llm_engine.engine_core.num_kv_blocks == 1


def test_max_model_len_above_the_models_limit_is_refused(refused_early, tiny_llama_dir):
    refused_early(r"max_model_len \(1000000\)", str(tiny_llama_dir), max_model_len=1_000_000)


def test_unreadable_weights_are_refused_naming_the_file(refused_early, tiny_llama_dir, tmp_path):
    model = tmp_path / "broken"
    shutil.copytree(tiny_llama_dir, model)
    (model / "model.safetensors").write_bytes(b"this is not a safetensors file")
    refused_early(r"model\.safetensors", str(model))
    (model / "model.safetensors").unlink()
    refused_early(r"no \*\.safetensors weights", str(model))
