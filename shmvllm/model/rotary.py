"""Rotary position embeddings (RoPE), with the scalings of transformers' `config.rope_parameters`.

Types: `default`, `linear`, `llama3`, `yarn`, `dynamic` (NTK) and `longrope` (Phi-3's short and
long factors), each with `partial_rotary_factor` (only the first `rotary_dim` features of a head
rotate, neox style within them, as Phi-3/4 and GLM). The cos/sin tables are computed in float32
the way transformers computes them (position * inv_freq, then cos/sin, times the attention
factor), so that our rotations equal theirs bit for bit in fp32.

Two types change with the length of the sequence. transformers recomputes them in every forward
from that forward's longest position (`dynamic_rope_update`); in `generate` a sequence's prompt
forward sees the prompt's length L and each decode forward the position p + 1 of its one token.
A paged engine computes the same sequence in other chunks (chunked prefill, preemption's
recompute), so it rotates each token with the length transformers' `generate` gives it,
whatever the chunk: s = max(L, p + 1), L the request's prompt length (`rope_lengths`). Then
- `dynamic`: tokens with s <= max_position_embeddings use the unscaled table (exact, as
  transformers' reset), longer ones the NTK base for s, computed per step;
- `longrope`: tokens with s > original_max_position_embeddings use the long factors, the others
  the short ones.
Only an engine whose max_model_len passes that threshold needs the lengths (`length_dependent`);
below it every token uses the one table. The prefix cache then files the blocks of a prompt
longer than the threshold apart (core/kv_cache_manager.py): under its length (dynamic) or with
every other such prompt (longrope). Not reproduced: transformers' state across calls (a dynamic
base grown by an earlier, longer sequence is kept for the next), and Phi-3's generate, which
drops its cache when a sequence first passes original_max_position_embeddings and recomputes it
all with the long factors: a Phi-3 prompt within the threshold whose decode passes it keeps its
short-factor keys here (as transformers' other models do), and its tokens after that point may
differ from transformers' Phi-3.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from shmvllm.model.kernels import kernels_for

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")


def rope_parameters(hf_config: Any, layer_type: Optional[str] = None) -> dict:
    """The rope parameters of a config (of one layer type where they are per layer type), with
    what transformers' `standardize_rope_params` fills in: rope_theta, partial_rotary_factor,
    original_max_position_embeddings."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    if layer_type is not None:
        params = params.get(layer_type) or {}
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    if params.get("rope_theta") is None:
        params["rope_theta"] = getattr(hf_config, "rope_theta", None) or 10000.0
    partial = getattr(hf_config, "partial_rotary_factor", None)
    if partial is not None:
        params.setdefault("partial_rotary_factor", partial)
    if params["rope_type"] in ("llama3", "yarn", "longrope"):
        original = getattr(hf_config, "original_max_position_embeddings", None)
        if original is not None and layer_type is None:  # Phi-3 keeps it beside rope_parameters
            params["original_max_position_embeddings"] = original
        params.setdefault("original_max_position_embeddings", getattr(hf_config, "max_position_embeddings", None))
    return params


def rotary_dim_of(params: dict, head_dim: int) -> int:
    """The number of features of a head that rotate: head_dim * partial_rotary_factor, even."""
    factor = params.get("partial_rotary_factor", 1.0)
    if not isinstance(factor, (int, float)) or not 0.0 < factor <= 1.0:
        raise ValueError(f"rope_parameters.partial_rotary_factor must be in (0, 1], got {factor!r}.")
    dim = int(head_dim * factor)
    if dim < 2 or dim % 2:
        raise ValueError(
            f"rope_parameters.partial_rotary_factor={factor} gives {dim} rotary features of head_dim {head_dim}; "
            "an even number >= 2 is needed."
        )
    return dim


