"""Input and output processors without an engine: the engine's outputs are written by hand."""

from __future__ import annotations

import numpy as np
import pytest

from shmvllm.engine.input_processor import InputProcessor
from shmvllm.boundary.messages import EngineCoreOutput, EngineCoreOutputs, FinishReason, Logprobs
from shmvllm.engine.output_processor import OutputProcessor, ParentRequest
from shmvllm.engine.renderer import Renderer
from shmvllm.logprobs import FlatLogprobs
from shmvllm.sampling_params import RequestOutputKind, SamplingParams

TEXT = "Hello world, this is a test of stop strings."


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture
def input_processor(tokenizer, smollm2_dir):
    return InputProcessor(Renderer(tokenizer), max_model_len=64, vocab_size=49152, model_dir=smollm2_dir)


def add(processor: OutputProcessor, input_processor, rid: str, params: SamplingParams, prompt="Hi"):
    request, text, ids = input_processor.process_inputs(rid, prompt, params)
    processor.add_request(request, text, ids)
    return request


def feed(processor, rid, ids, finish_at_end=None, stop_reason=None):
    """Feeds ids one per step, as the engine sends them: the first and the last as an
    EngineCoreOutput, the others as a row of the columns; returns every step's
    (request_outputs, reqs_to_abort)."""
    steps = []
    for i, tid in enumerate(ids):
        last = i == len(ids) - 1
        message = EngineCoreOutputs()
        if i == 0 or last:
            message.outputs.append(EngineCoreOutput(
                request_id=rid,
                new_token_ids=[tid],
                finish_reason=finish_at_end if last else None,
                stop_reason=stop_reason if last else None,
            ))
        else:
            message.add_tokens(rid, [tid])
        result = processor.process_outputs(message)
        steps.append((result.request_outputs, result.reqs_to_abort))
    return steps


def message_of(*items):
    """One message of these EngineCoreOutputs."""
    return EngineCoreOutputs(outputs=list(items))


def text_ids(tokenizer, text=TEXT):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# --- input processor ---------------------------------------------------------------------------


def test_input_processor_sets_eos_and_caps_max_tokens(input_processor):
    request, text, ids = input_processor.process_inputs("a", "Hello there", SamplingParams(max_tokens=1000))
    assert text == "Hello there" and request.prompt_token_ids.tolist() == ids
    params = request.sampling_params
    assert params.eos_token_id == 2  # <|im_end|>
    assert params.max_tokens == 64 - len(ids)
    request, _, _ = input_processor.process_inputs("b", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=None))
    assert request.sampling_params.max_tokens == 61 and request.prompt_token_ids.tolist() == [1, 2, 3]


@pytest.mark.parametrize(
    "prompt, match",
    [
        ({"prompt_token_ids": list(range(64))}, "max_model_len=64"),
        ({"prompt_token_ids": []}, "empty"),
        ({"prompt_token_ids": [5, 49152]}, "vocabulary"),
        ({"prompt_token_ids": "abc"}, "prompt_token_ids"),
        (12, "prompt"),
        ({"text": "x"}, "prompt"),
    ],
)
def test_input_processor_rejects_bad_prompts(input_processor, prompt, match):
    with pytest.raises(ValueError, match=match):
        input_processor.process_inputs("x", prompt, SamplingParams())


def test_user_params_are_not_modified(input_processor):
    params = SamplingParams(max_tokens=1000)
    input_processor.process_inputs("a", "Hi", params)
    assert params.max_tokens == 1000 and params.eos_token_id is None


# --- detokenization and stop strings -------------------------------------------------------------


def test_cumulative_text_matches_decode(tokenizer, input_processor):
    processor = OutputProcessor(tokenizer)
    add(processor, input_processor, "r", SamplingParams(max_tokens=50))
    ids = text_ids(tokenizer, "中文 and emoji 😀🎉 here")
    steps = feed(processor, "r", ids, finish_at_end=FinishReason.LENGTH)
    final = steps[-1][0][0]
    assert final.finished and final.outputs[0].finish_reason == "length"
    assert final.outputs[0].text == tokenizer.decode(ids) and final.outputs[0].token_ids == ids
    assert not processor.has_unfinished_requests()


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(tokenizer, input_processor, include):
    ids = text_ids(tokenizer)
    stop = "o wor"  # spans "Hello" | " world"
    assert all(stop not in tokenizer.decode([t]) for t in ids)
    processor = OutputProcessor(tokenizer)
    add(processor, input_processor, "r", SamplingParams(max_tokens=50, stop=[stop, "never"], include_stop_str_in_output=include))
    steps = feed(processor, "r", ids)
    finished_at = next(i for i, (outs, _) in enumerate(steps) if outs and outs[0].finished)
    outs, to_abort = steps[finished_at]
    assert to_abort == ["r"]
    completion = outs[0].outputs[0]
    assert completion.text == ("Hello wor" if include else "Hell")
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert tokenizer.decode(completion.token_ids).startswith("Hello wor")
    # Later engine outputs for a stopped request are ignored.
    assert all(not outs for outs, _ in steps[finished_at + 1:])


