"""The mixture-of-experts MLP (Qwen3-MoE, Mixtral): an fp32 router picks each token's top-k
experts, and a step's tokens are grouped by expert so that each chosen expert's weights are read
once and multiplied with all of its tokens; an expert no token chose is not touched.

The router follows transformers' arithmetic in fp32: logits = x @ W_gate^T, softmax over all
experts, top-k, then (Mixtral always; Qwen3-MoE where `norm_topk_prob`) the chosen weights
divided by their sum. Each expert is a gated MLP whose `gate_up_proj` / `down_proj` are the
project's `Linear` (dense and packed for oneDNN, or GGML blocks: the GEMV kernel for a few rows,
the blocked GEMM for many). Grouping: one stable argsort of the flattened expert ids gives each
expert its tokens in token order; the expert outputs, scaled by their routing weights, are
accumulated in expert order into zeros, as transformers' loop does, and the residual is added last.

Tensor parallel (model/parallel/layers.py): each rank builds and loads every expert's share of
the intermediate rows (the dense MLP's split, no routing change) rather than whole experts: no
token exchange, and no rank idle when a step's tokens choose the other rank's experts (a single
request's top-k often does). The router runs whole on every rank, each rank's experts yield
partial sums, and one all-reduce per layer adds them. The split is drawn in whole blocks of
`down_proj`; a rank whose share of an expert is empty skips it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from shmvllm.model.kernels import kernels_for
from shmvllm.model.parallel.layers import ColumnParallelLinear, Placement, RowParallelLinear
from shmvllm.model.parallel.split import split_range


@dataclass(frozen=True)
class MoEOptions:
    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    norm_topk_prob: bool  # the chosen weights divided by their sum


class Expert(nn.Module):
    """One expert: down(act(gate(x)) * up(x)), gate and up fused into one projection."""

    def __init__(self, hidden: int, intermediate: int, activation: str, placement: Placement, prefix: str) -> None:
        super().__init__()
        group = placement.group
        unit = placement.unit(f"{prefix}.down_proj.weight")
        u0, u1 = split_range(-(-intermediate // unit), group.world_size, group.rank)  # whole blocks; a rank may get none
        i0, i1 = min(u0 * unit, intermediate), min(u1 * unit, intermediate)
        self.intermediate_size = i1 - i0
        self.activation = activation
        self.gate_up_proj = ColumnParallelLinear(hidden, [intermediate, intermediate], [(i0, i1), (i0, i1)], False, group)
        # the partial sums are all-reduced once per layer, by MoEMLP
        self.down_proj = RowParallelLinear(intermediate, hidden, i0, i1, unit, False, group, reduce=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        size = gate_up.shape[-1] // 2  # a tensor-parallel rank holds a share of the rows
        kernels = kernels_for(gate_up)
        if kernels is not None:  # the dense MLP's GLU kernel
            act = gate_up.new_empty(gate_up.shape[0], size)
            glu = kernels.shm_silu_and_mul if self.activation == "silu" else kernels.shm_gelu_tanh_and_mul
            glu(act.data_ptr(), gate_up.data_ptr(), gate_up.shape[0], size)
        else:
            gate, up = gate_up.split(size, dim=-1)
            act = (F.silu(gate) if self.activation == "silu" else F.gelu(gate, approximate="tanh")).mul_(up)
        return self.down_proj(act)


class MoEMLP(nn.Module):
    """`forward(x, residual)`: the routed experts' weighted sum (+ residual)."""

    def __init__(self, hidden: int, options: MoEOptions, activation: str, placement: Placement, prefix: str) -> None:
        super().__init__()
        if not 0 < options.top_k <= options.num_experts:
            raise ValueError(f"num_experts_per_tok must lie in [1, {options.num_experts}], got {options.top_k}.")
        self.num_experts, self.top_k, self.norm_topk_prob = options.num_experts, options.top_k, options.norm_topk_prob
        self.intermediate_size, self.activation = options.intermediate_size, activation
        group = placement.group
        # the router: all its rows on every rank
        self.gate = ColumnParallelLinear(hidden, [options.num_experts], [(0, options.num_experts)], False, group)
        self.experts = nn.ModuleList(
            Expert(hidden, options.intermediate_size, activation, placement, f"{prefix}.experts.{index}")
            for index in range(options.num_experts)
        )
        self.group: Any = group if group.world_size > 1 else None  # the ranks' partial sums are all-reduced

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [rows, top_k] fp32, expert ids [rows, top_k]) of each token."""
        logits = self.gate(x).float()
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        weights, ids = self.route(x)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # each expert's (token, slot) pairs, in token order
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = order // self.top_k
        scales = weights.reshape(-1)[order].unsqueeze(-1).to(x.dtype)
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count and self.experts[expert].intermediate_size:  # 0: a tensor-parallel rank holds none of it
                rows = tokens[start : start + count]
                y = self.experts[expert](x.index_select(0, rows))
                out.index_add_(0, rows, y.mul_(scales[start : start + count]))
            start += count
        if self.group is not None:
            if residual is not None and self.group.rank == 0:
                out.add_(residual)
            return self.group.all_reduce_(out)
        return out if residual is None else out.add_(residual)
