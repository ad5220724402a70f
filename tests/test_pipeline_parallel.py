"""Pipeline parallelism end to end: PP=2 (two stage programs; the engine process computes
nothing) against PP=1 on tiny random Llama (tied lm_head) and Qwen2 (untied) models and on the
shipped SmolLM2, in mixed batches with preemption, prefix-cache hits and chunked prefill; PP=3
on a 3-layer model (a stage per layer); PP=2 x TP=2 (four processes) against PP=1 on Qwen2 and
SmolLM2, and kill -9 of a rank of each stage; what each stage builds and reads; the scheduler's
micro-batches; knobs refused by name. Kill -9 of each PP=2 stage: test_engine_death."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shmvllm import LLM, SamplingParams
from shmvllm.config import CacheConfig, SchedulerConfig
from shmvllm.core.request import Request
from shmvllm.core.sched.output import ModelRunnerOutput
from shmvllm.core.sched.scheduler import Scheduler
from shmvllm.engine.arg_utils import EngineArgs
from shmvllm.model import checkpoint
from shmvllm.model.attention import AttentionMetadata, PrefillSeq
from shmvllm.model.loader import get_model
from shmvllm.model.parallel.pipeline import PipelineStage
from test_engine_death import ENGINE_ARGS, _children, _kill_mid_generate
from test_tensor_parallel import MAX_MODEL_LEN, assert_same_greedy, mixed_prompts, params_for

pytestmark = pytest.mark.usefixtures("no_engine_left_behind")


def run(model_dir: Path, pp: int, multiprocess: bool, params=None, prompts=None, tp: int = 1,
        num_kv_blocks: int = 40) -> tuple[list, dict]:
    # 40 blocks of 16 tokens for 32 requests of up to ~120 tokens: the scheduler preempts; a
    # budget of 64 tokens a step cuts the longer prompts into chunks
    with LLM(model=str(model_dir), multiprocess=multiprocess, max_model_len=MAX_MODEL_LEN, num_kv_blocks=num_kv_blocks,
             max_num_batched_tokens=64, pipeline_parallel_size=pp, tensor_parallel_size=tp) as llm:
        outputs = llm.generate(prompts or mixed_prompts(), params or params_for(), use_tqdm=False)
        stats = llm.llm_engine.engine_core.get_stats()
    return outputs, stats


@pytest.fixture(scope="module")
def tiny_qwen2_3_layers_dir(tmp_path_factory, smollm2_dir) -> Path:
    from transformers import Qwen2Config

    from conftest import _save_tiny_causal_lm

    config = Qwen2Config(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )
    return _save_tiny_causal_lm(config, smollm2_dir, tmp_path_factory.mktemp("tiny-qwen2-3-layers"))


@pytest.mark.parametrize("model", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_pp2_greedy_equals_pp1_with_preemption_prefix_hits_and_chunks(model, request):
    model_dir = request.getfixturevalue(model)
    reference, _ = run(model_dir, 1, multiprocess=False)
    outputs, stats = run(model_dir, 2, multiprocess=model == "tiny_llama_dir")  # the other in-process
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0, stats
    assert_same_greedy(reference, outputs)


def test_pp3_on_three_layers_equals_pp1(tiny_qwen2_3_layers_dir):
    reference, _ = run(tiny_qwen2_3_layers_dir, 1, multiprocess=False)
    outputs, stats = run(tiny_qwen2_3_layers_dir, 3, multiprocess=False)
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0, stats
    assert_same_greedy(reference, outputs)


def test_pp2_on_the_shipped_smollm2_equals_pp1(smollm2_dir):
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]
    params = SamplingParams(temperature=0.0, max_tokens=16)
    tokens = {}
    for pp in (1, 2):
        with LLM(str(smollm2_dir), max_model_len=MAX_MODEL_LEN, num_kv_blocks=64, pipeline_parallel_size=pp,
                 multiprocess=False) as llm:
            tokens[pp] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens[2] == tokens[1]


def test_pp2_x_tp2_on_qwen2_equals_pp1_in_a_mixed_batch(tiny_qwen2_dir):
    # four processes on two cores: 8 requests (half with the shared prefix), chunked by the budget,
    # preempted in 16 blocks
    prompts, params = mixed_prompts(8), params_for(8)
    reference, _ = run(tiny_qwen2_dir, 1, multiprocess=False, params=params, prompts=prompts, num_kv_blocks=16)
    outputs, stats = run(tiny_qwen2_dir, 2, multiprocess=False, params=params, prompts=prompts, tp=2, num_kv_blocks=16)
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0, stats
    handoff = stats["pipeline_handoff"]  # every step's hand-offs timed, none negative
    assert handoff["steps"] == stats["num_steps"] and handoff["edges_ms"] > 0, handoff
    assert min(handoff["command_ms"], handoff["output_ms"]) >= 0, handoff
    assert_same_greedy(reference, outputs)


def test_pp2_x_tp2_on_the_shipped_smollm2_equals_pp1(smollm2_dir):
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2)
    outputs = {}
    for pp, tp in ((1, 1), (2, 2)):
        with LLM(str(smollm2_dir), max_model_len=MAX_MODEL_LEN, num_kv_blocks=64, pipeline_parallel_size=pp,
                 tensor_parallel_size=tp, multiprocess=False) as llm:
            outputs[pp] = llm.generate(prompts, params, use_tqdm=False)
    assert_same_greedy(outputs[1], outputs[2])


@pytest.mark.parametrize("victim", [1, 3])  # stage 0's rank 1 (amid all-reduces), stage 1's (which sends nothing)
def test_kill_9_of_a_rank_of_pp2_x_tp2_leaves_nothing(tiny_llama_dir, victim):
    with LLM(str(tiny_llama_dir), pipeline_parallel_size=2, tensor_parallel_size=2, **ENGINE_ARGS) as llm:
        engine = llm.llm_engine.engine_core.engine_pid
        # a process's command line: python -m shmvllm.worker.pp_worker RING INDEX ... (INDEX = stage * 2 + rank)
        procs = {int(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[4]): pid for pid in _children(engine)}
        assert sorted(procs) == [0, 1, 2, 3], procs
        _kill_mid_generate(llm, procs[victim], {engine, *procs.values()})


def test_each_stage_builds_and_reads_only_its_part(tiny_qwen2_3_layers_dir, monkeypatch):
    config = EngineArgs(model=str(tiny_qwen2_3_layers_dir), max_model_len=64).create_engine_config().model_config
    whole = get_model(config)
    read: list[str] = []
    original = checkpoint.SafetensorsTensor.rows

    def recording_rows(self, *args, **kwargs):
        read.append(self.name)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(checkpoint.SafetensorsTensor, "rows", recording_rows)
    stages = []
    for index in range(3):
        read.clear()
        stage = get_model(config, stage=PipelineStage.of(3, 3, index))
        names = {name for name, _ in stage.named_parameters()}
        layers = {name.split(".")[2] for name in names if name.startswith("model.layers.")}
        assert layers == {str(index)}, names
        assert ("model.embed_tokens.weight" in names) == (index == 0)
        assert ("lm_head.weight" in names) == ("model.norm.weight" in names) == (index == 2)
        assert read and all(f"layers.{index}." in name or "layers." not in name for name in read), read
        stages.append(stage)
    ids, positions = torch.arange(3, 23), torch.arange(20)
    meta = AttentionMetadata(slot_mapping=None)
    meta.prefills.append(PrefillSeq(0, 20, None, None))
    with torch.inference_mode():
        hidden = None
        for stage in stages:
            hidden = stage(ids, positions, meta, hidden)
        assert torch.equal(hidden, whole(ids, positions, meta))
        assert torch.equal(stages[-1].compute_logits(hidden), whole.compute_logits(hidden))


def test_the_scheduler_splits_running_requests_into_micro_batches():
    scheduler = Scheduler(SchedulerConfig(max_model_len=64), CacheConfig(), 64, micro_batches=2)
    for i in range(4):
        params = SamplingParams(temperature=0.0, max_tokens=4)
        scheduler.add_request(Request(request_id=f"r{i}", prompt_token_ids=[5 + i] * 8, sampling_params=params))
    first = scheduler.schedule()  # all four prefill: none was running
    assert len(first.num_scheduled_tokens) == 4
    ids = list(first.num_scheduled_tokens)
    scheduler.update_from_output(first, ModelRunnerOutput(req_ids=ids, sampled_token_ids=[[7]] * 4))
    a = scheduler.schedule()  # half of the four decode
    b = scheduler.schedule()  # the other half, while the first half is in flight
    c = scheduler.schedule()  # nothing: every request has a step in flight
    assert len(a.num_scheduled_tokens) == len(b.num_scheduled_tokens) == 2
    assert set(a.num_scheduled_tokens).isdisjoint(b.num_scheduled_tokens)
    assert c.total_num_scheduled_tokens == 0
    with pytest.raises(ValueError, match="micro_batches"):
        Scheduler(SchedulerConfig(), CacheConfig(), 64, micro_batches=0)


@pytest.mark.parametrize("extra, match", [
    (dict(pipeline_parallel_size=0), "pipeline_parallel_size must be a positive int, got 0"),
    (dict(pipeline_parallel_size=3), "pipeline_parallel_size=3 is more than the model's num_hidden_layers=2"),
    (dict(pipeline_parallel_size=2, data_parallel_size=2), "pipeline_parallel_size=2 with data_parallel_size=2"),
    (dict(pipeline_parallel_size=2, async_scheduling=True), "pipeline_parallel_size=2 with async_scheduling=True"),
    (dict(pipeline_parallel_size=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
     "pipeline_parallel_size=2 is not supported with speculative_config"),
])
def test_knobs_refused_by_name(tiny_llama_dir, extra, match):
    with pytest.raises(ValueError, match=match):
        LLM(str(tiny_llama_dir), multiprocess=False, max_model_len=MAX_MODEL_LEN, **extra)
    with pytest.raises(TypeError, match="pipeline_parallel_size must be int, got '2'"):
        LLM(str(tiny_llama_dir), multiprocess=False, pipeline_parallel_size="2")


def test_embedding_models_are_refused(minilm_dir):
    with pytest.raises(ValueError, match="pipeline_parallel_size=2 is not supported for task 'embed'"):
        LLM(str(minilm_dir), pipeline_parallel_size=2)
