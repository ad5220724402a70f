"""Sharded Llama-family layers: a loaded model is cut in place into one rank's share.

Megatron's split, per decoder layer:
- attention: the KV heads are split across the ranks (as evenly as they go: a rank may hold
  one more), each rank keeping the query heads of its KV heads; `qkv_proj` keeps those rows
  (column-parallel), `o_proj` the matching input columns (row-parallel: each rank's partial
  product is summed over the ranks); each rank's KV cache holds only its own KV heads;
- MLP: `gate_up_proj` keeps one slice of the intermediate rows of gate and of up
  (column-parallel), `down_proj` the same input columns (row-parallel);
- the embedding keeps one slice of the vocabulary (a token outside it looks up zeros, and the
  sum over the ranks is the one rank's row, exactly), and the lm_head the same rows; its
  logits are gathered on every rank, so that every rank samples the same tokens (with the
  same seeded generators) and keeps the same token history without a message back.

Each rank loads the whole checkpoint and keeps its slices (`shard_llama_`); the sharded Linear
layers are the project's `Linear` (packed for oneDNN, fused residual), composed here with the
collective rather than subclassed. The residual and a row-parallel bias are added by rank 0
only, before the sum. GGUF blocks are not sharded (yet): a model on blocks is refused.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from shmvllm.model.attention import PagedAttention
from shmvllm.model.linear import Linear
from shmvllm.model.parallel.group import TPGroup


def split_range(n: int, world_size: int, rank: int) -> tuple[int, int]:
    """Rank's [start, stop) of n items split into world_size contiguous parts, the first
    n % world_size parts one item longer."""
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def split_sizes(n: int, world_size: int) -> list[int]:
    return [stop - start for start, stop in (split_range(n, world_size, r) for r in range(world_size))]


def _linear(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> Linear:
    layer = Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    layer.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias.contiguous(), requires_grad=False)
    layer.pack()
    return layer


def _rows(layer: Linear, ranges: list[tuple[int, int]]) -> Linear:
    """A Linear with the output rows of `ranges` (column-parallel)."""
    weight = torch.cat([layer.weight[a:b] for a, b in ranges])
    bias = None if layer.bias is None else torch.cat([layer.bias[a:b] for a, b in ranges])
    return _linear(weight, bias)


class RowParallelLinear(nn.Module):
    """x_rank @ W[:, cols_rank]^T summed over the ranks (+ bias + residual, added by rank 0)."""

    def __init__(self, full: Linear, start: int, stop: int, group: TPGroup) -> None:
        super().__init__()
        self.group = group
        self.in_features, self.out_features = stop - start, full.out_features
        bias = full.bias if group.rank == 0 else None
        self.local = _linear(full.weight[:, start:stop], None if bias is None else bias.detach())

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        out = self.local(x, residual if self.group.rank == 0 else None)
        return self.group.all_reduce_(out)


class VocabParallelEmbedding(nn.Module):
    """The rows [start, stop) of the embedding table; ids outside them look up zeros."""

    def __init__(self, full: nn.Embedding, start: int, stop: int, group: TPGroup) -> None:
        super().__init__()
        self.group, self.start, self.stop = group, start, stop
        self.embedding_dim = full.embedding_dim
        self.weight = nn.Parameter(full.weight[start:stop].detach().clone(), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.stop)
        local = (ids - self.start).masked_fill_(outside, 0)
        out = nn.functional.embedding(local, self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.group.all_reduce_(out)


class ParallelLMHead(nn.Module):
    """The lm_head rows of this rank's vocabulary slice; the logits gathered on every rank."""

    def __init__(self, weight: torch.Tensor, sizes: list[int], group: TPGroup) -> None:
        super().__init__()
        self.group, self.sizes = group, sizes
        self.local = _linear(weight, None)

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


def shard_llama_(model: nn.Module, group: TPGroup) -> nn.Module:
    """Cuts a loaded LlamaForCausalLM (fp32/bf16 weights, not GGUF blocks) into `group.rank`'s share, in place."""
    world, rank = group.world_size, group.rank
    blocked = [name for name, m in model.named_modules() if getattr(m, "blocks", None) is not None]
    if blocked:
        raise ValueError(
            f"tensor parallelism does not shard GGUF blocks yet ({blocked[0]} runs on blocks): "
            "load the model with quantization='none'."
        )
    check_shardable(model.config, world)
    inner = model.model
    inner.decode_step = None  # the native all-layer step knows nothing of the collectives
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        group_size = attn.num_heads // attn.num_kv_heads
        kv0, kv1 = split_range(attn.num_kv_heads, world, rank)
        hd = attn.head_dim
        q_rows = (kv0 * group_size * hd, kv1 * group_size * hd)
        k_rows = (attn.q_size + kv0 * hd, attn.q_size + kv1 * hd)
        v_rows = (attn.q_size + attn.kv_size + kv0 * hd, attn.q_size + attn.kv_size + kv1 * hd)
        attn.qkv_proj = _rows(attn.qkv_proj, [q_rows, k_rows, v_rows])
        attn.o_proj = RowParallelLinear(attn.o_proj, *q_rows, group)
        attn.num_heads, attn.num_kv_heads = (kv1 - kv0) * group_size, kv1 - kv0
        attn.q_size, attn.kv_size = attn.num_heads * hd, attn.num_kv_heads * hd
        attn.attn = PagedAttention(attn.num_heads, attn.num_kv_heads, hd, attn.attn.scale)

        size = mlp.intermediate_size
        i0, i1 = split_range(size, world, rank)
        mlp.gate_up_proj = _rows(mlp.gate_up_proj, [(i0, i1), (size + i0, size + i1)])
        mlp.down_proj = RowParallelLinear(mlp.down_proj, i0, i1, group)
        mlp.intermediate_size = i1 - i0

    vocab = model.config.vocab_size
    v0, v1 = split_range(vocab, world, rank)
    embedding = VocabParallelEmbedding(inner.embed_tokens, v0, v1, group)
    head_weight = embedding.weight if model.tie_word_embeddings else model.lm_head.weight[v0:v1].detach().clone()
    model.lm_head = ParallelLMHead(head_weight, split_sizes(vocab, world), group)
    inner.embed_tokens = embedding
    return model
