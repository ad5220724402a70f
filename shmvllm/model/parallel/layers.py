"""Sharded decoder layers (every family of model/decoder.py): a loaded model is cut in place into
one rank's share.

Megatron's split, per decoder layer:
- attention: the KV heads are split across the ranks (as evenly as they go: a rank may hold
  one more), each rank keeping the query heads of its KV heads; `qkv_proj` keeps those rows
  (column-parallel), `o_proj` the matching input columns (row-parallel: each rank's partial
  product is summed over the ranks); each rank's KV cache holds only its own KV heads; per-head
  options (q/k norm per head, window, soft-capping, rotary) need nothing more, and a q/k norm
  over the whole projection (OLMo 2) sums its squares over the ranks;
- MLP: `gate_up_proj` keeps one slice of the intermediate rows of gate and of up
  (column-parallel), `down_proj` the same input columns (row-parallel);
- a mixture-of-experts MLP keeps every expert's share of its intermediate rows, split as the MLP's
  (`shard_moe_`: the router whole on every rank, one all-reduce per layer);
- the embedding keeps one slice of the vocabulary (a token outside it looks up zeros, and the
  sum over the ranks is the one rank's row, exactly), and the lm_head the same rows; its
  logits are gathered on every rank, so that every rank samples the same tokens (with the
  same seeded generators) and keeps the same token history without a message back.

GGML blocks (a GGUF model, or quantization='q8_0') are sharded as blocks: a weight's rows are
runs of blocks along its input dimension K, so a row split (column-parallel layers, the
embedding, the lm_head) keeps whole rows of blocks, and an input split (row-parallel `o_proj`,
`down_proj`) keeps the byte columns of whole blocks (32 values; 256 for the K-quants). The MLP's
intermediate split is drawn in whole blocks of `down_proj`, so that one always falls on block
boundaries; the attention's is fixed by the heads. Where a row-parallel split falls inside a
block (e.g. SmolLM2-like 3 KV heads of 64 split 2 + 1 over Q4_K's 256-value blocks), each rank
keeps the whole blocks around its share (the straddling block column is held by both ranks)
and multiplies zeros in the columns outside its share: the sum over the ranks is still
the full product, every weight stays in its blocks, and the cost (a block column of memory and
work per row, per rank) is logged as a warning naming the tensors.

Each rank loads the whole checkpoint and keeps copies of its slices (`shard_decoder_`); the full
tensors are then freed and the heap handed back, so a rank holds its share only. The sharded
Linear layers are the project's `Linear` (packed for oneDNN or on blocks, fused residual),
composed here with the collective rather than subclassed. The residual and a row-parallel bias
are added by rank 0 only, before the sum.
"""

from __future__ import annotations

import gc
import logging
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from shmvllm.model.attention import PagedAttention
from shmvllm.model.kernels import quant_kernels
from shmvllm.model.linear import Linear, VocabEmbedding
from shmvllm.model.loader import return_freed_memory
from shmvllm.model.moe import MoEMLP
from shmvllm.model.parallel.group import TPGroup
from shmvllm.model.parallel.split import split_in_units, split_range, split_sizes
from shmvllm.model.quant import FORMATS, QuantizedWeight, format_name

logger = logging.getLogger(__name__)

Parts = list[tuple[int, QuantizedWeight]]


def block_unit(layer: Linear) -> int:
    """The input values a shard of `layer`'s K must start and stop at: 1 for a dense weight,
    else its blocks' (the kernels take F16 / BF16 rows in runs of 32 as well)."""
    if layer.blocks is None:
        return 1
    kernels = quant_kernels()
    return max(kernels.shm_qblock_values(part.qtype) for _, part in layer.blocks)


def block_bounds(k: int, unit: int, start: int, stop: int) -> tuple[int, int]:
    """[start, stop) of K widened to whole units."""
    return start // unit * unit, min(-(-stop // unit) * unit, k)


def _owned(data: torch.Tensor) -> torch.Tensor:
    """A copy with storage of its own (a view would keep the whole tensor alive)."""
    return data.contiguous().clone()


