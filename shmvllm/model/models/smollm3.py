"""SmolLM3: Llama's layer, with every layer whose `no_rope_layers` entry is 0 attending without
rotary (NoPE; by default every fourth)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from shmvllm.model.decoder import DecoderOptions, Family, gelu_tanh_or_silu, standard_options


def options(config: Any) -> DecoderOptions:
    base = standard_options(config, activation=gelu_tanh_or_silu(config.hidden_act))
    uses_rope = list(config.no_rope_layers)  # 1: the layer rotates (transformers' naming), 0: it does not
    if len(uses_rope) != len(base.layers):
        raise ValueError(f"no_rope_layers has {len(uses_rope)} entries for {len(base.layers)} layers.")
    layers = tuple(layer if use else replace(layer, rope=None) for layer, use in zip(base.layers, uses_rope))
    return replace(base, layers=layers)


# no GGUF names: transformers' GGUF loader reads no smollm3 file, so such a file is refused by name
FAMILY = Family(options=options, gguf_names={})
