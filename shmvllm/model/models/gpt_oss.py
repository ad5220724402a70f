"""gpt-oss (GptOssForCausalLM): Llama's pre-norm layers with biases on q/k/v/o, a learned sink
logit per query head in each attention softmax, sliding-window and full layers alternating
(config.layer_types), YaRN rope, and in every layer a mixture of experts: a router with a bias
whose top-k logits are softmaxed, experts with biases and the clamped SwiGLU (alpha, limit).

The HF checkpoint ships each layer's experts stacked: gate_up_proj [experts, hidden, 2 *
intermediate] with gate and up interleaved column by column, down_proj [experts, intermediate,
hidden] (both x @ W), and their biases; `split_experts` hands them to the loader as each
expert's gate / up / down rows, the layout llama.cpp's converter writes into a GGUF file
(gate and up de-interleaved, transposed; MXFP4 blocks), so both load the same way.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Iterable, Iterator

from shmvllm.model.checkpoint import CheckpointTensor, DerivedTensor
from shmvllm.model.decoder import LLAMA_GGUF_NAMES, DecoderOptions, Family, standard_options
from shmvllm.model.moe import MOE_GGUF_NAMES, MoEOptions

# stacked checkpoint name -> each expert's parts: (projection, the columns it takes)
_STACKED = {
    "gate_up_proj": (("gate_proj", slice(0, None, 2)), ("up_proj", slice(1, None, 2))),
    "down_proj": (("down_proj", slice(None)),),
}


def options(config: Any) -> DecoderOptions:
    moe = MoEOptions(
        num_experts=config.num_local_experts, top_k=config.num_experts_per_tok,
        intermediate_size=config.intermediate_size, norm_topk_prob=False, router_bias=True, softmax_topk=True,
        expert_bias=True, swiglu_limit=float(config.swiglu_limit), swiglu_alpha=float(config.swiglu_alpha),
    )
    # the router is MoEMLP's gate; the sinks are the attention kernel's (a GGUF file names them sinks.weight)
    renames = ((".mlp.router.", ".mlp.gate."), (".self_attn.sinks", ".self_attn.attn.sinks"), (".attn.sinks.weight", ".attn.sinks"))
    base = standard_options(config, attn_sinks=True, renames=renames)
    return replace(base, layers=tuple(replace(layer, moe=True) for layer in base.layers), moe=moe)


def split_experts(tensors: Iterable[tuple[str, CheckpointTensor]]) -> Iterator[tuple[str, CheckpointTensor]]:
    """The checkpoint's stacked experts as one tensor per expert and projection (weights [rows,
    k], biases [rows]); every other tensor as it is. Each expert's part is read when loaded."""
    for name, tensor in tensors:
        stem, _, leaf = name.rpartition(".mlp.experts.")
        stacked, bias = (leaf[: -len("_bias")], True) if leaf.endswith("_bias") else (leaf, False)
        if not stem or stacked not in _STACKED:
            yield name, tensor
            continue
        for expert in range(tensor.shape[0]):
            for projection, columns in _STACKED[stacked]:
                target = f"{stem}.mlp.experts.{expert}.{projection}.{'bias' if bias else 'weight'}"
                yield target, DerivedTensor(target, tensor, expert, columns, transpose=not bias)


FAMILY = Family(
    options=options,
    gguf_names={
        **LLAMA_GGUF_NAMES, **MOE_GGUF_NAMES, "post_attention_norm": "post_attention_layernorm",
        "attn_sinks": "self_attn.sinks",
    },
    split_checkpoint=split_experts,
)
