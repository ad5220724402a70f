"""SamplingParams: how to sample one request, validated when it is built.

It is a msgspec Struct so that it crosses the frontend/engine boundary inside
`EngineCoreRequest` with no conversion. Assigning a field re-validates the whole object (an
invalid value raises and leaves the old one in place), so a SamplingParams is valid whenever
it reaches the engine.
"""

from __future__ import annotations

import copy
import enum
import json as _json
import logging
import math
import sys
from typing import Any, Optional, Union

import msgspec

from shmvllm import envs

logger = logging.getLogger(__name__)

_SAMPLING_EPS = 1e-5
# vLLM raises a positive temperature below this to it (smaller ones overflow in the softmax).
_MIN_TEMPERATURE = 1e-2
_MAX_TEMPERATURE = 2.0
# Every int crosses the process boundary as a msgpack int64 (and seeds a torch generator).
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# vLLM's bound on n (its VLLM_MAX_N_SEQUENCES): the frontend keeps n requests per prompt.
MAX_N_SEQUENCES_ENV = "SHMVLLM_MAX_N_SEQUENCES"
DEFAULT_MAX_N_SEQUENCES = 16384
_set_field = msgspec.Struct.__setattr__  # a field assignment without re-validation
_FLOAT_MAX = sys.float_info.max


def max_n_sequences() -> int:
    """The largest n: $SHMVLLM_MAX_N_SEQUENCES, else DEFAULT_MAX_N_SEQUENCES."""
    value = envs.SHMVLLM_MAX_N_SEQUENCES()
    if value is None:
        return DEFAULT_MAX_N_SEQUENCES
    if value < 1:
        raise ValueError(f"{MAX_N_SEQUENCES_ENV} must be a positive int, got {value}.")
    return value


