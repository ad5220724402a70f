"""A linear layer whose GEMM runs on a prepacked oneDNN weight on the CPU.

`F.linear` on the CPU goes through an sgemm that re-packs the weight into its blocked layout on
every call. oneDNN can pack a weight once (`_reorder_linear_weight`) and reuse that layout, and
it fuses a residual add into the GEMM's epilogue: faster than `F.linear` at every row count
measured (benchmarks/results/throughput.md, "GEMM choices"). The pack is a copy: call `pack()`
after the weights are loaded (and again if they change). bf16 weights are packed the same way:
oneDNN then runs its bf16 GEMM (AVX512-BF16 / AMX where the CPU has them, fp32 accumulation, one
rounding of each output). Elsewhere (CUDA, fp16, no oneDNN) it is `F.linear`.

One dispatch in `forward`: GGML blocks -> the block path (`block_linear`); a packed dense
weight -> the C kernel for a few rows, else the packed oneDNN GEMM (fp32 or bf16, by the
weight's dtype); anything else -> `F.linear`.

A Linear can instead hold its weight as GGML blocks (`set_blocks`, from a GGUF file; see
quant.py): then there is no fp32 weight at all, and every call runs the C kernel
`shm_qgemm` (kernels/quant_kernels.c) on the blocks, with fp32 activations: a GEMV for up to
FEW_ROWS rows, a blocked GEMM on dequantized panels beyond (on a par with oneDNN's packed fp32
GEMM on this model's shapes: benchmarks/qgemm.py). A fused projection whose shards come in
different formats keeps one block part per run of rows.

With at most FEW_ROWS rows (decoding one to four requests) a GEMM is bound by reading the
weights, and the C kernel `shm_linear_few_rows` streams them faster than oneDNN's blocked GEMM
(up to 4 rows; from 6 oneDNN wins: benchmarks/results/throughput.md, "GEMM choices").
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from shmvllm.model.kernels import kernels_for, quant_kernels
from shmvllm.model.quant import QuantizedWeight, concat

_ONEDNN = (
    torch.backends.mkldnn.is_available()
    and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
)

_PACKED_DTYPES = (torch.float32, torch.bfloat16)

PACK_BATCH_HINT = 128
"""The row count oneDNN tunes the packed layout for; 64-1024 measured alike for 1-2048 rows."""

FEW_ROWS = 4
"""Up to this many rows the C kernel streams the weights; above it, the oneDNN GEMM."""

BF16_FEW_ROWS = 2
"""The same bound for bf16 weights: oneDNN's bf16 GEMM is about 2x its fp32 one, and the C
kernel's bf16 dot products (vdpbf16ps) beat it only at 1-2 rows (SmolLM2 shapes, AVX512-BF16)."""


def _few_rows_limit(dtype: torch.dtype) -> int:
    return BF16_FEW_ROWS if dtype == torch.bfloat16 else FEW_ROWS


class Linear(nn.Linear):
    """nn.Linear plus `forward(x, residual)` = x @ W^T + b + residual, one fused op on the CPU."""

    packed_weight: Optional[torch.Tensor] = None
    blocks: Optional[list[tuple[int, QuantizedWeight]]] = None  # (first output row, its blocks)

    def set_blocks(self, parts: list[tuple[int, QuantizedWeight]]) -> None:
        """Runs on these GGML blocks from now on (they must cover every output row once) and
        drops the fp32 weight. Adjacent parts of one format are stacked into one."""
        self.blocks = merge_parts(parts, self.out_features, self.in_features)
        self.weight = nn.Parameter(torch.empty(0), requires_grad=False)
        self.packed_weight = None

    def repack(self, buffer: Optional[Callable[[int], torch.Tensor]] = None) -> None:
        """Moves the block parts this kernel build reads faster in another layout into it, once,
        as a copy (the old parts' pages are then not read): Q4_1 parts of a multiple of 8 rows into
        quant.Q4_1_R8 on the builds with the 8-row GEMV pass (AVX2, AVX-512 VNNI). Each copy goes
        into buffer(bytes) (a uint8 tensor) where given, else into a tensor of its own."""
        kernels = quant_kernels()
        if self.blocks is None or kernels is None:
            return
        self.blocks = [(offset, repacked(weight, kernels, buffer)) for offset, weight in self.blocks]

    def pack(self) -> bool:
        """Packs the weight for oneDNN where that pays (CPU, float32 or bfloat16); True if it did."""
        weight = self.weight
        if self.blocks is not None:
            return False
        if not _ONEDNN or weight.device.type != "cpu" or weight.dtype not in _PACKED_DTYPES or not weight.numel():
            self.packed_weight = None
            return False
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)
        return True

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.blocks is not None:
            return block_linear(x, self.blocks, self.out_features, self.bias, residual)
        packed = self.packed_weight
        if packed is not None:
            if x.numel() <= _few_rows_limit(self.weight.dtype) * self.in_features:
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
        operands = [t for t in (x, weight, bias, residual) if t is not None]
        kernels = kernels_for(*operands) if weight.is_contiguous() else None
        if kernels is None:
            return None
        rows = x.numel() // self.in_features
        out = x.new_empty(*x.shape[:-1], self.out_features)
        kernels.shm_linear_few_rows(
            out.data_ptr(), x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
            None if residual is None else residual.data_ptr(), rows, self.out_features, self.in_features,
        )
        return out


