"""A step's outputs on the wire: the rows of new tokens travel as columns of EngineCoreOutputs,
everything else as EngineCoreOutput structs; the scheduler puts each output in its form, the
codec carries both, and the output processor makes the same RequestOutputs of either."""

from __future__ import annotations

import numpy as np
import pytest

from shmvllm.boundary.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    Logprobs,
    decode_from_engine,
    make_encoder,
)
from shmvllm.core.sched.output import ModelRunnerOutput
from test_scheduler import fake_runner, make_request, make_scheduler, step


def _round_trip(outputs: EngineCoreOutputs) -> EngineCoreOutputs:
    return decode_from_engine(make_encoder().encode(outputs))


def test_columns_round_trip_with_and_without_counts():
    one_each = EngineCoreOutputs(timestamp=1.5)
    for i in range(5):
        one_each.add_tokens(f"r{i}", [100 + i])
    assert one_each.token_counts is None and one_each.num_outputs == 5
    got = _round_trip(one_each)
    assert got == one_each and list(got.new_tokens()) == [(f"r{i}", [100 + i]) for i in range(5)]

    mixed = EngineCoreOutputs(outputs=[EngineCoreOutput("done", [9], finish_reason=FinishReason.LENGTH)])
    mixed.add_tokens("a", [1])
    mixed.add_tokens("b", [2, 3, 4])  # accepted speculative tokens: the counts start here
    mixed.add_tokens("c", [5])
    assert mixed.token_counts == [1, 3, 1] and mixed.num_outputs == 4
    got = _round_trip(mixed)
    assert list(got.new_tokens()) == [("a", [1]), ("b", [2, 3, 4]), ("c", [5])]
    assert [(o.request_id, o.new_token_ids, o.finished) for o in got.all_outputs()] == [
        ("done", [9], True), ("a", [1], False), ("b", [2, 3, 4], False), ("c", [5], False)
    ]


@pytest.mark.parametrize("columns, message", [
    (dict(token_req_ids=["a", "b"], token_ids=[1]), "1 token_ids for 2 token_req_ids"),
    (dict(token_req_ids=["a"], token_ids=[1, 2], token_counts=[1, 1]), "token_counts \\[1, 1\\] for 1 token_req_ids"),
    (dict(token_req_ids=["a", "b"], token_ids=[1, 2], token_counts=[2, 0]), "token_counts \\[2, 0\\]"),
])
def test_columns_that_disagree_raise_naming_them(columns, message):
    outputs = _round_trip(EngineCoreOutputs(**columns))
    with pytest.raises(ValueError, match=message):
        list(outputs.new_tokens())


def test_scheduler_sends_a_decode_step_as_columns():
    """The first tokens (with num_cached_tokens) and the last (finished) go as structs, the
    decode steps between them as rows; a request with logprobs always as a struct."""
    sched = make_scheduler()
    for name in ("a", "b"):
        sched.add_request(make_request(name, 6, max_tokens=4))
    _, first = step(sched)
    assert sorted(o.request_id for o in first.outputs) == ["a", "b"] and not first.token_req_ids
    _, second = step(sched)
    assert second.outputs == [] and sorted(second.new_tokens()) == [("a", [7]), ("b", [7])]
    sched.add_request(make_request("lp", 6, first_token=40, logprobs=1))
    out = sched.schedule()
    runner = fake_runner(sched, out)
    rows = Logprobs.from_arrays(np.array([[7, 7]]), np.array([[-0.1, -0.1]]), np.array([1]))
    runner.logprobs = {"lp": rows}
    third = sched.update_from_output(out, runner)
    assert [o.request_id for o in third.outputs] == ["lp"] and sorted(third.token_req_ids) == ["a", "b"]
    out = sched.schedule()
    last = sched.update_from_output(out, ModelRunnerOutput(
        req_ids=list(out.num_scheduled_tokens), sampled_token_ids=[[7]] * len(out.num_scheduled_tokens),
        logprobs={"lp": rows},
    ))
    finished = {o.request_id: o.finish_reason for o in last.outputs if o.finished}
    assert finished == {"a": FinishReason.LENGTH, "b": FinishReason.LENGTH} and last.token_req_ids == []
