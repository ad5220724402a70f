"""LLM.generate / LLM.chat end to end, on a tiny random Llama in this process."""

from __future__ import annotations

import random

import pytest

from shmvllm import LLM, SamplingParams
from shmvllm.boundary.messages import EngineCoreRequest
from shmvllm.sampling_params import RequestOutputKind, StructuredOutputsParams

MAX_MODEL_LEN = 256

SEED_TEXTS = [
    "Hello, my name is",
    "The capital of France is",
    "中文的句子：今天天气很好，我们去公园散步。",
    "日本語とEnglishが混ざった文章です。",
    "Emoji party 😀🎉🚀👨‍👩‍👧‍👦 and more 🇫🇷",
    "Ünïcödé and Ελληνικά and русский",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)",
]


def fifty_prompts() -> list[str]:
    rng = random.Random(0)
    prompts = list(SEED_TEXTS)
    while len(prompts) < 50:
        a, b = rng.sample(SEED_TEXTS, 2)
        prompts.append(f"{a[: rng.randint(3, 20)]} {b[-rng.randint(3, 20):]}")
    return prompts


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    with LLM(model=str(tiny_llama_dir), multiprocess=False, max_model_len=MAX_MODEL_LEN, num_kv_blocks=256) as llm:
        yield llm


@pytest.fixture(scope="module")
def tokenizer(llm):
    return llm.get_tokenizer()


def engine_is_idle(llm: LLM) -> bool:
    stats = llm.llm_engine.engine_core.get_stats()
    return stats["num_running_reqs"] == 0 and stats["num_waiting_reqs"] == 0 and not llm.llm_engine.has_unfinished_requests()


def test_text_equals_decode_of_token_ids_for_50_prompts(llm, tokenizer):
    """Random sampling over a random model: arbitrary ids, many of them pieces of multi-byte characters."""
    prompts = fifty_prompts()
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=24) for i in range(len(prompts))]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outputs] == prompts
    num_non_ascii = 0
    for prompt, output in zip(prompts, outputs):
        assert output.finished and output.prompt_token_ids == tokenizer(prompt)["input_ids"]
        completion = output.outputs[0]
        assert completion.token_ids, prompt
        assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        num_non_ascii += any(ord(c) > 127 for c in completion.text)
    assert num_non_ascii > 10  # the random ids did exercise multi-byte text


def test_outputs_in_input_order_whatever_finishes_first(llm):
    prompts = ["one", "two", "three", "four"]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (20, 3, 11, 1)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outputs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outputs] == [20, 3, 11, 1]
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)


def test_prompt_forms(llm, tokenizer):
    ids = tokenizer("Hello there")["input_ids"]
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    by_text = llm.generate("Hello there", greedy, use_tqdm=False)
    by_ids = llm.generate({"prompt_token_ids": ids}, greedy, use_tqdm=False)
    by_dict = llm.generate([{"prompt": "Hello there"}], greedy, use_tqdm=False)
    assert by_ids[0].prompt is None and by_ids[0].prompt_token_ids == ids
    assert by_text[0].outputs[0].token_ids == by_ids[0].outputs[0].token_ids == by_dict[0].outputs[0].token_ids


def test_stop_string_across_token_boundary_stops_and_aborts_in_engine(llm, tokenizer):
    prompt = "The future of AI is"
    base = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)[0]
    ids, text = base.outputs[0].token_ids, base.outputs[0].text
    # A stop string made of the end of one token's text and the start of the next one's.
    pieces = [tokenizer.decode(ids[:k], skip_special_tokens=True) for k in range(len(ids) + 1)]
    def spans(k: int) -> bool:  # 2+ chars each side of the boundary after token k, first occurrence
        b = len(pieces[k])
        return len(pieces[k]) - len(pieces[k - 1]) >= 2 and len(pieces[k + 1]) - b >= 2 and text.find(text[b - 2 : b + 2]) == b - 2

    k = next(k for k in range(1, len(ids)) if spans(k))
    boundary = len(pieces[k])
    stop = text[boundary - 2 : boundary + 2]
    for include in (False, True):
        out = llm.generate(
            prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop], include_stop_str_in_output=include),
            use_tqdm=False,
        )[0].outputs[0]
        cut = text.index(stop) + (len(stop) if include else 0)
        assert out.text == text[:cut]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert len(out.token_ids) < len(ids)
        assert engine_is_idle(llm)  # the request that hit the stop string was aborted in the engine


def test_n3_seeded_is_repeatable(llm, tiny_llama_dir):
    params = SamplingParams(n=3, temperature=1.0, seed=123, max_tokens=16, ignore_eos=True)
    first = llm.generate("Once upon a time", params, use_tqdm=False)[0]
    again = llm.generate("Once upon a time", params, use_tqdm=False)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    texts = [c.token_ids for c in first.outputs]
    assert texts == [c.token_ids for c in again.outputs]
    assert len({tuple(t) for t in texts}) > 1  # the children differ from each other
    with LLM(model=str(tiny_llama_dir), multiprocess=False, max_model_len=MAX_MODEL_LEN, num_kv_blocks=64) as fresh:
        other = fresh.generate("Once upon a time", params, use_tqdm=False)[0]
    assert [c.token_ids for c in other.outputs] == texts


