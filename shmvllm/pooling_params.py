"""PoolingParams: how an embedding request's hidden states become its output vector."""

from __future__ import annotations

from typing import Optional

import msgspec

from shmvllm.sampling_params import ParameterTypeError

# vLLM's pooling tasks that shmvllm's models serve ("encode": vLLM's older name of "embed"):
# embed and token_embed for embedding models, classify and score for classification heads.
POOLING_TASKS = ("embed", "encode", "classify", "score", "token_embed")
# extra_kwargs keys: the index of a cross-encoder pair's first second-segment token (its token
# type ids are 0 before it and 1 from it on), as vLLM carries BERT's token types.
EXTRA_KWARGS = ("compressed_token_type_ids",)


class PoolingParams(
    msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True
):  # type: ignore[call-arg]
    """normalize: L2-normalize the pooled vector (None: the model's default).
    dimensions: keep only the first `dimensions` values (Matryoshka truncation), renormalized
    when normalize is on.
    use_activation: for classify / score, apply the model's activation to the logits (softmax
    or sigmoid for classify, the cross-encoder's own for score); None: True. False: raw logits.

    Invalid values raise ValueError naming the field; a wrong type raises ParameterTypeError
    (both a TypeError and a ValueError), as SamplingParams does.
    """

    normalize: Optional[bool] = None
    dimensions: Optional[int] = None
    # vLLM's: the pooling task ("embed"; set by LLM.encode's pooling_task), and the prompt
    # truncation (keep the last k tokens; -1: max_model_len).
    task: Optional[str] = None
    truncate_prompt_tokens: Optional[int] = None
    use_activation: Optional[bool] = None
    extra_kwargs: Optional[dict[str, int]] = None

    def __post_init__(self) -> None:
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"task={self.task!r} is not supported: shmvllm's pooling models do {list(POOLING_TASKS)}.")
        if self.truncate_prompt_tokens is not None and (
            not isinstance(self.truncate_prompt_tokens, int) or isinstance(self.truncate_prompt_tokens, bool)
            or (self.truncate_prompt_tokens < 1 and self.truncate_prompt_tokens != -1)
        ):
            raise ValueError(f"truncate_prompt_tokens must be an int >= 1 or -1, got {self.truncate_prompt_tokens!r}.")
        for name in ("normalize", "use_activation"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ParameterTypeError(f"{name} must be a bool or None, got {value!r}.")
        if self.extra_kwargs is not None:
            unknown = sorted(set(self.extra_kwargs) - set(EXTRA_KWARGS)) if isinstance(self.extra_kwargs, dict) else None
            if unknown is None or unknown:
                raise ValueError(f"extra_kwargs keys {unknown if unknown else self.extra_kwargs!r} are not supported; supported: {list(EXTRA_KWARGS)}.")
            for key, value in self.extra_kwargs.items():
                if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                    raise ValueError(f"extra_kwargs[{key!r}] must be an int >= 0, got {value!r}.")
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
