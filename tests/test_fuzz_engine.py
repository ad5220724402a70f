"""Fuzzing the API boundary (issue 14): SamplingParams, prompts and chat messages, valid and not,
against one running engine process (a tiny random Llama).

Every input either works (every output finished, none with an engine error) or raises
ValueError / TypeError before anything was sent to the engine; after every example the engine
process is alive, holds nothing of ours, and answers a new request. 500 examples in the default
run, 5000 under `-m slow`.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ipc.segment import pid_alive
from shmvllm import LLM, SamplingParams

ENGINE_ARGS = dict(max_model_len=64, num_kv_blocks=256, max_num_seqs=16)
PROBE = SamplingParams(temperature=0.0, max_tokens=1)

# ---- strategies ------------------------------------------------------------------------------
# Each example is a valid call with, a third of the time, one or two parts replaced by something
# hostile (an int beyond 64 bits, NaN, a value of the wrong type, a malformed prompt or message),
# so that both the calls that must work and the ones that must be refused are drawn often.

EDGE_INTS = [0, -1, 1, 2**31, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64 - 1, 2**64, 49151, 49152, 10**30]
junk = st.one_of(
    st.none(), st.booleans(), st.text(max_size=4), st.lists(st.integers(0, 5), max_size=2),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=1), st.just(b"\x00"), st.just(object()),
)
big_ints = st.one_of(st.sampled_from(EDGE_INTS), st.integers(-(2**70), 2**70))
bad_floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([math.nan, math.inf, 10**400]))
hostile = st.one_of(big_ints, bad_floats, junk)
text = st.text(max_size=12)

VALID_FIELDS = {
    "n": st.integers(1, 3),
    "temperature": st.one_of(st.just(0.0), st.floats(0, 2)),
    "top_p": st.floats(0.01, 1),
    "top_k": st.sampled_from([-1, 1, 5, 100, 49152, 10**6]),
    "min_p": st.floats(0, 1),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "max_tokens": st.integers(1, 4),
    "min_tokens": st.integers(0, 4),
    "logprobs": st.integers(0, 20),
    "prompt_logprobs": st.integers(0, 20),
    "stop": st.one_of(text, st.lists(text, max_size=3)),
    "stop_token_ids": st.lists(st.integers(0, 49151), max_size=3),
    "ignore_eos": st.booleans(),
    "detokenize": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "output_kind": st.sampled_from([0, 1, 2]),
    "logit_bias": st.dictionaries(st.integers(0, 49151), st.floats(-100, 100), max_size=2),
    "allowed_token_ids": st.lists(st.integers(0, 49151), min_size=1, max_size=3),
    "bad_words": st.lists(st.text(min_size=1, max_size=6), max_size=2),
}
corruption = st.one_of(st.just({}), st.just({}), st.dictionaries(st.sampled_from(sorted(VALID_FIELDS)), hostile, min_size=1, max_size=2))
params_kwargs = st.builds(lambda base, bad: {**base, **bad}, st.fixed_dictionaries({}, optional=VALID_FIELDS), corruption)

valid_ids = st.lists(st.integers(0, 49151), min_size=1, max_size=12)
valid_prompt = st.one_of(
    st.text(min_size=1, max_size=24), st.fixed_dictionaries({"prompt": st.text(min_size=1, max_size=24)}),
    st.fixed_dictionaries({"prompt_token_ids": valid_ids}),
)
hostile_prompt = st.one_of(
    junk, big_ints, st.just(""), st.just([]),
    st.fixed_dictionaries({"prompt": hostile}),
    st.fixed_dictionaries({"prompt_token_ids": st.one_of(hostile, st.lists(st.one_of(big_ints, junk), min_size=1, max_size=3))}),
    st.dictionaries(st.text(max_size=3), hostile, max_size=2),
)
one_prompt = st.one_of(valid_prompt, valid_prompt, valid_prompt, hostile_prompt)
prompts = st.one_of(one_prompt, st.lists(one_prompt, min_size=1, max_size=3), st.tuples(one_prompt))

valid_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system"]), "content": st.text(max_size=16)}
)
hostile_message = st.one_of(
    junk,
    st.fixed_dictionaries({}, optional={"role": st.one_of(text, hostile), "content": st.one_of(text, hostile)}),
    st.fixed_dictionaries({"role": st.just("user"), "content": st.lists(
        st.fixed_dictionaries({}, optional={"type": st.sampled_from(["text", "image_url", ""]), "text": st.one_of(text, hostile)}),
        max_size=2,
    )}),
)
conversation = st.lists(st.one_of(valid_message, valid_message, valid_message, hostile_message), min_size=1, max_size=3)
messages = st.one_of(conversation, conversation, conversation, valid_message, st.lists(conversation, max_size=2), hostile)

# ---- the engine ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fuzz_llm(tiny_llama_dir):
    with LLM(str(tiny_llama_dir), **ENGINE_ARGS) as llm:
        client = llm.llm_engine.engine_core
        real_add = client.add_request
        sent: list[str] = []

        def counting_add(request):
            sent.append(request.request_id)
            real_add(request)

        client.add_request = counting_add
        llm.sent = sent  # what reached the engine
        yield llm


OUTCOMES = {"generated": 0, "refused": 0, "params refused": 0}


def check_one(llm: LLM, kind: str, kwargs: dict, prompt, conv) -> None:
    engine = llm.llm_engine
    del llm.sent[:]
    try:
        params = SamplingParams(**kwargs)
    except (ValueError, TypeError):
        params = None
        OUTCOMES["params refused"] += 1
    if params is not None:
        try:
            if kind == "generate":
                outputs = llm.generate(prompt, params, use_tqdm=False)
            else:
                outputs = llm.chat(conv, params, use_tqdm=False)
        except (ValueError, TypeError):
            assert not llm.sent, f"raised after sending {llm.sent}"
            OUTCOMES["refused"] += 1
        else:
            OUTCOMES["generated"] += 1
            for output in outputs:
                assert output.finished and output.error is None, output.error
                assert len(output.outputs) == params.n
                if params.logprobs is not None:
                    assert all(len(c.logprobs) == len(c.token_ids) for c in output.outputs)
    assert pid_alive(engine.engine_core.engine_pid), "the engine process died"
    assert not engine.has_unfinished_requests()
    probe = llm.generate("ok", PROBE, use_tqdm=False)
    assert probe[0].error is None and len(probe[0].outputs[0].token_ids) == 1


FUZZ = dict(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@settings(max_examples=500, **FUZZ)
@given(kind=st.sampled_from(["generate", "chat"]), kwargs=params_kwargs, prompt=prompts, conv=messages)
def test_fuzz_inputs_never_hurt_the_engine(fuzz_llm, kind, kwargs, prompt, conv):
    check_one(fuzz_llm, kind, kwargs, prompt, conv)


@pytest.mark.slow
@settings(max_examples=5000, **FUZZ)
@given(kind=st.sampled_from(["generate", "chat"]), kwargs=params_kwargs, prompt=prompts, conv=messages)
def test_fuzz_inputs_never_hurt_the_engine_long(fuzz_llm, kind, kwargs, prompt, conv):
    check_one(fuzz_llm, kind, kwargs, prompt, conv)


def test_fuzz_examples_include_valid_calls(fuzz_llm):
    """The fuzz is not all junk: valid calls generate, and (after the fuzz test above) a good
    share of its examples reached the engine."""
    check_one(fuzz_llm, "generate", {"max_tokens": 2, "logprobs": 3, "n": 2, "seed": 2**63 - 1}, ["a", {"prompt": "b"}], None)
    check_one(fuzz_llm, "chat", {"max_tokens": 2, "temperature": 0.0}, None, [{"role": "user", "content": "hi"}])
    if sum(OUTCOMES.values()) >= 500:
        assert OUTCOMES["generated"] >= 60 and OUTCOMES["refused"] + OUTCOMES["params refused"] >= 100, OUTCOMES
