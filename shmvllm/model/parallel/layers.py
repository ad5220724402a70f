"""Tensor-parallel layers, built at their rank's shapes: each parameter carries a
`weight_loader(param, tensor, part=None)` that reads only this rank's share of its checkpoint
tensor (model/checkpoint.py: a safetensors or GGUF handle), so a rank never holds more than its
share. Size 1 is the same code, rank 0 of 1 (every share the whole, no collective).

Megatron's split, per decoder layer (model/decoder.py builds every family from these):
- attention: the KV heads are split across the ranks (as evenly as they go: a rank may hold one
  more), each rank keeping the query heads of its KV heads; `qkv_proj` holds those rows
  (`ColumnParallelLinear`, read from q/k/v_proj, or from a fused qkv_proj part by part),
  `o_proj` the matching input columns (`RowParallelLinear`: each rank's partial product is
  summed over the ranks); each rank's KV cache holds only its own KV heads; per-head options
  (q/k norm per head, window, soft-capping, rotary) need nothing more, and a q/k norm over the
  whole projection (OLMo 2, decoder.ProjRMSNorm) sums its squares over the ranks;
- MLP: `gate_up_proj` holds one slice of the intermediate rows of gate and of up, `down_proj`
  the same input columns; a mixture-of-experts MLP (model/moe.py) the same slice of every expert,
  its router whole, one all-reduce per layer;
- the embedding holds one slice of the vocabulary (`VocabParallelEmbedding`: a token outside it
  looks up zeros, and the sum over the ranks is the one rank's row, exactly), and the lm_head
  the same rows (`ParallelLMHead`, tied to the embedding's slice where the model ties them); its
  logits are gathered on every rank, so that every rank samples the same tokens (with the same
  seeded generators) and keeps the same token history without a message back.

GGML blocks (a GGUF model, or quantization='q8_0') are shared as blocks: a row share is a view
of the mapped file's rows, an input share the byte columns of whole blocks (32 values; 256 for
the K-quants). Which format each weight will be held in is known before the model is built
(`Placement.formats`, from the GGUF header), so the MLP's intermediate split is drawn in whole
blocks of `down_proj`; the attention's is fixed by the heads. Where a row-parallel split falls
inside a block (e.g. 3 KV heads of 64 split 2 + 1 over Q4_K's 256-value blocks), each rank holds
the whole blocks around its share (the straddling block column is held by both ranks) and
multiplies zeros in the columns outside it (`pad`): the sum over the ranks is still the full
product, and the cost (a block column of memory and work per row, per rank) is logged as a
warning naming the tensors (`report`). The residual and a row-parallel bias are added by rank 0
only, before the sum.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from shmvllm.model.checkpoint import CheckpointTensor
from shmvllm.model.linear import Linear, VocabEmbedding
from shmvllm.model.parallel.group import TPGroup
from shmvllm.model.parallel.pipeline import PipelineStage
from shmvllm.model.parallel.split import split_range
from shmvllm.model.quant import QuantizedWeight, format_name

logger = logging.getLogger(__name__)


def _dense(name: str) -> Optional[int]:
    return None


@dataclass(frozen=True)
class Placement:
    """Where the weights go: this rank of `group`, and `formats(checkpoint name)`, the GGML
    format a weight will be held in (None: dense), which fixes where its input may be split;
    `stage`: the pipeline stage whose layers this process holds."""

    group: TPGroup = field(default_factory=lambda: TPGroup(0, 1))
    formats: Callable[[str], Optional[int]] = _dense
    stage: PipelineStage = field(default_factory=PipelineStage)

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def world_size(self) -> int:
        return self.group.world_size

    def unit(self, name: str) -> int:
        """The input values a share of weight `name` must start and stop at: 1 for a dense
        weight, else its blocks' (the kernels take F16 / BF16 rows in runs of 32 as well)."""
        qtype = self.formats(name)
        if qtype is None:
            return 1
        from shmvllm.model.kernels import quant_kernels

        return quant_kernels().shm_qblock_values(qtype)


def block_bounds(k: int, unit: int, start: int, stop: int) -> tuple[int, int]:
    """[start, stop) of K widened to whole units."""
    return start // unit * unit, min(-(-stop // unit) * unit, k)


def _check_shape(tensor: CheckpointTensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"checkpoint tensor {tensor.name!r} has shape {tuple(tensor.shape)}, expected {tuple(expected)}.")


