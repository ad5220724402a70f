"""Bursts: a lone greedy decode decodes several tokens in one engine step (SHMVLLM_DECODE_BURST).

Real models in a real engine process: the tokens, finish reasons and stop reasons with bursts
equal those of one token a step (the shipped SmolLM2 and a tiny random Llama); EOS,
stop_token_ids, max_tokens and min_tokens end the output exactly there (a request with stop
strings decodes one token a step, so its token ids end with its text); a request that
arrives during a burst is served at once, and both outputs equal their runs alone; with n-gram
speculation bursts run between proposals, which are still verified; a burst of the native decode
step is one native call (embedding, step, lm_head, argmax and the stop rule in C).
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest

from shmvllm import LLM, SamplingParams

PROMPTS = ["Tell me about the sea.", "What is 2 + 2? Answer briefly.", "Write a list of fruits."]


@contextmanager
def engine(model_dir, burst: int, monkeypatch, **engine_args):
    """A multiprocess LLM whose engine process decodes bursts of up to `burst` tokens."""
    monkeypatch.setenv("SHMVLLM_DECODE_BURST", str(burst))
    with LLM(model=str(model_dir), max_model_len=1024, **engine_args) as llm:
        yield llm


def outputs_alone(llm: LLM, prompts: list[str], params: SamplingParams) -> list:
    """Each prompt's completion, one request at a time (so that each decodes alone)."""
    return [llm.generate([p], params, use_tqdm=False)[0].outputs[0] for p in prompts]


def summary(completion) -> tuple:
    return list(completion.token_ids), completion.text, completion.finish_reason, completion.stop_reason


@pytest.mark.parametrize("which", ["smollm2", "tiny_llama"])
def test_bursts_give_the_tokens_of_one_a_step(which, smollm2_dir, tiny_llama_dir, monkeypatch, no_engine_left_behind):
    model_dir = smollm2_dir if which == "smollm2" else tiny_llama_dir
    chat = [f"<|im_start|>user\n{p}<|im_end|>\n<|im_start|>assistant\n" for p in PROMPTS]
    cases = [
        SamplingParams(temperature=0.0, max_tokens=45, ignore_eos=True),  # 45: bursts of 8 and a short one
        SamplingParams(temperature=0.0, max_tokens=13),
        SamplingParams(temperature=0.0, max_tokens=200),  # SmolLM2 ends its chat answers with EOS
        SamplingParams(temperature=0.0, max_tokens=60, min_tokens=30),  # EOS masked for 30 tokens
    ]
    results = {}
    for burst in (1, 8):
        with engine(model_dir, burst, monkeypatch) as llm:
            steps = llm.llm_engine.engine_core.get_stats()["num_steps"]
            results[burst] = [[summary(c) for c in outputs_alone(llm, chat, params)] for params in cases]
            steps = llm.llm_engine.engine_core.get_stats()["num_steps"] - steps
            tokens = sum(len(s[0]) for case in results[burst] for s in case)
            if burst == 8:
                assert steps < tokens / 2, f"{steps} steps for {tokens} tokens: no bursts"
    assert results[8] == results[1]
    long, short, natural, at_least = results[8]
    assert all(len(s[0]) >= 30 for s in at_least)
    assert all(len(s[0]) == 45 and s[2] == "length" for s in long)
    assert all((len(s[0]), s[2]) == (13, "length") or (len(s[0]) < 13 and s[2] == "stop") for s in short)
    assert any(s[2] == "length" for s in short)
    if which == "smollm2":
        assert any(s[2] == "stop" for s in natural), "no answer ended with EOS"


@pytest.mark.parametrize("which", ["smollm2", "tiny_llama"])
def test_a_burst_is_one_native_call(which, smollm2_dir, tiny_llama_dir, monkeypatch, no_engine_left_behind):
    """In the engine's process, bursts run as the native step's burst (DecodeStep.burst): its
    tokens equal one token a step's, with EOS masked by min_tokens, stop_token_ids and max_tokens."""
    model_dir = smollm2_dir if which == "smollm2" else tiny_llama_dir
    chat = [f"<|im_start|>user\n{p}<|im_end|>\n<|im_start|>assistant\n" for p in PROMPTS]
    cases = [
        SamplingParams(temperature=0.0, max_tokens=45, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=60, min_tokens=30),
        SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[28, 30]),  # SmolLM2's "," and "."
    ]
    results = {}
    for burst in (1, 8):
        monkeypatch.setenv("SHMVLLM_DECODE_BURST", str(burst))
        with LLM(model=str(model_dir), max_model_len=1024, multiprocess=False) as llm:
            step = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.model.model.decode_step
            results[burst] = [[summary(c) for c in outputs_alone(llm, chat, params)] for params in cases]
            assert (step.bursts > 0) == (burst > 1)
    assert results[8] == results[1]
    assert all(len(s[0]) >= 30 for s in results[8][1])
    if which == "smollm2":
        assert any(s[3] in (28, 30) for s in results[8][2]), "no answer stopped at a stop token id"


