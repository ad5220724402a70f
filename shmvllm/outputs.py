"""What `LLM.generate` / `LLM.embed` return, with vLLM's class and field names."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generic, Optional, TypeVar, Union

import numpy as np


@dataclass
class Logprob:
    """One token's log probability at one position, its rank (1 = most likely), and its text."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


# One dict per position: token id -> Logprob (the sampled/actual token and the top-k).
SampleLogprobs = list[dict[int, Logprob]]
# Prompt logprobs: None for the first prompt token, which has no preceding context.
PromptLogprobs = list[Optional[dict[int, Logprob]]]


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

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request: its prompt and its completions so far (or in this step, for DELTA).

    `error` is set (and each completion's finish_reason is "error") when the engine could not
    serve the request; the other requests of the same call are not affected.
    """

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: Optional[list[int]]
    prompt_logprobs: Optional[PromptLogprobs]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: Optional[int] = None
    error: Optional[str] = None


@dataclass
class PoolingOutput:
    """The pooled vector of one input. `data`: a float32 numpy array viewing the engine's output
    bytes (read-only, no copy) from the output processor; a torch tensor from `LLM.encode`."""

    data: Any


@dataclass
class EmbeddingOutput:
    """`embedding`: a read-only float32 numpy array (vLLM gives a list of floats: len, indexing,
    iteration and `.tolist()` work alike, without a Python float per value)."""

    embedding: Any

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


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
        data = base.outputs.data
        embedding = data.numpy() if hasattr(data, "numpy") else np.asarray(data, dtype=np.float32)
        return cls(
            request_id=base.request_id,
            outputs=EmbeddingOutput(embedding=embedding),
            prompt_token_ids=base.prompt_token_ids,
            finished=base.finished,
            prompt=base.prompt,
            num_cached_tokens=base.num_cached_tokens,
            error=base.error,
        )
