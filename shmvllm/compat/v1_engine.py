"""vLLM's `vllm.v1.engine` names that programs and vLLM's own tests build: `EngineCoreRequest`
with vLLM's fields, turned into shmvllm's wire message by `to_wire()`, and `FinishReason`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from shmvllm.boundary import messages
from shmvllm.boundary.messages import FinishReason
from shmvllm.pooling_params import PoolingParams
from shmvllm.sampling_params import SamplingParams


@dataclass
class EngineCoreRequest:
    """One request as vLLM's v1 engine takes it. The multimodal, LoRA and prompt-embedding fields
    exist for vLLM's constructor calls and must be None: shmvllm serves text-only models without
    adapters. cache_salt and data_parallel_rank are kept for programs that read them back."""

    request_id: str
    prompt_token_ids: Optional[list[int]]
    mm_features: Any
    sampling_params: Optional[SamplingParams]
    pooling_params: Optional[PoolingParams]
    arrival_time: float
    lora_request: Any
    cache_salt: Optional[str]
    data_parallel_rank: Optional[int]
    prompt_embeds: Any = None
    client_index: int = 0
    current_wave: int = 0
    priority: int = 0
    trace_headers: Optional[dict[str, str]] = None
    external_req_id: Optional[str] = None  # the id the caller gave, where request_id was made unique

    def __post_init__(self) -> None:
        for name in ("mm_features", "lora_request", "prompt_embeds"):
            if getattr(self, name) is not None:
                raise ValueError(f"EngineCoreRequest.{name} must be None: shmvllm serves text-only models "
                                 f"without LoRA adapters; got {getattr(self, name)!r}.")
        if (self.sampling_params is None) == (self.pooling_params is None):
            raise ValueError("EngineCoreRequest needs exactly one of sampling_params and pooling_params.")

    def to_wire(self) -> messages.EngineCoreRequest:
        """shmvllm's EngineCoreRequest for the engine's input channel."""
        return messages.EngineCoreRequest(
            request_id=self.request_id,
            prompt_token_ids=messages.EngineCoreRequest.pack_token_ids(self.prompt_token_ids or []),
            sampling_params=self.sampling_params,
            pooling_params=self.pooling_params,
            arrival_time=self.arrival_time,
            priority=self.priority,
        )


__all__ = ["EngineCoreRequest", "FinishReason"]
