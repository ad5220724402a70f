"""Gemma 2: (1 + w) norms before and after attention and MLP, GeGLU (tanh GELU), embeddings
scaled by sqrt(hidden), scores scaled by query_pre_attn_scalar ** -0.5, attention and final
logit soft-capping, sliding-window layers alternating with global ones."""

from __future__ import annotations

from typing import Any

from shmvllm.model.decoder import LLAMA_GGUF_NAMES, DecoderOptions, Family, gelu_tanh_or_silu, sqrt_hidden, standard_options

GEMMA_GGUF_NAMES = {
    **LLAMA_GGUF_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def gemma_options(config: Any, **overrides: Any) -> DecoderOptions:
    return standard_options(
        config, norm="sandwich", norm_offset=1.0, activation=gelu_tanh_or_silu(config.hidden_activation),
        embed_scale=sqrt_hidden(config), attn_scale=config.query_pre_attn_scalar**-0.5,
        attn_softcap=getattr(config, "attn_logit_softcapping", None),
        final_softcap=getattr(config, "final_logit_softcapping", None), **overrides,
    )


FAMILY = Family(options=gemma_options, gguf_names=GEMMA_GGUF_NAMES, gguf_norms_minus_one=True)
