"""The mixture-of-experts MLP (Qwen3-MoE, Mixtral, gpt-oss): an fp32 router picks each token's
top-k experts, and a step's tokens are grouped by expert so that each chosen expert's weights are
read once and multiplied with all of its tokens; an expert no token chose is not touched.
gpt-oss's variant (router bias, softmax over the top-k logits, expert biases, the clamped SwiGLU)
runs the experts one by one from Python (`native_options`): the C kernels have none of it.

The router follows transformers' arithmetic in fp32: logits = x @ W_gate^T, softmax over all
experts, top-k, then (Mixtral always; Qwen3-MoE where `norm_topk_prob`) the chosen weights
divided by their sum. Each expert is a gated MLP whose `gate_up_proj` / `down_proj` are the
project's `Linear` (dense and packed for oneDNN, or GGML blocks: the GEMV kernel for a few rows,
the blocked GEMM for many). On the CPU with fp32 activations and GGML-block or fp32 experts, all
the chosen experts of a step run in one C call and one OpenMP team (kernels/moe.c: one kernel
call a layer where a batch of 16 made ~110 from Python; benchmarks/results/moe.md); elsewhere
(bf16, CUDA) one stable argsort of the flattened expert ids gives each expert its tokens in token
order and the experts run one by one. Both accumulate the expert outputs, scaled by their routing
weights, in expert order into zeros, as transformers' loop does, and add the residual last.

Tensor parallel (model/parallel/layers.py): each rank builds and loads every expert's share of
the intermediate rows (the dense MLP's split, no routing change) rather than whole experts: no
token exchange, and no rank idle when a step's tokens choose the other rank's experts (a single
request's top-k often does). The router runs whole on every rank, each rank's experts yield
partial sums, and one all-reduce per layer adds them. The split is drawn in whole blocks of
`down_proj`; a rank whose share of an expert is empty skips it.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from shmvllm.model.kernels import cpu_kernels, kernels_for, quant_kernels
from shmvllm.model.native_linear import linear_tables
from shmvllm.model.parallel.layers import ColumnParallelLinear, Placement, RowParallelLinear
from shmvllm.model.parallel.split import split_range


GLU_KERNELS = {"silu": "shm_silu_and_mul", "gelu_tanh": "shm_gelu_tanh_and_mul"}  # cpu_kernels.c's GLU of each activation


class _MoETable(ctypes.Structure):
    """kernels/moe.c's shm_moe: the experts' weight tables and the layer's sizes."""

    _fields_ = [
        ("gate_up", ctypes.c_void_p), ("down", ctypes.c_void_p), ("num_experts", ctypes.c_int64),
        ("top_k", ctypes.c_int64), ("hidden", ctypes.c_int64), ("intermediate", ctypes.c_int64),
        ("glu", ctypes.c_void_p), ("linear_rows", ctypes.c_void_p),
    ]


# llama.cpp stacks each layer's experts into one [n_expert, rows, k] tensor: read_gguf yields one
# tensor per expert, "*" standing for its index
MOE_GGUF_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.*.gate_proj",
    "ffn_up_exps": "mlp.experts.*.up_proj",
    "ffn_down_exps": "mlp.experts.*.down_proj",
}


@dataclass(frozen=True)
class MoEOptions:
    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    norm_topk_prob: bool  # the chosen weights divided by their sum
    router_bias: bool = False
    softmax_topk: bool = False  # the softmax over the top-k logits only (gpt-oss), not over all experts before the top-k
    expert_bias: bool = False  # biases on each expert's gate / up / down (gpt-oss)
    # gpt-oss's clamped SwiGLU: gate <= limit, |up| <= limit, (up + 1) * gate * sigmoid(alpha * gate); None: the plain GLU
    swiglu_limit: Optional[float] = None
    swiglu_alpha: float = 1.702


def native_options(options: MoEOptions) -> bool:
    """Whether the C kernels (kernels/moe.c, the native decode step's router) run these experts:
    not gpt-oss's clamped SwiGLU, expert biases, router bias or softmax over the top-k, which run
    op by op in torch."""
    return options.swiglu_limit is None and not (options.expert_bias or options.router_bias or options.softmax_topk)


