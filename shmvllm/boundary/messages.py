"""Every message that crosses the frontend/engine process boundary, and their one codec.

Frontend -> engine (`ToEngine`, tagged): `EngineCoreRequest` (ADD), `EngineCoreAbort`,
`EngineCoreUtility`, `EngineCoreShutdown`. Engine -> frontend (`FromEngine`, tagged):
`EngineReady` once (the engine's real limits), then `EngineCoreOutputs` (a step's outputs, or a
utility call's answer), or `EngineFailed` (why it could not start, or why it stopped serving).

Bulk numbers are numpy arrays in the messages (prompt token ids, logprobs, pooled vectors): the
codec carries each as one msgpack extension (dtype, shape, raw little-endian bytes), so that
encoding and decoding stay O(1) Python objects per array and nobody above the codec builds or
parses bytes. The scheduler and the model runner hand over these types and arrays as they are;
`shmvllm.core` and `shmvllm.worker` import this module, never `shmvllm.engine`.
"""

from __future__ import annotations

import enum
import itertools
import re
import struct
import sys
import time
import typing
from typing import Annotated, Any, Iterator, Literal, Optional, Union

import msgspec
import numpy as np
from msgspec import Meta

from shmvllm.pooling_params import PoolingParams
from shmvllm.sampling_params import INT64_MAX, INT64_MIN, RequestOutputKind, SamplingParams, StructuredOutputsParams


class FinishReason(enum.IntEnum):
    """Why a request finished; `str()` gives vLLM's strings ("stop", "length", ...)."""

    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3

    def __str__(self) -> str:
        return self.name.lower()


_STRUCT = dict(array_like=True, omit_defaults=True, gc=False)

# ---- frontend -> engine ------------------------------------------------------------------

# Each field's own bounds, as SamplingParams' checks have them, for msgspec to check in C.
_Int64 = Annotated[int, Meta(ge=INT64_MIN, le=INT64_MAX)]
_Count = Annotated[int, Meta(ge=0, le=INT64_MAX)]
_Finite = Annotated[float, Meta(ge=-sys.float_info.max, le=sys.float_info.max)]
_Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
_Logprobs = Annotated[int, Meta(ge=-1, le=INT64_MAX)]
_Text = Annotated[str, Meta(min_length=1)]


class WireSamplingParams(SamplingParams, kw_only=True):  # type: ignore[call-arg]
    """SamplingParams as the engine decodes them. The frontend validated and normalized them
    when they were built (and at every assignment), so decoding runs none of that Python again:
    each field's own bounds are declared here instead, and msgspec checks them in C as it reads
    the bytes, so no value outside them (n = 0, a NaN temperature, a negative token id) reaches
    the engine. Rules between fields (min_tokens <= max_tokens, stop strings need detokenize,
    greedy means n = 1, n at most $SHMVLLM_MAX_N_SEQUENCES) stay the frontend's.
    tests/test_boundary.py checks these bounds against SamplingParams' own checks."""

    n: Annotated[int, Meta(ge=1, le=INT64_MAX)] = 1
    presence_penalty: _Penalty = 0.0
    frequency_penalty: _Penalty = 0.0
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=sys.float_info.max)] = 1.0
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Meta(ge=-1, le=INT64_MAX)] = 0
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    seed: Optional[_Int64] = None
    stop: Optional[list[_Text]] = None
    stop_token_ids: Optional[list[_Count]] = None
    max_tokens: Optional[Annotated[int, Meta(ge=1, le=INT64_MAX)]] = 16
    min_tokens: _Count = 0
    logprobs: Optional[_Logprobs] = None
    prompt_logprobs: Optional[_Logprobs] = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    truncate_prompt_tokens: Optional[Annotated[int, Meta(ge=-1, le=INT64_MAX)]] = None
    logit_bias: Optional[dict[_Int64, _Finite]] = None
    allowed_token_ids: Optional[Annotated[list[_Int64], Meta(min_length=1)]] = None
    bad_words: Optional[list[_Text]] = None
    extra_args: Optional[dict[str, Any]] = None
    structured_outputs: Optional[StructuredOutputsParams] = None
    guided_decoding: Optional[StructuredOutputsParams] = None
    eos_token_id: Optional[_Int64] = None
    bad_words_token_ids: Optional[list[list[_Int64]]] = None

    def __post_init__(self) -> None:
        """Nothing: see the class docstring (msgspec needs a callable here to skip the parent's)."""


