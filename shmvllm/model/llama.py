"""The Llama family (Llama, Mistral, Qwen2) as native modules over a paged KV cache.

Module and parameter names follow transformers' so that checkpoints load by name, except
that q/k/v projections are fused into `qkv_proj` and gate/up into `gate_up_proj` (one GEMM
each instead of three and two); the loader stacks the checkpoint's shards into them.

The forward pass takes a flat batch of tokens ([num_tokens]) from many requests and returns
hidden states; `compute_logits` runs the lm_head only on the rows that are sampled.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from torch import nn

from shmvllm.model.attention import AttentionMetadata, PagedAttention
from shmvllm.model.decode_step import DecodeStep
from shmvllm.model.decode_step import enabled as decode_step_enabled
from shmvllm.model.kernels import kernels_for
from shmvllm.model.linear import Linear, VocabEmbedding
from shmvllm.model.rotary import RotaryEmbedding, RotaryStep

logger = logging.getLogger(__name__)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """transformers' arithmetic (normalize in fp32, cast, then scale): one C kernel or one
        fused torch op for fp32, where the cast is a no-op."""
        kernels = kernels_for(x, self.weight) if x.is_contiguous() else None
        if kernels is not None:
            out = torch.empty_like(x)
            hidden = x.shape[-1]
            kernels.shm_rms_norm(out.data_ptr(), x.data_ptr(), self.weight.data_ptr(), x.numel() // hidden, hidden, self.eps)
            return out
        if x.dtype == torch.float32:
            return torch.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * torch.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


class LlamaAttention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        qkv_bias = _has_qkv_bias(config)
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        o_bias = bool(getattr(config, "attention_bias", False)) and config.model_type != "qwen2"
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=o_bias)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)

    def forward(
        self, rope: RotaryStep, x: torch.Tensor, residual: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """x: the normed hidden states; returns residual + attention output."""
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x).view(num_tokens, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        rope.apply_(qkv[:, : self.num_heads + self.num_kv_heads])  # q and k, in place
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        return self.o_proj(self.attn(q, k, v, meta), residual)


class LlamaMLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act must be 'silu' for the Llama family, got {config.hidden_act!r}.")
        bias = bool(getattr(config, "mlp_bias", False))
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Returns residual + MLP(x)."""
        gate_up = self.gate_up_proj(x)
        kernels = kernels_for(gate_up)
        if kernels is not None:
            act = gate_up.new_empty(gate_up.shape[0], self.intermediate_size)
            kernels.shm_silu_and_mul(act.data_ptr(), gate_up.data_ptr(), gate_up.shape[0], self.intermediate_size)
        else:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            act = torch.nn.functional.silu(gate).mul_(up)
        return self.down_proj(act, residual)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, rope: RotaryStep, hidden: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        hidden = self.self_attn(rope, self.input_layernorm(hidden), hidden, meta)
        return self.mlp(self.post_attention_layernorm(hidden), hidden)


class LlamaModel(nn.Module):
    def __init__(self, config: Any, max_position: int) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.rotary_emb = RotaryEmbedding(config, head_dim, max_position)  # shared by all layers
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.decode_step: Optional[DecodeStep] = None  # set by process_weights_after_loading

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.decode_step is not None:
            out = self.decode_step.run(hidden, positions, meta)
            if out is not None:
                return out
        rope = self.rotary_emb(positions, hidden.dtype, meta.rope_lengths)  # looked up once for all layers
        for layer in self.layers:
            hidden = layer(rope, hidden, meta)
        return self.norm(hidden)


class LlamaForCausalLM(nn.Module):
    """Llama / Mistral / Qwen2 decoder. `max_position`: the longest position the engine will use."""

    packed_modules = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }

    def __init__(self, config: Any, max_position: int) -> None:
        super().__init__()
        window = _sliding_window(config)
        if window is not None and window < max_position:
            logger.warning(
                "sliding_window=%d is not implemented: attention sees the whole context, so outputs past "
                "%d tokens differ from the reference (max_model_len is %d)", window, window, max_position,
            )
        self.config = config
        self.model = LlamaModel(config, max_position)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> final hidden states [num_tokens, hidden_size]."""
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states of the sampled rows -> float32 logits [rows, vocab_size]."""
        return self.lm_head(hidden).float()

    def tie_blocks(self) -> None:
        """A tied lm_head runs on the embedding's blocks when the embedding has them."""
        blocks = self.model.embed_tokens.blocks
        if self.tie_word_embeddings and blocks is not None:
            self.lm_head.set_blocks([(0, blocks)])

    def process_weights_after_loading(self) -> None:
        """Packs every linear layer's weight for the device's fastest GEMM (see linear.py)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()
        step = DecodeStep(self.model) if decode_step_enabled() else None
        self.model.decode_step = step if step is not None and step.usable() else None

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def shard_for(self, param_name: str) -> tuple[str, int, int] | None:
        """A checkpoint name of a fused shard -> (our parameter, row offset, row count)."""
        for packed, shards in self.packed_modules.items():
            for index, shard in enumerate(shards):
                marker = f".{shard}."
                if marker not in param_name:
                    continue
                target = param_name.replace(marker, f".{packed}.")
                sizes = self._shard_sizes(packed)
                return target, sum(sizes[:index]), sizes[index]
        return None

    def _shard_sizes(self, packed: str) -> list[int]:
        attn = self.model.layers[0].self_attn
        if packed == "qkv_proj":
            return [attn.q_size, attn.kv_size, attn.kv_size]
        size = self.model.layers[0].mlp.intermediate_size
        return [size, size]


def _sliding_window(config: Any) -> int | None:
    if config.model_type == "qwen2" and not getattr(config, "use_sliding_window", False):
        return None
    return getattr(config, "sliding_window", None)


def _has_qkv_bias(config: Any) -> bool:
    if config.model_type == "qwen2":
        return True
    return bool(getattr(config, "attention_bias", False))
