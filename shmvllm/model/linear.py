"""A linear layer whose GEMM runs on a prepacked oneDNN weight on the CPU.

`F.linear` on the CPU goes through an sgemm that re-packs the weight into its blocked layout on
every call. oneDNN can pack a weight once (`_reorder_linear_weight`) and reuse that layout, and
it fuses a residual add into the GEMM's epilogue. Measured on this machine (2 cores, AVX2,
fp32, SmolLM2-135M shapes): ~215 GFLOP/s against ~130-175 for `F.linear` at 64-2048 rows, and
~45 against ~19 for one row. The pack is a copy: call `pack()` after the weights are loaded
(and again if they change). Elsewhere (CUDA, other dtypes, no oneDNN) it is `F.linear`.

With at most FEW_ROWS rows (decoding one to four requests) a GEMM is bound by reading the
weights, and the C kernel `shm_linear_few_rows` streams them faster than oneDNN's blocked
GEMM: a SmolLM2-135M token's GEMMs at one row take ~13-15 ms against ~25 (at 4 rows ~22 against
~25; at 6 rows oneDNN wins).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from shmvllm.model.kernels import kernels_for

_ONEDNN = (
    torch.backends.mkldnn.is_available()
    and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
)

PACK_BATCH_HINT = 128
"""The row count oneDNN tunes the packed layout for; 64-1024 measured alike for 1-2048 rows."""

FEW_ROWS = 4
"""Up to this many rows the C kernel streams the weights; above it, the oneDNN GEMM."""


class Linear(nn.Linear):
    """nn.Linear plus `forward(x, residual)` = x @ W^T + b + residual, one fused op on the CPU."""

    packed_weight: Optional[torch.Tensor] = None

    def pack(self) -> bool:
        """Packs the weight for oneDNN where that pays (CPU, float32); True if it did."""
        weight = self.weight
        if not _ONEDNN or weight.device.type != "cpu" or weight.dtype != torch.float32:
            self.packed_weight = None
            return False
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)
        return True

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        packed = self.packed_weight
        if packed is not None:
            if x.numel() <= FEW_ROWS * self.in_features:
                out = self._few_rows(x, residual)
                if out is not None:
                    return out
            if residual is not None:
                return torch.ops.mkldnn._linear_pointwise.binary(x, residual, packed, self.bias, "add")
            return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
        y = F.linear(x, self.weight, self.bias)
        return y if residual is None else y.add_(residual)

    def _few_rows(self, x: torch.Tensor, residual: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The C kernel's GEMV for a few contiguous rows; None where it does not apply."""
        if not x.is_contiguous() or (residual is not None and not residual.is_contiguous()):
            return None
        weight, bias = self.weight, self.bias
        kernels = kernels_for(x, weight) if weight.is_contiguous() else None
        if kernels is None:
            return None
        rows = x.numel() // self.in_features
        out = x.new_empty(*x.shape[:-1], self.out_features)
        kernels.shm_linear_few_rows(
            out.data_ptr(), x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
            None if residual is None else residual.data_ptr(), rows, self.out_features, self.in_features,
        )
        return out
