"""vLLM's incremental detokenizer classes (`vllm.v1.engine.detokenizer`) over shmvllm's own
detokenizer and stop-string search, for programs that drive a detokenizer by hand.

`update(new_token_ids, stop_terminated)` appends ids, extends `output_text` and returns the stop
string that finished the text (truncated at it), or None; the text of the first `min_tokens`
tokens never stops it; a stop-terminated last id (a stop token) stays out of the text unless
include_stop_str_in_output. `get_next_output_text(finished, delta)` holds back, while unfinished,
the characters that could begin an excluded stop string.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Optional

from shmvllm.compat.v1_engine import EngineCoreRequest
from shmvllm.engine.detokenizer import (
    IncrementalDetokenizer as _Detokenizer,
    added_token_ids,
    byte_fallback_token_ids,
    find_stop_string,
    special_token_ids,
)


class IncrementalDetokenizer:
    """Keeps the ids only: what a request gets without a tokenizer (skip_tokenizer_init)."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids

    def num_output_tokens(self) -> int:
        return len(self.token_ids)

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> Optional[str]:
        self.token_ids.extend(new_token_ids)
        return None

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        return ""

    @classmethod
    def from_new_request(cls, tokenizer: Any, request: EngineCoreRequest) -> "IncrementalDetokenizer":
        if request.sampling_params is None:
            raise ValueError("a detokenizer needs a request with sampling_params.")
        return cls() if tokenizer is None else FastIncrementalDetokenizer(tokenizer, request)


class BaseIncrementalDetokenizer(IncrementalDetokenizer, ABC):
    """Stop strings and min_tokens over `decode_next`, which subclasses define."""

    def __init__(self, request: EngineCoreRequest) -> None:
        super().__init__()
        params = request.sampling_params
        if params is None:
            raise ValueError("a detokenizer needs a request with sampling_params.")
        stop = params.stop or []
        self.stop: list[str] = [stop] if isinstance(stop, str) else list(stop)
        self.min_tokens = params.min_tokens
        self.include_stop_str_in_output = params.include_stop_str_in_output
        excluded = self.stop and not self.include_stop_str_in_output
        self.stop_buffer_length = max(len(s) for s in self.stop) - 1 if excluded else 0
        self.output_text = ""
        self._sent = 0

    @abstractmethod
    def decode_next(self, next_token_id: int) -> str:
        """The text one more id adds."""

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> Optional[str]:
        if not new_token_ids:
            return None
        skip_last = stop_terminated and not self.include_stop_str_in_output
        search_from = len(self.output_text)
        for token_id in new_token_ids[:-1] if skip_last else new_token_ids:
            self.token_ids.append(token_id)
            self.output_text += self.decode_next(token_id)
            if len(self.token_ids) <= self.min_tokens:
                search_from = len(self.output_text)
        if skip_last:
            self.token_ids.append(new_token_ids[-1])
        if not self.stop or len(self.token_ids) <= self.min_tokens:
            return None
        found = find_stop_string(self.output_text, self.stop, search_from, self.include_stop_str_in_output)
        if found is None:
            return None
        stop, truncate_to = found
        self.output_text = self.output_text[:truncate_to]
        return stop

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        end = len(self.output_text) - (0 if finished else self.stop_buffer_length)
        if not delta:
            return self.output_text[: max(end, 0)]
        if end <= self._sent:
            return ""
        start, self._sent = self._sent, end
        return self.output_text[start:end]


class FastIncrementalDetokenizer(BaseIncrementalDetokenizer):
    """Decodes with shmvllm's windowed detokenizer: the pieces concatenate to `tokenizer.decode`
    of the output ids (skip_special_tokens and spaces_between_special_tokens as the params say)."""

    def __init__(self, tokenizer: Any, request: EngineCoreRequest) -> None:
        super().__init__(request)
        params = request.sampling_params
        self.request_id = request.request_id
        special = special_token_ids(tokenizer)
        spaced = added_token_ids(tokenizer) if params.spaces_between_special_tokens else frozenset()
        self._detokenizer = _Detokenizer(
            tokenizer, params.skip_special_tokens, byte_fallback_token_ids(tokenizer), special, spaced
        )

    def decode_next(self, next_token_id: int) -> str:
        return self._detokenizer.update([next_token_id])


SlowIncrementalDetokenizer = FastIncrementalDetokenizer  # one algorithm serves both kinds of tokenizer

__all__ = ["IncrementalDetokenizer", "BaseIncrementalDetokenizer", "FastIncrementalDetokenizer", "SlowIncrementalDetokenizer"]
