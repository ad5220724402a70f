"""Phi-3 / Phi-4-mini: Llama's layer with the checkpoint's fused qkv_proj and gate_up_proj
(loaded as they are), a rotation of only the first partial_rotary_factor of each head, and
LongRoPE's short / long factors (model/rotary.py); a window on every layer where the config has one."""

from __future__ import annotations

from typing import Any

from shmvllm.model.decoder import DecoderOptions, Family, gelu_tanh_or_silu, standard_options


def options(config: Any) -> DecoderOptions:
    return standard_options(config, activation=gelu_tanh_or_silu(config.hidden_act))


FAMILY = Family(
    options=options,
    gguf_names={
        "attn_norm": "input_layernorm",
        "attn_qkv": "self_attn.qkv_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_norm": "post_attention_layernorm",
        "ffn_up": "mlp.gate_up_proj",  # llama.cpp's phi3 keeps gate and up fused in ffn_up
        "ffn_down": "mlp.down_proj",
    },
)