class EngineCoreRequest(msgspec.Struct, tag=0, **_STRUCT):  # type: ignore[call-arg]
    """ADD: one request. `prompt_token_ids` is an int32 array."""

    request_id: str
    prompt_token_ids: np.ndarray
    sampling_params: Optional[WireSamplingParams] = None  # built from a SamplingParams; decoded as this
    pooling_params: Optional[PoolingParams] = None
    arrival_time: float = 0.0
    priority: int = 0

    @staticmethod
    def pack_token_ids(token_ids: "list[int] | np.ndarray") -> np.ndarray:
        return np.asarray(token_ids, dtype="<i4")


class EngineCoreAbort(msgspec.Struct, tag=1, **_STRUCT):  # type: ignore[call-arg]
    """ABORT: stop these requests and free what they hold."""

    request_ids: list[str]


class EngineCoreUtility(msgspec.Struct, tag=2, **_STRUCT):  # type: ignore[call-arg]
    """UTILITY: call `EngineCore.<method>(*args)`; the answer comes back as a `UtilityOutput`."""

    call_id: int
    method: str
    args: list[Any] = []


class EngineCoreShutdown(msgspec.Struct, tag=3, **_STRUCT):  # type: ignore[call-arg]
    """SHUTDOWN: finish the busy loop and exit cleanly."""


ToEngine = Union[EngineCoreRequest, EngineCoreAbort, EngineCoreUtility, EngineCoreShutdown]

# ---- engine -> frontend ------------------------------------------------------------------


class Logprobs(msgspec.Struct, **_STRUCT):  # type: ignore[call-arg]
    """Logprobs of some positions, as arrays (what the runner computes, as the frontend reads it).

    token_ids: int32 [rows, width]; column 0 is the sampled (or, for prompt logprobs, the
    actual next prompt) token, columns 1.. the top-k tokens by logprob.
    logprobs: float32 [rows, width], matching token_ids.
    ranks: int32 [rows], the rank (1 = most likely) of column 0's token.
    """

    token_ids: np.ndarray
    logprobs: np.ndarray
    ranks: np.ndarray

    @property
    def num_rows(self) -> int:
        return self.token_ids.shape[0]

    @property
    def width(self) -> int:
        return self.token_ids.shape[1]

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.token_ids, self.logprobs, self.ranks

    @classmethod
    def from_arrays(cls, token_ids: np.ndarray, logprobs: np.ndarray, ranks: np.ndarray) -> "Logprobs":
        return cls(
            np.ascontiguousarray(token_ids, dtype="<i4"),
            np.ascontiguousarray(logprobs, dtype="<f4"),
            np.ascontiguousarray(ranks, dtype="<i4"),
        )


class EngineCoreOutput(msgspec.Struct, **_STRUCT):  # type: ignore[call-arg]
    """What one request produced in one engine step.

    new_logprobs: one row per new token, when the request asked for logprobs.
    new_prompt_logprobs: rows for the prompt positions computed in this step (prefill may be
    chunked, so they can arrive in pieces); the first prompt token has no row.
    pooling_output: the pooled vector (float32) of an embedding request.
    stop_reason: the stop token id that finished the request, if one did.
    error: set with finish_reason ERROR when the engine could not serve this request.
    """

    request_id: str
    new_token_ids: list[int] = []
    new_logprobs: Optional[Logprobs] = None
    new_prompt_logprobs: Optional[Logprobs] = None
    finish_reason: Optional[FinishReason] = None
    stop_reason: Union[int, str, None] = None
    pooling_output: Optional[np.ndarray] = None
    num_cached_tokens: int = 0
    error: Optional[str] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class UtilityOutput(msgspec.Struct, **_STRUCT):  # type: ignore[call-arg]
    """The answer to an `EngineCoreUtility` call: its result, or the failure's text."""

    call_id: int
    result: Any = None
    failure_message: Optional[str] = None


class SchedulerStats(msgspec.Struct, **_STRUCT):  # type: ignore[call-arg]
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0


