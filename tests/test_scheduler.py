"""Scheduler unit tests, driven by hand-made ModelRunnerOutputs (no model)."""

from __future__ import annotations

import numpy as np
import pytest

from shmvllm.config import CacheConfig, SchedulerConfig
from shmvllm.core.request import Request, RequestStatus
from shmvllm.core.sched.output import ModelRunnerOutput, SchedulerOutput
from shmvllm.core.sched.scheduler import Scheduler
from shmvllm.boundary.messages import FinishReason, Logprobs
from shmvllm.pooling_params import PoolingParams
from shmvllm.sampling_params import SamplingParams

BS = 4
EOS = 2


def make_scheduler(num_blocks=64, budget=64, max_num_seqs=16, max_model_len=256, policy="fcfs",
                   chunked=True, caching=True) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                        enable_chunked_prefill=chunked, policy=policy),
        CacheConfig(block_size=BS, enable_prefix_caching=caching),
        num_blocks,
    )


def make_request(req_id: str, num_prompt: int = 6, first_token: int = 10, priority: int = 0, **params) -> Request:
    params.setdefault("max_tokens", 4)
    params.setdefault("eos_token_id", EOS)
    prompt = list(range(first_token, first_token + num_prompt))
    return Request(req_id, prompt, SamplingParams(temperature=0.0, **params), priority=priority)


def fake_runner(sched: Scheduler, out: SchedulerOutput, token=7) -> ModelRunnerOutput:
    """Samples `token` (or token(req_id)) for each request whose known tokens are all computed."""
    req_ids, sampled = [], []
    for req_id in out.num_scheduled_tokens:
        req = sched.requests[req_id]
        req_ids.append(req_id)
        done = req.num_computed_tokens == req.num_tokens
        sampled.append([token(req_id) if callable(token) else token] if done else [])
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


def step(sched: Scheduler, token=7):
    out = sched.schedule()
    return out, sched.update_from_output(out, fake_runner(sched, out, token))


def run_to_end(sched: Scheduler, token=7, max_steps=200) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return tokens
        _, outputs = step(sched, token)
        for o in outputs.all_outputs():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    raise AssertionError("requests did not finish")


def test_new_requests_are_prefilled_in_one_step_then_decoded():
    sched = make_scheduler()
    sched.add_request(make_request("a", 6))
    sched.add_request(make_request("b", 4, first_token=50))
    out, outputs = step(sched)
    assert out.num_scheduled_tokens == {"a": 6, "b": 4} and out.total_num_scheduled_tokens == 10
    assert [r.req_id for r in out.scheduled_new_reqs] == ["a", "b"]
    assert out.scheduled_new_reqs[0].block_ids == sched.kv_cache_manager.get_block_ids("a")
    assert [o.new_token_ids for o in outputs.outputs] == [[7], [7]]
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 1, "b": 1} and not out.scheduled_new_reqs
    assert out.scheduled_cached_reqs.req_ids == ["a", "b"]
    assert out.scheduled_cached_reqs.num_computed_tokens == [6, 4]
    assert out.scheduled_cached_reqs.new_block_ids == [[], [sched.kv_cache_manager.get_block_ids("b")[1]]]


def test_token_budget_chunks_prefill_and_running_go_first():
    sched = make_scheduler(budget=8)
    sched.add_request(make_request("a", 20))
    sched.add_request(make_request("b", 5, first_token=50))
    out, outputs = step(sched)
    assert out.num_scheduled_tokens == {"a": 8} and not outputs.outputs  # partial chunk: no token
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 8}
    out, outputs = step(sched)
    assert out.num_scheduled_tokens == {"a": 4, "b": 4}
    assert [o.request_id for o in outputs.outputs] == ["a"]
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    assert out.scheduled_cached_reqs.num_computed_tokens == [20, 4]


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    sched = make_scheduler(budget=10, chunked=False)
    sched.add_request(make_request("a", 8))
    sched.add_request(make_request("b", 8, first_token=50))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 8}
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 1, "b": 8}


def test_max_num_seqs_limits_running_requests():
    sched = make_scheduler(max_num_seqs=2)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 4, first_token=10 * (i + 1)))
    out, _ = step(sched)
    assert set(out.num_scheduled_tokens) == {"r0", "r1"}
    assert run_to_end(sched) == {"r0": [7] * 3, "r1": [7] * 3, "r2": [7] * 4}