def test_stop_string_respects_min_tokens(tokenizer, input_processor):
    ids = text_ids(tokenizer)
    processor = OutputProcessor(tokenizer)
    add(processor, input_processor, "r", SamplingParams(max_tokens=50, min_tokens=5, stop=["Hello", "test"]))
    steps = feed(processor, "r", ids)
    final = next(outs[0] for outs, _ in steps if outs and outs[0].finished)
    assert final.outputs[0].text == "Hello world, this is a " and final.outputs[0].stop_reason == "test"


def test_stop_token_text_is_left_out(tokenizer, input_processor):
    ids = text_ids(tokenizer, "Hello world")
    processor = OutputProcessor(tokenizer)
    add(processor, input_processor, "r", SamplingParams(stop_token_ids=[ids[-1]]))
    steps = feed(processor, "r", ids, finish_at_end=FinishReason.STOP, stop_reason=ids[-1])
    completion = steps[-1][0][0].outputs[0]
    assert completion.text == "Hello" and completion.token_ids == ids and completion.stop_reason == ids[-1]


def test_delta_outputs_concatenate_and_never_show_a_stop_prefix(tokenizer, input_processor):
    ids = text_ids(tokenizer)
    processor = OutputProcessor(tokenizer)
    add(processor, input_processor, "r", SamplingParams(max_tokens=50, stop=["strings"], output_kind=RequestOutputKind.DELTA))
    steps = feed(processor, "r", ids)
    deltas = [outs[0].outputs[0] for outs, _ in steps if outs]
    assert "".join(d.text for d in deltas) == "Hello world, this is a test of stop "
    assert sum((d.token_ids for d in deltas), []) == ids[: len(sum((d.token_ids for d in deltas), []))]
    shown = ""
    for d in deltas:
        shown += d.text
        assert "str" not in shown
    assert deltas[-1].finish_reason == "stop"


def test_final_only_emits_once(tokenizer, input_processor):
    processor = OutputProcessor(tokenizer)
    add(processor, input_processor, "r", SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY))
    steps = feed(processor, "r", text_ids(tokenizer, "one two three"), finish_at_end=FinishReason.LENGTH)
    emitted = [outs for outs, _ in steps if outs]
    assert len(emitted) == 1 and emitted[0][0].finished and emitted[0][0].outputs[0].text == "one two three"


def test_error_finishes_one_request_only(tokenizer, input_processor):
    processor = OutputProcessor(tokenizer)
    add(processor, input_processor, "bad", SamplingParams())
    add(processor, input_processor, "good", SamplingParams())
    result = processor.process_outputs(message_of(
        EngineCoreOutput(request_id="bad", finish_reason=FinishReason.ERROR, error="boom: no KV blocks"),
        EngineCoreOutput(request_id="good", new_token_ids=[28]),
    ))
    bad, good = result.request_outputs
    assert bad.finished and bad.error == "boom: no KV blocks" and bad.outputs[0].finish_reason == "error"
    assert not good.finished and good.error is None
    assert processor.get_num_unfinished_requests() == 1


# --- n > 1 ------------------------------------------------------------------------------------


