"""Gemma 3 text (Gemma3ForCausalLM): Gemma 2's layout without its soft-capping (unless the
config sets it), plus per-head q/k norms and a separate rope base for the sliding layers (the
config's rope parameters per layer type)."""

from __future__ import annotations

from typing import Any

from shmvllm.model.decoder import DecoderOptions, Family
from shmvllm.model.models.gemma2 import GEMMA_GGUF_NAMES, gemma_options


def options(config: Any) -> DecoderOptions:
    return gemma_options(config, qk_norm="head")


FAMILY = Family(
    options=options,
    gguf_names={**GEMMA_GGUF_NAMES, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
    gguf_norms_minus_one=True,
)