def test_stop_on_eos_and_stop_token_ids_with_stop_reason():
    sched = make_scheduler()
    sched.add_request(make_request("eos", 4))
    sched.add_request(make_request("stop", 4, first_token=50, stop_token_ids=[9]))
    sched.add_request(make_request("ignore", 4, first_token=90, ignore_eos=True, max_tokens=2))
    outputs = step(sched, token={"eos": EOS, "stop": 9, "ignore": EOS}.get)[1].outputs
    by_id = {o.request_id: o for o in outputs}
    assert by_id["eos"].finish_reason == FinishReason.STOP and by_id["eos"].stop_reason is None
    assert by_id["stop"].finish_reason == FinishReason.STOP and by_id["stop"].stop_reason == 9
    assert by_id["ignore"].finish_reason is None
    assert step(sched, token=EOS)[1].outputs[0].finish_reason == FinishReason.LENGTH
    assert not sched.has_unfinished_requests()
    assert sched.kv_cache_manager.get_num_free_blocks() == 64


def test_min_tokens_delays_stop_tokens():
    sched = make_scheduler()
    sched.add_request(make_request("a", 4, min_tokens=2, max_tokens=10))
    assert run_to_end(sched, token=EOS) == {"a": [EOS, EOS]}


def test_max_tokens_and_max_model_len_finish_with_length():
    sched = make_scheduler(max_model_len=8)
    sched.add_request(make_request("short", 4, max_tokens=2))
    sched.add_request(make_request("long", 6, first_token=50, max_tokens=None))
    finals = {}
    for _ in range(10):
        for o in step(sched)[1].outputs:
            if o.finished:
                finals[o.request_id] = o.finish_reason
    assert finals == {"short": FinishReason.LENGTH, "long": FinishReason.LENGTH}
    assert sched.has_unfinished_requests() is False


def test_model_len_is_capped_by_cache_capacity():
    sched = make_scheduler(num_blocks=2, max_model_len=256)
    assert sched.max_model_len == 2 * BS
    sched.add_request(make_request("a", 6, max_tokens=None))
    assert run_to_end(sched) == {"a": [7, 7]}


def test_preemption_fcfs_evicts_the_latest_arrival_and_resumes_with_outputs():
    sched = make_scheduler(num_blocks=4, max_model_len=16)
    sched.add_request(make_request("a", 4, max_tokens=6))
    sched.add_request(make_request("b", 4, first_token=50, max_tokens=6))
    for _ in range(5):  # 4 prompt + 4 computed tokens each: 2 blocks each, the pool is full
        out, _ = step(sched)
    assert sched.num_preemptions_total == 0
    out, outputs = step(sched)  # both need a third block: "b" (latest) goes
    assert out.preempted_req_ids == {"b"} and out.num_scheduled_tokens == {"a": 1}
    assert outputs.scheduler_stats.num_preemptions == 1
    assert outputs.outputs[0].finish_reason == FinishReason.LENGTH  # "a" has its 6 tokens
    request_b = sched.requests["b"]
    assert request_b.status == RequestStatus.PREEMPTED and request_b.num_computed_tokens == 0
    assert request_b.output_token_ids == [7] * 5
    out, outputs = step(sched)
    assert out.finished_req_ids == {"a"} and out.scheduled_new_reqs[0].req_id == "b"
    assert outputs.outputs[0].new_token_ids == [7] and outputs.outputs[0].finish_reason == FinishReason.LENGTH
    assert not sched.has_unfinished_requests()
    assert sched.num_preemptions_total == 1


def test_resumed_request_is_sent_as_new_with_outputs_and_prefix_hits():
    sched = make_scheduler(num_blocks=5, max_model_len=20)
    sched.add_request(make_request("a", 4, max_tokens=10))
    sched.add_request(make_request("b", 4, first_token=50, max_tokens=10))
    resumed = None
    for _ in range(30):
        out, _ = step(sched)
        for new in out.scheduled_new_reqs:
            if new.req_id == "b" and new.output_token_ids:
                resumed = new
        if resumed:
            break
    assert resumed is not None
    assert resumed.prompt_token_ids == list(range(50, 54)) and resumed.output_token_ids
    assert resumed.num_computed_tokens > 0 and resumed.num_computed_tokens % BS == 0
    assert resumed.block_ids == sched.kv_cache_manager.get_block_ids("b")
    assert sched.requests["b"].num_cached_tokens == 0  # the first schedule's hit, not the resume's


def test_priority_policy_preempts_the_lowest_priority():
    sched = make_scheduler(num_blocks=4, max_model_len=16, policy="priority")
    sched.add_request(make_request("low", 4, priority=5, max_tokens=8))
    sched.add_request(make_request("high", 4, first_token=50, priority=0, max_tokens=8))
    out, _ = step(sched)
    assert list(out.num_scheduled_tokens) == ["high", "low"]
    preempted = set()
    for _ in range(6):
        preempted |= step(sched)[0].preempted_req_ids
    assert preempted == {"low"}


