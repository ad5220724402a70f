"""Request: the engine's state of one request, from arrival to finish."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Optional

from shmvllm.boundary.messages import EngineCoreRequest, FinishReason
from shmvllm.pooling_params import PoolingParams
from shmvllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from shmvllm.structured_output.request import StructuredOutputRequest


class RequestStatus(enum.IntEnum):
    """Where a request is. Every status from FINISHED_STOPPED on is final. WAITING_FOR_FSM: its
    structured-output grammar is still compiling."""

    WAITING = 0
    WAITING_FOR_FSM = 1
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH_CAPPED = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status >= RequestStatus.FINISHED_STOPPED

    @staticmethod
    def get_finish_reason(status: "RequestStatus") -> Optional[FinishReason]:
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class Request:
    """One request's tokens and progress.

    all_token_ids is the prompt followed by the outputs; num_computed_tokens counts the leading
    tokens whose KV is in the cache (or is being written in the step just scheduled).
    block_hashes holds the chained hashes of the request's full blocks, grown lazily by the KV
    cache manager; tokens are only ever appended, so a computed hash stays valid.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: Optional[SamplingParams] = None,
        pooling_params: Optional[PoolingParams] = None,
        arrival_time: float = 0.0,
        priority: int = 0,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.pooling_params = pooling_params
        self.arrival_time = arrival_time
        self.priority = priority
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # set when first scheduled: the prefix-cache hit, in tokens
        self.num_preemptions = 0
        self.stop_reason: Optional[int] = None
        self.block_hashes: list[bytes] = []
        self.num_output_placeholders = 0  # async scheduling: tokens of steps in flight, not yet known
        self.sched_key: tuple[int, int] = (0, 0)  # set by the scheduler: its policy's order
        self.structured_output_request: Optional["StructuredOutputRequest"] = None  # set by the scheduler

    @classmethod
    def from_engine_core_request(cls, req: EngineCoreRequest) -> "Request":
        return cls(
            request_id=req.request_id,
            prompt_token_ids=ids if isinstance(ids := req.prompt_token_ids, list) else ids.tolist(),
            sampling_params=req.sampling_params,
            pooling_params=req.pooling_params,
            arrival_time=req.arrival_time,
            priority=req.priority,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_pooling(self) -> bool:
        return self.pooling_params is not None

    @property
    def use_prefix_cache(self) -> bool:
        """Pooling and prompt_logprobs need every prompt position's hidden state, so they cannot
        skip a cached prefix."""
        if self.is_pooling:
            return False
        return self.sampling_params is None or self.sampling_params.prompt_logprobs is None

    @property
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finish_reason(self) -> Optional[FinishReason]:
        return RequestStatus.get_finish_reason(self.status)

    def append_output_token_ids(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