def default_weight_loader(param: nn.Parameter, tensor: CheckpointTensor, part: Optional[int] = None) -> None:
    """The whole tensor into `param` (a replicated parameter: norms, a rank-0 bias)."""
    _check_shape(tensor, tuple(param.shape))
    values = tensor.whole(param.data)
    if isinstance(values, QuantizedWeight):
        values = values.dequantize()
    if values is not param.data:
        param.data.copy_(values.view(param.shape))


def read_rows(param: nn.Parameter, tensor: CheckpointTensor, start: int, stop: int, local: int,
               pending: list[tuple[int, QuantizedWeight]]) -> None:
    """Rows [start, stop) of `tensor` into `param` from row `local`; blocks go to `pending`."""
    target = param.data[local : local + stop - start]
    values = tensor.rows(start, stop, target if target.numel() else None)
    if isinstance(values, QuantizedWeight):
        if param.dim() != 2:
            values = values.dequantize()
        else:
            pending.append((local, values))
            return
    if values is not target:
        target.copy_(values.view(target.shape))


class ColumnParallelLinear(Linear):
    """The output rows of this rank of a weight made of `sizes` parts (q, k, v; gate, up; the
    vocabulary): of part i, rows `ranges[i]`, stacked in part order. The checkpoint gives the
    parts one by one (`part` = i) or fused (`part` None: Phi-3's qkv_proj, a fused gate_up)."""

    def __init__(self, in_features: int, sizes: list[int], ranges: list[tuple[int, int]], bias: bool, group: TPGroup) -> None:
        super().__init__(in_features, sum(b - a for a, b in ranges), bias=bias)
        self.group, self.sizes, self.ranges = group, sizes, ranges
        self.pending_blocks: list[tuple[int, QuantizedWeight]] = []
        self.weight.weight_loader = self.load_rows
        if self.bias is not None:
            self.bias.weight_loader = self.load_rows

    def load_rows(self, param: nn.Parameter, tensor: CheckpointTensor, part: Optional[int] = None) -> None:
        parts = range(len(self.sizes)) if part is None else [part]
        rows = sum(self.sizes) if part is None else self.sizes[part]
        _check_shape(tensor, (rows, *param.shape[1:]) if param.dim() == 2 else (rows,))
        for i in parts:
            base = sum(self.sizes[:i]) if part is None else 0
            local = sum(b - a for a, b in self.ranges[:i])
            a, b = self.ranges[i]
            if a == b:  # an expert of which this rank holds nothing
                continue
            read_rows(param, tensor, base + a, base + b, local, self.pending_blocks if param is self.weight else [])


class RowParallelLinear(Linear):
    """x_rank @ W[:, start:stop]^T summed over the ranks (+ bias + residual, added by rank 0).
    Where `unit` (the weight's blocks) misses [start, stop), the rank holds the whole units
    around it, [lo, hi), and pads its input with zeros to that width (`pad`)."""

    def __init__(self, in_features: int, out_features: int, start: int, stop: int, unit: int, bias: bool,
                 group: TPGroup, reduce: bool = True) -> None:
        lo, hi = block_bounds(in_features, unit, start, stop)
        super().__init__(hi - lo, out_features, bias=bias)
        self.group, self.full_in_features, self.unit, self.reduce = group, in_features, unit, reduce
        self.start, self.stop, self.lo, self.hi = start, stop, lo, hi
        self.pad: Optional[tuple[int, int]] = None if (lo, hi) == (start, stop) else (start - lo, hi - stop)
        self.pending_blocks: list[tuple[int, QuantizedWeight]] = []
        self.weight.weight_loader = self.load_columns
        if self.bias is not None:
            self.bias.weight_loader = self.load_bias

    def load_columns(self, param: nn.Parameter, tensor: CheckpointTensor, part: Optional[int] = None) -> None:
        _check_shape(tensor, (self.out_features, self.full_in_features))
        if self.hi == self.lo:  # an expert of which this rank holds nothing
            return
        values = tensor.columns(self.lo, self.hi)
        if isinstance(values, QuantizedWeight):
            self.pending_blocks.append((0, values))
        else:
            param.data.copy_(values)

    def load_bias(self, param: nn.Parameter, tensor: CheckpointTensor, part: Optional[int] = None) -> None:
        if self.group.rank == 0:
            default_weight_loader(param, tensor)
        else:  # the bias is rank 0's to add; zeros add nothing
            _check_shape(tensor, tuple(param.shape))
            param.data.zero_()

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.pad is not None:
            x = F.pad(x, self.pad)  # zeros in the columns of the straddled blocks outside this share
        group = self.group
        out = super().forward(x, residual if group.rank == 0 else None)
        return group.all_reduce_(out) if self.reduce and group.world_size > 1 else out

    def straddle_note(self, name: str) -> Optional[str]:
        """What holding the straddled block columns costs, where this share falls inside a block."""
        if self.pad is None:
            return None
        formats = "/".join(sorted({format_name(p.qtype) for _, p in self.blocks})) if self.blocks else "dense"
        column_bytes = sum(p.data.numel() for _, p in self.blocks) / self.in_features if self.blocks else 0
        extra = (self.hi - self.lo) - (self.stop - self.start)
        return (f"{name} ({formats}, {self.unit}-value blocks, K={self.full_in_features}: this rank's "
                f"[{self.start}, {self.stop}) held as [{self.lo}, {self.hi}), +{extra} input values, "
                f"~{extra * column_bytes / 2**10:.0f} KiB)")