class Expert(nn.Module):
    """One expert: down(act(gate(x)) * up(x)), gate and up fused into one projection."""

    def __init__(self, hidden: int, options: MoEOptions, activation: str, placement: Placement, prefix: str) -> None:
        super().__init__()
        group = placement.group
        intermediate = options.intermediate_size
        unit = placement.unit(f"{prefix}.down_proj.weight")
        u0, u1 = split_range(-(-intermediate // unit), group.world_size, group.rank)  # whole blocks; a rank may get none
        i0, i1 = min(u0 * unit, intermediate), min(u1 * unit, intermediate)
        self.intermediate_size = i1 - i0
        self.activation = activation
        self.limit, self.alpha = options.swiglu_limit, options.swiglu_alpha
        bias = options.expert_bias
        self.gate_up_proj = ColumnParallelLinear(hidden, [intermediate, intermediate], [(i0, i1), (i0, i1)], bias, group)
        # the partial sums are all-reduced once per layer, by MoEMLP (the bias added by rank 0)
        self.down_proj = RowParallelLinear(intermediate, hidden, i0, i1, unit, bias, group, reduce=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        size = gate_up.shape[-1] // 2  # a tensor-parallel rank holds a share of the rows
        if self.limit is not None:  # transformers' arithmetic, op by op
            gate = gate_up[:, :size].clamp(max=self.limit)
            up = gate_up[:, size:].clamp(min=-self.limit, max=self.limit)
            return self.down_proj((up + 1) * (gate * torch.sigmoid(gate * self.alpha)))
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
        self.options = options
        group = placement.group
        # the router: all its rows on every rank
        self.gate = ColumnParallelLinear(hidden, [options.num_experts], [(0, options.num_experts)], options.router_bias, group)
        self.experts = nn.ModuleList(
            Expert(hidden, options, activation, placement, f"{prefix}.experts.{index}")
            for index in range(options.num_experts)
        )
        self.group: Any = group if group.world_size > 1 else None  # the ranks' partial sums are all-reduced
        shares = {expert.intermediate_size for expert in self.experts}
        # each expert's rows on this rank (one split for all); None: they differ, the C kernel does not apply
        self.intermediate_share: Optional[int] = shares.pop() if len(shares) == 1 else None
        self._native_table: Any = None  # None: not built yet; False: the kernels do not apply

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [rows, top_k] fp32, expert ids [rows, top_k]) of each token."""
        logits = self.gate(x).float()
        if self.options.softmax_topk:
            top, ids = torch.topk(logits, self.top_k, dim=-1)
            return torch.softmax(top, dim=-1), ids
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        weights, ids = self.route(x)
        if self.group is not None and self.group.rank != 0:
            residual = None  # rank 0's partial sum carries it through the all-reduce
        out = self._native(x, weights, ids, residual)
        if out is None:
            out = self._layered(x, weights, ids, residual)
        return self.group.all_reduce_(out) if self.group is not None else out

    def _native(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                residual: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Every expert in one C call (kernels/moe.c), on the CPU with fp32 activations and weights
        the kernels run (GGML blocks or fp32); None where that does not apply."""
        if x.dtype != torch.float32 or x.device.type != "cpu" or not self.intermediate_share or not native_options(self.options):
            return None
        table = self._table()
        if table is None:
            return None
        kernels, struct = table
        x = x.contiguous()
        if residual is not None:
            residual = residual.contiguous()
        rows = x.shape[0]
        ids = ids.contiguous()
        weights = weights.contiguous()
        out = torch.empty_like(x)
        scratch = torch.empty(kernels.shm_moe_scratch_floats(ctypes.addressof(struct), rows), dtype=torch.float32)
        rc = kernels.shm_moe_experts(
            ctypes.addressof(struct), out.data_ptr(), x.data_ptr(), None if residual is None else residual.data_ptr(),
            rows, ids.data_ptr(), weights.data_ptr(), scratch.data_ptr(), torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(f"the native mixture-of-experts kernel failed (status {rc}).")
        return out

    def _table(self) -> Optional[tuple[Any, Any]]:
        """(the kernels, the experts' C table), built on first use from the loaded weights; None
        where the kernels are missing or cannot run these weights (bf16, CUDA)."""
        if self._native_table is False:
            return None
        if self._native_table is None:
            self._native_table = False
            kernels, glu = quant_kernels(), cpu_kernels()
            if kernels is None or glu is None:
                return None
            keep: list[Any] = []
            try:
                gate_up = linear_tables([e.gate_up_proj for e in self.experts], keep)
                down = linear_tables([e.down_proj for e in self.experts], keep)
            except ValueError:
                return None
            struct = _MoETable(
                ctypes.addressof(gate_up), ctypes.addressof(down), self.num_experts, self.top_k,
                self.gate.in_features, self.intermediate_share,
                ctypes.cast(getattr(glu, GLU_KERNELS[self.activation]), ctypes.c_void_p).value,
                ctypes.cast(glu.shm_linear_rows, ctypes.c_void_p).value,
            )
            self._native_table = (kernels, struct, keep)
        kernels, struct, _ = self._native_table
        return kernels, struct

    def _layered(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                 residual: Optional[torch.Tensor]) -> torch.Tensor:
        """The experts one by one from Python (bf16 or CUDA weights)."""
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
        return out if residual is None else out.add_(residual)