@pytest.mark.parametrize("field, value", [("temperature", -1.0), ("top_p", 0.0), ("n", 0), ("max_tokens", 0), ("stop", 5)])
def test_invalid_parameter_raises_naming_it(llm, field, value):
    with pytest.raises(ValueError, match=field):
        llm.generate("hi", SamplingParams(**{field: value}), use_tqdm=False)


def test_too_long_prompt_is_rejected_and_the_llm_keeps_serving(llm):
    too_long = {"prompt_token_ids": [28] * (MAX_MODEL_LEN + 10)}
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(too_long, use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(["fine", too_long], use_tqdm=False)  # nothing of this call is queued
    assert engine_is_idle(llm)
    out = llm.generate("still serving", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("bad", ["prompt", "params", "priority", "structured"])
def test_a_bad_fifth_of_eight_queues_nothing(llm, monkeypatch, bad):
    """The input processor checks the whole batch before the first request is queued."""
    prompts: list = [f"prompt {i}" for i in range(8)]
    params = [SamplingParams(temperature=0, max_tokens=2) for _ in range(8)]
    priority = [0] * 8
    if bad == "prompt":
        prompts[4] = {"prompt_token_ids": [5, 10**6]}
    elif bad == "params":
        params[4] = SamplingParams(max_tokens=2, logprobs=10**4)  # above max_logprobs
    elif bad == "priority":
        priority[4] = "high"
    else:
        params[4] = SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(regex="(unclosed"))
    queued = []
    monkeypatch.setattr(llm.llm_engine.engine_core, "add_request", lambda *a, **k: queued.append(a))
    with pytest.raises((ValueError, TypeError)):
        llm.generate(prompts, params, priority=priority, use_tqdm=False)
    assert queued == [] and engine_is_idle(llm)


def test_bad_request_fails_alone(llm):
    """A request the engine rejects (it slipped past the frontend's checks) finishes with its error."""
    engine = llm.llm_engine
    bad = EngineCoreRequest(
        request_id="bad-1",
        prompt_token_ids=EngineCoreRequest.pack_token_ids([5, 10**6]),
        sampling_params=engine.input_processor.engine_params(SamplingParams(max_tokens=4), 2),
    )
    engine.output_processor.add_request(bad, None, [5, 10**6])
    engine.engine_core.add_request(bad)
    good = [f"good-{i}" for i in range(2)]
    for rid in good:
        engine.add_request(rid, "hello", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    outputs = {o.request_id: o for o in llm._run_engine(["bad-1", *good], use_tqdm=False)}
    assert outputs["bad-1"].error and "vocabulary" in outputs["bad-1"].error
    assert outputs["bad-1"].outputs[0].finish_reason == "error"
    assert all(outputs[r].error is None and len(outputs[r].outputs[0].token_ids) == 4 for r in good)


def test_delta_stream_adds_up_to_the_final_text(llm):
    engine = llm.llm_engine
    prompt = "Streaming 中文 test"
    final = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)[0]
    engine.add_request("stream-1", prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                          output_kind=RequestOutputKind.DELTA))
    pieces, ids, steps = [], [], 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            pieces.append(out.outputs[0].text)
            ids += out.outputs[0].token_ids
            steps += 1
    assert "".join(pieces) == final.outputs[0].text and ids == final.outputs[0].token_ids
    assert steps > 3  # it did stream (a lone greedy request, in bursts of up to SHMVLLM_DECODE_BURST=8 tokens)


def test_chat_uses_the_template(llm, tokenizer):
    conversation = [{"role": "user", "content": "Say hi"}]
    out = llm.chat(conversation, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert len(out) == 1 and out[0].prompt.endswith("<|im_start|>assistant\n")
    expected = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert out[0].prompt == expected
    two = llm.chat([conversation, [{"role": "user", "content": "Bye"}]], SamplingParams(max_tokens=3), use_tqdm=False)
    assert len(two) == 2


def test_user_sampling_params_untouched(llm):
    params = SamplingParams(max_tokens=3)
    llm.generate("x", params, use_tqdm=False)
    assert params.output_kind == RequestOutputKind.CUMULATIVE and params.eos_token_id is None


def test_progress_bar_shows_output_speed(llm, capsys):
    llm.generate(["a", "b", "c"], SamplingParams(max_tokens=4), use_tqdm=True)
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "output:" in err and "toks/s" in err


def test_unknown_engine_argument(tiny_llama_dir):
    with pytest.raises(TypeError, match="max_modle_len"):
        LLM(model=str(tiny_llama_dir), multiprocess=False, max_modle_len=10)


def test_logprobs_end_to_end(llm, tokenizer):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    out = llm.generate("Logprobs for this prompt", params, use_tqdm=False)[0]
    completion = out.outputs[0]
    assert len(completion.logprobs) == len(completion.token_ids) == 6
    for token_id, position in zip(completion.token_ids, completion.logprobs):
        assert position[token_id].rank == 1  # greedy picks the most likely token
        assert len(position) == 3 and position[token_id].decoded_token == tokenizer.decode([token_id])
    chosen = sum(p[t].logprob for t, p in zip(completion.token_ids, completion.logprobs))
    assert completion.cumulative_logprob == pytest.approx(chosen, abs=1e-4)
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids) and out.prompt_logprobs[0] is None
    for token_id, position in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        assert token_id in position and 2 <= len(position) <= 3
