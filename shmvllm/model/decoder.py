"""One causal decoder for every family: layers composed from a handful of declared options.

A family (model/models/<family>.py) declares its `DecoderOptions` from the HF config (where the
norms sit, (1 + w) norms, q/k norm, activation, embedding / residual / attention / logit scales,
soft-capping, and per layer: sliding window and which rotary table, if any) and its GGUF tensor
names; this module builds the model from them.

Module and parameter names follow transformers' so that checkpoints load by name, except that
q/k/v projections are fused into `qkv_proj` and gate/up into `gate_up_proj` (one GEMM each
instead of three and two); the loader stacks the checkpoint's shards into them (a checkpoint
that ships them fused, as Phi-3 does, loads part by part into them). Every module is built at
its tensor-parallel rank's shapes (`Placement`; size 1: rank 0 of 1) and its parameters read
only their rank's share of the checkpoint (model/parallel/layers.py).

The forward pass takes a flat batch of tokens ([num_tokens]) from many requests and returns
hidden states; `compute_logits` runs the lm_head only on the rows that are sampled.

Norms before the blocks only and no residual scale (Llama, Mistral, Qwen2/3, Phi-3, SmolLM3)
fuse the residual add into o_proj / down_proj. A single request's decode (and a few requests'
at once) runs the native all-layer decode step (decode_step.py), whose layer table carries
every option; `decode_step.fallback_reasons` names the few that keep a model on the
layer-by-layer path (the same kernels, called from Python).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from shmvllm.model.attention import AttentionMetadata, PagedAttention
from shmvllm.model.checkpoint import CheckpointTensor
from shmvllm.model.decode_step import DecodeStep
from shmvllm.model.decode_step import enabled as decode_step_enabled
from shmvllm.model.decode_step import fallback_reasons as decode_fallback_reasons
from shmvllm.model.kernels import kernels_for
from shmvllm.model.linear import Linear
from shmvllm.model.moe import MoEMLP, MoEOptions
from shmvllm.model.parallel.group import TPGroup
from shmvllm.model.parallel.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    Placement,
    RowParallelLinear,
    VocabParallelEmbedding,
    check_shardable,
    read_rows,
)
from shmvllm.model.parallel.split import split_in_units, split_range
from shmvllm.model.rotary import RotaryEmbedding, RotaryStep

logger = logging.getLogger(__name__)

NORM_PLACEMENTS = ("pre", "sandwich", "post")
QK_NORMS = (None, "head", "proj")
ACTIVATIONS = ("silu", "gelu_tanh")

# checkpoint names of each norm, by placement: (before attention, after it, before the MLP, after it)
_NORM_NAMES = {
    "pre": ("input_layernorm", None, "post_attention_layernorm", None),
    "sandwich": ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"),
    "post": (None, "post_attention_layernorm", None, "post_feedforward_layernorm"),
}


@dataclass(frozen=True)
class LayerOptions:
    # the query sees the last `sliding_window` positions (not causal: those closer than it either side); None: all
    sliding_window: Optional[int] = None
    rope: Optional[str] = "global"  # which rotary table (one of DecoderOptions.rope); None: no rotary
    moe: bool = False  # the MLP is DecoderOptions.moe's mixture of experts


@dataclass(frozen=True)
class DecoderOptions:
    """Everything in which the supported families differ."""

    layers: tuple[LayerOptions, ...]
    # the rotary tables: "global" (the config's rope parameters) or a layer type of parameters
    # given per layer type (Gemma 3: "sliding_attention" has its own base)
    rope: tuple[str, ...] = ("global",)
    norm: str = "pre"  # "pre" (Llama), "sandwich" (Gemma: before and after attention and MLP), "post" (OLMo 2)
    norm_offset: float = 0.0  # 1.0: the norms scale by (1 + weight) (Gemma)
    qk_norm: Optional[str] = None  # "head": RMSNorm over each head (Qwen3, Gemma 3); "proj": over the whole projection (OLMo 2)
    activation: str = "silu"  # the MLP's gate: "silu" or "gelu_tanh" (GeGLU)
    embed_scale: float = 1.0  # embeddings times this (Gemma: sqrt(hidden); Granite: embedding_multiplier)
    residual_scale: float = 1.0  # each block's output times this before the residual add (Granite)
    attn_scale: Optional[float] = None  # score scale; None: head_dim ** -0.5
    attn_softcap: Optional[float] = None  # scores -> cap * tanh(score / cap) (Gemma 2)
    causal: bool = True  # False: bidirectional attention within each sequence (EmbeddingGemma; pooling only)
    attn_sinks: bool = False  # a learned logit per query head in each softmax's denominator (gpt-oss; PagedAttention.sinks)
    final_softcap: Optional[float] = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    logits_scale: float = 1.0  # logits times this (Granite: 1 / logits_scaling)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    moe: Optional[MoEOptions] = None  # the experts of the layers whose LayerOptions.moe is set
    # checkpoint name fragments renamed on load, in order (Mixtral's block_sparse_moe.experts.N.w1 -> mlp.experts.N.gate_proj)
    renames: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.norm not in NORM_PLACEMENTS:
            raise ValueError(f"DecoderOptions.norm must be one of {NORM_PLACEMENTS}, got {self.norm!r}.")
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"DecoderOptions.qk_norm must be one of {QK_NORMS}, got {self.qk_norm!r}.")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"DecoderOptions.activation must be one of {ACTIVATIONS}, got {self.activation!r}.")
        for index, layer in enumerate(self.layers):
            if layer.rope is not None and layer.rope not in self.rope:
                raise ValueError(f"layer {index} uses rope {layer.rope!r}, which is not one of {sorted(self.rope)}.")
            if layer.moe and self.moe is None:
                raise ValueError(f"layer {index} is a mixture-of-experts layer but DecoderOptions.moe is not set.")


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def standard_options(config: Any, **overrides: Any) -> DecoderOptions:
    """Options read from the fields transformers' configs share (rope_parameters, layer_types,
    sliding_window, attention_bias, mlp_bias, num_hidden_layers), then the family's overrides.
    Rope parameters keyed by layer type (Gemma 3) give one rotary table per type."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    layer_types = list(getattr(config, "layer_types", None) or [])
    num_layers = config.num_hidden_layers
    per_type = bool(layer_types) and set(layer_types) <= set(params) and all(isinstance(v, dict) for v in params.values())
    rope = tuple(sorted(set(layer_types))) if per_type else ("global",)
    window = getattr(config, "sliding_window", None)
    layers = []
    for index in range(num_layers):
        kind = layer_types[index] if layer_types else None
        sliding = window if (kind == "sliding_attention" or (kind is None and window is not None)) else None
        layers.append(LayerOptions(sliding_window=sliding, rope=kind if per_type else "global"))
    options: dict[str, Any] = {
        "layers": tuple(layers), "rope": rope,
        "qkv_bias": bool(getattr(config, "attention_bias", False)),
        "o_bias": bool(getattr(config, "attention_bias", False)),
        "mlp_bias": bool(getattr(config, "mlp_bias", False)),
    }
    options.update(overrides)
    return DecoderOptions(**options)


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension; `offset` 1.0 scales by (1 + weight) (Gemma), computed in
    fp32 and rounded once at the end, as transformers' Gemma norms."""

    def __init__(self, hidden_size: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.offset = offset
        self.scale: Optional[torch.Tensor] = None  # fp32 (offset + weight), set by fold_offset

    def fold_offset(self) -> None:
        """After loading: the (offset + weight) factor, once, in fp32."""
        if self.offset:
            self.scale = self.weight.detach().float() + self.offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.offset:
            scale = self.scale if self.scale is not None else self.weight.float() + self.offset
            if x.dtype == torch.float32:
                return _rms_norm_fp32(x, scale, self.eps)
            return (torch.rms_norm(x.float(), scale.shape, eps=self.eps) * scale).to(x.dtype)
        if x.dtype == torch.float32:
            return _rms_norm_fp32(x, self.weight, self.eps)
        kernels = kernels_for(x, self.weight) if x.is_contiguous() else None
        if kernels is not None:
            return _rms_norm_kernel(kernels, x, self.weight, self.eps)
        return self.weight * torch.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


def _rms_norm_kernel(kernels: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty_like(x)
    hidden = x.shape[-1]
    kernels.shm_rms_norm(out.data_ptr(), x.data_ptr(), weight.data_ptr(), x.numel() // hidden, hidden, eps)
    return out


def _rms_norm_fp32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' arithmetic (normalize, then scale) in one C kernel or one fused torch op."""
    kernels = kernels_for(x, weight) if x.is_contiguous() else None
    if kernels is not None:
        return _rms_norm_kernel(kernels, x, weight, eps)
    return torch.rms_norm(x, weight.shape, weight, eps)


class ProjRMSNorm(RMSNorm):
    """An RMSNorm over a whole projection (all heads' features: OLMo 2's q/k norm) of which this
    rank holds the features [start, stop). Size 1: RMSNorm's arithmetic; sharded: the sum of
    squares summed over the ranks, then transformers' (fp32 normalize, cast, scale)."""

    def __init__(self, width: int, start: int, stop: int, eps: float, offset: float, group: TPGroup) -> None:
        super().__init__(stop - start, eps, offset)
        self.width, self.start, self.stop, self.group = width, start, stop, group
        self.weight.weight_loader = self.load_rows

    def load_rows(self, param: nn.Parameter, tensor: CheckpointTensor, part: Optional[int] = None) -> None:
        if tuple(tensor.shape) != (self.width,):
            raise ValueError(f"checkpoint tensor {tensor.name!r} has shape {tuple(tensor.shape)}, expected ({self.width},).")
        read_rows(param, tensor, self.start, self.stop, 0, [])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group.world_size == 1:
            return super().forward(x)
        x32 = x.float()
        squares = self.group.all_reduce_(x32.pow(2).sum(-1, keepdim=True))
        scale = self.weight if not self.offset else self.weight.float() + self.offset
        return scale * (x32 * torch.rsqrt(squares / self.width + self.eps)).to(x.dtype)


class Attention(nn.Module):
    """This rank's KV heads (split_range over the ranks) and the query heads of each."""

    def __init__(self, config: Any, options: DecoderOptions, layer: LayerOptions, placement: Placement, prefix: str) -> None:
        super().__init__()
        group = placement.group
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        d = self.head_dim = head_dim_of(config)
        kv0, kv1 = split_range(kv_heads, group.world_size, group.rank)
        per_kv = heads // kv_heads
        self.num_kv_heads, self.num_heads = kv1 - kv0, (kv1 - kv0) * per_kv
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        q_rows, kv_rows = (kv0 * per_kv * d, kv1 * per_kv * d), (kv0 * d, kv1 * d)
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, [heads * d, kv_heads * d, kv_heads * d],
                                             [q_rows, kv_rows, kv_rows], options.qkv_bias, group)
        self.o_proj = RowParallelLinear(heads * d, config.hidden_size, *q_rows, placement.unit(f"{prefix}.o_proj.weight"),
                                        options.o_bias, group)
        self.qk_norm = options.qk_norm
        if options.qk_norm == "head":
            self.q_norm = RMSNorm(d, config.rms_norm_eps, options.norm_offset)
            self.k_norm = RMSNorm(d, config.rms_norm_eps, options.norm_offset)
        elif options.qk_norm == "proj":
            self.q_norm = ProjRMSNorm(heads * d, *q_rows, config.rms_norm_eps, options.norm_offset, group)
            self.k_norm = ProjRMSNorm(kv_heads * d, *kv_rows, config.rms_norm_eps, options.norm_offset, group)
        self.rope = layer.rope
        scale = options.attn_scale if options.attn_scale is not None else self.head_dim**-0.5
        self.attn = PagedAttention(
            self.num_heads, self.num_kv_heads, self.head_dim, scale, layer.sliding_window, options.attn_softcap,
            options.causal, options.attn_sinks,
        )
        if self.attn.sinks is not None:  # this rank's query heads' sink logits
            first = kv0 * per_kv
            self.attn.sinks.weight_loader = lambda param, tensor, part=None: _read_sinks(param, tensor, first, heads)

    def forward(
        self, ropes: dict[str, RotaryStep], x: torch.Tensor, residual: Optional[torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        """x: the normed hidden states; returns the attention output (+ residual when given)."""
        rows, heads, kv_heads, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        rope = ropes[self.rope] if self.rope is not None else None
        qkv = self.qkv_proj(x)
        if self.qk_norm is None:
            qkv = qkv.view(rows, heads + 2 * kv_heads, d)
            if rope is not None:
                rope.apply_(qkv[:, : heads + kv_heads])  # q and k, in place
            q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            if self.qk_norm == "head":
                # contiguous rows: the C norm the native decode step runs, for any number of rows
                q = self.q_norm(q.contiguous().view(rows, heads, d))
                k = self.k_norm(k.contiguous().view(rows, kv_heads, d))
            else:
                q = self.q_norm(q.contiguous()).view(rows, heads, d)
                k = self.k_norm(k.contiguous()).view(rows, kv_heads, d)
            v = v.view(rows, kv_heads, d)
            if rope is not None:
                rope.apply_(q)
                rope.apply_(k)
        return self.o_proj(self.attn(q, k, v, meta), residual)


def _read_sinks(param: nn.Parameter, tensor: CheckpointTensor, first: int, heads: int) -> None:
    if tuple(tensor.shape) != (heads,):
        raise ValueError(f"checkpoint tensor {tensor.name!r} has shape {tuple(tensor.shape)}, expected ({heads},).")
    read_rows(param, tensor, first, first + param.shape[0], 0, [])


class MLP(nn.Module):
    """This rank's intermediate rows, split in whole blocks of down_proj's input."""

    def __init__(self, config: Any, options: DecoderOptions, placement: Placement, prefix: str) -> None:
        super().__init__()
        group = placement.group
        self.activation = options.activation
        size = config.intermediate_size
        unit = placement.unit(f"{prefix}.down_proj.weight")
        i0, i1 = split_in_units(size, unit, group.world_size, group.rank)
        self.intermediate_size = i1 - i0
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [size, size], [(i0, i1), (i0, i1)], options.mlp_bias, group)
        self.down_proj = RowParallelLinear(size, config.hidden_size, i0, i1, unit, options.mlp_bias, group)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor]) -> torch.Tensor:
        """Returns MLP(x) (+ residual when given)."""
        gate_up = self.gate_up_proj(x)
        kernels = kernels_for(gate_up)
        if kernels is not None:  # the kernel the native decode step calls too
            act = gate_up.new_empty(gate_up.shape[0], self.intermediate_size)
            glu = kernels.shm_silu_and_mul if self.activation == "silu" else kernels.shm_gelu_tanh_and_mul
            glu(act.data_ptr(), gate_up.data_ptr(), gate_up.shape[0], self.intermediate_size)
        else:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            if self.activation == "silu":
                act = F.silu(gate).mul_(up)
            else:
                act = F.gelu(gate, approximate="tanh").mul_(up)
        return self.down_proj(act, residual)


class DecoderLayer(nn.Module):
    def __init__(self, config: Any, options: DecoderOptions, layer: LayerOptions, placement: Placement, prefix: str) -> None:
        super().__init__()
        self.self_attn = Attention(config, options, layer, placement, f"{prefix}.self_attn")
        if layer.moe:
            if options.mlp_bias:
                raise ValueError("mlp_bias is not supported in mixture-of-experts layers.")
            self.mlp: nn.Module = MoEMLP(config.hidden_size, options.moe, options.activation, placement, f"{prefix}.mlp")
        else:
            self.mlp = MLP(config, options, placement, f"{prefix}.mlp")
        self.norm_names = _NORM_NAMES[options.norm]
        for name in self.norm_names:
            if name is not None:
                setattr(self, name, RMSNorm(config.hidden_size, config.rms_norm_eps, options.norm_offset))
        self.residual_scale = options.residual_scale
        self.fused_residual = options.norm == "pre" and options.residual_scale == 1.0

    def _norm(self, role: int, x: torch.Tensor) -> torch.Tensor:
        name = self.norm_names[role]
        return x if name is None else getattr(self, name)(x)

    def forward(self, ropes: dict[str, RotaryStep], hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if self.fused_residual:  # the residual add inside o_proj's and down_proj's GEMMs
            hidden = self.self_attn(ropes, self._norm(0, hidden), hidden, meta)
            return self.mlp(self._norm(2, hidden), hidden)
        out = self._norm(1, self.self_attn(ropes, self._norm(0, hidden), None, meta))
        hidden = hidden + (out if self.residual_scale == 1.0 else out * self.residual_scale)
        out = self._norm(3, self.mlp(self._norm(2, hidden), None))
        return hidden + (out if self.residual_scale == 1.0 else out * self.residual_scale)


class MissingLayer(nn.Module):
    """A decoder layer another pipeline stage holds: no parameters, so that the layers this
    stage holds keep their checkpoint index (model.layers.N)."""

    def forward(self, *args: Any) -> torch.Tensor:
        raise RuntimeError("this decoder layer is held by another pipeline stage.")


class DecoderModel(nn.Module):
    """The embedding, the layers and the final norm, or the part of them a pipeline stage holds
    (`placement.stage`: its layers; the first stage the embedding, the last the norm)."""

    def __init__(self, config: Any, options: DecoderOptions, max_position: int, placement: Placement) -> None:
        super().__init__()
        stage = placement.stage
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size, placement.group)
                             if stage.is_first else None)
        head_dim = head_dim_of(config)
        used = {layer.rope for layer in options.layers if layer.rope is not None}
        # one table per rope kind, shared by the layers that use it
        self.rotary = nn.ModuleDict({
            key: RotaryEmbedding(config, head_dim, max_position, layer_type=None if key == "global" else key)
            for key in sorted(used)
        })
        self.layers = nn.ModuleList(
            DecoderLayer(config, options, layer, placement, f"model.layers.{index}") if stage.holds_layer(index)
            else MissingLayer() for index, layer in enumerate(options.layers)
        )
        self.held_layers = [layer for layer in self.layers if isinstance(layer, DecoderLayer)]
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, options.norm_offset) if stage.is_last else None
        self.embed_scale = options.embed_scale
        self.decode_step: Optional[DecodeStep] = None  # set by process_weights_after_loading

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        hidden: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """hidden: the previous pipeline stage's output (a stage without the embedding)."""
        if self.embed_tokens is not None:
            hidden = self.embed_tokens(input_ids)
            if self.embed_scale != 1.0:
                # transformers multiplies by the scale rounded to the weights' dtype
                hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        elif hidden is None:
            raise ValueError("a pipeline stage without the embedding needs the previous stage's hidden states.")
        if self.decode_step is not None:
            out = self.decode_step.run(hidden, positions, meta)
            if out is not None:
                return out
        # looked up once for all layers
        ropes = {key: table(positions, hidden.dtype, meta.rope_lengths) for key, table in self.rotary.items()}
        for layer in self.held_layers:
            hidden = layer(ropes, hidden, meta)
        return self.norm(hidden) if self.norm is not None else hidden


