"""Incremental detokenization whose concatenated pieces equal `tokenizer.decode` of all the ids.

Decoding each new token on its own is wrong in three ways: a character split over several
tokens (byte-level BPE pieces of a multi-byte UTF-8 character, or SentencePiece byte-fallback
tokens like `<0xE4>`) decodes to U+FFFD until its last byte arrives; SentencePiece tokenizers
drop the leading space of the first token they decode; and a byte-fallback decoder turns a
whole run of byte tokens into one U+FFFD per token when the run is not valid UTF-8, so a
character that looked complete can still turn into replacement characters later.

So each step decodes a short window of ids: `decode(ids[prefix:])` minus `decode(ids[prefix:read])`,
where `prefix..read` are the tokens already emitted last time (context for the leading space),
and text is emitted only at a clean boundary: the window's text does not end in U+FFFD and the
last token it decodes (a skipped special token does not split a byte run) is not a
byte-fallback token. At such a boundary the decoders are stateless, so the
emitted pieces concatenate to the full decode. `flush()` emits what is held back at the end.

spaces_between_special_tokens (vLLM's SamplingParams field, transformers' slow-tokenizer rule):
each added token that shows in the text (special ones only with skip_special_tokens=False) is
joined to its neighbours with a space. transformers' fast tokenizers ignore the flag, so the
detokenizer applies it itself: the window is decoded in runs split at those tokens, joined with
" " (False: the tokenizer's own decode, which joins them without).
"""

from __future__ import annotations

import re
from typing import Any, Optional

_REPLACEMENT = "\ufffd"
_BYTE_TOKEN = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")


def byte_fallback_token_ids(tokenizer: Any) -> frozenset[int]:
    """Ids of SentencePiece byte-fallback tokens (`<0x00>`..`<0xFF>`); empty for other tokenizers."""
    vocab = tokenizer.get_vocab()
    # the prefix test first: the regex over a whole vocabulary (49k+ tokens) costs ~20 ms
    found = {token: i for token, i in vocab.items() if token.startswith("<0x") and _BYTE_TOKEN.match(token)}
    return frozenset(found.values()) if len(found) >= 256 else frozenset()


def added_token_ids(tokenizer: Any) -> frozenset[int]:
    """Ids of the tokenizer's added tokens (special or not): where spaces_between_special_tokens
    puts its spaces."""
    return frozenset(getattr(tokenizer, "added_tokens_decoder", {}) or {})


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """Ids that `decode(..., skip_special_tokens=True)` drops: special added tokens."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return frozenset(tokenizer.all_special_ids) | frozenset(i for i, t in added.items() if getattr(t, "special", False))


def find_stop_string(text: str, stops: list[str], new_from: int, include: bool) -> Optional[tuple[str, int]]:
    """Of the stop strings that end past `new_from` (the text before it was searched already),
    the one that starts first, and the length the text is cut to: after it (include=True,
    include_stop_str_in_output) or before it. None when there is none."""
    best: Optional[tuple[int, str]] = None
    for stop in stops:
        at = text.find(stop, max(0, new_from - len(stop) + 1))
        if at != -1 and (best is None or at < best[0]):
            best = (at, stop)
    if best is None:
        return None
    at, stop = best
    return stop, at + len(stop) if include else at


class IncrementalDetokenizer:
    """Turns a request's output token ids into text as they arrive.

    `token_ids` holds every output id; `output_text` the text emitted so far.
    """

    def __init__(
        self,
        tokenizer: Any,
        skip_special_tokens: bool = True,
        byte_token_ids: frozenset[int] = frozenset(),
        special_ids: frozenset[int] = frozenset(),
        spaced_ids: frozenset[int] = frozenset(),
    ):
        """byte_token_ids: from `byte_fallback_token_ids`; special_ids: from `special_token_ids`
        (needed with byte tokens and skip_special_tokens, and for spaced_ids); spaced_ids: the
        added tokens (`added_token_ids`) to join with spaces (spaces_between_special_tokens),
        empty for none."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # the added tokens that show in the text and get spaces around them
        self.spaced_ids = spaced_ids - special_ids if skip_special_tokens else spaced_ids
        self.byte_token_ids = byte_token_ids
        self.skipped_ids = special_ids if skip_special_tokens else frozenset()
        self.token_ids: list[int] = []
        self.output_text = ""
        # Ids the detokenizer has seen; a stop token excluded from the text is in token_ids only.
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def update(self, new_token_ids: list[int], skip_last: bool = False) -> str:
        """Adds ids; returns the text they complete. skip_last: keep the last id out of the text
        (a stop token that the user does not want to see)."""
        self.token_ids.extend(new_token_ids)
        visible = new_token_ids[:-1] if skip_last else new_token_ids
        if not visible:
            return ""
        self._ids.extend(visible)
        prefix_text, new_text = self._window_texts()
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT) or self._ends_in_byte_run():
            return ""
        return self._emit(new_text[len(prefix_text):])

    def flush(self) -> str:
        """Emits the text held back (an unfinished character decodes to U+FFFD); call once, at the end."""
        prefix_text, new_text = self._window_texts()
        if len(new_text) <= len(prefix_text):
            return ""
        return self._emit(new_text[len(prefix_text):])

    def _ends_in_byte_run(self) -> bool:
        if not self.byte_token_ids:
            return False
        for token_id in reversed(self._ids):
            if token_id not in self.skipped_ids:
                return token_id in self.byte_token_ids
        return False

    def _window_texts(self) -> tuple[str, str]:
        window = self._ids[self._prefix_offset:]
        prefix_len = self._read_offset - self._prefix_offset
        prefix_text = self._decode(window[:prefix_len]) if prefix_len else ""
        return prefix_text, self._decode(window)

    def _decode(self, ids: list[int]) -> str:
        decode, skip, spaced = self.tokenizer.decode, self.skip_special_tokens, self.spaced_ids
        if not spaced or spaced.isdisjoint(ids):
            return decode(ids, skip_special_tokens=skip)
        parts: list[str] = []
        start = 0
        for i, token_id in enumerate(ids):
            if token_id in spaced:
                if i > start:
                    parts.append(decode(ids[start:i], skip_special_tokens=skip))
                parts.append(decode([token_id], skip_special_tokens=False))
                start = i + 1
        if start < len(ids):
            parts.append(decode(ids[start:], skip_special_tokens=skip))
        return " ".join(part for part in parts if part)

    def _emit(self, delta: str) -> str:
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.output_text += delta
        return delta
