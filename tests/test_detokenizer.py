"""Incremental detokenization equals `tokenizer.decode` of the same ids, however they arrive."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmvllm.engine.detokenizer import IncrementalDetokenizer, added_token_ids, byte_fallback_token_ids, special_token_ids

TEXTS = [
    "The capital of France is Paris.",
    "中文分词和汉字的编码：北京、上海、广州。",
    "Emoji: 😀🎉👨‍👩‍👧‍👦 and flags 🇫🇷🇯🇵, mixed with text.",
    "Ünïcödé àccents, Ελληνικά, русский, العربية, עברית, हिन्दी, 日本語のテキスト。",
    "  leading spaces,\ttabs\nand newlines\n\n",
    "code: def f(x):\n    return x ** 2  # ✓",
]


def stream(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random) -> str:
    """Feeds ids in random-sized chunks; returns the concatenated pieces."""
    pieces, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 3)
        pieces.append(detok.update(ids[i : i + n]))
        i += n
    pieces.append(detok.flush())
    text = "".join(pieces)
    assert text == detok.output_text
    return text


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(params=["smollm2", "byte_fallback"])
def tokenizer(request, smollm2_tokenizer, byte_fallback_tokenizer):
    return smollm2_tokenizer if request.param == "smollm2" else byte_fallback_tokenizer


def make(tokenizer, skip_special_tokens=True) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(
        tokenizer, skip_special_tokens, byte_fallback_token_ids(tokenizer), special_token_ids(tokenizer)
    )


def test_byte_fallback_ids_detected(smollm2_tokenizer, byte_fallback_tokenizer):
    assert byte_fallback_token_ids(smollm2_tokenizer) == frozenset()
    assert len(byte_fallback_token_ids(byte_fallback_tokenizer)) == 256


@pytest.mark.parametrize("text", TEXTS)
def test_encoded_text_streams_back_exactly(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    expected = tokenizer.decode(ids, skip_special_tokens=True)
    assert stream(make(tokenizer), ids, random.Random(0)) == expected
    if tokenizer.decode(ids) == text:  # the byte-fallback toy tokenizer round-trips all of these
        assert expected == text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_ids_equal_full_decode(tokenizer, skip_special_tokens):
    """50 random sequences over the whole vocabulary (specials, partial UTF-8, byte tokens)."""
    rng = random.Random(1234)
    vocab = len(tokenizer)
    for _ in range(50):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert stream(make(tokenizer, skip_special_tokens), ids, rng) == expected, ids


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_property_random_byte_heavy_ids(data, smollm2_tokenizer, byte_fallback_tokenizer):
    """Ids drawn mostly from byte tokens (byte-fallback) and multi-byte pieces stay exact."""
    tokenizer = data.draw(st.sampled_from([smollm2_tokenizer, byte_fallback_tokenizer]))
    byte_ids = sorted(byte_fallback_token_ids(tokenizer)) or list(range(len(tokenizer)))
    ids = data.draw(
        st.lists(st.one_of(st.sampled_from(byte_ids), st.integers(0, len(tokenizer) - 1)), min_size=1, max_size=30)
    )
    seed = data.draw(st.integers(0, 2**16))
    assert stream(make(tokenizer), ids, random.Random(seed)) == tokenizer.decode(ids, skip_special_tokens=True)


def test_partial_character_is_held_back(smollm2_tokenizer):
    """'😀' is split over byte-level pieces: nothing shows until its last byte arrives."""
    ids = smollm2_tokenizer("I 😀", add_special_tokens=False)["input_ids"]
    detok = make(smollm2_tokenizer)
    pieces = [detok.update([i]) for i in ids]
    assert "\ufffd" not in "".join(pieces)
    assert "".join(pieces) == "I 😀"
    assert pieces[-1].endswith("😀") and pieces[-2] == ""


def test_byte_fallback_run_waits_for_a_non_byte_token(byte_fallback_tokenizer):
    """A byte run can still turn invalid (then every byte becomes U+FFFD), so it is not emitted early."""
    vocab = byte_fallback_tokenizer.get_vocab()
    b = lambda x: vocab[f"<0x{x:02X}>"]  # noqa: E731
    detok = make(byte_fallback_tokenizer)
    assert detok.update([vocab["▁hello"]]) == "hello"
    assert detok.update([b(0xE4), b(0xB8), b(0xAD)]) == ""  # 中, complete, but the run goes on
    assert detok.update([b(0xB8)]) == ""
    assert detok.update([vocab["▁world"]]) == "\ufffd" * 4 + " world"
    assert detok.output_text == byte_fallback_tokenizer.decode(detok.token_ids)


def test_leading_space_kept_between_pieces(byte_fallback_tokenizer):
    vocab = byte_fallback_tokenizer.get_vocab()
    detok = make(byte_fallback_tokenizer)
    assert detok.update([vocab["▁hello"]]) == "hello"
    assert detok.update([vocab["▁world"]]) == " world"
    assert detok.update([vocab["▁the"]]) == " the"


def test_skip_last_keeps_the_id_but_not_its_text(smollm2_tokenizer):
    ids = smollm2_tokenizer("Hello world", add_special_tokens=False)["input_ids"]
    detok = make(smollm2_tokenizer)
    detok.update(ids, skip_last=True)
    detok.flush()
    assert detok.token_ids == ids
    assert detok.output_text == smollm2_tokenizer.decode(ids[:-1])


@pytest.mark.parametrize("spaces", [True, False])
def test_spaces_between_special_tokens(smollm2_tokenizer, spaces):
    """True: each visible added token is joined to its neighbours with a space (the slow
    tokenizers' rule, which transformers' fast decode ignores); False: the tokenizer's decode."""
    tok = smollm2_tokenizer
    start, end = tok.convert_tokens_to_ids("<|im_start|>"), tok.convert_tokens_to_ids("<|im_end|>")
    ids = tok.encode("hello", add_special_tokens=False) + [start, end] + tok.encode(" world", add_special_tokens=False)
    specials = special_token_ids(tok)
    detok = IncrementalDetokenizer(tok, False, frozenset(), specials, added_token_ids(tok) if spaces else frozenset())
    streamed = stream(detok, ids, random.Random(0))
    expected = "hello <|im_start|> <|im_end|>  world" if spaces else tok.decode(ids, skip_special_tokens=False)
    assert streamed == expected == detok.output_text
    hidden = IncrementalDetokenizer(tok, True, frozenset(), specials, added_token_ids(tok) if spaces else frozenset())
    assert stream(hidden, ids, random.Random(0)) == tok.decode(ids, skip_special_tokens=True)  # skipped: no spaces