def _dense_linear(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> Linear:
    layer = Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    layer.weight = nn.Parameter(_owned(weight.detach()), requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(_owned(bias.detach()), requires_grad=False)
    layer.pack()
    return layer


def _blocks_linear(pieces: list[QuantizedWeight], bias: Optional[torch.Tensor]) -> Linear:
    """A Linear on these block pieces stacked along rows (each piece a copy already)."""
    parts: Parts = []
    row = 0
    for piece in pieces:
        parts.append((row, piece))
        row += piece.n
    layer = Linear(pieces[0].k, row, bias=bias is not None, device="meta")
    if bias is not None:
        layer.bias = nn.Parameter(_owned(bias.detach()), requires_grad=False)
    layer.set_blocks(parts)
    return layer


def block_rows(parts: Parts, start: int, stop: int) -> list[QuantizedWeight]:
    """Copies of the rows [start, stop) of a weight in block parts (one piece per part touched)."""
    pieces = []
    for offset, weight in parts:
        a, b = max(start, offset), min(stop, offset + weight.n)
        if a < b:
            pieces.append(QuantizedWeight(_owned(weight.data[a - offset : b - offset]), weight.qtype, weight.k))
    return pieces


def block_columns(weight: QuantizedWeight, start: int, stop: int) -> QuantizedWeight:
    """A copy of the input values [start, stop) of every row; both ends on block boundaries."""
    _, values, nbytes = FORMATS[weight.qtype]
    if start % values or stop % values:
        raise ValueError(f"{weight.name} columns [{start}, {stop}) do not fall on {values}-value block boundaries.")
    return QuantizedWeight(_owned(weight.data[:, start // values * nbytes : stop // values * nbytes]), weight.qtype, stop - start)


def _rows(layer: Linear, ranges: list[tuple[int, int]]) -> Linear:
    """A Linear with the output rows of `ranges` (column-parallel)."""
    bias = None if layer.bias is None else torch.cat([layer.bias[a:b] for a, b in ranges])
    if layer.blocks is not None:
        return _blocks_linear([piece for a, b in ranges for piece in block_rows(layer.blocks, a, b)], bias)
    return _dense_linear(torch.cat([layer.weight[a:b] for a, b in ranges]), bias)


class RowParallelLinear(nn.Module):
    """x_rank @ W[:, start:stop]^T summed over the ranks (+ bias + residual, added by rank 0).

    On blocks whose boundaries [start, stop) misses, the rank holds the whole blocks around it,
    [lo, hi), and pads its input with zeros to that width (`pad`)."""

    def __init__(self, full: Linear, start: int, stop: int, group: TPGroup) -> None:
        super().__init__()
        self.group = group
        self.in_features, self.out_features = stop - start, full.out_features
        bias = full.bias if group.rank == 0 else None
        lo, hi = block_bounds(full.in_features, block_unit(full), start, stop)
        self.pad: Optional[tuple[int, int]] = None if (lo, hi) == (start, stop) else (start - lo, hi - stop)
        if full.blocks is not None:
            pieces = [block_columns(part, lo, hi) for _, part in full.blocks]
            self.local = _blocks_linear(pieces, bias)
        else:
            self.local = _dense_linear(full.weight[:, start:stop], bias)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.pad is not None:
            x = F.pad(x, self.pad)  # zeros in the columns of the straddled blocks outside this share
        out = self.local(x, residual if self.group.rank == 0 else None)
        return self.group.all_reduce_(out)


class VocabParallelEmbedding(nn.Module):
    """The rows [start, stop) of the embedding table (dense or blocks); ids outside them look up zeros."""

    def __init__(self, full: VocabEmbedding, start: int, stop: int, group: TPGroup) -> None:
        super().__init__()
        self.group, self.start, self.stop = group, start, stop
        self.embedding_dim = full.embedding_dim
        self.local = VocabEmbedding(stop - start, full.embedding_dim, device="meta")
        if full.blocks is not None:
            self.local.set_blocks(block_rows([(0, full.blocks)], start, stop)[0])
        else:
            self.local.weight = nn.Parameter(_owned(full.weight[start:stop].detach()), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.stop)
        local = (ids - self.start).masked_fill_(outside, 0)
        out = self.local(local)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.group.all_reduce_(out)


class ProjNormShard(nn.Module):
    """An RMSNorm over a whole projection (all heads' features: OLMo 2's q/k norm) of which this
    rank holds the features [start, stop): the sum of squares is summed over the ranks, then
    transformers' arithmetic (fp32 normalize, cast, scale by this rank's weights)."""

    def __init__(self, full: nn.Module, start: int, stop: int, group: TPGroup) -> None:
        super().__init__()
        self.group, self.eps, self.width = group, full.eps, full.weight.shape[0]
        self.weight = nn.Parameter(_owned(full.weight[start:stop].detach()), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        squares = self.group.all_reduce_(x32.pow(2).sum(-1, keepdim=True))
        return self.weight * (x32 * torch.rsqrt(squares / self.width + self.eps)).to(x.dtype)


class ParallelLMHead(nn.Module):
    """The lm_head rows of this rank's vocabulary slice; the logits gathered on every rank."""

    def __init__(self, local: Linear, sizes: list[int], group: TPGroup) -> None:
        super().__init__()
        self.group, self.sizes = group, sizes
        self.local = local

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather_columns(self.local(hidden), self.sizes)


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


def _lm_head(model: nn.Module, embedding: VocabParallelEmbedding, v0: int, v1: int) -> Linear:
    """This rank's lm_head rows: the local embedding's own table or blocks when tied to it."""
    head = model.lm_head
    full_embedding = model.model.embed_tokens
    tied_blocks = head.blocks is not None and len(head.blocks) == 1 and head.blocks[0][1] is full_embedding.blocks
    if tied_blocks:
        layer = Linear(head.in_features, v1 - v0, bias=False, device="meta")
        layer.set_blocks([(0, embedding.local.blocks)])
        return layer
    if head.blocks is None and model.tie_word_embeddings and head.weight is full_embedding.weight:
        layer = Linear(head.in_features, v1 - v0, bias=False, device="meta")
        layer.weight = embedding.local.weight
        layer.pack()
        return layer
    return _rows(head, [(v0, v1)])


def _straddles(name: str, full: Linear, cuts: list[tuple[int, int]]) -> Optional[str]:
    """A description of the row-parallel split of `full` into `cuts` when some cut falls inside
    a block (each rank then holds the straddling block columns too), else None."""
    unit = block_unit(full)
    widened = [block_bounds(full.in_features, unit, a, b) for a, b in cuts]
    if widened == cuts:
        return None
    extra = [(hi - lo) - (b - a) for (a, b), (lo, hi) in zip(cuts, widened)]
    formats = "/".join(sorted({format_name(part.qtype) for _, part in full.blocks}))
    column_bytes = sum(part.data.numel() for _, part in full.blocks) / full.in_features
    return (f"{name} ({formats}, {unit}-value blocks, K={full.in_features} split "
            f"{' | '.join(f'[{a}, {b})' for a, b in cuts)}; ranks hold +{', +'.join(map(str, extra))} "
            f"input values, ~{max(extra) * column_bytes / 2**10:.0f} KiB)")


def _query_columns(attn: nn.Module, world: int, rank: int) -> tuple[int, int]:
    """Rank's query rows of qkv_proj, which are its input columns of o_proj."""
    kv0, kv1 = split_range(attn.num_kv_heads, world, rank)
    width = attn.num_heads // attn.num_kv_heads * attn.head_dim
    return kv0 * width, kv1 * width


def shard_decoder_(model: nn.Module, group: TPGroup) -> nn.Module:
    """Cuts a loaded decoder (model/decoder.py, any family; fp32 / bf16 weights or GGML blocks)
    into `group.rank`'s share, in place."""
    world, rank = group.world_size, group.rank
    check_shardable(model.config, world)
    inner = model.model
    inner.decode_step = None  # the native all-layer step knows nothing of the collectives
    straddled: list[str] = []
    for index, layer in enumerate(inner.layers):
        attn, mlp = layer.self_attn, layer.mlp
        hd = attn.head_dim
        group_size = attn.num_heads // attn.num_kv_heads
        q_cuts = [_query_columns(attn, world, r) for r in range(world)]
        kv0, kv1 = split_range(attn.num_kv_heads, world, rank)
        q_rows = q_cuts[rank]
        k_rows = (attn.q_size + kv0 * hd, attn.q_size + kv1 * hd)
        v_rows = (attn.q_size + attn.kv_size + kv0 * hd, attn.q_size + attn.kv_size + kv1 * hd)
        note = _straddles(f"model.layers.{index}.self_attn.o_proj", attn.o_proj, q_cuts)
        if note is not None:
            straddled.append(note)
        attn.qkv_proj = _rows(attn.qkv_proj, [q_rows, k_rows, v_rows])
        attn.o_proj = RowParallelLinear(attn.o_proj, *q_rows, group)
        if getattr(attn, "qk_norm", None) == "proj":  # OLMo 2: one norm over all heads' features
            attn.q_norm = ProjNormShard(attn.q_norm, q_rows[0], q_rows[1], group)
            attn.k_norm = ProjNormShard(attn.k_norm, kv0 * hd, kv1 * hd, group)
        attn.num_heads, attn.num_kv_heads = (kv1 - kv0) * group_size, kv1 - kv0
        attn.q_size, attn.kv_size = attn.num_heads * hd, attn.num_kv_heads * hd
        full = attn.attn
        attn.attn = PagedAttention(attn.num_heads, attn.num_kv_heads, hd, full.scale, full.sliding_window, full.softcap)

        if isinstance(mlp, MoEMLP):
            shard_moe_(mlp, group)
            continue
        size = mlp.intermediate_size
        unit = block_unit(mlp.down_proj)
        cuts = [split_in_units(size, unit, world, r) for r in range(world)]
        note = _straddles(f"model.layers.{index}.mlp.down_proj", mlp.down_proj, cuts)
        if note is not None:
            straddled.append(note)
        i0, i1 = cuts[rank]
        mlp.gate_up_proj = _rows(mlp.gate_up_proj, [(i0, i1), (size + i0, size + i1)])
        mlp.down_proj = RowParallelLinear(mlp.down_proj, i0, i1, group)
        mlp.intermediate_size = i1 - i0

    vocab = model.config.vocab_size
    v0, v1 = split_range(vocab, world, rank)
    embedding = VocabParallelEmbedding(inner.embed_tokens, v0, v1, group)
    model.lm_head = ParallelLMHead(_lm_head(model, embedding, v0, v1), split_sizes(vocab, world), group)
    inner.embed_tokens = embedding
    if straddled and rank == 0:
        logger.warning(
            "tensor parallelism: %d row-parallel weight(s) split inside a GGML block: each rank keeps the whole "
            "blocks its share touches and multiplies zeros in their columns outside the share (the sum stays exact; "
            "the straddled block column costs memory and work on both ranks): %s%s", len(straddled), "; ".join(straddled[:4]),
            f"; ... ({len(straddled) - 4} more alike)" if len(straddled) > 4 else "",
        )
    gc.collect()
    return_freed_memory()
    blocks, dense = shard_bytes(model)
    logger.info("rank %d of %d holds its shard: %.1f MiB in GGML blocks, %.1f MiB dense", rank, world,
                blocks / 2**20, dense / 2**20)
    return model


def shard_moe_(mlp: MoEMLP, group: TPGroup) -> None:
    """Cuts a loaded MoE MLP into `group.rank`'s share of every expert, in place; its forward then
    all-reduces the partial sums (the router stays whole on every rank).

    Every rank holds every expert's share of the intermediate rows (the dense MLP's split, applied to
    each expert) rather than whole experts: no routing change and no token exchange; every rank runs
    the same router, reads its share of each chosen expert (1/world of the step's expert bytes), sums
    the experts' partial outputs locally, and one all-reduce per layer adds the ranks' sums. Whole
    experts per rank would leave a rank idle whenever a step's tokens choose the other rank's experts
    (a single request's top-k often does). The split is drawn in whole blocks of `down_proj`; a rank
    whose share of an expert is empty skips it."""
    world, rank = group.world_size, group.rank
    for expert in mlp.experts:
        size = expert.intermediate_size
        unit = block_unit(expert.down_proj)
        u0, u1 = split_range(-(-size // unit), world, rank)  # whole blocks; a rank may get none
        i0, i1 = min(u0 * unit, size), min(u1 * unit, size)
        down = expert.down_proj
        expert.gate_up_proj = _rows(expert.gate_up_proj, [(i0, i1), (size + i0, size + i1)]) if i1 > i0 else None
        if i1 <= i0:
            expert.down_proj = None
        elif down.blocks is not None:
            expert.down_proj = _blocks_linear([block_columns(part, i0, i1) for _, part in down.blocks], None)
        else:
            expert.down_proj = _dense_linear(down.weight[:, i0:i1], None)
        expert.intermediate_size = i1 - i0
    mlp.group = group


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
