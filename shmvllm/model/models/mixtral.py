"""Mixtral: Mistral's attention and, in every layer, a softmax router over `num_local_experts`
whose top-k weights are renormalized; the checkpoint's block_sparse_moe.experts.N.w1 / w3 / w2
load as the experts' gate / up / down projections. A GGUF file of it is llama.cpp's "llama" with
experts (registry: its MixtralConfig): llama's names and q/k row interleave, the experts stacked."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from shmvllm.model.decoder import LLAMA_GGUF_NAMES, DecoderOptions, Family, gelu_tanh_or_silu, standard_options
from shmvllm.model.moe import MOE_GGUF_NAMES, MoEOptions

_RENAMES = ((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj."))


def options(config: Any) -> DecoderOptions:
    activation = gelu_tanh_or_silu(config.hidden_act)
    moe = MoEOptions(
        num_experts=config.num_local_experts, top_k=config.num_experts_per_tok,
        intermediate_size=config.intermediate_size, norm_topk_prob=True,
    )
    base = standard_options(config, activation=activation, renames=_RENAMES)
    return replace(base, layers=tuple(replace(layer, moe=True) for layer in base.layers), moe=moe)


FAMILY = Family(options=options, gguf_names={**LLAMA_GGUF_NAMES, **MOE_GGUF_NAMES}, gguf_permute_qk=("llama",))
