"""Defence in depth (issue 14): a request whose processing raises in the engine finishes alone
with an error output, and the engine process goes on serving.

The failure is injected inside the sampler of a real engine process: the sampler raises for
any batch that holds the poisoned request (the one sampled at temperature POISON_T).
"""

from __future__ import annotations

import pytest

from ipc.segment import pid_alive
from shmvllm import LLM, SamplingParams
from shmvllm.engine import llm_engine
from shmvllm.engine.core_client import MPClient
from shmvllm.executor.uniproc import UniProcExecutor
from shmvllm.model.sampler import Sampler

POISON_T = 0.625
ENGINE_ARGS = dict(max_model_len=256, num_kv_blocks=128, max_num_seqs=8)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
POISONED = SamplingParams(temperature=POISON_T, max_tokens=8, ignore_eos=True)
PROMPTS = ["Hello, my name is", "The capital of France is", "1, 2, 3,", "Once upon a time"]


class PoisonSampler(Sampler):
    def forward(self, logits, meta):
        if bool(((meta.temperature - POISON_T).abs() < 1e-6).any()):
            raise RuntimeError("poisoned row in the sampler")
        return super().forward(logits, meta)


class PoisonExecutor(UniProcExecutor):
    def __init__(self, config):
        super().__init__(config)
        runner = self.worker.model_runner
        runner.sampler = PoisonSampler(runner.sampler.generator)


class FailingStepExecutor(UniProcExecutor):
    """The model step itself raises once (the third step), whatever it holds."""

    def execute_model(self, scheduler_output):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == 3:
            raise RuntimeError("boom in execute_model")
        return super().execute_model(scheduler_output)


def llm_with(executor_class, tiny_llama_dir, monkeypatch) -> LLM:
    def make_client(config, multiprocess=True, started=None, prestarted=None):
        return MPClient(config, executor_class=executor_class, started=started, prestarted=prestarted)

    monkeypatch.setattr(llm_engine.EngineCoreClient, "make_client", staticmethod(make_client))
    return LLM(str(tiny_llama_dir), **ENGINE_ARGS)


def test_a_sampler_failure_for_one_request_finishes_it_alone(tiny_llama_dir, monkeypatch):
    with llm_with(PoisonExecutor, tiny_llama_dir, monkeypatch) as llm:
        clean = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        params = [GREEDY, POISONED, GREEDY, GREEDY]
        mixed = llm.generate(PROMPTS, params, use_tqdm=False)
        poisoned = mixed[1]
        assert poisoned.finished and poisoned.outputs[0].finish_reason == "error"
        assert "poisoned row in the sampler" in poisoned.error
        for i in (0, 2, 3):
            assert mixed[i].error is None and mixed[i].outputs[0].finish_reason == "length"
            assert list(mixed[i].outputs[0].token_ids) == list(clean[i].outputs[0].token_ids)
        assert pid_alive(llm.llm_engine.engine_core.engine_pid)
        again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in again] == [list(o.outputs[0].token_ids) for o in clean]
        stats = llm.llm_engine.engine_core.get_stats()
        assert stats["num_running_reqs"] == stats["num_waiting_reqs"] == 0


def test_a_failing_model_step_fails_its_requests_and_the_engine_serves_on(tiny_llama_dir, monkeypatch):
    with llm_with(FailingStepExecutor, tiny_llama_dir, monkeypatch) as llm:
        failed = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert all(o.outputs[0].finish_reason == "error" for o in failed)
        assert all("boom in execute_model" in o.error for o in failed)
        served = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert all(o.error is None and len(o.outputs[0].token_ids) == 8 for o in served)
        assert pid_alive(llm.llm_engine.engine_core.engine_pid)


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_a_logprobs_failure_in_one_request_is_its_own(tiny_llama_dir, monkeypatch, field):
    """The logprob reductions raising for one request (as torch.topk did for k > vocab): in the
    sampler (logprobs) or in the runner's prompt logprobs."""
    from shmvllm.model import sampler
    from shmvllm.worker import model_runner

    def failing_if_top_7(real):
        def call(*args):
            if args[-1] == 7:  # num_top, the last argument of both
                raise RuntimeError("selected index k out of range")
            return real(*args)
        return call

    monkeypatch.setattr(model_runner, "prompt_logprobs", failing_if_top_7(model_runner.prompt_logprobs))
    monkeypatch.setattr(sampler, "gather_logprobs", failing_if_top_7(sampler.gather_logprobs))
    with LLM(str(tiny_llama_dir), multiprocess=False, **ENGINE_ARGS) as llm:
        params = [GREEDY, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, **{field: 7})]
        outputs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
        assert outputs[1].outputs[0].finish_reason == "error" and "out of range" in outputs[1].error
        assert outputs[0].error is None and len(outputs[0].outputs[0].token_ids) == 8
        assert llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].error is None