class RequestOutputKind(enum.IntEnum):
    """What each RequestOutput carries: all tokens so far, only the new ones, or only the end."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class ParameterTypeError(TypeError, ValueError):
    """A parameter of the wrong type: a TypeError, and a ValueError like every other invalid parameter."""


_CONSTRAINT_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


class StructuredOutputsParams(
    msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True
):  # type: ignore[call-arg]
    """A constraint on the output, with vLLM's fields: exactly one of `json` (a JSON schema as a
    dict, a JSON string, or a pydantic model class), `regex`, `choice` (a list of strings),
    `grammar` (EBNF / GBNF, or Lark), `json_object` (any JSON object) and `structural_tag` (an
    xgrammar structural tag, as JSON text or a dict).

    Options: `disable_any_whitespace` (JSON without free whitespace), `disable_additional_properties`
    (objects of the schema that do not say otherwise get additionalProperties false),
    `whitespace_pattern` (refused when set: xgrammar has no such knob, as in vLLM's xgrammar
    backend), `disable_fallback` (accepted at any value: there is one backend, never a fallback).

    Whether the constraint itself is valid (a schema xgrammar can compile, a regex that parses)
    is checked by the frontend's input processor, which has the grammar library.
    """

    json: Union[str, dict[str, Any], None] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    structural_tag: Union[str, dict[str, Any], None] = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: Optional[str] = None
    disable_fallback: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.json, type) or _is_pydantic_model(self.json):
            self.json = _pydantic_schema(self.json)
        if isinstance(self.choice, tuple):
            self.choice = list(self.choice)
        if self.json_object is False:
            self.json_object = None  # vLLM counts only True as a constraint
        given = [name for name in _CONSTRAINT_FIELDS if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs needs exactly one constraint of "
                f"{list(_CONSTRAINT_FIELDS)}, got {len(given)}: {given or 'none'}."
            )
        self._verify()

    def _verify(self) -> None:
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ParameterTypeError(
                "structured_outputs.json must be a JSON schema (dict or str) or a pydantic model class, "
                f"got {self.json!r} ({type(self.json).__name__})."
            )
        if isinstance(self.json, str):
            try:
                schema = _json.loads(self.json)
            except ValueError as exc:
                raise ValueError(f"structured_outputs.json is not valid JSON: {exc}; got {self.json!r}.") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"structured_outputs.json must be a JSON schema object, got {self.json!r}.")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ParameterTypeError(f"structured_outputs.{name} must be a str, got {value!r}.")
            if value is not None and "\x00" in value:
                raise ValueError(f"structured_outputs.{name} must not contain a NUL character, got {value!r}.")
        if self.grammar is not None and not self.grammar.strip():
            raise ValueError(f"structured_outputs.grammar is empty, got {self.grammar!r}.")
        if self.choice is not None:
            if not isinstance(self.choice, list) or not all(isinstance(c, str) for c in self.choice):
                raise ParameterTypeError(f"structured_outputs.choice must be a list of str, got {self.choice!r}.")
            if not self.choice:
                raise ValueError("structured_outputs.choice must hold at least one string, got [].")
        if self.json_object is not None and self.json_object is not True:
            raise ParameterTypeError(f"structured_outputs.json_object must be a bool, got {self.json_object!r}.")
        if self.structural_tag is not None:
            if not isinstance(self.structural_tag, (str, dict)):
                raise ParameterTypeError(
                    f"structured_outputs.structural_tag must be JSON text or a dict, got {self.structural_tag!r}."
                )
            if isinstance(self.structural_tag, str):
                try:
                    _json.loads(self.structural_tag)
                except ValueError as exc:
                    raise ValueError(
                        f"structured_outputs.structural_tag is not valid JSON: {exc}; got {self.structural_tag!r}."
                    ) from None
        for name in ("disable_any_whitespace", "disable_additional_properties", "disable_fallback"):
            if not isinstance(getattr(self, name), bool):
                raise ParameterTypeError(f"structured_outputs.{name} must be a bool, got {getattr(self, name)!r}.")
        if self.whitespace_pattern is not None:
            raise ValueError(
                "structured_outputs.whitespace_pattern is not supported by the xgrammar backend "
                f"(use disable_any_whitespace=True for compact JSON), got {self.whitespace_pattern!r}."
            )

    @property
    def kind(self) -> str:
        """The name of the one constraint field that is set."""
        return next(name for name in _CONSTRAINT_FIELDS if getattr(self, name) is not None)

    def all_constraints_none(self) -> bool:
        return all(getattr(self, name) is None for name in _CONSTRAINT_FIELDS)


# vLLM's older name for the same parameters.
GuidedDecodingParams = StructuredOutputsParams


def _is_pydantic_model(value: object) -> bool:
    return hasattr(value, "model_json_schema") and callable(value.model_json_schema)


def _pydantic_schema(model: Any) -> Any:
    if not _is_pydantic_model(model):
        raise ParameterTypeError(
            f"structured_outputs.json must be a JSON schema (dict or str) or a pydantic model class, got {model!r}."
        )
    return model.model_json_schema()


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
    top_k: int = 0  # 0 or -1: off
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
    # vLLM's v1 fields (applied by the input processor and the sampler's logits processors):
    truncate_prompt_tokens: Optional[int] = None  # keep the last k prompt tokens; -1: max_model_len
    logit_bias: Optional[dict[int, float]] = None  # token id -> added to its logit
    allowed_token_ids: Optional[list[int]] = None  # only these may be sampled
    bad_words: Optional[list[str]] = None  # a word's last token is banned after the rest of it
    extra_args: Optional[dict[str, Any]] = None  # carried for custom code; no in-tree use (as in vLLM)
    flat_logprobs: bool = False  # logprobs as one FlatLogprobs per completion (fewer objects)
    structured_outputs: Optional[StructuredOutputsParams] = None
    guided_decoding: Optional[StructuredOutputsParams] = None  # vLLM's older name: moved to structured_outputs
    # Set by the input processor from the tokenizer / generation config, not by users.
    eos_token_id: Optional[int] = None
    bad_words_token_ids: Optional[list[list[int]]] = None  # bad_words, tokenized

    def __post_init__(self) -> None:
        self._validate()
        if _SAMPLING_EPS <= self.temperature < _MIN_TEMPERATURE:
            logger.warning("temperature %s is below %s, which overflows the softmax: raised to %s",
                           self.temperature, _MIN_TEMPERATURE, _MIN_TEMPERATURE)
            _set_field(self, "temperature", _MIN_TEMPERATURE)
        if self.temperature < _SAMPLING_EPS:
            # Greedy: the other truncation knobs are meaningless, and n copies would be equal.
            # (Each is set only if it is not that value, of that type and sign, already.)
            if type(self.top_p) is not float or self.top_p != 1.0:
                _set_field(self, "top_p", 1.0)
            if type(self.top_k) is not int or self.top_k != 0:
                _set_field(self, "top_k", 0)
            if type(self.min_p) is not float or self.min_p != 0.0 or math.copysign(1.0, self.min_p) < 0:
                _set_field(self, "min_p", 0.0)
            self._check_greedy_n()

    def __setattr__(self, name: str, value: Any) -> None:
        """Sets a field, then validates everything again; an invalid value is not kept."""
        old = getattr(self, name)
        _set_field(self, name, value)
        try:
            self._validate()
            if self.temperature < _SAMPLING_EPS:
                self._check_greedy_n()
        except BaseException:
            _set_field(self, name, old)
            raise

    def _validate(self) -> None:
        """Normalizes and checks every field (on construction and on every assignment)."""
        self._normalize()
        self._verify()
        self._verify_v1_fields()

    def _check_greedy_n(self) -> None:
        if self.n > 1:
            raise ValueError(f"n must be 1 when using greedy sampling (temperature=0), got n={self.n}.")

    @staticmethod
    def from_optional(**kwargs: Any) -> "SamplingParams":
        """vLLM's constructor for values that may be None (None: the default). logit_bias keys may
        be strings of token ids, and its values are clamped to [-100, 100]."""
        defaults = {"n": 1, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
                    "temperature": 1.0, "top_p": 1.0}
        values = {k: (defaults[k] if v is None and k in defaults else v) for k, v in kwargs.items()}
        bias = values.get("logit_bias")
        if bias is not None:
            try:
                values["logit_bias"] = {int(t): min(100.0, max(-100.0, float(b))) for t, b in bias.items()}
            except (TypeError, ValueError, AttributeError):
                raise ValueError(f"logit_bias must map token ids to numbers, got {bias!r}.") from None
        return SamplingParams(**values)

    def _verify_v1_fields(self) -> None:
        """Checks of the fields vLLM's v1 API added; what needs the model (vocabulary, max_logprobs)
        is checked by the input processor."""
        if self.truncate_prompt_tokens is not None:
            _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens)
            if self.truncate_prompt_tokens < 1 and self.truncate_prompt_tokens != -1:
                raise ValueError(f"truncate_prompt_tokens must be an int >= 1 or -1, got {self.truncate_prompt_tokens}.")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ParameterTypeError(f"logit_bias must be a dict of token id -> float, got {self.logit_bias!r}.")
            for token, bias in self.logit_bias.items():
                _check_int("logit_bias token id", token)
                _check_number(f"logit_bias[{token}]", bias)
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in self.allowed_token_ids
            ):
                raise ParameterTypeError(f"allowed_token_ids must be a list of int, got {self.allowed_token_ids!r}.")
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids is empty: no token could be sampled.")
        if self.bad_words is not None:
            if not isinstance(self.bad_words, list) or not all(isinstance(w, str) for w in self.bad_words):
                raise ParameterTypeError(f"bad_words must be a list of str, got {self.bad_words!r}.")
            if any(not w.strip() for w in self.bad_words):
                raise ValueError(f"bad_words cannot contain an empty string, got {self.bad_words!r}.")
            _set_field(self, "bad_words", list(dict.fromkeys(self.bad_words)))
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise ParameterTypeError(f"extra_args must be a dict, got {self.extra_args!r}.")
        if not isinstance(self.flat_logprobs, bool):
            raise ParameterTypeError(f"flat_logprobs must be a bool, got {self.flat_logprobs!r}.")

    def _normalize(self) -> None:
        if self.seed == -1:  # vLLM: -1 means no seed
            _set_field(self, "seed", None)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is True:  # vLLM: True means 1
                _set_field(self, name, 1)
        if self.guided_decoding is not None:
            if self.structured_outputs is not None and self.structured_outputs != self.guided_decoding:
                raise ValueError(
                    "structured_outputs and guided_decoding (its older name) are both set, to different values: "
                    f"{self.structured_outputs!r} and {self.guided_decoding!r}."
                )
            _set_field(self, "structured_outputs", self.guided_decoding)
            _set_field(self, "guided_decoding", None)
        if isinstance(self.stop, str):
            _set_field(self, "stop", [self.stop])
        elif isinstance(self.stop, tuple):
            _set_field(self, "stop", list(self.stop))
        if self.stop is None:
            _set_field(self, "stop", [])
        if self.stop_token_ids is None:
            _set_field(self, "stop_token_ids", [])
        if isinstance(self.output_kind, int) and not isinstance(self.output_kind, (bool, RequestOutputKind)):
            if self.output_kind not in set(RequestOutputKind):
                raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}.")
            _set_field(self, "output_kind", RequestOutputKind(self.output_kind))

    def _verify(self) -> None:
        _check_int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        if self.n > max_n_sequences():
            raise ValueError(f"n must be at most {max_n_sequences()} (${MAX_N_SEQUENCES_ENV}), got {self.n}.")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_number(name, value)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}.")
        _check_number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.")
        _check_number("temperature", self.temperature)
        if not 0.0 <= self.temperature <= _MAX_TEMPERATURE:
            raise ValueError(f"temperature must be in [0, {_MAX_TEMPERATURE}], got {self.temperature}.")
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be 0 or -1 (disable), or at least 1, got {self.top_k}.")
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
                if value < -1:
                    raise ValueError(f"{name} must be non-negative, or -1 (the whole vocabulary), got {value}.")
        stop, stop_token_ids = self.stop, self.stop_token_ids
        if not isinstance(stop, list) or (stop and not all(isinstance(s, str) for s in stop)):
            raise ParameterTypeError(f"stop must be a str or a list of str, got {stop!r}.")
        if stop and any(s == "" for s in stop):
            raise ValueError(f"stop cannot contain an empty string, got {stop!r}.")
        if not isinstance(stop_token_ids, list) or (
            stop_token_ids and not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_token_ids)
        ):
            raise ParameterTypeError(f"stop_token_ids must be a list of int, got {stop_token_ids!r}.")
        if stop_token_ids and any(not 0 <= t <= INT64_MAX for t in stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative 64-bit ints, got {stop_token_ids!r}.")
        if not (type(self.ignore_eos) is type(self.detokenize) is type(self.skip_special_tokens) is bool
                and type(self.spaces_between_special_tokens) is type(self.include_stop_str_in_output) is bool):
            for name in ("ignore_eos", "detokenize", "skip_special_tokens", "spaces_between_special_tokens",
                         "include_stop_str_in_output"):
                if not isinstance(getattr(self, name), bool):
                    raise ParameterTypeError(f"{name} must be a bool, got {getattr(self, name)!r}.")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ParameterTypeError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}.")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ParameterTypeError(
                f"structured_outputs must be a StructuredOutputsParams, got {self.structured_outputs!r}."
            )
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
    def argmax_decides(self) -> bool:
        """Whether the argmax of the raw logits alone picks each token (min_tokens' stop-token
        mask aside): greedy, with no logprobs, grammar, allowed tokens, logit bias, penalties or
        bad words. What a decode burst and the engine's first requests before torch compute."""
        return (
            self.sampling_type == SamplingType.GREEDY and self.logprobs is None and self.structured_outputs is None
            and not self.allowed_token_ids and not self.logit_bias and not self.bad_words_token_ids
            and self.repetition_penalty == 1.0 and self.presence_penalty == 0.0 and self.frequency_penalty == 0.0
        )

    @property
    def all_stop_token_ids(self) -> set[int]:
        """Token ids that finish the request: stop_token_ids, plus EOS unless ignore_eos."""
        ids = set(self.stop_token_ids or ())
        if self.eos_token_id is not None and not self.ignore_eos:
            ids.add(self.eos_token_id)
        return ids

    def clone(self) -> "SamplingParams":
        """A copy that shares no mutable state (lists, dicts) with this one."""
        return copy.deepcopy(self)