class EngineCoreOutputs(msgspec.Struct, tag=0, **_STRUCT):  # type: ignore[call-arg]
    """Everything one engine step (or one utility call) sends to the frontend.

    A step's outputs come in two forms, each request in one of them at most once. A request that
    only got new tokens (no logprobs, not finished, not its first tokens) is a row of the columns:
    `token_req_ids[i]` got `token_ids[i]`, or, once some request got other than one token (spec
    decoding), the next `token_counts[i]` of `token_ids`. Every other output is an
    `EngineCoreOutput` in `outputs`. The columns are the common case of a decode step, and they
    decode into three lists instead of a struct, a string and a list per request (out64 in
    benchmarks/results/ipc_messages.md).
    """

    engine_index: int = 0
    outputs: list[EngineCoreOutput] = []
    finished_requests: Optional[list[str]] = None
    utility_output: Optional[UtilityOutput] = None
    scheduler_stats: Optional[SchedulerStats] = None
    timestamp: float = 0.0
    token_req_ids: list[str] = []
    token_ids: list[int] = []
    token_counts: Optional[list[int]] = None

    def add_tokens(self, request_id: str, token_ids: list[int]) -> None:
        """Adds a row to the columns: `request_id` got `token_ids` (at least one) and nothing else."""
        counts = self.token_counts
        if counts is None and len(token_ids) != 1:
            counts = self.token_counts = [1] * len(self.token_req_ids)
        if counts is not None:
            counts.append(len(token_ids))
        self.token_req_ids.append(request_id)
        self.token_ids.extend(token_ids)

    def new_tokens(self) -> Iterator[tuple[str, list[int]]]:
        """(request id, its new token ids) for each row of the columns. ValueError if the
        columns' lengths disagree (a message no engine makes)."""
        ids, tokens, counts = self.token_req_ids, self.token_ids, self.token_counts
        if counts is None:
            if len(tokens) != len(ids):
                raise ValueError(f"EngineCoreOutputs has {len(tokens)} token_ids for {len(ids)} token_req_ids")
            return zip(ids, ([token] for token in tokens))
        if len(counts) != len(ids) or sum(counts) != len(tokens) or min(counts, default=1) < 1:
            raise ValueError(
                f"EngineCoreOutputs has token_counts {counts} for {len(ids)} token_req_ids and {len(tokens)} token_ids"
            )
        ends = itertools.accumulate(counts)
        return zip(ids, (tokens[end - count : end] for end, count in zip(ends, counts)))

    @property
    def num_outputs(self) -> int:
        """How many requests have an output in this message."""
        return len(self.outputs) + len(self.token_req_ids)

    def all_outputs(self) -> list[EngineCoreOutput]:
        """Every request's output as an `EngineCoreOutput`, the columns' rows after `outputs`
        (for readers that want one shape; the output processor reads the columns as they are)."""
        return self.outputs + [EngineCoreOutput(request_id, ids) for request_id, ids in self.new_tokens()]


class EngineReady(msgspec.Struct, tag=1, **_STRUCT):  # type: ignore[call-arg]
    """The engine's first message: it serves with these limits (the frontend validates every
    request against them), now or once its model is loaded (requests wait in its ring meanwhile).

    max_model_len: the configured one, clamped to what the KV cache holds.
    max_concurrency: how many requests of max_model_len tokens the KV cache holds at once.
    max_logprobs: resolved: never -1, never above vocab_size.
    """

    num_kv_blocks: int
    block_size: int
    max_concurrency: float
    max_model_len: int
    vocab_size: int
    max_logprobs: int


class EngineFailed(msgspec.Struct, tag=2, **_STRUCT):  # type: ignore[call-arg]
    """The engine's last message: it could not start ("startup", instead of READY) or its busy
    loop failed ("serving"); `traceback` is the engine's own, `error` the failure's type and
    message ("ValueError: ...") for the first line of the frontend's error."""

    stage: Literal["startup", "serving"]
    traceback: str
    error: str = ""


FromEngine = Union[EngineCoreOutputs, EngineReady, EngineFailed]

# ---- the codec ---------------------------------------------------------------------------

_NDARRAY_EXT = 1
_ARRAY_HEAD = struct.Struct("<4sB")  # dtype (numpy's str, e.g. "<i4", padded), ndim; then ndim uint32 dims


