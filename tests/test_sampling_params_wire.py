"""SamplingParams on the wire: the engine's decoding (WireSamplingParams, bounds checked by msgspec
in C) refuses what is out of each field's bounds and agrees with the params' own validation; n's
bound is read at every validation; greedy resets the truncation knobs."""

from __future__ import annotations

import logging
import math
from typing import Any

import msgspec
import pytest

from shmvllm.boundary.messages import (
    EngineCoreRequest,
    UndecodableRequest,
    WireSamplingParams,
    decode_to_engine,
    make_encoder,
)
from shmvllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams, _set_field


NAN, INF = math.nan, math.inf
PENALTY = [0.0, 0, 2, 2.0, -2.0, 1.5, 2.5, -2.0000001, NAN, INF, -INF, True, "0", None, 10**400]
POOLS: dict[str, list[Any]] = {
    "n": [1, 2, 8, 16384, 16385, 0, -1, 1.0, True, "1", 2**63 - 1, 2**63, 2**64],
    "presence_penalty": PENALTY,
    "frequency_penalty": PENALTY,
    "repetition_penalty": [1.0, 1, 0.5, 1.2, 0.0, 0, -1.0, INF, NAN, 1.7976931348623157e308, 10**308, 10**309,
                           2**1024, True, None],
    "temperature": [1.0, 0.0, 0, 1, 2, 2.0, 0.8, 0.005, 1e-6, 2.0000001, -0.0, -0.1, NAN, INF, True, "hot", None],
    "top_p": [1.0, 0.95, 1, 0.0, 0, 1.5, 1e-9, NAN, False],
    "top_k": [0, -1, 40, -2, 2.5, True, 2**63 - 1, 2**63],
    "min_p": [0.0, 0, 1, 0.5, 1.5, -0.1, NAN],
    "seed": [None, 0, 42, -1, -5, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, "42", True, 1.0],
    "stop": [None, [], "x", ["a", "b"], [""], ("a",), [1], "", ["a", 1], 5, ["\n"], ["a", ""]],
    "stop_token_ids": [None, [], [2, 7], [0], [-1], [True], [2**63], [2**63 - 1], (1, 2), [1.0], "1", [3, "4"]],
    "ignore_eos": [False, True, 0, 1, None],
    "max_tokens": [16, 64, None, 1, 0, -1, 2**63 - 1, 2**63, 1.0, True, "16"],
    "min_tokens": [0, 1, 20, 100, -1, 2**63, True, 0.0],
    "logprobs": [None, 0, 5, -1, -2, True, False, 1.0, 2**63],
    "prompt_logprobs": [None, 0, 3, -1, -3, True, 2**63 - 1],
    "detokenize": [True, False, 1, None],
    "skip_special_tokens": [True, False, 0],
    "spaces_between_special_tokens": [True, False, "yes"],
    "include_stop_str_in_output": [False, True, 1],
    "output_kind": list(RequestOutputKind) + [0, 1, 2, 3, -1, True, "delta", 1.0],
    "truncate_prompt_tokens": [None, 5, -1, 0, -2, True],
    "logit_bias": [None, {1: 1.0}, {1: 2}, {"a": 1.0}, [1], {1: NAN}],
    "allowed_token_ids": [None, [1, 2], [], [1, "2"], [True]],
    "bad_words": [None, ["a", "a", "b"], [""], "word", [" "]],
    "extra_args": [None, {"k": 1}, [1]],
    "flat_logprobs": [False, True, 1],
    "structured_outputs": [None, StructuredOutputsParams(regex="a+"), {"regex": "a"}],
    "guided_decoding": [None, StructuredOutputsParams(regex="a+"), StructuredOutputsParams(regex="b")],
    "eos_token_id": [None, 2],
    "bad_words_token_ids": [None, [[1, 2]]],
}
assert set(POOLS) == set(SamplingParams.__struct_fields__)
TYPICAL = [
    {},
    {"max_tokens": 64, "temperature": 0.8, "top_p": 0.95},
    {"max_tokens": 64, "temperature": 0.0},
    {"temperature": 0, "max_tokens": 8},
    {"temperature": 0.7, "seed": 3, "logprobs": 5, "top_k": 40, "min_p": 0.05},
    {"n": 4, "temperature": 1, "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1},
    {"stop": ["\n", "END"], "stop_token_ids": [2, 7], "include_stop_str_in_output": True},
    {"max_tokens": None, "min_tokens": 5, "ignore_eos": True, "output_kind": RequestOutputKind.DELTA},
    {"prompt_logprobs": 0, "detokenize": False, "skip_special_tokens": False, "flat_logprobs": True},
    {"temperature": 0.005},
    {"n": 2, "temperature": 0.0},
    {"seed": -1},
    {"logprobs": True},
    {"stop": "x"},
    {"output_kind": 1},
]


def outcome(make: Any) -> tuple[Any, ...]:
    """What `make()` gives: each field's type and repr, or the exception's type and message."""
    try:
        params = make()
    except Exception as exc:  # noqa: BLE001 - the exception is what is compared
        return ("raised", type(exc), str(exc))
    return ("built", tuple((type(v), repr(v)) for v in msgspec.structs.astuple(params)))


def raw(cls: type, fields: dict[str, Any]) -> SamplingParams:
    """Params of `cls` holding `fields` as given, unvalidated (what a peer could put on the wire)."""
    params = cls()
    for name, value in fields.items():
        _set_field(params, name, value)
    return params


@pytest.fixture(autouse=True)
def quiet_temperature_warning(caplog):
    caplog.set_level(logging.ERROR, logger="shmvllm.sampling_params")


def test_max_n_sequences_is_read_on_every_validation(monkeypatch):
    assert SamplingParams(n=5).n == 5
    buf = msgspec.msgpack.encode(SamplingParams())
    monkeypatch.setenv("SHMVLLM_MAX_N_SEQUENCES", "4")
    with pytest.raises(ValueError, match=r"n must be at most 4 \(\$SHMVLLM_MAX_N_SEQUENCES\), got 5"):
        SamplingParams(n=5)
    assert SamplingParams(n=4).n == 4
    monkeypatch.setenv("SHMVLLM_MAX_N_SEQUENCES", "0")
    with pytest.raises(ValueError, match="SHMVLLM_MAX_N_SEQUENCES must be a positive int, got 0"):
        SamplingParams()
    monkeypatch.setenv("SHMVLLM_MAX_N_SEQUENCES", "many")
    with pytest.raises(ValueError, match="SHMVLLM_MAX_N_SEQUENCES must be an integer, got 'many'"):
        msgspec.msgpack.decode(buf, type=SamplingParams)
    monkeypatch.delenv("SHMVLLM_MAX_N_SEQUENCES")
    assert SamplingParams(n=16384).n == 16384


@pytest.mark.parametrize(("name", "value", "message"), [
    ("n", 0, "Expected `int` >= 1 - at `$[3][0]` (sampling_params.n)"),
    ("temperature", NAN, "Expected `float` >= 0.0 - at `$[3][4]` (sampling_params.temperature)"),
    ("top_p", 0.0, "Expected `float` > 0.0 - at `$[3][5]` (sampling_params.top_p)"),
    ("stop_token_ids", [-1], "Expected `int` >= 0 - at `$[3][10][0]` (sampling_params.stop_token_ids[0])"),
    ("stop", [""], "Expected `str` of length >= 1 - at `$[3][9][0]` (sampling_params.stop[0])"),
    ("seed", -(2**63), None),  # valid: decodes
    # A rule between fields is the frontend's: the wire checks each field's own bounds only.
    ("min_tokens", 99, None),
])
def test_the_engine_refuses_out_of_bounds_params_on_the_wire(name, value, message):
    request = EngineCoreRequest(request_id="wire", prompt_token_ids=EngineCoreRequest.pack_token_ids([1, 2, 3]),
                                sampling_params=raw(SamplingParams, {name: value}))
    got = decode_to_engine(make_encoder().encode(request))
    if message is None:
        assert getattr(got.sampling_params, name) == value
        return
    assert isinstance(got, UndecodableRequest) and got.request_id == "wire"
    assert got.error == "the engine could not decode the request: " + message, got.error


# What SamplingParams refuses although the wire accepts it: rules between fields or against the
# configuration, and the two a bound cannot say (0 among the truncations, blank bad words).
FRONTEND_RULES = ("n must be at most", "min_tokens must be less than or equal to max_tokens",
                  "stop strings are only supported when detokenize", "n must be 1 when using greedy",
                  "truncate_prompt_tokens must be an int >= 1 or -1", "bad_words cannot contain an empty string")


def test_the_wire_bounds_agree_with_the_params_own_checks():
    """Every single-field value of the table, and the typical params, on the wire: the engine's
    decoding (WireSamplingParams, bounds checked by msgspec) accepts the bytes that
    SamplingParams' own decoding (its Python validation) accepts, but for forms it rewrites
    (which a built SamplingParams never sends), and refuses what it refuses, but for
    FRONTEND_RULES; and what a SamplingParams built from them sends arrives with the same fields."""
    encode = make_encoder().encode
    wire = msgspec.msgpack.Decoder(WireSamplingParams).decode
    checked = msgspec.msgpack.Decoder(SamplingParams).decode
    left_to_the_frontend, refused = set(), 0
    for fields in TYPICAL + [{name: value} for name, pool in POOLS.items() for value in pool]:
        try:
            buf = encode(raw(SamplingParams, fields))
        except (OverflowError, TypeError):  # beyond msgpack: never on the wire
            continue
        own = outcome(lambda: checked(buf))
        got = outcome(lambda: wire(buf))
        if own[0] == "built":
            if got[0] != "built":  # only a form SamplingParams rewrites (a str stop)
                assert own[1] != outcome(lambda: raw(SamplingParams, fields))[1], (fields, got)
        elif got[0] == "built":
            assert own[2].startswith(FRONTEND_RULES), (fields, own)
            left_to_the_frontend.add(own[2].split(",")[0])
        else:
            refused += 1
        if outcome(lambda: SamplingParams(**fields))[0] == "built":
            params = SamplingParams(**fields)
            assert msgspec.structs.astuple(wire(encode(params))) == msgspec.structs.astuple(params), fields
    assert refused > 100 and len(left_to_the_frontend) >= 4, (refused, left_to_the_frontend)


@pytest.mark.parametrize("knobs", [{}, {"top_p": 1, "top_k": -1, "min_p": 0}, {"min_p": -0.0},
                                   {"top_p": 0.5, "top_k": 3, "min_p": 0.2}, {"top_p": 1.0, "top_k": 0, "min_p": 0.0}])
def test_greedy_resets_the_truncation_knobs_to_exactly_their_defaults(knobs):
    for params in (SamplingParams(temperature=0, **knobs),
                   msgspec.msgpack.decode(msgspec.msgpack.encode(raw(SamplingParams, {"temperature": 0.0, **knobs})),
                                          type=SamplingParams)):
        assert [(type(v), repr(v)) for v in (params.top_p, params.top_k, params.min_p)] == [
            (float, "1.0"), (int, "0"), (float, "0.0")]