def rope_inv_freq(
    hf_config: Any, head_dim: int, seq_len: Optional[int] = None, layer_type: Optional[str] = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rotary_dim // 2] and the attention factor that scales cos and sin.
    seq_len: the forward's length for the types that depend on it (dynamic, longrope); None:
    the table transformers builds at init (unscaled / short factors)."""
    params = rope_parameters(hf_config, layer_type)
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_parameters.rope_type must be one of {SUPPORTED_ROPE_TYPES}, got {rope_type!r}.")
    base = float(params["rope_theta"])
    dim = rotary_dim_of(params, head_dim)
    if rope_type == "dynamic":
        return _dynamic_inv_freq(base, dim, params, hf_config, seq_len), 1.0
    if rope_type == "longrope":
        return _longrope_inv_freq(base, dim, params, hf_config, seq_len)
    if rope_type == "yarn":
        return _yarn_inv_freq(base, dim, params, hf_config)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / dim
    inv_freq = 1.0 / (base**exponents)
    if rope_type == "linear":
        return inv_freq / float(params["factor"]), 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params), 1.0
    return inv_freq, 1.0


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


def _yarn_inv_freq(base: float, dim: int, params: dict, hf_config: Any) -> tuple[torch.Tensor, float]:
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
        return dim * math.log(original_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").to(torch.float32) / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _dynamic_inv_freq(base: float, dim: int, params: dict, hf_config: Any, seq_len: Optional[int]) -> torch.Tensor:
    """NTK: the base grows with the sequence past max_position_embeddings. The arithmetic is
    transformers': Python floats at init, float32 tensors for a forward's length (it passes
    `max(position_ids) + 1`, a tensor), so that the frequencies are the same bits."""
    factor, max_len = params["factor"], hf_config.max_position_embeddings
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / dim
    if seq_len is None:
        scaled = base * ((factor * max_len / max_len) - (factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (scaled**exponents)
    length = torch.maximum(torch.tensor(seq_len, device="cpu"), torch.tensor(max_len, device="cpu"))
    scaled_t = base * ((factor * length / max_len) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (scaled_t**exponents)


def _longrope_inv_freq(
    base: float, dim: int, params: dict, hf_config: Any, seq_len: Optional[int]
) -> tuple[torch.Tensor, float]:
    """LongRoPE: per-frequency factors, the long ones past original_max_position_embeddings;
    cos and sin scaled by the attention factor (from max / original length unless given)."""
    original_len = params["original_max_position_embeddings"]
    factor = params.get("factor") or hf_config.max_position_embeddings / original_len
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original_len))
    name = "long_factor" if seq_len and seq_len > original_len else "short_factor"
    ext = params[name]
    if len(ext) != dim // 2:
        raise ValueError(f"rope_parameters.{name} has {len(ext)} values; rotary_dim {dim} needs {dim // 2}.")
    shape = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    return 1.0 / (torch.tensor(ext, dtype=torch.float32, device="cpu") * base**shape), float(attention_factor)


def _tables(inv_freq: torch.Tensor, attention_factor: float, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos twice, sin with the first half negated) [len(positions), rotary_dim], fp32."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos() * attention_factor, freqs.sin() * attention_factor
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


class RotaryEmbedding(torch.nn.Module):
    """Neox-style rotation (first half / second half of the rotary features) from a table.

    The tables hold, per position, cos twice and sin with the first half negated, so that one
    rotation is x * cos + swap_halves(x) * sin: x1 * cos - x2 * sin and x2 * cos + x1 * sin,
    bit for bit (negation is exact). They are built on the CPU even under a meta-device
    context (the loader builds models on meta), then follow the module to its device.
    `layer_type`: the key of per-layer-type rope parameters (Gemma 3's local layers).
    """

    def __init__(self, hf_config: Any, head_dim: int, max_position: int, layer_type: Optional[str] = None) -> None:
        super().__init__()
        self.hf_config, self.layer_type, self.max_position = hf_config, layer_type, max_position
        params = rope_parameters(hf_config, layer_type)
        self.rope_type, self.head_dim = params["rope_type"], head_dim
        inv_freq, self.attention_factor = rope_inv_freq(hf_config, head_dim, layer_type=layer_type)
        self.rotary_dim = rotary_dim_of(params, head_dim)
        positions = torch.arange(max_position, dtype=torch.int64, device="cpu")
        cos, sin = _tables(inv_freq, self.attention_factor, positions)
        # the length past which a token's rotation depends on its sequence's length
        self.threshold: Optional[int] = None
        if self.rope_type == "dynamic":
            self.threshold = int(hf_config.max_position_embeddings)
        elif self.rope_type == "longrope":
            self.threshold = int(params["original_max_position_embeddings"])
        self.length_dependent = self.threshold is not None and max_position > self.threshold
        if self.length_dependent and self.rope_type == "longrope":  # rows [max_position, 2 * max_position): long
            long_inv, _ = rope_inv_freq(hf_config, head_dim, seq_len=self.threshold + 1, layer_type=layer_type)
            long_cos, long_sin = _tables(long_inv, self.attention_factor, positions)
            cos, sin = torch.cat((cos, long_cos)), torch.cat((sin, long_sin))
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)

    @property
    def by_position_only(self) -> bool:
        """Whether rows [0, max_position) of cos_cache / sin_cache, looked up by position, are the
        whole rotation of a full head (what the native decode step assumes)."""
        return not self.length_dependent and self.rotary_dim == self.head_dim

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype, rope_lengths: Optional[torch.Tensor] = None
    ) -> "RotaryStep":
        """positions: [T] -> the rotation of this step, to apply to every layer's q and k.
        rope_lengths: [T] the length s = max(prompt length, position + 1) of each token's
        sequence; needed where `length_dependent`."""
        if not self.length_dependent:
            return RotaryStep(self, positions, dtype, self.cos_cache, self.sin_cache)
        if rope_lengths is None:
            raise ValueError(
                f"rope_type {self.rope_type!r} with max_model_len {self.max_position} > {self.threshold} needs the "
                "sequence length of each token (rope_lengths)."
            )
        scaled = rope_lengths > self.threshold
        if self.rope_type == "longrope":
            return RotaryStep(self, positions + scaled * self.max_position, dtype, self.cos_cache, self.sin_cache)
        return self._dynamic_step(positions, rope_lengths, scaled, dtype)

    def _dynamic_step(
        self, positions: torch.Tensor, lengths: torch.Tensor, scaled: torch.Tensor, dtype: torch.dtype
    ) -> "RotaryStep":
        """Per-step tables: the unscaled rows for short sequences, the NTK base of each longer
        length (one per prompt, one per decode token) for the rest."""
        if not bool(scaled.any()):
            return RotaryStep(self, positions, dtype, self.cos_cache, self.sin_cache)
        cpu_positions = positions.cpu()
        cos = self.cos_cache.index_select(0, positions).cpu()
        sin = self.sin_cache.index_select(0, positions).cpu()
        lengths = lengths.cpu()
        for length in torch.unique(lengths[scaled.cpu()]).tolist():
            rows = torch.nonzero(lengths == length).flatten()
            inv_freq, factor = rope_inv_freq(self.hf_config, self.head_dim, seq_len=length, layer_type=self.layer_type)
            cos[rows], sin[rows] = _tables(inv_freq, factor, cpu_positions[rows])
        device = self.cos_cache.device
        step_positions = torch.arange(len(positions), dtype=torch.int64, device=device)
        return RotaryStep(self, step_positions, dtype, cos.to(device), sin.to(device))


class RotaryStep:
    """One step's rotation, shared by all layers: the C kernel reads the tables at the step's
    positions itself; the torch path looks up (cos, signed sin) once, at the first layer."""

    def __init__(
        self, embedding: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype,
        cos_table: torch.Tensor, sin_table: torch.Tensor,
    ) -> None:
        self.rotary_dim, self.dtype = embedding.rotary_dim, dtype
        self.positions = positions.contiguous()
        self.cos_table, self.sin_table = cos_table.contiguous(), sin_table.contiguous()
        self._tables: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def apply_(self, x: torch.Tensor) -> None:
        """Rotates x [T, H, D] (may be a strided view of rows) in place: its first rotary_dim
        features; the rest of each head passes unchanged (partial rotary, in torch)."""
        num_tokens, num_heads, head_dim = x.shape
        full = self.rotary_dim == head_dim
        strided_rows = x.stride(2) == 1 and x.stride(1) == head_dim and self.positions.dtype == torch.int64
        tables_fp32 = self.cos_table.dtype == torch.float32 and self.cos_table.device == x.device
        kernels = kernels_for(x) if full and strided_rows and tables_fp32 else None  # the tables stay fp32
        if kernels is not None:
            kernels.shm_rotary(
                x.data_ptr(), x.stride(0), num_tokens, num_heads, head_dim, self.positions.data_ptr(),
                self.cos_table.data_ptr(), self.sin_table.data_ptr(),
            )
            return
        if self._tables is None:
            cos = self.cos_table.index_select(0, self.positions).unsqueeze(1).to(self.dtype)
            sin = self.sin_table.index_select(0, self.positions).unsqueeze(1).to(self.dtype)
            self._tables = cos, sin
        apply_rotary_(x if full else x[..., : self.rotary_dim], *self._tables)


def apply_rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotates x [T, H, D] (may be a strided view) in place with (cos, signed sin) [T, 1, D]."""
    head_dim = x.shape[-1]
    swapped = x.unflatten(-1, (2, head_dim // 2)).flip(2).flatten(-2)
    x.mul_(cos)
    x.add_(swapped.mul_(sin))
