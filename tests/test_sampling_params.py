"""SamplingParams: every invalid value is a ValueError naming its field; valid ones survive msgspec."""

from __future__ import annotations

import msgspec
import pytest

from shmvllm.sampling_params import ParameterTypeError, RequestOutputKind, SamplingParams, SamplingType

INVALID = [
    ("temperature", -0.1),
    ("temperature", "hot"),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_k", -2),
    ("top_k", 2.5),
    ("min_p", 1.5),
    ("n", 0),
    ("n", 1.0),
    ("max_tokens", 0),
    ("max_tokens", "16"),
    ("min_tokens", -1),
    ("logprobs", -2),
    ("prompt_logprobs", -3),
    ("temperature", 2.5),
    ("truncate_prompt_tokens", 0),
    ("truncate_prompt_tokens", -2),
    ("logit_bias", {"a": 1.0}),
    ("logit_bias", [1, 2]),
    ("allowed_token_ids", []),
    ("allowed_token_ids", [1, "2"]),
    ("bad_words", [""]),
    ("bad_words", "word"),
    ("extra_args", [1]),
    ("flat_logprobs", 1),
    ("presence_penalty", 2.5),
    ("frequency_penalty", -3.0),
    ("repetition_penalty", 0.0),
    ("seed", "42"),
    ("stop", 5),
    ("stop", ["ok", 3]),
    ("stop", [""]),
    ("stop_token_ids", [1, "2"]),
    ("stop_token_ids", [-1]),
    ("ignore_eos", "yes"),
    ("skip_special_tokens", None),
    ("output_kind", 9),
    ("output_kind", "delta"),
]


@pytest.mark.parametrize("field, value", INVALID)
def test_invalid_value_raises_value_error_naming_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_stop_strings_need_detokenize():
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop="x", detokenize=False)


def test_type_errors_are_also_type_errors():
    with pytest.raises(TypeError, match="temperature"):
        SamplingParams(temperature="hot")
    assert issubclass(ParameterTypeError, TypeError) and issubclass(ParameterTypeError, ValueError)


def test_greedy_invalid_knobs_are_still_rejected_then_reset():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(temperature=0.0, top_p=2.0)
    params = SamplingParams(temperature=0.0, top_k=5, top_p=0.5)
    assert (params.top_k, params.top_p, params.sampling_type) == (0, 1.0, SamplingType.GREEDY)


def test_normalization_and_types():
    params = SamplingParams(stop="END", seed=3, temperature=0.7, output_kind=1)
    assert params.stop == ["END"] and params.stop_token_ids == []
    assert params.output_kind is RequestOutputKind.DELTA
    assert params.sampling_type == SamplingType.RANDOM_SEED
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(max_tokens=None).max_tokens is None


def test_all_stop_token_ids():
    params = SamplingParams(stop_token_ids=[5, 6], eos_token_id=2)
    assert params.all_stop_token_ids == {2, 5, 6}
    assert SamplingParams(stop_token_ids=[5], eos_token_id=2, ignore_eos=True).all_stop_token_ids == {5}


def test_msgpack_round_trip_keeps_every_field():
    params = SamplingParams(
        n=2, temperature=0.5, top_p=0.9, top_k=40, seed=11, stop=["x"], stop_token_ids=[7], max_tokens=9,
        min_tokens=2, logprobs=3, prompt_logprobs=1, include_stop_str_in_output=True,
        output_kind=RequestOutputKind.FINAL_ONLY, eos_token_id=2,
    )
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
    assert decoded == params and decoded.output_kind is RequestOutputKind.FINAL_ONLY


def test_clone_is_independent():
    params = SamplingParams(stop=["a"])
    clone = params.clone()
    clone.stop.append("b")
    assert params.stop == ["a"]