class BeamSearchParams(msgspec.Struct, omit_defaults=True, kw_only=True):  # type: ignore[call-arg]
    """`LLM.beam_search`'s parameters, vLLM's: keep beam_width beams for up to max_tokens tokens,
    ranked by cumulative logprob / length ** length_penalty."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            _check_int(name, getattr(self, name))
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}.")
        for name in ("temperature", "length_penalty"):
            _check_number(name, getattr(self, name))
        if not 0.0 <= self.temperature <= _MAX_TEMPERATURE:
            raise ValueError(f"temperature must be in [0, {_MAX_TEMPERATURE}], got {self.temperature}.")


def _check_int(name: str, value: object) -> None:
    if type(value) is int and INT64_MIN <= value <= INT64_MAX:  # the common case, in two comparisons
        return
    if not isinstance(value, int) or isinstance(value, bool):
        raise ParameterTypeError(f"{name} must be an int, got {value!r} ({type(value).__name__}).")
    if not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(f"{name} must fit in 64 bits ([{INT64_MIN}, {INT64_MAX}]), got {value}.")


def _check_number(name: str, value: object) -> None:
    if (type(value) is float or type(value) is int) and -_FLOAT_MAX <= value <= _FLOAT_MAX:  # finite (NaN fails)
        return
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ParameterTypeError(f"{name} must be a number, got {value!r} ({type(value).__name__}).")
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an int beyond every float
        finite = False
    if not finite:
        raise ValueError(f"{name} must be a finite number, got {value!r}.")