class VocabParallelEmbedding(VocabEmbedding):
    """The rows [start, stop) of the embedding table (dense or blocks); ids outside them look up zeros."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group: TPGroup) -> None:
        start, stop = split_range(num_embeddings, group.world_size, group.rank)
        super().__init__(stop - start, embedding_dim)
        self.start, self.stop, self.group, self.full_num_embeddings = start, stop, group, num_embeddings
        self.pending_blocks: list[tuple[int, QuantizedWeight]] = []
        self.weight.weight_loader = self.load_rows

    def load_rows(self, param: nn.Parameter, tensor: CheckpointTensor, part: Optional[int] = None) -> None:
        _check_shape(tensor, (self.full_num_embeddings, self.embedding_dim))
        read_rows(param, tensor, self.start, self.stop, 0, self.pending_blocks)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.group.world_size == 1:
            return super().forward(ids)
        outside = (ids < self.start) | (ids >= self.stop)
        local = (ids - self.start).masked_fill_(outside, 0)
        out = super().forward(local)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.group.all_reduce_(out)


class ParallelLMHead(ColumnParallelLinear):
    """The lm_head rows of this rank's vocabulary slice (the embedding's); the logits gathered on every rank."""

    def __init__(self, hidden_size: int, vocab_size: int, group: TPGroup) -> None:
        super().__init__(hidden_size, [vocab_size], [split_range(vocab_size, group.world_size, group.rank)], False, group)
        self.vocab_sizes = [b - a for a, b in (split_range(vocab_size, group.world_size, r) for r in range(group.world_size))]

    def forward(self, hidden: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        local = super().forward(hidden, residual)
        return local if self.group.world_size == 1 else self.group.all_gather_columns(local, self.vocab_sizes)


def check_shardable(config: Any, world_size: int) -> None:
    """ValueError naming the field when the model cannot be split over world_size ranks."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if kv_heads < world_size:
        raise ValueError(
            f"tensor_parallel_size={world_size} is more than the model's num_key_value_heads={kv_heads}: "
            "every rank needs at least one KV head."
        )
    if config.intermediate_size < world_size or config.vocab_size < world_size:
        raise ValueError(f"tensor_parallel_size={world_size} is more than the model's intermediate_size or vocab_size.")


def report(model: nn.Module, group: TPGroup) -> None:
    """Logs what this rank holds, and (rank 0) the row-parallel weights split inside a block."""
    if group.world_size == 1:
        return
    straddled = [note for name, module in model.named_modules() if isinstance(module, RowParallelLinear)
                 for note in [module.straddle_note(name)] if note is not None]
    if straddled and group.rank == 0:
        logger.warning(
            "tensor parallelism: %d row-parallel weight(s) split inside a GGML block: each rank keeps the whole "
            "blocks its share touches and multiplies zeros in their columns outside the share (the sum stays exact; "
            "the straddled block column costs memory and work on both ranks): %s%s", len(straddled), "; ".join(straddled[:4]),
            f"; ... ({len(straddled) - 4} more alike)" if len(straddled) > 4 else "",
        )
    blocks, dense = shard_bytes(model)
    logger.info("rank %d of %d holds its shard: %.1f MiB in GGML blocks, %.1f MiB dense", group.rank,
                group.world_size, blocks / 2**20, dense / 2**20)


def shard_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of GGML blocks, bytes of dense parameters) the model holds, each tensor counted once."""
    seen: set[int] = set()
    blocks = dense = 0
    for module in model.modules():
        parts = getattr(module, "blocks", None)
        if parts is None:
            continue
        for part in [parts] if isinstance(parts, QuantizedWeight) else [p for _, p in parts]:
            if id(part.data) not in seen:
                seen.add(id(part.data))
                blocks += part.data.numel()
    for param in model.parameters():
        if id(param) not in seen:
            seen.add(id(param))
            dense += param.numel() * param.element_size()
    return blocks, dense
