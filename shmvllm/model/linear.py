"""A linear layer whose GEMM runs on a prepacked oneDNN weight on the CPU.

`F.linear` on the CPU goes through an sgemm that re-packs the weight into its blocked layout on
every call. oneDNN can pack a weight once (`_reorder_linear_weight`) and reuse that layout, and
it fuses a residual add into the GEMM's epilogue. Measured on this machine (2 cores, AVX2,
fp32, SmolLM2-135M shapes): ~215 GFLOP/s against ~130-175 for `F.linear` at 64-2048 rows, and
~45 against ~19 for one row. The pack is a copy: call `pack()` after the weights are loaded
(and again if they change). Elsewhere (CUDA, other dtypes, no oneDNN) it is `F.linear`.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

_ONEDNN = (
    torch.backends.mkldnn.is_available()
    and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
)

PACK_BATCH_HINT = 128
"""The row count oneDNN tunes the packed layout for; 64-1024 measured alike for 1-2048 rows."""


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
            if residual is not None:
                return torch.ops.mkldnn._linear_pointwise.binary(x, residual, packed, self.bias, "add")
            return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
        y = F.linear(x, self.weight, self.bias)
        return y if residual is None else y.add_(residual)
