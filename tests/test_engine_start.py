"""How an engine process starts: a program of its own (the default) or a fork of the caller
(SHMVLLM_ENGINE_START=fork, vLLM's VLLM_WORKER_MULTIPROC_METHOD=fork, and the default after
install_as_vllm()), which sees the caller's modules as they are, monkeypatches included."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from shmvllm import LLM, SamplingParams, envs
from shmvllm.engine.core import EngineCore
from shmvllm.engine.core_proc import FORKED_ENGINE_NAME
from test_engine_death import _kill_mid_generate

ENGINE_ARGS = dict(max_model_len=256, num_kv_blocks=64)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [7, 8, 9]}, {"prompt_token_ids": [9, 8, 7, 6]}]

pytestmark = pytest.mark.usefixtures("no_engine_left_behind")


@pytest.fixture
def start(monkeypatch):
    def set_method(shmvllm_start, vllm_method=None):
        for name, value in (("SHMVLLM_ENGINE_START", shmvllm_start), ("VLLM_WORKER_MULTIPROC_METHOD", vllm_method)):
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
    return set_method


@pytest.mark.parametrize("shmvllm_start, vllm_method, expected", [
    (None, None, "program"), (None, "fork", "fork"), (None, "spawn", "program"),
    ("program", "fork", "program"), ("fork", "spawn", "fork"),
])
def test_the_start_method_comes_from_the_environment(start, shmvllm_start, vllm_method, expected):
    start(shmvllm_start, vllm_method)
    assert envs.SHMVLLM_ENGINE_START() == expected


@pytest.mark.parametrize("name, value", [("SHMVLLM_ENGINE_START", "spawn"), ("VLLM_WORKER_MULTIPROC_METHOD", "forkserver")])
def test_a_bad_start_method_names_its_variable(monkeypatch, name, value):
    monkeypatch.delenv("SHMVLLM_ENGINE_START", raising=False)
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"{name} must be one of .* got '{value}'"):
        envs.SHMVLLM_ENGINE_START()


def test_install_as_vllm_makes_fork_the_default(start, monkeypatch):
    from shmvllm.compat import install_as_vllm
    from shmvllm.compat.vllm_modules import VllmFinder

    start(None)
    monkeypatch.setattr(envs, "_default_engine_start", "program")  # restored after the test
    finders = list(sys.meta_path)
    try:
        install_as_vllm()
        assert envs.SHMVLLM_ENGINE_START() == "fork"
        start(None, "spawn")
        assert envs.SHMVLLM_ENGINE_START() == "program"  # the user's choice still wins
    finally:
        sys.meta_path[:] = [f for f in finders if not isinstance(f, VllmFinder)]


def _preprocess_refusing_token_7(monkeypatch) -> None:
    original = EngineCore.preprocess_add_request

    def refusing(self, request):
        if request.prompt_token_ids and request.prompt_token_ids[0] == 7:  # a list, as vLLM's request carries
            raise ValueError("refused by the caller's patch")
        return original(self, request)

    monkeypatch.setattr(EngineCore, "preprocess_add_request", refusing)


def test_a_forked_engine_sees_the_callers_patch_where_a_program_does_not(tiny_llama_dir, start, monkeypatch):
    _preprocess_refusing_token_7(monkeypatch)
    a = torch.randn(256, 256)
    (a @ a).sum()  # the caller's OpenMP threads exist at the fork: they must not hang the engine
    start("fork")
    with LLM(str(tiny_llama_dir), **ENGINE_ARGS) as llm:
        engine = llm.llm_engine.engine_core.engine_pid
        assert Path(f"/proc/{engine}/comm").read_text().strip() == FORKED_ENGINE_NAME
        refused, served = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert refused.finished and refused.outputs[0].finish_reason == "error" and refused.outputs[0].token_ids == []
        assert len(served.outputs[0].token_ids) == 8
        again = llm.generate(PROMPTS[1:], GREEDY, use_tqdm=False)[0]  # the engine serves on
    start("program")
    with LLM(str(tiny_llama_dir), **ENGINE_ARGS) as llm:  # a fresh interpreter: the patch is not there
        first, second = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert first.outputs[0].finish_reason == "length"
        assert second.outputs[0].token_ids == served.outputs[0].token_ids == again.outputs[0].token_ids


def test_kill_9_of_a_forked_engine_leaves_nothing(tiny_llama_dir, start):
    start("fork")
    with LLM(str(tiny_llama_dir), **ENGINE_ARGS) as llm:
        engine = llm.llm_engine.engine_core.engine_pid
        _kill_mid_generate(llm, engine, {engine})
