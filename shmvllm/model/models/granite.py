"""Granite (3.x): Llama's layer with four scales: embeddings times embedding_multiplier, each
block's output times residual_multiplier before the residual add, scores times
attention_multiplier (instead of head_dim ** -0.5), logits divided by logits_scaling."""

from __future__ import annotations

from typing import Any

from shmvllm.model.decoder import DecoderOptions, Family, gelu_tanh_or_silu, standard_options


def options(config: Any) -> DecoderOptions:
    return standard_options(
        config, activation=gelu_tanh_or_silu(config.hidden_act), embed_scale=config.embedding_multiplier,
        residual_scale=config.residual_multiplier, attn_scale=config.attention_multiplier,
        logits_scale=1.0 / config.logits_scaling,
    )


# no GGUF names: transformers' GGUF loader reads no granite file, so such a file is refused by name
FAMILY = Family(options=options, gguf_names={})