class DecoderForCausalLM(nn.Module):
    """A causal LM of any declared family. `max_position`: the longest position the engine will use."""

    packed_modules = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }

    def __init__(self, config: Any, max_position: int, options: DecoderOptions, placement: Placement) -> None:
        super().__init__()
        check_shardable(config, placement.world_size)
        self.config = config
        self.options = options
        self.world_size = placement.world_size
        self.stage = placement.stage
        self.model = DecoderModel(config, options, max_position, placement)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, placement.group) if self.stage.is_last else None
        if self.tie_word_embeddings and self.lm_head is not None and self.model.embed_tokens is not None:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        hidden: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> final hidden states [num_tokens, hidden_size]
        (a pipeline stage: its layers' output; one after the first takes the previous one's as `hidden`)."""
        return self.model(input_ids, positions, meta, hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states of the sampled rows -> float32 logits [rows, vocab_size]."""
        logits = self.lm_head(hidden)
        if self.options.logits_scale != 1.0:
            logits = logits * self.options.logits_scale
        cap = self.options.final_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def decode_burst(self, token: int, position: int, block_table: np.ndarray, count: int, stops: Sequence[int],
                     masked: Sequence[int], masked_tokens: int,
                     input_waiting: Optional[Callable[[], bool]]) -> Optional[list[int]]:
        """Greedy tokens of one sequence decoded in one native call (DecodeStep.burst); None where
        the native step or its head does not apply (the caller then runs the model a token a step)."""
        step = self.model.decode_step
        if step is None:
            return None
        return step.burst(token, position, block_table, count, stops, masked, masked_tokens, input_waiting)

    def tie_blocks(self) -> None:
        """A tied lm_head runs on the embedding's blocks when the embedding has them."""
        if self.model.embed_tokens is None or self.lm_head is None:
            return  # a pipeline stage with one of them loads the lm_head from the embedding's tensor itself
        blocks = self.model.embed_tokens.blocks
        if self.tie_word_embeddings and blocks is not None:
            self.lm_head.set_blocks([(0, blocks)])

    def process_weights_after_loading(self) -> None:
        """Packs every linear layer's weight for the device's fastest GEMM (see linear.py), folds
        (1 + w) norms, and sets up the native decode step where the options allow it."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()
            elif isinstance(module, RMSNorm):
                module.fold_offset()
        # the native all-layer step knows nothing of the collectives
        step = DecodeStep(self.model) if decode_step_enabled() and self.world_size == 1 and self.stage.whole else None
        self.model.decode_step = step if step is not None and step.usable() else None
        if (self.model.decode_step is not None and self.lm_head is not None and self.options.logits_scale == 1.0
                and self.options.final_softcap is None and self.model.embed_scale == 1.0):
            self.model.decode_step.set_head(self.model.embed_tokens, self.lm_head)
        if step is not None and self.model.decode_step is None:
            logger.info("single-request decode runs layer by layer: %s", "; ".join(decode_fallback_reasons(self.model))
                        or "no C kernels")

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.held_layers]

    def checkpoint_name(self, name: str) -> str:
        """A checkpoint tensor's name in this model's terms (the family's renames applied); a
        base model's checkpoint (Gemma3TextModel: EmbeddingGemma) names its tensors without "model."."""
        if not name.startswith(("model.", "lm_head.")):
            name = "model." + name
        for old, new in self.options.renames:
            name = name.replace(old, new)
        if name == "model.embed_tokens.weight" and self.model.embed_tokens is None and self.tie_word_embeddings:
            return "lm_head.weight"  # the last pipeline stage's tied lm_head, without the embedding
        return name

    def skips(self, name: str) -> bool:
        """Whether checkpoint tensor `name` (in this model's terms) belongs to another pipeline
        stage: its layer, or the embedding / norm / lm_head this stage does not hold."""
        stage = self.stage
        if stage.whole:
            return False
        if name.startswith("model.layers."):
            return not stage.holds_layer(int(name.split(".", 3)[2]))
        if name.startswith("model.embed_tokens."):
            return self.model.embed_tokens is None
        if name.startswith(("model.norm.", "lm_head.")):
            return self.lm_head is None
        return False

    def shard_for(self, param_name: str) -> tuple[str, int] | None:
        """A checkpoint name of a fused part -> (our parameter, the part's index)."""
        for packed, shards in self.packed_modules.items():
            for index, shard in enumerate(shards):
                marker = f".{shard}."
                if marker in param_name:
                    return param_name.replace(marker, f".{packed}."), index
        return None


@dataclass(frozen=True)
class Family:
    """What a family file declares: its options from the HF config, and its GGUF names."""

    options: Callable[[Any], DecoderOptions]
    gguf_names: dict[str, str]  # GGUF tensor name after "blk.N." -> checkpoint name after "model.layers.N."
    gguf_norms_minus_one: bool = False  # GGUF stores (1 + w) norms: transformers subtracts 1 on load (Gemma)
    gguf_permute_qk: tuple[str, ...] = ()  # file architectures whose q/k rows llama.cpp interleaved ("llama")
    # an HF checkpoint's tensors as the model's parameters take them (gpt-oss: its stacked experts one by one)
    split_checkpoint: Optional[Callable[[Iterable[tuple[str, Any]]], Iterable[tuple[str, Any]]]] = None

    def build(self, config: Any, max_position: int, placement: Optional[Placement] = None) -> DecoderForCausalLM:
        options = self.options(config)
        # a window no position reaches is no window: the layer (and the model) stays plain
        layers = tuple(
            replace(layer, sliding_window=None)
            if layer.sliding_window is not None and layer.sliding_window >= max_position else layer
            for layer in options.layers
        )
        return DecoderForCausalLM(config, max_position, replace(options, layers=layers), placement or Placement())


# the GGUF names every family shares (llama.cpp's names on the left)
LLAMA_GGUF_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def gelu_tanh_or_silu(name: str) -> str:
    """transformers' activation name -> our option (a ValueError naming it otherwise)."""
    if name in ("silu", "swish"):
        return "silu"
    if name in ("gelu_pytorch_tanh", "gelu_tanh"):
        return "gelu_tanh"
    raise ValueError(f"hidden_act / hidden_activation {name!r} is not supported; supported: silu, gelu_pytorch_tanh.")


def sqrt_hidden(config: Any) -> float:
    return math.sqrt(config.hidden_size)
