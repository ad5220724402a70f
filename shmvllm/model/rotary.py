"""Rotary position embeddings (RoPE), with the scalings of transformers' `config.rope_parameters`.

The cos/sin tables are computed once for every position up to the model's length, in float32
the way transformers computes them (position * inv_freq, then cos/sin, times the attention
factor), so that our rotations equal theirs bit for bit in fp32.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from shmvllm.model.kernels import kernels_for

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_inv_freq(hf_config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] and the attention factor that scales cos and sin."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    base = float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"rope_parameters.partial_rotary_factor must be 1.0, got {params['partial_rotary_factor']}.")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / head_dim
    inv_freq = 1.0 / (base**exponents)
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(params["factor"]), 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(base, head_dim, params, hf_config)
    raise ValueError(f"rope_parameters.rope_type must be one of {SUPPORTED_ROPE_TYPES}, got {rope_type!r}.")


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths are divided by `factor`, short ones kept, the middle blended."""
    factor = float(params["factor"])
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    original_len = float(params["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original_len / low, inv_freq / factor, inv_freq)
    smooth = (original_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_middle = (wavelen >= original_len / high) & (wavelen <= original_len / low)
    return torch.where(is_middle, blended, scaled)


def _yarn_inv_freq(base: float, head_dim: int, params: dict, hf_config: Any) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, ramp between; scale attention."""
    original_len = params["original_max_position_embeddings"]
    factor = params.get("factor") or hf_config.max_position_embeddings / original_len
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor, 1.0)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, head_dim, 2, device="cpu").to(torch.float32) / head_dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class RotaryEmbedding(torch.nn.Module):
    """Neox-style rotation (first half / second half of each head) from a precomputed table.

    The tables hold, per position, cos twice and sin with the first half negated, so that one
    rotation is x * cos + swap_halves(x) * sin: x1 * cos - x2 * sin and x2 * cos + x1 * sin,
    bit for bit (negation is exact). They are built on the CPU even under a meta-device
    context (the loader builds models on meta), then follow the module to its device.
    """

    def __init__(self, hf_config: Any, head_dim: int, max_position: int) -> None:
        super().__init__()
        inv_freq, attention_factor = rope_inv_freq(hf_config, head_dim)
        positions = torch.arange(max_position, dtype=torch.int64, device="cpu").to(torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        cos, sin = freqs.cos() * attention_factor, freqs.sin() * attention_factor
        self.register_buffer("cos_cache", torch.cat((cos, cos), dim=-1), persistent=False)
        self.register_buffer("sin_cache", torch.cat((-sin, sin), dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> "RotaryStep":
        """positions: [T] -> the rotation of this step, to apply to every layer's q and k."""
        return RotaryStep(self, positions, dtype)


class RotaryStep:
    """One step's rotation, shared by all layers: the C kernel reads the tables at the step's
    positions itself; the torch path looks up (cos, signed sin) once, at the first layer."""

    def __init__(self, embedding: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype) -> None:
        self.embedding, self.positions, self.dtype = embedding, positions.contiguous(), dtype
        self._tables: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def apply_(self, x: torch.Tensor) -> None:
        """Rotates x [T, H, D] (may be a strided view of rows) in place."""
        emb = self.embedding
        num_tokens, num_heads, head_dim = x.shape
        strided_rows = x.stride(2) == 1 and x.stride(1) == head_dim and self.positions.dtype == torch.int64
        tables_fp32 = emb.cos_cache.dtype == torch.float32 and emb.cos_cache.device == x.device
        kernels = kernels_for(x) if strided_rows and tables_fp32 else None  # the tables stay fp32
        if kernels is not None:
            kernels.shm_rotary(
                x.data_ptr(), x.stride(0), num_tokens, num_heads, head_dim, self.positions.data_ptr(),
                emb.cos_cache.data_ptr(), emb.sin_cache.data_ptr(),
            )
            return
        if self._tables is None:
            cos = emb.cos_cache.index_select(0, self.positions).unsqueeze(1).to(self.dtype)
            sin = emb.sin_cache.index_select(0, self.positions).unsqueeze(1).to(self.dtype)
            self._tables = cos, sin
        apply_rotary_(x, *self._tables)


def apply_rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotates x [T, H, D] (may be a strided view) in place with (cos, signed sin) [T, 1, D]."""
    head_dim = x.shape[-1]
    swapped = x.unflatten(-1, (2, head_dim // 2)).flip(2).flatten(-2)
    x.mul_(cos)
    x.add_(swapped.mul_(sin))
