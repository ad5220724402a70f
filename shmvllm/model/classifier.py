"""Sequence-classification heads of the encoders (cross-encoder rerankers and classifiers):
packed last hidden states -> one row of logits per sequence, as transformers'
`*ForSequenceClassification` computes them.

- BERT: the [CLS] state through the pooler (dense + tanh), then `classifier`.
- RoBERTa / XLM-RoBERTa: the <s> state through `classifier.dense` + tanh, then `classifier.out_proj`.
- ModernBERT: the CLS state or the mean of the sequence (`classifier_pooling`), through
  `head.dense`, the activation and `head.norm`, then `classifier`.

What the logits become (softmax, sigmoid, nothing) is the runner's choice per task
(worker/pooling_runner.py).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn


class SequenceClassifier(nn.Module):
    def __init__(self, kind: str, config: Any) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.kind = kind
        self.num_labels = config.num_labels
        self.dense = nn.Linear(hidden, hidden, bias=kind != "modernbert" or config.classifier_bias)
        self.out = nn.Linear(hidden, self.num_labels)
        self.norm: Optional[nn.LayerNorm] = None
        self.mean_pooling = False
        if kind == "modernbert":
            self.norm = nn.LayerNorm(hidden, eps=config.norm_eps, bias=config.norm_bias)
            if config.classifier_pooling not in ("cls", "mean"):
                raise ValueError(f"classifier_pooling {config.classifier_pooling!r} is not supported; supported: cls, mean.")
            self.mean_pooling = config.classifier_pooling == "mean"
            self.act = _hidden_act(config.classifier_activation)

    def forward(self, hidden: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """hidden: [num_tokens, H] packed; cu_seqlens: [num_seqs + 1] -> logits [num_seqs, num_labels]."""
        starts, ends = cu_seqlens[:-1], cu_seqlens[1:]
        if self.mean_pooling:
            lengths = ends - starts
            seq_ids = torch.repeat_interleave(torch.arange(len(lengths), device=hidden.device), lengths)
            sums = hidden.new_zeros(len(lengths), hidden.shape[1]).index_add_(0, seq_ids, hidden)
            pooled = sums / lengths.unsqueeze(1).to(hidden.dtype)
        else:
            pooled = hidden.index_select(0, starts)
        if self.norm is not None:
            x = self.norm(self.act(self.dense(pooled)))
        else:
            x = torch.tanh(self.dense(pooled))
        return self.out(x)


def _hidden_act(name: str) -> Any:
    acts = {"gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu, "relu": F.relu}
    if name not in acts:
        raise ValueError(f"classifier_activation {name!r} is not supported; supported: {sorted(acts)}.")
    return acts[name]


# Where each family keeps its head's tensors: our name -> the checkpoint's.
_HEAD_NAMES = {
    "bert": {"dense": "bert.pooler.dense", "out": "classifier"},
    "roberta": {"dense": "classifier.dense", "out": "classifier.out_proj"},
    "modernbert": {"dense": "head.dense", "norm": "head.norm", "out": "classifier"},
}
_KINDS = {"bert": "bert", "roberta": "roberta", "xlm-roberta": "roberta", "modernbert": "modernbert"}


def pop_classifier(hf_config: Any, weights: dict[str, torch.Tensor]) -> SequenceClassifier:
    """Builds the head of `hf_config`'s family from the checkpoint tensors, popping them."""
    kind = _KINDS.get(hf_config.model_type)
    if kind is None:
        raise ValueError(
            f"sequence classification is not supported for model_type {hf_config.model_type!r}; supported: {sorted(_KINDS)}."
        )
    head = SequenceClassifier(kind, hf_config)
    own: dict[str, torch.Tensor] = {}
    for ours, theirs in _HEAD_NAMES[kind].items():
        for part in ("weight", "bias"):
            name = f"{theirs}.{part}"
            if name not in weights and kind == "bert":
                name = name.removeprefix("bert.")
            if name in weights:
                own[f"{ours}.{part}"] = weights.pop(name)
    missing, unexpected = head.load_state_dict(own, strict=False)
    if missing or unexpected:
        raise ValueError(f"the classification head's weights do not match the config: missing {missing}, unexpected {unexpected}.")
    return head
