"""PoolingParams: how an embedding request's hidden states become its output vector."""

from __future__ import annotations

from typing import Optional

import msgspec

from shmvllm.sampling_params import ParameterTypeError

# The pooling tasks shmvllm's models serve ("encode": vLLM's older name of the same pooled vector).
POOLING_TASKS = ("embed", "encode")


class PoolingParams(
    msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True
):  # type: ignore[call-arg]
    """normalize: L2-normalize the pooled vector (None: the model's default).
    dimensions: keep only the first `dimensions` values (Matryoshka truncation), renormalized
    when normalize is on.

    Invalid values raise ValueError naming the field; a wrong type raises ParameterTypeError
    (both a TypeError and a ValueError), as SamplingParams does.
    """

    normalize: Optional[bool] = None
    dimensions: Optional[int] = None
    # vLLM's: the pooling task ("embed"; set by LLM.encode's pooling_task), and the prompt
    # truncation (keep the last k tokens; -1: max_model_len).
    task: Optional[str] = None
    truncate_prompt_tokens: Optional[int] = None

    def __post_init__(self) -> None:
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"task={self.task!r} is not supported: shmvllm's pooling models do {list(POOLING_TASKS)}.")
        if self.truncate_prompt_tokens is not None and (
            not isinstance(self.truncate_prompt_tokens, int) or isinstance(self.truncate_prompt_tokens, bool)
            or (self.truncate_prompt_tokens < 1 and self.truncate_prompt_tokens != -1)
        ):
            raise ValueError(f"truncate_prompt_tokens must be an int >= 1 or -1, got {self.truncate_prompt_tokens!r}.")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ParameterTypeError(f"normalize must be a bool or None, got {self.normalize!r}.")
        if self.dimensions is not None:
            if not isinstance(self.dimensions, int) or isinstance(self.dimensions, bool):
                raise ParameterTypeError(f"dimensions must be an int, got {self.dimensions!r}.")
            if self.dimensions < 1:
                raise ValueError(f"dimensions must be at least 1, got {self.dimensions}.")

    def clone(self) -> "PoolingParams":
        return msgspec.structs.replace(self)

    def verify(self, hidden_size: int) -> None:
        """Checks against the model, once it is known."""
        if self.dimensions is not None and self.dimensions > hidden_size:
            raise ValueError(
                f"dimensions must be at most the model's embedding size {hidden_size}, got {self.dimensions}."
            )
