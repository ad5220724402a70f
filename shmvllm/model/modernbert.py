"""Native ModernBERT encoder over packed sequences (no padding anywhere).

Pre-LayerNorm blocks (the first without its attention norm), bias-free LayerNorms and linears
where the config says so, rotary position embeddings with one base per layer type (global and
local layers), local layers attending within `sliding_window` positions either side, and a
GeGLU MLP (`Wi` makes input and gate, act(input) * gate, then `Wo`). Attention is model/bert.py's
AttentionPlan (per sequence in C on the CPU, else per run of equal-length sequences); a local
layer limits each query to its window (the SDPA runs add a band mask to runs longer than it).

Weights: a Hugging Face `ModernBertModel` directory, with or without the `model.` prefix of
`ModernBertFor*` checkpoints; a classification head is taken out before (model/classifier.py),
a masked-LM head is ignored.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from shmvllm.model.bert import AttentionPlan

_IGNORED_PREFIXES = ("head.", "decoder.")
_ACTIVATIONS = {"gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu, "relu": F.relu}


def _layer_norm(config: Any) -> nn.LayerNorm:
    return nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.norm_bias)


class ModernBertEmbeddings(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.norm = _layer_norm(config)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.norm(self.tok_embeddings(input_ids))


class ModernBertAttention(nn.Module):
    def __init__(self, config: Any, local: bool) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.Wqkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=config.attention_bias)
        self.Wo = nn.Linear(config.hidden_size, config.hidden_size, bias=config.attention_bias)
        self.window: Optional[int] = config.sliding_window if local else None

    @torch.no_grad()
    def fold_query_scale(self) -> None:
        """The softmax scale folded into the query rows (rope rotates, so it commutes with scaling)."""
        hidden = self.num_heads * self.head_dim
        self.Wqkv.weight[:hidden] *= self.head_dim**-0.5
        if self.Wqkv.bias is not None:
            self.Wqkv.bias[:hidden] *= self.head_dim**-0.5

    def forward(
        self, x: torch.Tensor, plan: AttentionPlan, cos: torch.Tensor, sin: torch.Tensor, query_at: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        qkv = self.Wqkv(x)
        qk = qkv.view(x.shape[0], 3, self.num_heads, self.head_dim)[:, :2]
        qkv.view(x.shape[0], 3, self.num_heads, self.head_dim)[:, :2] = qk * cos + _rotate_half(qk) * sin
        if query_at is None:
            return self.Wo(plan.attend(qkv, self.num_heads, self.head_dim, self.window))
        hidden = self.num_heads * self.head_dim
        q = qkv[plan.token_rows(query_at), :hidden]
        return self.Wo(plan.attend_one(q, qkv[:, hidden:], self.num_heads, self.head_dim, query_at, self.window))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class ModernBertMLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.Wi = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.Wo = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        if config.hidden_activation not in _ACTIVATIONS:
            raise ValueError(f"hidden_activation {config.hidden_activation!r} is not supported; supported: {sorted(_ACTIVATIONS)}.")
        self.act = _ACTIVATIONS[config.hidden_activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inputs, gate = self.Wi(x).chunk(2, dim=-1)
        return self.Wo(self.act(inputs) * gate)


class ModernBertLayer(nn.Module):
    def __init__(self, config: Any, index: int) -> None:
        super().__init__()
        self.layer_type = config.layer_types[index]
        self.attn_norm = nn.Identity() if index == 0 else _layer_norm(config)
        self.attn = ModernBertAttention(config, local=self.layer_type == "sliding_attention")
        self.mlp_norm = _layer_norm(config)
        self.mlp = ModernBertMLP(config)

    def forward(
        self, x: torch.Tensor, plan: AttentionPlan, cos: torch.Tensor, sin: torch.Tensor, query_at: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """query_at (see AttentionPlan.attend_one): the layer's output for those tokens only, one per sequence."""
        attn = self.attn(self.attn_norm(x), plan, cos, sin, query_at)
        if query_at is not None:
            x = x.index_select(0, plan.token_rows(query_at))
        x = x + attn
        return x + self.mlp(self.mlp_norm(x))


class ModernBertModel(nn.Module):
    """Returns the last hidden state of every packed token: [num_tokens, hidden_size], or of one
    token per sequence (`query_at`, as BertModel): [num_seqs, hidden_size]."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        types = set(config.layer_types)
        if not types <= {"full_attention", "sliding_attention"}:
            raise ValueError(f"layer_types {sorted(types)} are not supported: full_attention and sliding_attention are.")
        for layer_type in types:
            rope = config.rope_parameters[layer_type]
            if rope.get("rope_type", "default") != "default":
                raise ValueError(f"rope_parameters[{layer_type!r}] rope_type {rope['rope_type']!r} is not supported; supported: default.")
        self.embeddings = ModernBertEmbeddings(config)
        self.layers = nn.ModuleList(ModernBertLayer(config, i) for i in range(config.num_hidden_layers))
        self.final_norm = _layer_norm(config)

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    def _rope(self, positions: torch.Tensor, layer_type: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [num_tokens, 1, 1, head_dim] for this layer type's base (computed in fp32)."""
        head_dim = self.config.hidden_size // self.config.num_attention_heads
        base = self.config.rope_parameters[layer_type]["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim))
        freqs = positions[:, None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cu_seqlens: list[int],
        token_type_ids: Optional[torch.Tensor] = None,
        query_at: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens]; cu_seqlens: len = num_seqs + 1. ModernBERT has no token types.
        query_at: as BertModel's (the last layer's queries, attention output and MLP for those tokens only)."""
        if token_type_ids is not None:
            raise ValueError("ModernBERT has no token type embeddings: token_type_ids must be None.")
        plan = AttentionPlan(cu_seqlens)
        x = self.embeddings(input_ids)
        ropes = {t: self._rope(positions, t, x.dtype) for t in set(self.config.layer_types)}
        for layer in self.layers[:-1]:
            x = layer(x, plan, *ropes[layer.layer_type])
        last = self.layers[-1]
        return self.final_norm(last(x, plan, *ropes[last.layer_type], query_at))

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Loads HF ModernBertModel tensors (names with or without `model.`)."""
        own = {}
        for name, tensor in state_dict.items():
            name = name.removeprefix("model.")
            if not name.startswith(_IGNORED_PREFIXES):
                own[name] = tensor
        missing, unexpected = self.load_state_dict(own, strict=False)
        if missing or unexpected:
            raise ValueError(f"ModernBERT weights do not match the config: missing {missing[:5]}, unexpected {unexpected[:5]}.")
        for layer in self.layers:
            layer.attn.fold_query_scale()