def test_parent_request_derives_child_seeds():
    parent = ParentRequest("p", SamplingParams(n=3, seed=7, temperature=0.8))
    assert parent.child_ids == ["0_p", "1_p", "2_p"]
    assert [parent.child_params(i).seed for i in range(3)] == [7, 8, 9]
    assert all(parent.child_params(i).n == 1 for i in range(3))
    assert ParentRequest("q", SamplingParams(n=2)).child_params(1).seed is None


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_children_merge_into_one_output(tokenizer, input_processor, kind):
    processor = OutputProcessor(tokenizer)
    request, text, ids = input_processor.process_inputs("p", "Hi", SamplingParams(n=3, seed=1, output_kind=kind))
    parent = ParentRequest("p", request.sampling_params)
    processor.add_parent(parent)
    for i, child_id in enumerate(parent.child_ids):
        import msgspec

        child = msgspec.structs.replace(request, request_id=child_id, sampling_params=parent.child_params(i))
        processor.add_request(child, text, ids, parent=parent, index=i)
    words = {0: text_ids(tokenizer, " zero"), 1: text_ids(tokenizer, " one"), 2: text_ids(tokenizer, " two")}
    outputs = []
    for child in (2, 0, 1):  # children finish in any order
        outputs += processor.process_outputs(message_of(
            EngineCoreOutput(request_id=f"{child}_p", new_token_ids=words[child], finish_reason=FinishReason.LENGTH)
        )).request_outputs
    assert all(o.request_id == "p" for o in outputs)
    final = outputs[-1]
    assert final.finished and not any(o.finished for o in outputs[:-1])
    if kind == RequestOutputKind.FINAL_ONLY:
        assert len(outputs) == 1
    if kind != RequestOutputKind.DELTA:
        assert [c.index for c in final.outputs] == [0, 1, 2]
        assert [c.text for c in final.outputs] == [" zero", " one", " two"]
    assert not processor.has_unfinished_requests() and not processor.parents


def test_abort_parent_aborts_children(tokenizer, input_processor):
    processor = OutputProcessor(tokenizer)
    request, text, ids = input_processor.process_inputs("p", "Hi", SamplingParams(n=2))
    parent = ParentRequest("p", request.sampling_params)
    processor.add_parent(parent)
    for i, child_id in enumerate(parent.child_ids):
        processor.add_request(request.__class__(child_id, request.prompt_token_ids, parent.child_params(i)), text, ids, parent, i)
    assert sorted(processor.abort_requests(["p"])) == ["0_p", "1_p"]
    assert not processor.has_unfinished_requests()


# --- logprobs -----------------------------------------------------------------------------------


def test_logprobs_become_dicts_with_ranks(tokenizer, input_processor):
    processor = OutputProcessor(tokenizer)
    add(processor, input_processor, "r", SamplingParams(logprobs=2, prompt_logprobs=1), prompt="Hello world")
    sampled = Logprobs.from_arrays(
        np.array([[28, 28, 29], [30, 31, 30]]), np.array([[-0.5, -0.5, -1.0], [-2.0, -0.1, -2.0]]), np.array([1, 2])
    )
    prompt_rows = Logprobs.from_arrays(np.array([[905, 905]]), np.array([[-3.0, -3.0]]), np.array([1]))
    out = processor.process_outputs(message_of(
        EngineCoreOutput(request_id="r", new_token_ids=[28, 30], new_logprobs=sampled, new_prompt_logprobs=prompt_rows,
                          finish_reason=FinishReason.LENGTH)
    )).request_outputs[0]
    completion = out.outputs[0]
    assert completion.cumulative_logprob == pytest.approx(-2.5)
    first, second = completion.logprobs
    assert set(first) == {28, 29} and first[28].rank == 1 and first[29].rank == 2
    assert first[28].decoded_token == tokenizer.decode([28])
    assert set(second) == {30, 31} and second[30].rank == 2 and second[31].rank == 1
    assert out.prompt_logprobs[0] is None and out.prompt_logprobs[1][905].logprob == pytest.approx(-3.0)


@pytest.mark.parametrize("detokenize", [True, False])
def test_flat_logprobs_hold_what_the_dicts_hold(tokenizer, input_processor, detokenize):
    """FlatLogprobs are filled straight from the arrays: position by position the same dicts as
    the list form, the row's own token left out of its top-k where it is one of them."""
    sampled = Logprobs.from_arrays(
        np.array([[28, 28, 29], [30, 31, 30], [7, 8, 9]]), np.array([[-0.5, -0.5, -1.0], [-2.0, -0.1, -2.0],
                                                                      [-4.0, -1.0, -2.0]]), np.array([1, 2, 9])
    )
    prompt_rows = Logprobs.from_arrays(np.array([[905, 905, 12], [40, 905, 41]]),
                                       np.array([[-3.0, -3.0, -4.0], [-5.0, -1.0, -2.0]]), np.array([1, 7]))
    outputs = {}
    for flat in (False, True):
        processor = OutputProcessor(tokenizer)
        params = SamplingParams(logprobs=2, prompt_logprobs=2, flat_logprobs=flat, detokenize=detokenize)
        add(processor, input_processor, "r", params, prompt="Hello world")
        outputs[flat] = processor.process_outputs(message_of(
            EngineCoreOutput(request_id="r", new_token_ids=[28, 30, 7], new_logprobs=sampled,
                              new_prompt_logprobs=prompt_rows, finish_reason=FinishReason.LENGTH)
        )).request_outputs[0]
    listed, flat = outputs[False], outputs[True]
    assert isinstance(flat.prompt_logprobs, FlatLogprobs) and isinstance(flat.outputs[0].logprobs, FlatLogprobs)
    for got, dicts in ((flat.prompt_logprobs, listed.prompt_logprobs), (flat.outputs[0].logprobs, listed.outputs[0].logprobs)):
        assert list(got) == dicts
        expected = FlatLogprobs()
        expected.extend(dicts)
        assert got == expected  # the same flat lists, the duplicates left out
    assert flat.outputs[0].cumulative_logprob == listed.outputs[0].cumulative_logprob


