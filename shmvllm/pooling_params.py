"""PoolingParams: how an embedding request's hidden states become its output vector."""

from __future__ import annotations

from typing import Optional

import msgspec

from shmvllm.sampling_params import ParameterTypeError


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

    def __post_init__(self) -> None:
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ParameterTypeError(f"normalize must be a bool or None, got {self.normalize!r}.")
        if self.dimensions is not None:
            if not isinstance(self.dimensions, int) or isinstance(self.dimensions, bool):
                raise ParameterTypeError(f"dimensions must be an int, got {self.dimensions!r}.")
            if self.dimensions < 1:
                raise ValueError(f"dimensions must be at least 1, got {self.dimensions}.")

    def verify(self, hidden_size: int) -> None:
        """Checks against the model, once it is known."""
        if self.dimensions is not None and self.dimensions > hidden_size:
            raise ValueError(
                f"dimensions must be at most the model's embedding size {hidden_size}, got {self.dimensions}."
            )
