"""The msgspec Structs that cross the frontend/engine process boundary.

Everything the frontend and the engine say to each other is one of these. Bulk numbers travel
as raw little-endian bytes (int32 token ids, float32 logprobs and embeddings), never as lists
of Python floats, so that encoding and decoding stay O(1) Python objects per message.

Frontend -> engine: `EngineCoreRequestMsg` (a tagged union; the tag is an
`EngineCoreRequestType`). Engine -> frontend: `EngineCoreOutputs`.
"""

from __future__ import annotations

import enum
import time
from typing import Any, Optional, Union

import msgspec
import numpy as np

from shmvllm.pooling_params import PoolingParams
from shmvllm.sampling_params import SamplingParams


class EngineCoreRequestType(enum.IntEnum):
    ADD = 0
    ABORT = 1
    UTILITY = 2
    SHUTDOWN = 3


class FinishReason(enum.IntEnum):
    """Why a request finished; `str()` gives vLLM's strings ("stop", "length", ...)."""

    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3

    def __str__(self) -> str:
        return self.name.lower()


class EngineCoreRequest(
    msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=int(EngineCoreRequestType.ADD)
):  # type: ignore[call-arg]
    """ADD: one request. `prompt_token_ids` is raw int32 little-endian bytes."""

    request_id: str
    prompt_token_ids: bytes
    sampling_params: Optional[SamplingParams] = None
    pooling_params: Optional[PoolingParams] = None
    arrival_time: float = 0.0
    priority: int = 0

    @property
    def prompt_token_ids_list(self) -> list[int]:
        return np.frombuffer(self.prompt_token_ids, dtype="<i4").tolist()

    @staticmethod
    def pack_token_ids(token_ids: "list[int] | np.ndarray") -> bytes:
        return np.asarray(token_ids, dtype="<i4").tobytes()


class EngineCoreAbort(
    msgspec.Struct, array_like=True, gc=False, tag=int(EngineCoreRequestType.ABORT)
):  # type: ignore[call-arg]
    """ABORT: stop these requests and free what they hold."""

    request_ids: list[str]


class EngineCoreUtility(
    msgspec.Struct, array_like=True, gc=False, tag=int(EngineCoreRequestType.UTILITY)
):  # type: ignore[call-arg]
    """UTILITY: call `EngineCore.<method>(*args)`; the answer comes back as a `UtilityOutput`."""

    call_id: int
    method: str
    args: list[Any] = []


class EngineCoreShutdown(
    msgspec.Struct, array_like=True, gc=False, tag=int(EngineCoreRequestType.SHUTDOWN)
):  # type: ignore[call-arg]
    """SHUTDOWN: finish the busy loop and exit cleanly."""


EngineCoreRequestMsg = Union[EngineCoreRequest, EngineCoreAbort, EngineCoreUtility, EngineCoreShutdown]


class Logprobs(msgspec.Struct, array_like=True, gc=False):  # type: ignore[call-arg]
    """Logprobs of `num_rows` positions, as raw little-endian arrays.

    token_ids: int32 [num_rows, width]; column 0 is the sampled (or, for prompt logprobs, the
    actual next prompt) token, columns 1.. the top-k tokens by logprob.
    logprobs: float32 [num_rows, width], matching token_ids.
    ranks: int32 [num_rows], the rank (1 = most likely) of column 0's token.
    """

    num_rows: int
    width: int
    token_ids: bytes
    logprobs: bytes
    ranks: bytes

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        ids = np.frombuffer(self.token_ids, dtype="<i4").reshape(self.num_rows, self.width)
        lps = np.frombuffer(self.logprobs, dtype="<f4").reshape(self.num_rows, self.width)
        ranks = np.frombuffer(self.ranks, dtype="<i4")
        return ids, lps, ranks

    @classmethod
    def from_arrays(cls, token_ids: np.ndarray, logprobs: np.ndarray, ranks: np.ndarray) -> "Logprobs":
        rows, width = token_ids.shape
        return cls(
            num_rows=rows,
            width=width,
            token_ids=np.ascontiguousarray(token_ids, dtype="<i4").tobytes(),
            logprobs=np.ascontiguousarray(logprobs, dtype="<f4").tobytes(),
            ranks=np.ascontiguousarray(ranks, dtype="<i4").tobytes(),
        )


class EngineCoreOutput(
    msgspec.Struct, array_like=True, omit_defaults=True, gc=False
):  # type: ignore[call-arg]
    """What one request produced in one engine step.

    new_logprobs: one row per new token, when the request asked for logprobs.
    new_prompt_logprobs: rows for the prompt positions computed in this step (prefill may be
    chunked, so they can arrive in pieces); the first prompt token has no row.
    pooling_output: float32 little-endian bytes of the pooled vector (embedding requests).
    stop_reason: the stop token id that finished the request, if one did.
    error: set with finish_reason ERROR when the engine could not serve this request.
    """

    request_id: str
    new_token_ids: list[int] = []
    new_logprobs: Optional[Logprobs] = None
    new_prompt_logprobs: Optional[Logprobs] = None
    finish_reason: Optional[FinishReason] = None
    stop_reason: Union[int, str, None] = None
    pooling_output: Optional[bytes] = None
    num_cached_tokens: int = 0
    error: Optional[str] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class UtilityOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    """The answer to an `EngineCoreUtility` call: its result, or the failure's text."""

    call_id: int
    result: Any = None
    failure_message: Optional[str] = None


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    """Everything one engine step (or one utility call, or a READY) sends to the frontend."""

    engine_index: int = 0
    outputs: list[EngineCoreOutput] = []
    finished_requests: Optional[list[str]] = None
    utility_output: Optional[UtilityOutput] = None
    scheduler_stats: Optional[SchedulerStats] = None
    timestamp: float = 0.0


class EngineReady(msgspec.Struct, array_like=True, gc=False):  # type: ignore[call-arg]
    """The engine's first message on the output ring: it is loaded and serving, with these
    limits (the frontend validates requests against them)."""

    num_kv_blocks: int
    block_size: int
    max_concurrency: float
    max_model_len: int
    vocab_size: int
    max_logprobs: int  # resolved: never -1, never above vocab_size


def now() -> float:
    return time.monotonic()
