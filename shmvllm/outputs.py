"""What `LLM.generate` / `LLM.embed` return, with vLLM's class and field names."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Generic, Optional, TypeVar, Union

import numpy as np

from shmvllm.logprobs import FlatLogprobs, Logprob, PromptLogprobs, SampleLogprobs

logger = logging.getLogger(__name__)

__all__ = [
    "CompletionOutput", "RequestOutput", "PoolingOutput", "EmbeddingOutput", "PoolingRequestOutput",
    "EmbeddingRequestOutput", "ClassificationOutput", "ClassificationRequestOutput", "ScoringOutput",
    "ScoringRequestOutput", "RequestStateStats", "Logprob", "FlatLogprobs", "SampleLogprobs", "PromptLogprobs",
]


@dataclass
class RequestStateStats:
    """When a request's tokens came, as the frontend saw them (`RequestOutput.metrics`); times are
    time.monotonic() seconds, like `arrival_time`."""

    arrival_time: float = 0.0
    first_token_ts: float = 0.0  # 0.0: no token yet
    last_token_ts: float = 0.0
    num_generation_tokens: int = 0

    @property
    def first_token_latency(self) -> float:
        """Seconds from arrival to the first token (time to first token)."""
        return self.first_token_ts - self.arrival_time if self.first_token_ts else 0.0


@dataclass
class CompletionOutput:
    """One completion of a request (a request with n > 1 has n of them, by `index`)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[SampleLogprobs]
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | "error"
    stop_reason: Union[int, str, None] = None  # the stop string or stop token id that ended it
    lora_request: None = None  # vLLM's field; shmvllm has no LoRA

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(init=False)
class RequestOutput:
    """The state of one request: its prompt and its completions so far (or in this step, for DELTA).

    `error` is set (and each completion's finish_reason is "error") when the engine could not
    serve the request; the other requests of the same call are not affected. Keyword arguments
    of later vLLM versions are accepted and dropped with a warning, as vLLM's own class does, so
    code written for a newer vLLM still builds one.
    """

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: Optional[list[int]]
    prompt_logprobs: Optional[PromptLogprobs]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: Optional[int] = None
    error: Optional[str] = None
    metrics: Optional[RequestStateStats] = None
    # vLLM's fields for what shmvllm does not do (LoRA, encoder-decoder models, KV transfer): None.
    lora_request: None = None
    encoder_prompt: None = None
    encoder_prompt_token_ids: None = None
    kv_transfer_params: None = None

    def __init__(
        self,
        request_id: str,
        prompt: Optional[str],
        prompt_token_ids: Optional[list[int]],
        prompt_logprobs: Optional[PromptLogprobs],
        outputs: list[CompletionOutput],
        finished: bool,
        num_cached_tokens: Optional[int] = None,
        error: Optional[str] = None,
        metrics: Optional[RequestStateStats] = None,
        lora_request: None = None,
        encoder_prompt: None = None,
        encoder_prompt_token_ids: None = None,
        kv_transfer_params: None = None,
        **unknown: Any,
    ) -> None:
        if unknown:
            logger.warning("RequestOutput: ignoring arguments this version does not know: %s", sorted(unknown))
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, prompt_token_ids
        self.prompt_logprobs, self.outputs, self.finished = prompt_logprobs, outputs, finished
        self.num_cached_tokens, self.error, self.metrics = num_cached_tokens, error, metrics
        self.lora_request, self.encoder_prompt = lora_request, encoder_prompt
        self.encoder_prompt_token_ids, self.kv_transfer_params = encoder_prompt_token_ids, kv_transfer_params


@dataclass
class PoolingOutput:
    """The pooled vector of one input. `data`: a float32 numpy array viewing the engine's output
    bytes (read-only, no copy) from the output processor; a torch tensor from `LLM.encode`."""

    data: Any


class EmbeddingOutput:
    """`embedding`: the vector as a list of floats, as vLLM gives it; `numpy()`: the same vector as
    a read-only float32 numpy array viewing the engine's output bytes (no copy, no Python float
    per value). The list is built on first access."""

    __slots__ = ("_array", "_list")

    def __init__(self, embedding: Any):
        if isinstance(embedding, np.ndarray):
            self._array, self._list = embedding, None
        else:
            self._array, self._list = None, list(embedding)

    @property
    def embedding(self) -> list[float]:
        if self._list is None:
            self._list = self._array.tolist()
        return self._list

    def numpy(self) -> np.ndarray:
        """The vector as a float32 array (zero-copy when it came from the engine)."""
        if self._array is None:
            self._array = np.asarray(self._list, dtype=np.float32)
        return self._array

    @property
    def hidden_size(self) -> int:
        return len(self._array) if self._array is not None else len(self._list)

    def __repr__(self) -> str:
        return f"EmbeddingOutput(hidden_size={self.hidden_size})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, EmbeddingOutput) and np.array_equal(self.numpy(), other.numpy())


_O = TypeVar("_O")


@dataclass
class PoolingRequestOutput(Generic[_O]):
    """The output of one pooling request: `outputs` is a PoolingOutput (or a typed view of one).

    `error` is set (and the vector empty) when the engine could not serve the request.
    """

    request_id: str
    outputs: _O
    prompt_token_ids: list[int]
    finished: bool
    prompt: Optional[str] = None
    num_cached_tokens: int = 0
    error: Optional[str] = field(default=None)


@dataclass
class EmbeddingRequestOutput(PoolingRequestOutput[EmbeddingOutput]):
    """A PoolingRequestOutput whose vector is an embedding."""

    @classmethod
    def from_base(cls, base: PoolingRequestOutput) -> "EmbeddingRequestOutput":
        return cls(**_fields_of(base, EmbeddingOutput(_as_array(base.outputs.data))))


@dataclass
class ClassificationOutput:
    """`probs`: the class probabilities of one input."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput(PoolingRequestOutput[ClassificationOutput]):
    @classmethod
    def from_base(cls, base: PoolingRequestOutput) -> "ClassificationRequestOutput":
        return cls(**_fields_of(base, ClassificationOutput(_as_array(base.outputs.data).tolist())))


@dataclass
class ScoringOutput:
    """`score`: the similarity of one pair (cosine of the two embeddings, for an embedding model)."""

    score: float


@dataclass
class ScoringRequestOutput(PoolingRequestOutput[ScoringOutput]):
    @classmethod
    def from_base(cls, base: PoolingRequestOutput) -> "ScoringRequestOutput":
        return cls(**_fields_of(base, ScoringOutput(float(_as_array(base.outputs.data).reshape(-1)[0]))))


def _as_array(data: Any) -> np.ndarray:
    return data.numpy() if hasattr(data, "numpy") else np.asarray(data, dtype=np.float32)


def _fields_of(base: PoolingRequestOutput, outputs: Any) -> dict[str, Any]:
    return {
        "request_id": base.request_id, "outputs": outputs, "prompt_token_ids": base.prompt_token_ids,
        "finished": base.finished, "prompt": base.prompt, "num_cached_tokens": base.num_cached_tokens,
        "error": base.error,
    }
