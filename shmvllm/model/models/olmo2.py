"""OLMo 2: norms after attention and after the MLP (none before), and an RMSNorm over the whole
query and key projections (all heads at once) before the rotation."""

from __future__ import annotations

from typing import Any

from shmvllm.model.decoder import DecoderOptions, Family, gelu_tanh_or_silu, standard_options


def options(config: Any) -> DecoderOptions:
    return standard_options(config, norm="post", qk_norm="proj", activation=gelu_tanh_or_silu(config.hidden_act))


# no GGUF names: transformers' GGUF loader reads no olmo2 file, so such a file is refused by name
FAMILY = Family(options=options, gguf_names={})
