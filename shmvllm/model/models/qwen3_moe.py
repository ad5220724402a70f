"""Qwen3-MoE: Qwen3's attention, and a mixture of experts in the layers that `mlp_only_layers`
and `decoder_sparse_step` leave sparse (the others keep a dense MLP of `intermediate_size`)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from shmvllm.model.decoder import LLAMA_GGUF_NAMES, DecoderOptions, Family, gelu_tanh_or_silu, standard_options
from shmvllm.model.moe import MOE_GGUF_NAMES, MoEOptions


def options(config: Any) -> DecoderOptions:
    dense = set(getattr(config, "mlp_only_layers", None) or [])
    step = getattr(config, "decoder_sparse_step", 1) or 1
    sparse = [i not in dense and config.num_local_experts > 0 and (i + 1) % step == 0 for i in range(config.num_hidden_layers)]
    base = standard_options(config, qk_norm="head", activation=gelu_tanh_or_silu(config.hidden_act))
    moe = MoEOptions(
        num_experts=config.num_local_experts, top_k=config.num_experts_per_tok,
        intermediate_size=config.moe_intermediate_size, norm_topk_prob=bool(config.norm_topk_prob),
    ) if any(sparse) else None
    layers = tuple(replace(layer, moe=flag) for layer, flag in zip(base.layers, sparse))
    return replace(base, layers=layers, moe=moe)


FAMILY = Family(
    options=options,
    gguf_names={**LLAMA_GGUF_NAMES, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", **MOE_GGUF_NAMES},
)