@pytest.mark.parametrize("flat", [False, True])
def test_tied_top_k_carry_ranks_one_to_k(tokenizer, input_processor, flat):
    """The row's own token ties with the token above it: its rank by count is 1, its top-k
    position 2; the top k still carry ranks 1..k (vLLM's rule: a top-k token's rank is its position)."""
    processor = OutputProcessor(tokenizer)
    add(processor, input_processor, "r", SamplingParams(logprobs=2, flat_logprobs=flat), prompt="Hello world")
    rows = Logprobs.from_arrays(np.array([[31, 30, 31]]), np.array([[-1.0, -1.0, -1.0]]), np.array([1]))
    out = processor.process_outputs(message_of(
        EngineCoreOutput(request_id="r", new_token_ids=[31], new_logprobs=rows, finish_reason=FinishReason.LENGTH)
    )).request_outputs[0]
    (row,) = list(out.outputs[0].logprobs)
    assert {token: lp.rank for token, lp in row.items()} == {30: 1, 31: 2}


def test_child_error_reaches_the_parent_output(tokenizer, input_processor):
    import msgspec

    processor = OutputProcessor(tokenizer)
    request, text, ids = input_processor.process_inputs("p", "Hi", SamplingParams(n=2))
    parent = ParentRequest("p", request.sampling_params)
    processor.add_parent(parent)
    for i, child_id in enumerate(parent.child_ids):
        child = msgspec.structs.replace(request, request_id=child_id, sampling_params=parent.child_params(i))
        processor.add_request(child, text, ids, parent=parent, index=i)
    processor.process_outputs(message_of(EngineCoreOutput(request_id="0_p", finish_reason=FinishReason.ERROR, error="bad child")))
    final = processor.process_outputs(message_of(
        EngineCoreOutput(request_id="1_p", new_token_ids=[28], finish_reason=FinishReason.LENGTH)
    )).request_outputs[0]
    assert final.finished and final.error == "bad child"
    assert [c.finish_reason for c in final.outputs] == ["error", "length"]


def test_output_processor_makes_the_same_outputs_from_columns_and_structs(tokenizer, input_processor):
    """A prompt's tokens fed once as rows (speculative bursts included) and once as structs,
    with a stop string that ends the request in the frontend: the same outputs, step by step."""
    ids = text_ids(tokenizer, "one two three four five six seven")
    cuts = [0, 1, 3, 4, len(ids) - 1, len(ids)]
    bursts = [ids[a:b] for a, b in zip(cuts, cuts[1:])]
    assert len(ids) >= 6 and all(bursts)
    seen = {}
    for columns in (False, True):
        processor = OutputProcessor(tokenizer)
        add(processor, input_processor, "r", SamplingParams(stop=["five"], output_kind=RequestOutputKind.DELTA))
        steps = []
        for burst in bursts:
            message = EngineCoreOutputs()
            if columns:
                message.add_tokens("r", burst)
            else:
                message.outputs.append(EngineCoreOutput("r", burst))
            result = processor.process_outputs(message)
            steps.append(([(o.outputs[0].text, o.outputs[0].token_ids, o.finished) for o in result.request_outputs],
                          result.reqs_to_abort))
        seen[columns] = steps
    assert seen[True] == seen[False]
    assert seen[True][-2][1] == ["r"]  # the stop string, found in the frontend: abort it in the engine
    assert "".join(text for outs, _ in seen[True] for text, _, _ in outs) == "one two three four "
