"""Structured outputs on the shipped chat model: every output of a JSON schema, a regex, a choice
list and an EBNF grammar validates, greedy and sampled, n=2, under preemption, and mixed with
free requests; bad constraints are a ValueError naming the field before anything is queued."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch

from shmvllm import LLM, SamplingParams
from shmvllm.boundary.messages import EngineCoreRequest, decode_to_engine, make_encoder
from shmvllm.sampling_params import GuidedDecodingParams, StructuredOutputsParams
from shmvllm.structured_output.bitmask import TokenBitmaskApplier
from shmvllm.structured_output.spec import choice_as_ebnf, grammar_spec

xgr = pytest.importorskip("xgrammar")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "height_m": {"type": "number", "minimum": 0.5, "maximum": 2.5},
        "role": {"type": "string", "enum": ["engineer", "doctor", "artist", "teacher"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "zip": {"type": "string", "pattern": "[0-9]{5}"}},
            "required": ["city", "zip"],
        },
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "role", "address", "skills"],
}
ORDER = {
    "type": "object",
    "properties": {
        "order_id": {"type": "integer", "minimum": 1, "maximum": 99999},
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string", "pattern": "[A-Z]{3}-[0-9]{3}"},
                               "qty": {"type": "integer", "minimum": 1, "maximum": 10}},
                "required": ["sku", "qty"],
            },
            "minItems": 1,
            "maxItems": 2,
        },
        "status": {"type": "string", "enum": ["pending", "shipped", "delivered"]},
        "express": {"type": "boolean"},
    },
    "required": ["order_id", "items", "status", "express"],
}
VERDICT = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}, "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
    "required": ["answer", "confidence"],
}
SCHEMAS = [PERSON, ORDER, VERDICT]
REGEXES = [  # (pattern, what it is)
    (r"\d{4}-\d{2}-\d{2}", "date"),
    (r"(19|20)\d{2}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])", "date"),
    (r"\(\d{3}\) \d{3}-\d{4}", "phone number"),
    (r"\+\d{1,3} \d{3} \d{3} \d{4}", "phone number"),
]
CHOICES = [
    ["positive", "negative", "neutral"],
    ["Paris", "London", "Berlin", "Madrid"],
    ["yes", "no"],
    ['He said "hi"', "naïve café", "back\\slash"],
]
# (EBNF, the same language as a Python regex)
GRAMMARS = [
    ('root ::= term (("+" | "-") term){0,3}\nterm ::= [0-9]{1,3}', r"[0-9]{1,3}([+-][0-9]{1,3}){0,3}"),
    ('root ::= pair ("," pair){0,2}\npair ::= [a-z]{1,8} "=" [0-9]{1,4}', r"[a-z]{1,8}=[0-9]{1,4}(,[a-z]{1,8}=[0-9]{1,4}){0,2}"),
]
TOPICS = [
    "a nurse in Paris", "a young painter", "an old farmer", "a software engineer from Berlin", "a teacher",
    "a chef", "a pilot", "a student", "a taxi driver", "a librarian", "a football coach", "a violinist",
    "a baker in Lyon", "a sailor", "a judge", "a gardener", "a firefighter", "a poet", "a dentist",
    "a carpenter", "a mountain guide", "a fisherman", "a journalist", "a pharmacist", "a tailor",
    "a photographer", "a nun", "a banker", "a miner", "a beekeeper", "a clown", "an astronaut",
]
assert len(TOPICS) == 32


def _chat(llm: LLM, text: str) -> str:
    return llm.get_tokenizer().apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                   add_generation_prompt=True)


def _cases(llm: LLM) -> list[tuple[str, dict, tuple]]:
    """(prompt, StructuredOutputsParams kwargs + max_tokens, checker) for each of the 32 topics
    and each kind, topic-major."""
    cases = []
    for i, topic in enumerate(TOPICS):
        for kind in ("json", "regex", "choice", "grammar"):
            if kind == "json":
                schema = SCHEMAS[i % len(SCHEMAS)]
                prompt = f"Describe {topic} as a JSON object." if schema is PERSON else (
                    f"Write an order placed by {topic} as JSON." if schema is ORDER else f"Is {topic} happy? Answer in JSON.")
                # compact JSON: free whitespace lets a small model loop on newlines (xgrammar warns of it)
                kwargs = dict(json=schema, disable_any_whitespace=schema is not VERDICT)
                cases.append((prompt, dict(kwargs, max_tokens=256), ("json", schema)))
            elif kind == "regex":
                pattern, what = REGEXES[i % len(REGEXES)]
                cases.append((f"Give a {what} for {topic}.", dict(regex=pattern, max_tokens=40), ("regex", pattern)))
            elif kind == "choice":
                choices = CHOICES[i % len(CHOICES)]
                cases.append((f"About {topic}: pick one of {', '.join(choices)}.", dict(choice=choices, max_tokens=16),
                              ("choice", choices)))
            else:
                grammar, pattern = GRAMMARS[i % len(GRAMMARS)]
                cases.append((f"Write a short formula about {topic}.", dict(grammar=grammar, max_tokens=40), ("regex", pattern)))
    return [(_chat(llm, prompt), kwargs, check) for prompt, kwargs, check in cases]


def _params(kwargs: dict, **sampling) -> SamplingParams:
    kwargs = dict(kwargs)
    max_tokens = kwargs.pop("max_tokens")
    return SamplingParams(max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(**kwargs), **sampling)


def _check(text: str, check: tuple) -> None:
    kind, spec = check
    if kind == "json":
        jsonschema.validate(json.loads(text), spec)
    elif kind == "regex":
        assert re.fullmatch(spec, text), (spec, text)
    else:
        assert text in spec, (spec, text)


def _assert_all_valid(outputs, cases, n: int = 1) -> None:
    for output, (_, _, check) in zip(outputs, cases):
        assert len(output.outputs) == n
        for completion in output.outputs:
            assert completion.finish_reason == "stop", (check, completion.text, completion.finish_reason)
            _check(completion.text, check)


@pytest.fixture(scope="module")
def llm():
    with LLM(max_model_len=1024) as llm:  # the default model, engine in its own process over the rings
        yield llm


@pytest.fixture(scope="module")
def greedy_run(llm):
    cases = _cases(llm)
    outputs = llm.generate([p for p, _, _ in cases], [_params(k, temperature=0.0) for _, k, _ in cases], use_tqdm=False)
    return cases, outputs


# ---- end to end on the shipped model --------------------------------------------------------

def test_greedy_outputs_validate(greedy_run, llm):
    cases, outputs = greedy_run
    assert len(cases) == 128
    _assert_all_valid(outputs, cases)
    stats = llm.llm_engine.engine_core.get_stats()["structured_output"]
    # 3 schemas + 4 regexes + 4 choice lists + 2 grammars, each compiled once for 128 requests
    assert stats["num_compiles"] == 13


def test_sampled_n2_outputs_validate(llm):
    # one kind per topic, in turn: 32 prompts, 8 of each kind
    all_cases = _cases(llm)  # topic-major, 4 kinds per topic
    cases = [all_cases[4 * topic + topic % 4] for topic in range(32)]
    params = [_params(k, temperature=0.9, top_p=0.95, top_k=50, seed=100 + i, n=2) for i, (_, k, _) in enumerate(cases)]
    outputs = llm.generate([p for p, _, _ in cases], params, use_tqdm=False)
    _assert_all_valid(outputs, cases, n=2)
    again = llm.generate([p for p, _, _ in cases[:8]], params[:8], use_tqdm=False)  # seeded: repeatable
    assert [[c.token_ids for c in o.outputs] for o in again] == [[c.token_ids for c in o.outputs] for o in outputs[:8]]
    assert any(o.outputs[0].token_ids != o.outputs[1].token_ids for o in outputs)  # the children sample apart


def test_mixed_with_free_requests_changes_neither(llm, greedy_run):
    cases, constrained_alone = greedy_run
    picked = list(range(0, 128, 9))[:12]
    free_prompts = [_chat(llm, f"Tell me about {topic}.") for topic in TOPICS[:12]]
    free = SamplingParams(temperature=0.0, max_tokens=24)
    free_alone = llm.generate(free_prompts, free, use_tqdm=False)
    mixed_prompts, mixed_params = [], []
    for j, i in enumerate(picked):  # interleaved
        mixed_prompts += [free_prompts[j], cases[i][0]]
        mixed_params += [free, _params(cases[i][1], temperature=0.0)]
    mixed = llm.generate(mixed_prompts, mixed_params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[0::2]] == [o.outputs[0].token_ids for o in free_alone]
    assert [o.outputs[0].token_ids for o in mixed[1::2]] == [constrained_alone[i].outputs[0].token_ids for i in picked]
    assert all(o.outputs[0].finish_reason == "length" for o in free_alone)


def test_preemption_keeps_outputs_valid_and_unchanged(greedy_run):
    cases, big_cache = greedy_run
    picked = [i for i in range(128) if cases[i][2][0] == "json"][:12]  # the longest outputs
    with LLM(max_model_len=1024, num_kv_blocks=40, multiprocess=False) as small:
        outputs = small.generate([cases[i][0] for i in picked], [_params(cases[i][1], temperature=0.0) for i in picked],
                                 use_tqdm=False)
        assert small.llm_engine.engine_core.get_stats()["num_preemptions"] > 0
    _assert_all_valid(outputs, [cases[i] for i in picked])
    assert [o.outputs[0].token_ids for o in outputs] == [big_cache[i].outputs[0].token_ids for i in picked]


def test_json_object_structural_tag_lark_and_guided_decoding_alias(llm):
    prompts = [_chat(llm, "Give a JSON object with a name and an age."), _chat(llm, "Call the weather tool for Paris."),
               _chat(llm, "Say a greeting."), _chat(llm, "Pick a colour.")]
    tag = {"type": "structural_tag", "format": {"type": "tag", "begin": "<call>", "content":
           {"type": "json_schema", "json_schema": VERDICT}, "end": "</call>"}}
    params = [
        SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=StructuredOutputsParams(json_object=True)),
        SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=StructuredOutputsParams(structural_tag=json.dumps(tag))),
        SamplingParams(temperature=0.0, max_tokens=20,
                       structured_outputs=StructuredOutputsParams(grammar='start: GREETING " " NAME\nGREETING: "hello" | "hi"\nNAME: /[a-z]{1,8}/')),
        SamplingParams(temperature=0.0, max_tokens=10, guided_decoding=GuidedDecodingParams(choice=["red", "green"])),
    ]
    obj, tagged, lark, colour = (o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False))
    assert obj.finish_reason == "stop" and isinstance(json.loads(obj.text), dict)
    match = re.fullmatch(r"<call>(.*)</call>", tagged.text, re.S)
    assert tagged.finish_reason == "stop" and match, tagged.text
    jsonschema.validate(json.loads(match.group(1)), VERDICT)
    assert lark.finish_reason == "stop" and re.fullmatch(r"(hello|hi) [a-z]{1,8}", lark.text), lark.text
    assert colour.finish_reason == "stop" and colour.text in ("red", "green")


def test_grammar_end_stops_even_with_ignore_eos_and_min_tokens_conflict_is_an_error(llm):
    prompt = _chat(llm, "Is water wet?")
    ended, conflict = llm.generate([prompt, prompt], [
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
        SamplingParams(temperature=0.0, max_tokens=30, min_tokens=10, structured_outputs=StructuredOutputsParams(choice=["yes"])),
    ], use_tqdm=False)
    assert ended.outputs[0].finish_reason == "stop" and ended.outputs[0].text in ("yes", "no")
    assert conflict.outputs[0].finish_reason == "error"
    assert "structured_outputs.choice" in conflict.error and "not allowed by the grammar" in conflict.error


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(json={"type": "foo"}), "structured_outputs.json"),
        (dict(json={"type": "object", "properties": {"a": {"$ref": "#/nope"}}}), "structured_outputs.json"),
        (dict(json={"type": "array", "items": {"type": "integer"}, "uniqueItems": True}), "uniqueItems"),
        (dict(regex="(ab"), "structured_outputs.regex"),
        (dict(regex="[a-"), "structured_outputs.regex"),
        (dict(grammar='root ::= foo'), "structured_outputs.grammar"),
        (dict(grammar='root ::= "a" |'), "structured_outputs.grammar"),
        (dict(structural_tag='{"type": "structural_tag", "format": {"type": "nonsense"}}'), "structured_outputs.structural_tag"),
    ],
)
def test_invalid_constraints_raise_before_anything_is_queued(llm, kwargs, field):
    good = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(choice=["a", "b"]))
    bad = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(**kwargs))
    with pytest.raises(ValueError, match=re.escape(field)):
        llm.generate(["one", "two", "three"], [good, bad, good], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.engine_core.get_stats()["num_waiting_reqs"] == 0
    out = llm.generate("Say yes or no.", good, use_tqdm=False)[0].outputs[0]  # still serving
    assert out.text in ("a", "b")


# ---- parameters, spec and mask (no model) ---------------------------------------------------

@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(), "exactly one constraint"),
        (dict(json={"type": "object"}, regex="a"), "exactly one constraint"),
        (dict(json_object=False), "exactly one constraint"),
        (dict(choice=[]), "structured_outputs.choice"),
        (dict(choice=["a", 1]), "structured_outputs.choice"),
        (dict(json="{not json"), "structured_outputs.json"),
        (dict(json=3), "structured_outputs.json"),
        (dict(regex=5), "structured_outputs.regex"),
        (dict(grammar="  "), "structured_outputs.grammar"),
        (dict(json={"type": "object"}, whitespace_pattern=r"[ ]?"), "structured_outputs.whitespace_pattern"),
        (dict(json={"type": "object"}, disable_any_whitespace="yes"), "structured_outputs.disable_any_whitespace"),
        (dict(structural_tag="{"), "structured_outputs.structural_tag"),
    ],
)
def test_params_refuse_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        StructuredOutputsParams(**kwargs)


def test_params_pydantic_alias_and_wire():
    pydantic = pytest.importorskip("pydantic")

    class Point(pydantic.BaseModel):
        x: int
        y: float

    params = StructuredOutputsParams(json=Point)
    assert params.json == Point.model_json_schema() and params.kind == "json"
    assert GuidedDecodingParams is StructuredOutputsParams
    old = SamplingParams(guided_decoding=GuidedDecodingParams(regex="a+"))
    assert old.structured_outputs == StructuredOutputsParams(regex="a+") and old.guided_decoding is None
    with pytest.raises(ValueError, match="guided_decoding"):
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="a"), guided_decoding=GuidedDecodingParams(regex="b"))
    with pytest.raises(TypeError, match="structured_outputs"):
        SamplingParams(structured_outputs={"regex": "a"})
    # what the ring carries: the params, round-tripped by the engine's codec
    request = EngineCoreRequest(request_id="r", prompt_token_ids=EngineCoreRequest.pack_token_ids([1, 2]),
                                sampling_params=SamplingParams(structured_outputs=params))
    decoded = decode_to_engine(make_encoder().encode(request))
    assert decoded.sampling_params.structured_outputs == params


def test_choice_grammar_accepts_exactly_the_choices(smollm2_dir):
    from shmvllm.engine.renderer import load_tokenizer

    choices = ['He said "hi"', "naïve café", "back\\slash", "a|b", "x"]
    grammar = xgr.Grammar.from_ebnf(choice_as_ebnf(choices))
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(load_tokenizer(smollm2_dir))).compile_grammar(grammar)
    for text in choices + ["He said hi", "a", "xx", "back\\\\slash"]:
        matcher = xgr.GrammarMatcher(compiled)
        ok = matcher.accept_string(text) and matcher.is_completed()
        assert ok == (text in choices), text


def test_spec_disable_additional_properties_and_key():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}},
                                               "properties": {"type": "string"}},
              "additionalProperties": True}
    spec = grammar_spec(StructuredOutputsParams(json=schema, disable_additional_properties=True))
    changed = json.loads(spec.text)
    assert changed["additionalProperties"] is True  # its own setting is kept
    assert changed["properties"]["a"]["additionalProperties"] is False
    assert "additionalProperties" not in changed["properties"]["properties"]  # a property named "properties"
    assert list(json.loads(grammar_spec(StructuredOutputsParams(json=json.dumps(schema))).text)["properties"]) == ["a", "properties"]
    assert grammar_spec(StructuredOutputsParams(json=schema)) == grammar_spec(StructuredOutputsParams(json=json.dumps(schema)))
    assert grammar_spec(StructuredOutputsParams(json_object=True)).kind == "json"


@pytest.mark.parametrize("vocab", [49152, 49157])
def test_bitmask_applier_matches_xgrammar(vocab):
    rng = np.random.default_rng(vocab)
    words = -(-vocab // 32)
    bitmask = rng.integers(-2**31, 2**31, size=(5, words), dtype=np.int64).astype(np.int32)
    logits = torch.randn(9, vocab)
    rows = np.array([7, 0, 3, 8, 4])
    expected = logits.clone()
    placed = torch.full((9, words), -1, dtype=torch.int32)
    placed[torch.from_numpy(rows)] = torch.from_numpy(bitmask)
    xgr.apply_token_bitmask_inplace(expected, placed, vocab_size=vocab, indices=rows.tolist())
    applier = TokenBitmaskApplier(vocab, torch.device("cpu"))
    for _ in range(2):  # the second call reuses the buffers
        got = logits.clone()
        applier.apply(got, rows, bitmask)
        assert torch.equal(got, expected)
    whole = logits[:5].clone()
    applier.apply(whole, np.arange(5), bitmask)
    reference = logits[:5].clone()
    xgr.apply_token_bitmask_inplace(reference, torch.from_numpy(bitmask), vocab_size=vocab)
    assert torch.equal(whole, reference)


# ---- a model whose lm_head is wider than its tokenizer ------------------------------------

@pytest.fixture(scope="module")
def padded_vocab_llama_dir(tmp_path_factory, smollm2_dir):
    from transformers import LlamaConfig

    from conftest import _save_tiny_causal_lm

    config = LlamaConfig(
        vocab_size=49152 + 77, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )
    return _save_tiny_causal_lm(config, smollm2_dir, tmp_path_factory.mktemp("padded-vocab-llama"))


def test_padded_vocab_masks_ids_the_tokenizer_lacks(padded_vocab_llama_dir):
    with LLM(model=str(padded_vocab_llama_dir), multiprocess=False, max_model_len=256, num_kv_blocks=64) as tiny:
        vocab = len(tiny.get_tokenizer())
        params = [SamplingParams(temperature=1.5, seed=i, max_tokens=20, structured_outputs=StructuredOutputsParams(
            regex=r"[0-9]{3}-[a-z]{2}" if i % 2 else None, choice=None if i % 2 else ["alpha", "beta", "gamma delta"]))
            for i in range(16)]
        outputs = tiny.generate([f"prompt {i}" for i in range(16)], params, use_tqdm=False)
    for i, output in enumerate(outputs):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop"
        assert max(completion.token_ids) < vocab
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", completion.text) if i % 2 else completion.text in ("alpha", "beta", "gamma delta")


# ---- the engine alone: a constraint that bypassed the frontend ------------------------------

def test_engine_fails_only_the_request_whose_grammar_does_not_compile(tiny_llama_dir):
    from shmvllm.engine.arg_utils import EngineArgs
    from shmvllm.engine.core import EngineCore
    from shmvllm.boundary.messages import FinishReason

    config = EngineArgs(model=str(tiny_llama_dir), device="cpu", dtype="float32", max_model_len=256,
                        num_kv_blocks=64).create_engine_config()
    engine = EngineCore(config)
    try:
        def request(req_id: str, **constraint) -> EngineCoreRequest:
            params = SamplingParams(temperature=0.0, max_tokens=8, eos_token_id=2,
                                    structured_outputs=StructuredOutputsParams(**constraint) if constraint else None)
            return EngineCoreRequest(request_id=req_id, prompt_token_ids=EngineCoreRequest.pack_token_ids([1, 5, 9]),
                                     sampling_params=params)

        engine.add_request(request("bad", regex="(unclosed"))
        engine.add_request(request("choice", choice=["left", "right"]))
        engine.add_request(request("free"))
        finished = {}
        for _ in range(200):
            for output in engine.step().all_outputs():
                if output.finished:
                    finished[output.request_id] = output
            if not engine.has_unfinished_requests():
                break
        assert finished["bad"].finish_reason == FinishReason.ERROR
        assert "structured_outputs.regex" in finished["bad"].error and "did not compile" in finished["bad"].error
        assert finished["choice"].finish_reason == FinishReason.STOP and finished["free"].finish_reason == FinishReason.LENGTH
        stats = engine.get_stats()
        assert stats["num_running_reqs"] == stats["num_waiting_reqs"] == 0
        assert stats["num_free_blocks"] == engine.num_kv_blocks
    finally:
        engine.shutdown()