def test_priority_policy_schedules_waiting_by_priority():
    sched = make_scheduler(max_num_seqs=1, policy="priority")
    sched.add_request(make_request("late-low", 4, priority=3, max_tokens=1))
    sched.add_request(make_request("high", 4, first_token=50, priority=1, max_tokens=1))
    assert list(step(sched)[0].num_scheduled_tokens) == ["high"]


def test_prefix_cache_hit_is_reported_as_num_cached_tokens():
    sched = make_scheduler()
    sched.add_request(make_request("a", 10))
    sched.add_request(make_request("b", 10))  # same prompt: hits what "a" is writing this step
    out, outputs = step(sched)
    assert out.num_scheduled_tokens == {"a": 10, "b": 2}
    assert {o.request_id: o.num_cached_tokens for o in outputs.outputs} == {"a": 0, "b": 8}
    assert outputs.scheduler_stats.prefix_cache_queries == 20
    assert outputs.scheduler_stats.prefix_cache_hits == 8


def test_abort_frees_blocks_and_reaches_the_runner():
    sched = make_scheduler(num_blocks=16)
    sched.add_request(make_request("a", 9, max_tokens=50))
    sched.add_request(make_request("w", 4, first_token=50))
    step(sched)
    sched.finish_requests(["a", "w", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert sched.kv_cache_manager.get_num_free_blocks() == 16
    assert not sched.has_unfinished_requests()
    sched.add_request(make_request("c", 4, first_token=90))
    out, _ = step(sched)
    assert out.finished_req_ids == {"a", "w"}
    with pytest.raises(ValueError, match="finished"):
        sched.finish_requests(["c"], RequestStatus.RUNNING)


def test_duplicate_request_id_is_refused():
    sched = make_scheduler()
    sched.add_request(make_request("a"))
    with pytest.raises(ValueError, match="'a'"):
        sched.add_request(make_request("a"))


def test_logprobs_and_prompt_logprobs_pass_through():
    sched = make_scheduler()
    sched.add_request(make_request("a", 4, logprobs=1, prompt_logprobs=0))
    out = sched.schedule()
    lp = Logprobs.from_arrays(np.array([[7, 3]]), np.array([[-0.5, -1.0]]), np.array([1]))
    plp = Logprobs.from_arrays(np.array([[11], [12], [13]]), np.array([[-1.0], [-2.0], [-3.0]]), np.array([1, 2, 3]))
    runner = ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[7]], logprobs={"a": lp}, prompt_logprobs={"a": plp})
    (o,) = sched.update_from_output(out, runner).outputs
    assert o.new_logprobs is lp and o.new_prompt_logprobs is plp


def test_pooling_request_is_scheduled_whole_and_finishes_with_its_vector():
    sched = make_scheduler(budget=8)
    sched.add_request(make_request("gen", 6, first_token=50))
    sched.add_request(Request("emb", list(range(10, 17)), pooling_params=PoolingParams()))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"gen": 6}  # 7 pooling tokens do not fit in the 2 left
    sched.update_from_output(out, fake_runner(sched, out))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"gen": 1, "emb": 7}
    vector = np.array([0.5, -1.0, 2.0], dtype=np.float32)
    runner = ModelRunnerOutput(req_ids=["gen", "emb"], sampled_token_ids=[[7], []], pooler_output={"emb": vector})
    outputs = {o.request_id: o for o in sched.update_from_output(out, runner).outputs}
    assert outputs["emb"].finish_reason == FinishReason.STOP
    assert outputs["emb"].pooling_output.tolist() == vector.tolist()
    assert "emb" not in sched.requests


def test_pooling_request_never_hits_the_prefix_cache():
    sched = make_scheduler()
    sched.add_request(make_request("a", 12))
    step(sched)
    sched.add_request(Request("emb", list(range(10, 22)), pooling_params=PoolingParams()))
    out = sched.schedule()
    assert out.num_scheduled_tokens["emb"] == 12 and out.scheduled_new_reqs[0].num_computed_tokens == 0


def test_stats_report_queues_usage_and_preemptions():
    sched = make_scheduler(num_blocks=8, max_num_seqs=1)
    sched.add_request(make_request("a", 4))
    sched.add_request(make_request("b", 4, first_token=50))
    stats = step(sched)[1].scheduler_stats
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (1, 1)
    assert stats.kv_cache_usage == pytest.approx(1 / 8)  # 4 prompt tokens: 1 block
    assert stats.num_preemptions == 0
