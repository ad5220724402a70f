"""SamplingParams: how to sample one request, validated when it is built.

It is a msgspec Struct so that it crosses the frontend/engine boundary inside
`EngineCoreRequest` with no conversion.
"""

from __future__ import annotations

import enum
from typing import Optional, Union

import msgspec

_SAMPLING_EPS = 1e-5


class RequestOutputKind(enum.IntEnum):
    """What each RequestOutput carries: all tokens so far, only the new ones, or only the end."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class ParameterTypeError(TypeError, ValueError):
    """A parameter of the wrong type: a TypeError, and a ValueError like every other invalid parameter."""


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


class SamplingParams(
    msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True
):  # type: ignore[call-arg]
    """Sampling parameters with vLLM's names and meanings.

    Invalid values raise ValueError naming the field (a wrong type raises ParameterTypeError,
    which is both a TypeError and a ValueError).
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Set by the input processor from the tokenizer / generation config, not by users.
    eos_token_id: Optional[int] = None

    def __post_init__(self) -> None:
        self._normalize()
        self._verify()
        if self.temperature < _SAMPLING_EPS:
            # Greedy: the other truncation knobs are meaningless.
            self.top_p, self.top_k, self.min_p = 1.0, -1, 0.0

    def _normalize(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, tuple):
            self.stop = list(self.stop)
        if self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if isinstance(self.output_kind, int) and not isinstance(self.output_kind, RequestOutputKind):
            if self.output_kind not in set(RequestOutputKind):
                raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}.")
            self.output_kind = RequestOutputKind(self.output_kind)

    def _verify(self) -> None:
        _check_int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_number(name, value)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}.")
        _check_number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.")
        _check_number("temperature", self.temperature)
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        _check_int("top_k", self.top_k)
        if self.top_k < -1 or self.top_k == 0:
            raise ValueError(f"top_k must be -1 (disable), or at least 1, got {self.top_k}.")
        _check_number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.seed is not None:
            _check_int("seed", self.seed)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        _check_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}."
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value)
                if value < 0:
                    raise ValueError(f"{name} must be non-negative, got {value}.")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise ParameterTypeError(f"stop must be a str or a list of str, got {self.stop!r}.")
        if any(s == "" for s in self.stop):
            raise ValueError(f"stop cannot contain an empty string, got {self.stop!r}.")
        if not isinstance(self.stop_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids
        ):
            raise ParameterTypeError(f"stop_token_ids must be a list of int, got {self.stop_token_ids!r}.")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative, got {self.stop_token_ids!r}.")
        for name in ("ignore_eos", "detokenize", "skip_special_tokens", "spaces_between_special_tokens",
                     "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ParameterTypeError(f"{name} must be a bool, got {getattr(self, name)!r}.")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ParameterTypeError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}.")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings are only supported when detokenize is True.")

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def all_stop_token_ids(self) -> set[int]:
        """Token ids that finish the request: stop_token_ids, plus EOS unless ignore_eos."""
        ids = set(self.stop_token_ids or ())
        if self.eos_token_id is not None and not self.ignore_eos:
            ids.add(self.eos_token_id)
        return ids

    def clone(self) -> "SamplingParams":
        """A copy that shares no mutable state (the stop lists) with this one."""
        return msgspec.structs.replace(self, stop=list(self.stop or []), stop_token_ids=list(self.stop_token_ids or []))


def _check_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ParameterTypeError(f"{name} must be an int, got {value!r} ({type(value).__name__}).")


def _check_number(name: str, value: object) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ParameterTypeError(f"{name} must be a number, got {value!r} ({type(value).__name__}).")