def merge_parts(parts: list[tuple[int, QuantizedWeight]], n: int, k: int) -> list[tuple[int, QuantizedWeight]]:
    """Sorted, checked (every row of [n, k] exactly once) and with neighbours of one format stacked."""
    parts = sorted(parts, key=lambda part: part[0])
    runs: list[tuple[int, list[QuantizedWeight]]] = []  # neighbours of one format, stacked in one copy
    row = 0
    for offset, weight in parts:
        if offset != row or weight.k != k:
            raise ValueError(f"block parts must tile the [{n}, {k}] weight: got [{weight.n}, {weight.k}] at row {offset}, expected row {row}.")
        if runs and runs[-1][1][0].qtype == weight.qtype:
            runs[-1][1].append(weight)
        else:
            runs.append((offset, [weight]))
        row += weight.n
    if row != n:
        raise ValueError(f"block parts cover {row} of the weight's {n} rows.")
    return [(offset, run[0] if len(run) == 1 else concat(run)) for offset, run in runs]


def repacks(weight: QuantizedWeight, kernels: Any) -> bool:
    """Whether `kernels` (a quant_kernels build) repacks `weight` into another layout."""
    return kernels.shm_qrepack_type(weight.qtype, weight.n) >= 0


def repacked(weight: QuantizedWeight, kernels: Any,
             buffer: Optional[Callable[[int], torch.Tensor]] = None) -> QuantizedWeight:
    """`weight` in the layout `kernels` (a quant_kernels build) repacks its type into (written to
    buffer(bytes) where given), or itself."""
    qtype = kernels.shm_qrepack_type(weight.qtype, weight.n)
    if qtype < 0:
        return weight
    source = weight.data.contiguous()
    data = buffer(source.numel()).view(source.shape) if buffer is not None else torch.empty_like(source)  # 64-byte aligned
    rc = kernels.shm_qrepack(data.data_ptr(), source.data_ptr(), source.shape[1], weight.qtype, weight.n, weight.k)
    if rc != qtype:
        raise RuntimeError(f"shm_qrepack failed ({rc}) on {weight.name} [{weight.n}, {weight.k}].")
    return QuantizedWeight(data, qtype, weight.k)


def _ptr(t: Optional[torch.Tensor], offset: int = 0) -> Optional[int]:
    return None if t is None else t.data_ptr() + offset * t.element_size()


def block_linear(
    x: torch.Tensor, parts: list[tuple[int, QuantizedWeight]], n: int,
    bias: Optional[torch.Tensor] = None, residual: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """x @ W^T (+ bias) (+ residual) with W as GGML block parts; x fp32 on the CPU."""
    kernels = quant_kernels()
    if kernels is None:
        raise RuntimeError("the quantized CPU kernels could not be built; load the model with quantization='none'.")
    k = parts[0][1].k
    if x.dtype != torch.float32 or x.shape[-1] != k:
        raise ValueError(f"block linear needs fp32 input [..., {k}], got {x.dtype} {tuple(x.shape)}.")
    x = x.contiguous()
    rows = x.numel() // k
    out = x.new_empty(*x.shape[:-1], n)
    if residual is not None:
        residual = residual.contiguous()
    for offset, weight in parts:
        rc = kernels.shm_qgemm(
            _ptr(out, offset), n, x.data_ptr(), k, weight.data.data_ptr(), weight.data.shape[1], weight.qtype,
            _ptr(bias, offset), _ptr(residual, offset), n, rows, weight.n, k,
        )
        if rc == -3:
            raise MemoryError(f"shm_qgemm could not allocate its panels for {weight.name} [{weight.n}, {k}] with {rows} rows.")
        if rc != 0:
            raise RuntimeError(f"shm_qgemm failed ({rc}) on {weight.name} [{weight.n}, {k}] with {rows} rows.")
    return out


class VocabEmbedding(nn.Embedding):
    """nn.Embedding that can hold its table as GGML blocks (`set_blocks`): a lookup then
    dequantizes just the rows asked for (`shm_qdequant_rows`)."""

    blocks: Optional[QuantizedWeight] = None

    def set_blocks(self, weight: QuantizedWeight) -> None:
        if weight.shape != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"embedding blocks are {list(weight.shape)}, expected [{self.num_embeddings}, {self.embedding_dim}].")
        self.blocks = weight
        self.weight = nn.Parameter(torch.empty(0), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        blocks = self.blocks
        if blocks is None:
            return super().forward(ids)
        kernels = quant_kernels()
        if kernels is None:
            raise RuntimeError("the quantized CPU kernels could not be built; load the model with quantization='none'.")
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(flat.numel(), blocks.k, dtype=torch.float32)
        rc = kernels.shm_qdequant_rows(out.data_ptr(), blocks.data.data_ptr(), blocks.data.shape[1], blocks.qtype,
                                       flat.data_ptr(), flat.numel(), blocks.n, blocks.k)
        if rc == -2:
            raise IndexError(f"token ids must lie in [0, {blocks.n}), got {flat.min().item()}..{flat.max().item()}.")
        if rc != 0:
            raise RuntimeError(f"shm_qdequant_rows failed ({rc}) on {blocks.name}.")
        return out.view(*ids.shape, blocks.k)
