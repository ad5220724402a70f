"""Pooling: packed hidden states -> one vector per sequence (mean / CLS / last token), then the
sentence-transformers Dense layers, then the per-request post-processing of PoolingParams
(Matryoshka truncation, L2 normalization).

How a model pools, its Dense layers and whether it normalizes by default are read from its
sentence-transformers files (model/st_config.py); models without them get the usual defaults:
CLS for encoders, last token for decoders, normalized.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F

from shmvllm.model.st_config import DenseLayer, read_st_config
from shmvllm.pooling_params import PoolingParams


class PoolingType(enum.Enum):
    MEAN = "mean"
    CLS = "cls"
    LAST = "last"


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: PoolingType
    normalize: bool  # the default when a request's PoolingParams.normalize is None
    dense: tuple[DenseLayer, ...] = field(default=(), compare=False)  # applied after pooling, in order

    def project(self, pooled: torch.Tensor) -> torch.Tensor:
        for layer in self.dense:
            pooled = layer(pooled)
        return pooled

    def output_size(self, hidden_size: int) -> int:
        return self.dense[-1].out_features if self.dense else hidden_size


def load_pooler_config(model_dir: Path, hf_config: Any) -> PoolerConfig:
    """The pooling of a sentence-transformers directory, or the default for the architecture."""
    st = read_st_config(Path(model_dir))
    if st.pooling_mode is None:
        if st.has_modules and not _is_classifier(hf_config):
            raise ValueError(f"{Path(model_dir) / 'modules.json'} lists no Pooling module.")
        return _default_pooler_config(hf_config)
    return PoolerConfig(pooling_type=PoolingType(st.pooling_mode), normalize=st.normalize, dense=tuple(st.dense))


def _is_classifier(hf_config: Any) -> bool:
    return any(a.endswith("ForSequenceClassification") for a in getattr(hf_config, "architectures", None) or [])


def _default_pooler_config(hf_config: Any) -> PoolerConfig:
    architectures = getattr(hf_config, "architectures", None) or []
    is_decoder = any(a.endswith("ForCausalLM") for a in architectures) or getattr(hf_config, "is_decoder", False)
    return PoolerConfig(pooling_type=PoolingType.LAST if is_decoder else PoolingType.CLS, normalize=True)


def pool(hidden: torch.Tensor, cu_seqlens: torch.Tensor, pooling_type: PoolingType) -> torch.Tensor:
    """hidden: [num_tokens, H] packed; cu_seqlens: [num_seqs + 1] int64 -> [num_seqs, H]."""
    starts, ends = cu_seqlens[:-1], cu_seqlens[1:]
    if pooling_type is PoolingType.CLS:
        return hidden.index_select(0, starts)
    if pooling_type is PoolingType.LAST:
        return hidden.index_select(0, ends - 1)
    lengths = ends - starts
    seq_ids = torch.repeat_interleave(torch.arange(len(lengths), device=hidden.device), lengths)
    sums = hidden.new_zeros(len(lengths), hidden.shape[1]).index_add_(0, seq_ids, hidden)
    return sums / lengths.clamp(min=1).unsqueeze(1).to(hidden.dtype)


def finalize(
    pooled: torch.Tensor, params: Sequence[Optional[PoolingParams]], default_normalize: bool
) -> list[torch.Tensor]:
    """Applies each request's `dimensions` (truncate) and `normalize` to its pooled row.

    Truncation comes first and normalization after, so a truncated vector is renormalized
    (what Matryoshka models expect).
    """
    if len(params) != pooled.shape[0]:
        raise ValueError(f"params has {len(params)} entries for {pooled.shape[0]} pooled vectors.")
    if all(p is None or (p.dimensions is None and p.normalize is None) for p in params):
        rows = F.normalize(pooled, dim=-1) if default_normalize else pooled
        return list(rows.unbind(0))
    out = []
    for row, p in zip(pooled.unbind(0), params):
        dimensions = p.dimensions if p is not None else None
        normalize = default_normalize if p is None or p.normalize is None else p.normalize
        if dimensions is not None:
            row = row[:dimensions]
        out.append(F.normalize(row, dim=-1) if normalize else row)
    return out
