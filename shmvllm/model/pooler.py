"""Pooling: packed hidden states -> one vector per sequence (mean / CLS / last token), then the
per-request post-processing of PoolingParams (Matryoshka truncation, L2 normalization).

How a model pools, and whether it normalizes by default, is read from a sentence-transformers
directory (modules.json -> the Pooling module's config.json, a Normalize module); models without
one get the usual defaults: CLS for encoders, last token for decoders, normalized.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F

from shmvllm.pooling_params import PoolingParams


class PoolingType(enum.Enum):
    MEAN = "mean"
    CLS = "cls"
    LAST = "last"


# sentence-transformers' Pooling config flags -> our pooling types.
_ST_POOLING_MODES = {
    "pooling_mode_mean_tokens": PoolingType.MEAN,
    "pooling_mode_cls_token": PoolingType.CLS,
    "pooling_mode_lasttoken": PoolingType.LAST,
}
_ST_UNSUPPORTED_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: PoolingType
    normalize: bool  # the default when a request's PoolingParams.normalize is None


def load_pooler_config(model_dir: Path, hf_config: Any) -> PoolerConfig:
    """The pooling of a sentence-transformers directory, or the default for the architecture."""
    modules_file = Path(model_dir) / "modules.json"
    if not modules_file.exists():
        return _default_pooler_config(hf_config)
    modules = json.loads(modules_file.read_text())
    pooling = [m for m in modules if m.get("type", "").endswith(".Pooling")]
    if len(pooling) != 1:
        raise ValueError(f"{modules_file} must list exactly one Pooling module, found {len(pooling)}.")
    pooling_type = _st_pooling_type(Path(model_dir) / pooling[0].get("path", "") / "config.json")
    normalize = any(m.get("type", "").endswith(".Normalize") for m in modules)
    return PoolerConfig(pooling_type=pooling_type, normalize=normalize)


def _st_pooling_type(config_file: Path) -> PoolingType:
    config = json.loads(config_file.read_text())
    mode = config.get("pooling_mode")  # newer sentence-transformers write the mode by name
    if isinstance(mode, str):
        try:
            return PoolingType("last" if mode == "lasttoken" else mode)
        except ValueError:
            raise ValueError(f"pooling_mode {mode!r} in {config_file} is not supported.") from None
    unsupported = [flag for flag in _ST_UNSUPPORTED_MODES if config.get(flag)]
    chosen = [kind for flag, kind in _ST_POOLING_MODES.items() if config.get(flag)]
    if unsupported or len(chosen) != 1:
        raise ValueError(f"{config_file}: exactly one of mean / cls / lasttoken pooling is supported, got {config}.")
    return chosen[0]


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
