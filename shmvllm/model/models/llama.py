"""Llama, Mistral and Qwen2: the plain options (Mistral's window, where it has one, and Qwen2's
q/k/v bias)."""

from __future__ import annotations

from typing import Any

from shmvllm.model.decoder import LLAMA_GGUF_NAMES, DecoderOptions, Family, gelu_tanh_or_silu, standard_options


def options(config: Any) -> DecoderOptions:
    activation = gelu_tanh_or_silu(getattr(config, "hidden_act", "silu"))
    if activation != "silu":
        raise ValueError(f"hidden_act must be 'silu' for the Llama family, got {config.hidden_act!r}.")
    if config.model_type == "qwen2":  # q/k/v always biased, o_proj never
        return standard_options(config, qkv_bias=True, o_bias=False)
    return standard_options(config)


FAMILY = Family(options=options, gguf_names=LLAMA_GGUF_NAMES, gguf_permute_qk=("llama",))
