"""The executor / model runner driven step by step with hand-planned SchedulerOutputs, against
transformers: greedy decode of mixed batches, chunked prefill, preemption, prefix-cache hits,
seeds, logprobs, prompt logprobs, and KV cache sizing."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import pytest
import torch

from shmvllm.engine.arg_utils import EngineArgs
from shmvllm.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from shmvllm.executor.uniproc import UniProcExecutor
from shmvllm.sampling_params import SamplingParams

BLOCK_SIZE = 4


@dataclass
class _Req:
    req_id: str
    prompt: list[int]
    params: SamplingParams
    outputs: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    sent: bool = False  # the runner holds its state
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.outputs)


class StepDriver:
    """Plans steps like the engine's scheduler would (FCFS, one token budget, chunked prefill),
    in a few lines, so that the runner can be tested on its own."""

    def __init__(self, executor: UniProcExecutor, num_blocks: int, token_budget: int, eos: Optional[int]) -> None:
        self.executor = executor
        self.free = list(range(num_blocks))
        self.token_budget = token_budget
        self.eos = eos
        self.running: list[_Req] = []
        self.done: dict[str, _Req] = {}
        self.finished: set[str] = set()
        self.preempted: set[str] = set()

    def add(self, req_id: str, prompt: list[int], params: SamplingParams, shared: Optional[_Req] = None,
            shared_blocks: int = 0) -> _Req:
        req = _Req(req_id, list(prompt), params)
        if shared is not None:  # a prefix-cache hit: reuse the first full blocks of `shared`
            req.blocks = list(shared.blocks[:shared_blocks])
            req.num_computed = shared_blocks * BLOCK_SIZE
        self.running.append(req)
        return req

    def preempt(self, req: _Req) -> None:
        self.free.extend(b for b in req.blocks if not self._shared_elsewhere(req, b))
        req.blocks, req.num_computed, req.sent = [], 0, False
        self.preempted.add(req.req_id)

    def _shared_elsewhere(self, req: _Req, block: int) -> bool:
        return any(block in other.blocks for other in self.running if other is not req)

    def step(self):
        budget = self.token_budget
        new_reqs, cached, scheduled = [], CachedRequestData(), {}
        for req in self.running:
            n = min(req.num_tokens - req.num_computed, budget)
            if n <= 0:
                continue
            need = -(-(req.num_computed + n) // BLOCK_SIZE) - len(req.blocks)
            added = [self.free.pop(0) for _ in range(need)]
            req.blocks.extend(added)
            budget -= n
            scheduled[req.req_id] = n
            if req.sent:
                cached.req_ids.append(req.req_id)
                cached.new_block_ids.append(added)
                cached.num_computed_tokens.append(req.num_computed)
            else:
                new_reqs.append(NewRequestData(req.req_id, list(req.prompt), list(req.outputs), req.params, None,
                                               list(req.blocks), req.num_computed))
                req.sent = True
        so = SchedulerOutput(new_reqs, cached, scheduled, sum(scheduled.values()), self.finished, self.preempted)
        self.finished, self.preempted = set(), set()
        out = self.executor.execute_model(so)
        assert sorted(out.req_ids) == sorted(scheduled)
        for req_id, tokens in zip(out.req_ids, out.sampled_token_ids):
            req = next(r for r in self.running if r.req_id == req_id)
            req.num_computed += scheduled[req_id]
            req.outputs.extend(tokens)
            if req_id in out.logprobs:
                req.logprobs.append(out.logprobs[req_id])
            if req_id in out.prompt_logprobs:
                req.prompt_logprobs.append(out.prompt_logprobs[req_id])
            if tokens and (len(req.outputs) >= req.params.max_tokens or tokens[-1] == self.eos):
                self._finish(req)
        return out

    def _finish(self, req: _Req) -> None:
        self.running.remove(req)
        self.free.extend(b for b in req.blocks if not self._shared_elsewhere(req, b))
        self.finished.add(req.req_id)
        self.done[req.req_id] = req

    def run(self, max_steps: int = 10_000) -> dict[str, _Req]:
        for _ in range(max_steps):
            if not self.running:
                return self.done
            self.step()
        raise AssertionError("requests did not finish")


def _executor(model_dir, num_blocks: int = 256, max_num_seqs: int = 16, **kwargs) -> UniProcExecutor:
    config = EngineArgs(model=str(model_dir), max_model_len=256, block_size=BLOCK_SIZE, num_kv_blocks=num_blocks,
                        max_num_seqs=max_num_seqs, **kwargs).create_engine_config()
    executor = UniProcExecutor(config)
    executor.initialize_kv_cache(executor.determine_num_kv_blocks())
    return executor


def _prompts(count: int, seed: int = 0, vocab: int = 49152) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=int(rng.integers(3, 30))).tolist() for _ in range(count)]


def _hf_greedy(hf_model, prompt: list[int], max_tokens: int, **kwargs) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                            pad_token_id=hf_model.config.eos_token_id, **kwargs)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def hf_models(tiny_llama_dir, tiny_qwen2_dir):
    from transformers import AutoModelForCausalLM

    return {d: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for d in (tiny_llama_dir, tiny_qwen2_dir)}


@pytest.mark.parametrize("which", ["llama", "qwen2"])
@pytest.mark.parametrize("budget", [512, 7])
def test_greedy_batch_matches_hf_generate(which, budget, tiny_llama_dir, tiny_qwen2_dir, hf_models):
    model_dir = tiny_llama_dir if which == "llama" else tiny_qwen2_dir
    hf = hf_models[model_dir]
    executor = _executor(model_dir)
    driver = StepDriver(executor, 256, budget, eos=hf.config.eos_token_id)
    prompts = _prompts(9, seed=1)
    for i, prompt in enumerate(prompts):
        driver.add(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=12 + i))
        if i % 4 == 0:  # random rows in the same batch leave the greedy ones alone
            driver.add(f"x{i}", prompt, SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8))
    done = driver.run()
    for i, prompt in enumerate(prompts):
        assert done[f"r{i}"].outputs == _hf_greedy(hf, prompt, 12 + i), f"request r{i}"


def test_greedy_with_repetition_penalty_matches_hf(tiny_llama_dir, hf_models):
    hf = hf_models[tiny_llama_dir]
    executor = _executor(tiny_llama_dir)
    driver = StepDriver(executor, 256, 512, eos=None)
    prompts = _prompts(3, seed=6)
    for i, prompt in enumerate(prompts):
        driver.add(f"r{i}", prompt, SamplingParams(temperature=0.0, repetition_penalty=1.8, max_tokens=20))
    driver.add("plain", prompts[0], SamplingParams(temperature=0.0, max_tokens=20))
    done = driver.run()
    for i, prompt in enumerate(prompts):
        assert done[f"r{i}"].outputs == _hf_greedy(hf, prompt, 20, repetition_penalty=1.8), f"request r{i}"
    assert done["plain"].outputs == _hf_greedy(hf, prompts[0], 20)
    assert done["plain"].outputs != done["r0"].outputs


def test_preemption_and_resume_match_hf(tiny_llama_dir, hf_models):
    hf = hf_models[tiny_llama_dir]
    executor = _executor(tiny_llama_dir)
    driver = StepDriver(executor, 256, 64, eos=None)
    prompts = _prompts(4, seed=2)
    reqs = [driver.add(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=16)) for i, p in enumerate(prompts)]
    for _ in range(5):
        driver.step()
    driver.preempt(reqs[3])
    driver.preempt(reqs[1])
    driver.step()  # the preempted ones are re-sent as NewRequestData with their outputs
    done = driver.run()
    for i, prompt in enumerate(prompts):
        assert done[f"r{i}"].outputs == _hf_greedy(hf, prompt, 16), f"request r{i}"


def test_unscheduled_request_keeps_its_state(tiny_llama_dir, hf_models):
    """A running request left out of a step (budget) leaves the batch but keeps its tokens."""
    hf = hf_models[tiny_llama_dir]
    executor = _executor(tiny_llama_dir)
    driver = StepDriver(executor, 256, 1, eos=None)  # budget 1: one request per step
    prompts = [[5, 6, 7], [9, 10, 11, 12]]
    for i, p in enumerate(prompts):
        driver.add(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=6))
    done = driver.run()
    for i, prompt in enumerate(prompts):
        assert done[f"r{i}"].outputs == _hf_greedy(hf, prompt, 6)


def test_prefix_cache_hit_matches_hf(tiny_llama_dir, hf_models):
    hf = hf_models[tiny_llama_dir]
    executor = _executor(tiny_llama_dir)
    driver = StepDriver(executor, 256, 512, eos=None)
    system = list(range(100, 118))  # 18 tokens: 4 full blocks of 4
    first = driver.add("a", system + [7, 8, 9], SamplingParams(temperature=0.0, max_tokens=8))
    driver.step()
    second = driver.add("b", system + [40, 41], SamplingParams(temperature=0.0, max_tokens=8), shared=first,
                        shared_blocks=4)
    assert second.num_computed == 16
    done = driver.run()
    assert done["a"].outputs == _hf_greedy(hf, system + [7, 8, 9], 8)
    assert done["b"].outputs == _hf_greedy(hf, system + [40, 41], 8)


def test_logprobs_and_prompt_logprobs_match_hf(tiny_qwen2_dir, hf_models):
    hf = hf_models[tiny_qwen2_dir]
    executor = _executor(tiny_qwen2_dir)
    driver = StepDriver(executor, 256, 6, eos=None)  # chunked prefill: prompt logprobs come in pieces
    prompt = _prompts(1, seed=3)[0] + [11, 12, 13, 14, 15, 16, 17]
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=5, logprobs=3, prompt_logprobs=2)
    driver.add("lp", prompt, params)
    driver.add("other", [4, 5, 6], SamplingParams(temperature=0.0, max_tokens=5))
    req = driver.run()["lp"]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt + req.outputs])).logits[0].float(), dim=-1)
    rows = [lp.arrays() for lp in req.logprobs]
    assert len(rows) == 5
    for i, (ids, lps, ranks) in enumerate(rows):
        position = len(prompt) - 1 + i
        assert ids.shape == (1, 4) and ids[0, 0] == req.outputs[i]
        np.testing.assert_allclose(lps[0], ref[position, torch.from_numpy(ids[0].copy()).long()].numpy(), atol=1e-4)
        top = torch.topk(ref[position], 3)
        assert ids[0, 1:].tolist() == top.indices.tolist()
        assert ranks[0] == int((ref[position] > ref[position, ids[0, 0]]).sum()) + 1
    ids = np.concatenate([lp.arrays()[0] for lp in req.prompt_logprobs])
    lps = np.concatenate([lp.arrays()[1] for lp in req.prompt_logprobs])
    assert len(req.prompt_logprobs) > 1 and ids.shape == (len(prompt) - 1, 3)
    assert ids[:, 0].tolist() == prompt[1:]
    expected = ref[torch.arange(len(prompt) - 1)[:, None], torch.from_numpy(ids).long()]
    np.testing.assert_allclose(lps, expected.numpy(), atol=1e-4)


@pytest.mark.parametrize("when", ["mid_prompt", "in_decode"])
def test_a_preempted_request_gets_each_prompt_logprob_row_once(tiny_qwen2_dir, hf_models, when):
    """Preempted half-way through its chunked prompt, or while decoding, then recomputed from
    its first token: the rows given before are not given again, the rest come, and together
    they are the rows of the prompt."""
    hf = hf_models[tiny_qwen2_dir]
    driver = StepDriver(_executor(tiny_qwen2_dir), 256, 8, eos=None)
    prompt = _prompts(1, seed=4)[0] + list(range(100, 120))
    req = driver.add("lp", prompt, SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=2))
    steps = 2 if when == "mid_prompt" else -(-len(prompt) // 8) + 1
    for _ in range(steps):
        driver.step()
    rows_before = sum(lp.num_rows for lp in req.prompt_logprobs)
    assert (0 < rows_before < len(prompt) - 1) if when == "mid_prompt" else rows_before == len(prompt) - 1
    driver.preempt(req)
    driver.run()
    ids = np.concatenate([lp.arrays()[0] for lp in req.prompt_logprobs])
    lps = np.concatenate([lp.arrays()[1] for lp in req.prompt_logprobs])
    assert ids[:, 0].tolist() == prompt[1:]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    expected = ref[torch.arange(len(prompt) - 1)[:, None], torch.from_numpy(ids).long()]
    np.testing.assert_allclose(lps, expected.numpy(), atol=1e-4)


def _sample_alone_and_in_batch(model_dir, params: SamplingParams, preempt: bool) -> tuple[list[int], list[int]]:
    executor = _executor(model_dir)
    alone = StepDriver(executor, 256, 512, eos=None)
    alone.add("s", [20, 21, 22, 23, 24], params)
    alone_tokens = alone.run()["s"].outputs
    executor = _executor(model_dir)
    batch = StepDriver(executor, 256, 9, eos=None)
    for i, prompt in enumerate(_prompts(5, seed=4)):
        batch.add(f"o{i}", prompt, SamplingParams(temperature=1.0, max_tokens=10))
    target = batch.add("s", [20, 21, 22, 23, 24], params)
    for _ in range(6):
        batch.step()
    if preempt:
        batch.preempt(target)
    return alone_tokens, batch.run()["s"].outputs


@pytest.mark.parametrize("preempt", [False, True])
def test_seeded_sampling_independent_of_batch(tiny_llama_dir, preempt):
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=1234, max_tokens=12)
    alone, in_batch = _sample_alone_and_in_batch(tiny_llama_dir, params, preempt)
    assert alone == in_batch
    other_seed, _ = _sample_alone_and_in_batch(tiny_llama_dir, SamplingParams(temperature=1.0, seed=99, max_tokens=12),
                                               False)
    assert other_seed != alone


def test_min_tokens_masks_stop_tokens(tiny_llama_dir):
    executor = _executor(tiny_llama_dir)
    driver = StepDriver(executor, 256, 512, eos=None)
    probe = driver.add("probe", [30, 31, 32], SamplingParams(temperature=0.0, max_tokens=4))
    driver.run()
    first = probe.outputs[0]
    # Make the greedy choices stop tokens: while below min_tokens they must not be sampled.
    params = SamplingParams(temperature=0.0, max_tokens=4, min_tokens=3, stop_token_ids=[first])
    driver.add("masked", [30, 31, 32], params)
    done = driver.run()
    assert first not in done["masked"].outputs[:3]
    # EOS too, under ignore_eos (which only keeps EOS from stopping), as vLLM and HF's min_new_tokens do.
    params = SamplingParams(temperature=0.0, max_tokens=4, min_tokens=3, ignore_eos=True, eos_token_id=first)
    driver.add("eos", [30, 31, 32], params)
    done = driver.run()
    assert first not in done["eos"].outputs[:3]


def test_finished_and_aborted_requests_are_dropped(tiny_llama_dir):
    executor = _executor(tiny_llama_dir)
    driver = StepDriver(executor, 256, 512, eos=None)
    a = driver.add("a", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=3))
    driver.add("b", [8, 9], SamplingParams(temperature=0.0, max_tokens=30))
    driver.step()
    driver.running.remove(a)  # an abort: the runner hears of it through finished_req_ids
    driver.finished.add("a")
    driver.step()
    runner = executor.worker.model_runner
    assert "a" not in runner.requests and runner.input_batch.req_ids == ["b"]


def test_kv_cache_sizing(tiny_llama_dir):
    config = EngineArgs(model=str(tiny_llama_dir), max_model_len=256, block_size=16, max_num_seqs=4,
                        kv_cache_memory=1 << 20).create_engine_config()
    executor = UniProcExecutor(config)
    per_block = executor.worker.model_runner.kv_cache_bytes_per_block()
    assert per_block == 2 * 2 * 16 * 2 * 16 * 4  # k+v, layers, block, kv heads, head_dim, fp32
    assert executor.determine_num_kv_blocks() == min((1 << 20) // per_block, 4 * 16)
    config.cache_config.kv_cache_memory = 10 * per_block
    assert executor.determine_num_kv_blocks() == 10
    config.cache_config.num_kv_blocks = 3
    assert executor.determine_num_kv_blocks() == 3
    config.cache_config.num_kv_blocks = None
    config.cache_config.kv_cache_memory = None  # default: a share of the free RAM, capped by max_num_seqs
    assert executor.determine_num_kv_blocks() == 4 * 16
    executor.worker.model_runner.profile_run()  # the CUDA sizing path's forward also runs on the CPU
    executor.shutdown()


def test_smollm2_greedy_batch_matches_hf(smollm2_dir):
    from transformers import AutoTokenizer

    from conftest import hf_causal_lm

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    hf = hf_causal_lm(smollm2_dir)
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far",
             "1, 2, 3, 4,", "Water boils at", "The quick brown fox", "My favourite colour is", "Hello"]
    prompts = [tokenizer(t)["input_ids"] for t in texts]
    executor = _executor(smollm2_dir, num_blocks=128)
    driver = StepDriver(executor, 128, 32, eos=hf.config.eos_token_id)
    for i, prompt in enumerate(prompts):
        driver.add(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=10))
    done = driver.run()
    for i, prompt in enumerate(prompts):
        assert done[f"r{i}"].outputs == _hf_greedy(hf, prompt, 10), texts[i]


def test_embedding_task_runs_the_pooling_runner(tiny_bert_dir):
    from sentence_transformers import SentenceTransformer

    from shmvllm.pooling_params import PoolingParams

    config = EngineArgs(model=str(tiny_bert_dir), max_num_seqs=4).create_engine_config()
    executor = UniProcExecutor(config)
    num_blocks = executor.determine_num_kv_blocks()
    assert num_blocks == 4 * -(-config.scheduler_config.max_model_len // config.cache_config.block_size)
    executor.initialize_kv_cache(num_blocks)
    prompt = [101, 7592, 2088, 102]
    new = NewRequestData("e", prompt, [], None, PoolingParams(), [0], 0)
    out = executor.execute_model(SchedulerOutput([new], CachedRequestData(), {"e": 4}, 4))
    reference = SentenceTransformer(str(tiny_bert_dir), device="cpu")
    with torch.no_grad():
        features = {"input_ids": torch.tensor([prompt]), "attention_mask": torch.ones(1, 4, dtype=torch.int64)}
        expected = reference(features)["sentence_embedding"][0].numpy()
    np.testing.assert_allclose(out.pooler_output["e"], expected, atol=1e-5)
    executor.shutdown()


def test_prompt_logprobs_cover_a_prompt_whose_prefix_is_cached(tiny_llama_dir):
    """Through EngineCore: a prompt_logprobs request skips prefix-cache hits, so every prompt row comes."""
    from shmvllm.engine.core import EngineCore
    from shmvllm.boundary.messages import EngineCoreRequest

    config = EngineArgs(model=str(tiny_llama_dir), max_model_len=256, block_size=BLOCK_SIZE,
                        num_kv_blocks=64).create_engine_config()
    engine = EngineCore(config)
    prefix = list(range(10, 30))
    for req_id, tail, prompt_logprobs in (("warm", [5, 6], None), ("lp", [7, 8], 1)):
        params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=prompt_logprobs)
        engine.add_request(EngineCoreRequest(req_id, EngineCoreRequest.pack_token_ids(prefix + tail), params))
        rows = 0
        while engine.has_unfinished_requests():
            rows += sum(o.new_prompt_logprobs.num_rows for o in engine.step().all_outputs() if o.new_prompt_logprobs)
    assert rows == len(prefix) + 1
    engine.shutdown()
