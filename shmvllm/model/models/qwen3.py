"""Qwen3: Llama plus an RMSNorm over each query and key head before the rotation."""

from __future__ import annotations

from typing import Any

from shmvllm.model.decoder import LLAMA_GGUF_NAMES, DecoderOptions, Family, gelu_tanh_or_silu, standard_options


def options(config: Any) -> DecoderOptions:
    return standard_options(config, qk_norm="head", activation=gelu_tanh_or_silu(config.hidden_act))


FAMILY = Family(
    options=options,
    gguf_names={**LLAMA_GGUF_NAMES, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
)