def test_stop_token_ids_and_stop_strings_end_a_burst_exactly(smollm2_dir, monkeypatch, no_engine_left_behind):
    prompt = PROMPTS[0]
    with engine(smollm2_dir, 1, monkeypatch) as llm:
        free = outputs_alone(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))[0]
    tokens = list(free.token_ids)
    stop_token = tokens[11]  # past a first burst, inside the second
    cut = tokens.index(stop_token) + 1
    stop_text = free.text[len(free.text) // 2 :][:6]
    with engine(smollm2_dir, 8, monkeypatch) as llm:
        by_token = outputs_alone(llm, [prompt], SamplingParams(
            temperature=0.0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop_token]))[0]
        by_text = outputs_alone(llm, [prompt], SamplingParams(
            temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop_text]))[0]
    assert list(by_token.token_ids) == tokens[:cut]
    assert (by_token.finish_reason, by_token.stop_reason) == ("stop", stop_token)
    assert by_text.text == free.text[: free.text.index(stop_text)]
    assert (by_text.finish_reason, by_text.stop_reason) == ("stop", stop_text)
    # no burst with stop strings: the output's token ids end where the stop string ends
    assert tokens[: len(by_text.token_ids)] == list(by_text.token_ids) and len(by_text.token_ids) < 40


def test_a_request_arriving_during_a_burst_is_served_at_once(smollm2_dir, monkeypatch, no_engine_left_behind):
    """The first request's burst could take all its 300 tokens; the second, sent once the
    first has its first token, still finishes first, and both equal their runs alone."""
    first = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
    second = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    with engine(smollm2_dir, 1, monkeypatch) as llm:
        alone = [summary(c) for c in (outputs_alone(llm, [PROMPTS[0]], first) + outputs_alone(llm, [PROMPTS[1]], second))]
    with engine(smollm2_dir, 1000, monkeypatch) as llm:
        core = llm.llm_engine
        core.add_request("a", PROMPTS[0], first)
        while not any(o.request_id == "a" and o.outputs[0].token_ids for o in core.step(timeout=60)):
            pass
        core.add_request("b", PROMPTS[1], second)
        finished: dict[str, tuple] = {}
        order = []
        while core.has_unfinished_requests():
            for out in core.step(timeout=60):
                if out.finished:
                    order.append(out.request_id)
                    finished[out.request_id] = summary(out.outputs[0])
    assert order == ["b", "a"]
    assert [finished["a"], finished["b"]] == alone


def test_ngram_speculation_bursts_between_its_proposals(smollm2_dir, monkeypatch, no_engine_left_behind):
    """A lone greedy request under n-gram speculation bursts in the steps that have no proposal
    and ends a burst at the token after which the proposer has one: the tokens equal one token
    a step's, proposals are still made and accepted, and the engine takes fewer steps."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 3}
    prompts = [
        "<|im_start|>user\nRepeat this sentence twice: the quick brown fox jumps over the lazy dog by the "
        "river.<|im_end|>\n<|im_start|>assistant\n",
        f"<|im_start|>user\n{PROMPTS[2]}<|im_end|>\n<|im_start|>assistant\n",
    ]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    results = {}
    for burst in (1, 8):
        with engine(smollm2_dir, burst, monkeypatch, speculative_config=spec) as llm:
            steps = llm.llm_engine.engine_core.get_stats()["num_steps"]
            tokens = [list(c.token_ids) for c in outputs_alone(llm, prompts, params)]
            steps = llm.llm_engine.engine_core.get_stats()["num_steps"] - steps
            metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
        results[burst] = tokens, steps, metrics["vllm:spec_decode_num_draft_tokens"], metrics["vllm:spec_decode_num_accepted_tokens"]
    (one, one_steps, _, _), (burst, burst_steps, drafted, accepted) = results[1], results[8]
    assert burst == one
    assert drafted > 0 and accepted > 0, "no proposals verified between the bursts"
    assert burst_steps < one_steps, (burst_steps, one_steps)
