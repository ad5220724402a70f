"""vLLM's v1 SamplingParams fields, each against a reference: transformers' generate with its
logits processors (SequenceBias, prefix-allowed tokens, NoBadWords, num_beams), its log_softmax,
or the same request without the field; on a tiny random Llama in this process."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from shmvllm import LLM, BeamSearchParams, SamplingParams
from shmvllm.logprobs import FlatLogprobs

MAX_MODEL_LEN = 256
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    with LLM(model=str(tiny_llama_dir), multiprocess=False, max_model_len=MAX_MODEL_LEN, num_kv_blocks=256,
             max_logprobs=-1) as llm:
        yield llm


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt_ids(llm):
    return llm.get_tokenizer()(PROMPT)["input_ids"]


def greedy(llm, max_tokens=12, **fields):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **fields)
    return llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]


def hf_greedy(hf, prompt_ids, max_tokens=12, **kwargs):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=max_tokens,
                          min_new_tokens=max_tokens, pad_token_id=0, **kwargs)
    return out[0, len(prompt_ids):].tolist()


def test_logit_bias_equals_transformers_sequence_bias(llm, hf, prompt_ids):
    plain = greedy(llm).token_ids
    bias = {plain[1]: -100.0, 4321: 12.0, 77: 3.5}
    got = greedy(llm, logit_bias=bias).token_ids
    expected = hf_greedy(hf, prompt_ids, sequence_bias={(t,): b for t, b in bias.items()})
    assert got == expected and got != plain


def test_allowed_token_ids_equals_transformers_prefix_allowed_tokens(llm, hf, prompt_ids):
    allowed = [11, 345, 2024, 7777, 30000]
    got = greedy(llm, allowed_token_ids=allowed).token_ids
    expected = hf_greedy(hf, prompt_ids, prefix_allowed_tokens_fn=lambda batch, ids: allowed)
    assert got == expected and set(got) <= set(allowed)


def test_bad_words_equals_transformers_no_bad_words(llm, hf, prompt_ids):
    """bad_words are tokenized as vLLM does (alone and after a space); transformers' NoBadWords
    processor bans the same token sequences."""
    tokenizer = llm.get_tokenizer()
    processor = llm.llm_engine.input_processor
    plain = greedy(llm, max_tokens=16).token_ids
    # A word of the unconstrained output whose tokenization bans a token that output has.
    word = next(w for w in (tokenizer.decode([t]).strip() for t in plain)
                if w and any(seq[-1] in plain for seq in processor.bad_words_token_ids([w])))
    words = [word, "quick brown"]  # and a two-token word, its second token banned after its first
    banned = processor.bad_words_token_ids(words)
    assert any(len(seq) == 2 for seq in banned)
    got = greedy(llm, max_tokens=16, bad_words=words).token_ids
    expected = hf_greedy(hf, prompt_ids, max_tokens=16, bad_words_ids=banned)
    assert got == expected and got != plain


def test_logprobs_minus_one_is_the_whole_vocabulary_as_transformers_log_softmax(llm, hf, prompt_ids):
    out = greedy(llm, max_tokens=3, logprobs=-1)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    assert all(len(position) == vocab for position in out.logprobs)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt_ids + out.token_ids[:2]])).logits[0, len(prompt_ids) - 1 :]
    expected = torch.log_softmax(logits, dim=-1).numpy()
    for step, position in enumerate(out.logprobs):
        got = np.array([position[t].logprob for t in range(vocab)])
        np.testing.assert_allclose(got, expected[step], atol=2e-4)
        assert position[out.token_ids[step]].rank == 1


def test_prompt_logprobs_minus_one(llm, hf, prompt_ids):
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=-1), use_tqdm=False)[0]
    with torch.no_grad():
        expected = torch.log_softmax(hf(torch.tensor([prompt_ids])).logits[0], dim=-1).numpy()
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt_ids)
    for p in range(1, len(prompt_ids)):
        np.testing.assert_allclose([out.prompt_logprobs[p][t].logprob for t in range(0, 49152, 997)],
                                   expected[p - 1, ::997], atol=2e-4)


def test_max_logprobs_limits_requests_before_anything_is_queued(tiny_llama_dir):
    with LLM(model=str(tiny_llama_dir), multiprocess=False, max_model_len=64, num_kv_blocks=32, max_logprobs=3) as small:
        with pytest.raises(ValueError, match="max_logprobs=3"):
            small.generate(["a", "b"], SamplingParams(logprobs=4), use_tqdm=False)
        with pytest.raises(ValueError, match="max_logprobs"):
            small.generate("a", SamplingParams(logprobs=-1), use_tqdm=False)
        assert not small.llm_engine.has_unfinished_requests()
        assert len(small.generate("a", SamplingParams(logprobs=3, max_tokens=2), use_tqdm=False)[0].outputs[0].logprobs[0]) >= 3


def test_top_k_zero_and_minus_one_are_off(llm):
    """Reference: the same seeded request with top_k at the vocabulary size (keeps every token)."""
    runs = [llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=5, top_k=k, max_tokens=12, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids for k in (0, -1, 49152)]
    assert runs[0] == runs[1] == runs[2]
    assert SamplingParams().top_k == 0


def test_detokenize_false_leaves_text_and_decoded_tokens_empty(llm):
    with_text = greedy(llm, logprobs=2)
    without = greedy(llm, logprobs=2, detokenize=False)
    assert without.token_ids == with_text.token_ids and without.text == "" and with_text.text
    assert all(lp.decoded_token is None for position in without.logprobs for lp in position.values())
    assert all(lp.decoded_token is not None for position in with_text.logprobs for lp in position.values())


def test_flat_logprobs_hold_the_same_values_as_the_list_form(llm):
    listed = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6, logprobs=3, prompt_logprobs=2),
                          use_tqdm=False)[0]
    flat = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6, logprobs=3, prompt_logprobs=2,
                                               flat_logprobs=True), use_tqdm=False)[0]
    assert isinstance(flat.outputs[0].logprobs, FlatLogprobs) and isinstance(flat.prompt_logprobs, FlatLogprobs)
    assert list(flat.outputs[0].logprobs) == listed.outputs[0].logprobs
    assert list(flat.prompt_logprobs) == listed.prompt_logprobs
    assert len(flat.outputs[0].logprobs.token_ids) == sum(len(p) for p in listed.outputs[0].logprobs)


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm, prompt_ids):
    """Reference: the same request given the last 3 prompt ids."""
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=5, truncate_prompt_tokens=3), use_tqdm=False)[0]
    direct = llm.generate({"prompt_token_ids": prompt_ids[-3:]}, SamplingParams(temperature=0, max_tokens=5),
                          use_tqdm=False)[0]
    assert out.prompt_token_ids == prompt_ids[-3:] and out.outputs[0].token_ids == direct.outputs[0].token_ids
    whole = llm.generate(PROMPT, SamplingParams(max_tokens=1, truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert whole.prompt_token_ids == prompt_ids
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        llm.generate(PROMPT, SamplingParams(truncate_prompt_tokens=MAX_MODEL_LEN + 1), use_tqdm=False)


def test_extra_args_are_carried_to_the_engine_unchanged(llm):
    """vLLM: extra_args are for custom sampling code and used by nothing in-tree; they must arrive."""
    params = SamplingParams(temperature=0, max_tokens=4, extra_args={"tag": [1, "x"]})
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
    assert decoded.extra_args == {"tag": [1, "x"]}
    assert llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids == greedy(llm, 4).token_ids


def test_from_optional_clone_and_vllm_limits():
    assert SamplingParams.from_optional(temperature=None, top_p=None, n=None) == SamplingParams()
    assert SamplingParams.from_optional(logit_bias={"7": 500, 8: -3}).logit_bias == {7: 100.0, 8: -3.0}
    original = SamplingParams(logit_bias={1: 1.0}, allowed_token_ids=[1, 2], stop=["x"])
    copy = original.clone()
    copy.logit_bias[2] = 2.0
    copy.allowed_token_ids.append(3)
    assert copy == copy and original.logit_bias == {1: 1.0} and original.allowed_token_ids == [1, 2]
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=2.01)
    with pytest.raises(ValueError, match="n must be 1 when using greedy"):
        SamplingParams(temperature=0, n=2)
    assert SamplingParams(temperature=0.001).temperature == 0.01  # vLLM raises tiny temperatures
    assert SamplingParams(seed=-1).seed is None and SamplingParams(logprobs=True).logprobs == 1


def test_out_of_vocabulary_ids_are_refused_by_name(llm):
    for field, value in (("allowed_token_ids", [49152]), ("logit_bias", {-1: 1.0})):
        with pytest.raises(ValueError, match=field):
            llm.generate(PROMPT, SamplingParams(**{field: value}), use_tqdm=False)


def test_beam_search_equals_transformers_num_beams(llm, hf, prompt_ids):
    """No EOS can end a beam (ignore_eos; transformers told of an EOS id no beam reaches), so both
    keep the beam_width best sequences by cumulative logprob at every step."""
    width, steps = 3, 5
    result = llm.beam_search([{"prompt": PROMPT}], BeamSearchParams(beam_width=width, max_tokens=steps, ignore_eos=True))
    got = [seq.tokens[len(prompt_ids):] for seq in result[0].sequences]
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt_ids]), do_sample=False, num_beams=width, num_return_sequences=width,
                          max_new_tokens=steps, min_new_tokens=steps, eos_token_id=49151, pad_token_id=0,
                          length_penalty=1.0, early_stopping=True)
    expected = [row[len(prompt_ids):].tolist() for row in out]
    assert 49151 not in {t for seq in got for t in seq}
    assert got == expected
    scores = [seq.cum_logprob for seq in result[0].sequences]
    assert scores == sorted(scores, reverse=True)
    assert result[0].sequences[0].text == llm.get_tokenizer().decode(result[0].sequences[0].tokens)