def _encode_ext(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        array = np.ascontiguousarray(obj)
        if array.dtype.byteorder == ">" or array.dtype.kind not in "iuf" or array.dtype.itemsize > 8:
            raise TypeError(f"the codec carries little-endian int/float arrays, got dtype {array.dtype}")
        head = _ARRAY_HEAD.pack(array.dtype.str.encode(), array.ndim) + struct.pack(f"<{array.ndim}I", *array.shape)
        return msgspec.msgpack.Ext(_NDARRAY_EXT, head + array.tobytes())
    raise NotImplementedError(f"the boundary codec cannot encode a {type(obj).__name__}")


def _decode_ext(code: int, data: memoryview) -> Any:
    """A writable array of its own (the engine's side: the scheduler may change what it got)."""
    return _array_from_ext(code, data, bytearray)


def _decode_ext_view(code: int, data: memoryview) -> Any:
    """A read-only array (the frontend's side: `numpy()` of an embedding hands this out as is)."""
    return _array_from_ext(code, data, bytes)


_DTYPES: dict[bytes, np.dtype] = {}  # the head's dtype field -> numpy's dtype, parsed once
_DIMS = [struct.Struct(f"<{ndim}I") for ndim in range(33)]  # numpy's most dimensions: 32


def _array_from_ext(code: int, data: memoryview, copy: type) -> Any:
    """The array over one copy of its bytes, made by `copy` (bytearray: writable, bytes: read-only):
    `data` may be the ring's memory, which the next message overwrites. A head that does not
    describe the bytes that follow is a ValidationError (the message is refused, not the loop)."""
    if code != _NDARRAY_EXT:
        raise msgspec.ValidationError(f"unknown msgpack extension type {code}")
    try:
        code, ndim = _ARRAY_HEAD.unpack_from(data)
        dtype = _DTYPES.get(code)
        if dtype is None:
            dtype = _DTYPES.setdefault(code, np.dtype(code.rstrip(b"\0").decode()))
        shape = _DIMS[ndim].unpack_from(data, _ARRAY_HEAD.size)
        array = np.frombuffer(copy(data[_ARRAY_HEAD.size + 4 * ndim :]), dtype)
        return array if ndim == 1 and len(array) == shape[0] else array.reshape(shape)
    except (struct.error, ValueError, TypeError, IndexError) as exc:
        raise msgspec.ValidationError(f"malformed array: {exc}") from None


def make_encoder() -> msgspec.msgpack.Encoder:
    """An encoder for either direction (one per sending endpoint: encoders are not thread-safe)."""
    return msgspec.msgpack.Encoder(enc_hook=_encode_ext)


_decode_to_engine = msgspec.msgpack.Decoder(ToEngine, ext_hook=_decode_ext).decode
_decode_raw = msgspec.msgpack.Decoder(ext_hook=_decode_ext).decode
decode_from_engine = msgspec.msgpack.Decoder(FromEngine, ext_hook=_decode_ext_view).decode


class UndecodableRequest(msgspec.Struct, gc=False):
    """A message the engine could not decode (a field its own validation refuses, say): an ADD
    whose request id could still be read finishes with ERROR; anything else is logged."""

    request_id: Optional[str]
    error: str


def decode_to_engine(buf: Any) -> Any:
    """The frontend's next message; an UndecodableRequest instead of an exception, so that one
    malformed message cannot stop the engine's busy loop."""
    try:
        return _decode_to_engine(buf)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        request_id = None
        where = ""
        try:
            raw = _decode_raw(buf)
            if isinstance(raw, list) and len(raw) > 1 and raw[0] == 0:  # ADD's tag
                request_id = raw[1] if isinstance(raw[1], str) else None
                where = _field_names(EngineCoreRequest, str(exc))
        except Exception:  # not even msgpack: nothing to answer
            pass
        return UndecodableRequest(request_id, f"the engine could not decode the request: {exc}{where}")


def _field_names(cls: type, error: str) -> str:
    """" (sampling_params.n)" for an error at `$[3][0]` of a `cls`: the fields an array-like
    struct's path of indices names (a tagged struct's element 0 is its tag); "" if none."""
    match = re.search(r"at `\$((?:\[\d+\])+)", error)
    names: list[str] = []
    for index in map(int, re.findall(r"\d+", match.group(1) if match else "")):
        if not (isinstance(cls, type) and issubclass(cls, msgspec.Struct)):
            names[-1] += f"[{index}]"
            continue
        fields = msgspec.structs.fields(cls)
        index -= cls.__struct_config__.tag is not None
        if not 0 <= index < len(fields):
            break
        names.append(fields[index].name)
        members = [t for t in typing.get_args(fields[index].type) if t is not type(None)] or [fields[index].type]
        cls = members[0] if len(members) == 1 else None
    return f" ({'.'.join(names)})" if names else ""


def now() -> float:
    return time.monotonic()
