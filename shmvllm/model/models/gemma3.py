"""Gemma 3 text (Gemma3ForCausalLM): Gemma 2's layout without its soft-capping (unless the
config sets it), plus per-head q/k norms and a separate rope base for the sliding layers (the
config's rope parameters per layer type). With use_bidirectional_attention (EmbeddingGemma, a
Gemma3TextModel checkpoint) attention is not causal and a sliding layer sees the keys closer than
sliding_window // 2 + 1 either side, as transformers converts config.json's window."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from shmvllm.model.decoder import DecoderOptions, Family
from shmvllm.model.models.gemma2 import GEMMA_GGUF_NAMES, gemma_options


def options(config: Any) -> DecoderOptions:
    if not getattr(config, "use_bidirectional_attention", False):
        return gemma_options(config, qk_norm="head")
    base = gemma_options(config, qk_norm="head", causal=False)
    # to_dict() holds config.json's window on transformers' object (which halved it) and on HFConfig alike
    window = config.to_dict()["sliding_window"] // 2 + 1
    layers = tuple(replace(layer, sliding_window=window) if layer.sliding_window is not None else layer for layer in base.layers)
    return replace(base, layers=layers)


FAMILY = Family(
    options=options,
    gguf_names={**GEMMA_GGUF_NAMES, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
    gguf_norms_minus_one=True,
)
