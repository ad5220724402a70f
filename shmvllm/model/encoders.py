"""The encoder families of the pooling runner, and loading one (with its classification head,
for a `*ForSequenceClassification` checkpoint) from a model directory's safetensors files."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:  # the frontend asks pooling_tasks() without importing torch
    import torch
    from torch import nn

    from shmvllm.model.classifier import SequenceClassifier

ENCODER_MODEL_TYPES = ("bert", "roberta", "xlm-roberta", "modernbert")


def is_classifier(hf_config: Any) -> bool:
    """A sequence-classification checkpoint (a cross-encoder reranker or a classifier)."""
    return any(a.endswith("ForSequenceClassification") for a in getattr(hf_config, "architectures", None) or [])


def max_positions(hf_config: Any) -> int:
    """The longest sequence the position embeddings cover (RoBERTa's start after padding_idx)."""
    limit = hf_config.max_position_embeddings
    if hf_config.model_type in ("roberta", "xlm-roberta"):
        limit -= hf_config.pad_token_id + 1
    return limit


def load_encoder(
    model_dir: Path, hf_config: Any, dtype: "torch.dtype", device: "torch.device"
) -> "tuple[nn.Module, Optional[SequenceClassifier]]":
    """(encoder, classification head or None), in eval mode, on `device`."""
    import torch
    from safetensors.torch import load_file

    from shmvllm.model.classifier import pop_classifier

    if hf_config.model_type not in ENCODER_MODEL_TYPES:
        raise ValueError(f"model_type {hf_config.model_type!r} is not an encoder shmvllm runs; supported: {ENCODER_MODEL_TYPES}.")
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"model directory {str(model_dir)!r} has no .safetensors weights.")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(load_file(file))
    head = pop_classifier(hf_config, weights) if is_classifier(hf_config) else None
    if hf_config.model_type == "modernbert":
        from shmvllm.model.modernbert import ModernBertModel as model_class
    else:
        from shmvllm.model.bert import BertModel as model_class
    from shmvllm.model.loader import built_on_meta

    with built_on_meta():
        model = model_class(hf_config)
    model = model.to_empty(device="cpu")
    model.load_weights(weights)
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    if hasattr(model, "pack_linears"):  # BERT's linears run on the AVX2 GEMM on x86 (model/encoder_gemm.py)
        model.pack_linears()
    if head is not None:
        head = head.to(device=device, dtype=dtype).eval().requires_grad_(False)
    return model, head


def pooling_tasks(hf_config: Any) -> tuple[str, ...]:
    """What a pooling model does (vLLM's task names), its default first."""
    if is_classifier(hf_config):
        return ("classify", "score") if hf_config.num_labels == 1 else ("classify",)
    return ("embed", "token_embed")
