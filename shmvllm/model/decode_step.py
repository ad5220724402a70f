"""A Llama-family decode step as one native call (kernels/decode_step.c).

On the CPU with fp32 activations, a step whose tokens are all decodes of at most FEW_ROWS
requests (the GEMV regime: single-request latency) runs every layer in C: Python embeds the
tokens, then makes one call, in which one OpenMP team runs the whole step (one parallel region a
token; see decode_step.c). The C driver calls the same kernels as the layer-by-layer modules, each
output value computed the same way whatever the threads' split (so the hidden states are
identical bit for bit, see tests/test_quant_model.py); this module lays out, once, a table of
every layer's weights (GGML block parts or plain fp32 rows), norms and KV-cache pointers, and
re-lays it (and the step's scratch buffer) when the cache is re-bound or the thread count
changes. ``SHMVLLM_FUSED_DECODE=0`` turns it off (the modules then run as for any other step).
Where its time goes: benchmarks/results/decode_profile.md.
"""

from __future__ import annotations

import ctypes
from typing import Any, Optional

import torch

from shmvllm import envs
from shmvllm.model.attention import AttentionMetadata
from shmvllm.model.kernels import cpu_kernels, quant_kernels
from shmvllm.model.linear import FEW_ROWS, Linear

_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


class _Part(ctypes.Structure):
    _fields_ = [("offset", _i64), ("n", _i64), ("row_bytes", _i64), ("type", _i64), ("w", _ptr)]


class _Linear(ctypes.Structure):
    _fields_ = [("parts", ctypes.POINTER(_Part)), ("num_parts", _i64), ("n", _i64), ("k", _i64), ("bias", _ptr)]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _ptr), ("post_norm", _ptr),
        ("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear),
        ("k_cache", _ptr), ("v_cache", _ptr),
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        ("num_layers", _i64), ("hidden", _i64), ("num_heads", _i64), ("kv_heads", _i64), ("head_dim", _i64),
        ("intermediate", _i64), ("num_slots", _i64), ("block_size", _i64),
        ("eps", _f32), ("scale", _f32), ("max_len", _i64), ("threads", _i64),
        ("layers", ctypes.POINTER(_Layer)), ("final_norm", _ptr), ("cos_table", _ptr), ("sin_table", _ptr),
        ("rms_norm", _ptr), ("rotary", _ptr), ("write_kv", _ptr), ("attention_task", _ptr),
        ("attention_combine", _ptr), ("silu_mul", _ptr), ("linear_rows", _ptr),
    ]


def enabled() -> bool:
    return envs.SHMVLLM_FUSED_DECODE()


def _fn(lib: ctypes.CDLL, name: str) -> int:
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


class DecodeStep:
    """The native decode step of one LlamaModel; `run` returns None where it does not apply."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.quant = quant_kernels()
        self.cpu = cpu_kernels()
        self._table: Optional[_Model] = None
        self._keep: list[Any] = []  # the ctypes arrays the table points into
        self._cache_ptr = None
        self._scratch: Optional[torch.Tensor] = None

    def usable(self) -> bool:
        if self.quant is None or self.cpu is None or not self.model.rotary_emb.by_position_only:
            return False
        for layer in self.model.layers:
            attn = layer.self_attn
            for linear in (attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
                if linear.blocks is None and (linear.weight.dtype != torch.float32 or linear.weight.device.type != "cpu"):
                    return False
            if layer.input_layernorm.weight.dtype != torch.float32:
                return False
        return True

    def _linear(self, linear: Linear) -> _Linear:
        if linear.blocks is not None:
            parts = [(offset, w.n, w.data.shape[1], w.qtype, w.data.data_ptr()) for offset, w in linear.blocks]
        else:
            weight = linear.weight.detach()
            if not weight.is_contiguous():
                raise ValueError("the fused decode step needs contiguous fp32 weights.")
            parts = [(0, linear.out_features, 0, -1, weight.data_ptr())]
        array = (_Part * len(parts))(*[_Part(*p) for p in parts])
        self._keep.append(array)
        bias = linear.bias.data_ptr() if linear.bias is not None else None
        return _Linear(array, len(parts), linear.out_features, linear.in_features, bias)

    def _build(self) -> _Model:
        model = self.model
        self._keep = []
        first = model.layers[0].self_attn
        attn = first.attn
        layers = (_Layer * len(model.layers))()
        for i, layer in enumerate(model.layers):
            a = layer.self_attn
            cache_k, cache_v = a.attn.k_cache, a.attn.v_cache
            if not (cache_k.is_contiguous() and cache_v.is_contiguous() and cache_k.dtype == torch.float32):
                raise ValueError("the fused decode step needs contiguous fp32 KV caches.")
            layers[i] = _Layer(
                layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
                self._linear(a.qkv_proj), self._linear(a.o_proj), self._linear(layer.mlp.gate_up_proj),
                self._linear(layer.mlp.down_proj), cache_k.data_ptr(), cache_v.data_ptr(),
            )
        self._keep.append(layers)
        k_cache = attn.k_cache
        norm = model.norm
        if len({layer.input_layernorm.eps for layer in model.layers} | {norm.eps}) != 1:
            raise ValueError("the fused decode step needs one rms_norm eps for all norms.")
        cpu = self.cpu
        cos = model.rotary_emb.cos_cache
        return _Model(
            len(model.layers), norm.weight.shape[0], attn.num_heads, attn.num_kv_heads, attn.head_dim,
            model.layers[0].mlp.intermediate_size, k_cache.shape[1] * k_cache.shape[2], k_cache.shape[2],
            norm.eps, attn.scale, min(cos.shape[0], k_cache.shape[1] * k_cache.shape[2]), torch.get_num_threads(),
            layers, norm.weight.data_ptr(), cos.data_ptr(), model.rotary_emb.sin_cache.data_ptr(),
            _fn(cpu, "shm_rms_norm"), _fn(cpu, "shm_rotary"), _fn(cpu, "shm_write_kv_cache"),
            _fn(cpu, "shm_attention_task"), _fn(cpu, "shm_attention_combine"), _fn(cpu, "shm_silu_and_mul"),
            _fn(cpu, "shm_linear_rows"),
        )

    def run(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> Optional[torch.Tensor]:
        """The final-normed hidden states of a pure-decode step of <= FEW_ROWS rows, else None.
        `hidden` (the embedded tokens) is used as the residual stream and overwritten."""
        decodes = meta.decodes
        rows = hidden.shape[0]
        if (
            meta.prefills or decodes is None or meta.slot_mapping is None or rows > FEW_ROWS
            or len(decodes.rows) != rows or not decodes.are_prefix or positions.dtype != torch.int64
            or hidden.dtype != torch.float32 or hidden.device.type != "cpu"
        ):
            return None
        k_cache = self.model.layers[0].self_attn.attn.k_cache
        if k_cache is None:
            return None
        if self._table is None or self._cache_ptr != k_cache.data_ptr() or self._table.threads != torch.get_num_threads():
            self._table = self._build()
            self._cache_ptr = k_cache.data_ptr()
            floats = self.quant.shm_decode_scratch_floats(ctypes.addressof(self._table), FEW_ROWS)
            self._scratch = torch.empty(floats, dtype=torch.float32)
        hidden = hidden.contiguous()
        positions = positions.contiguous()
        out = torch.empty_like(hidden)
        rows_ptr, table_ptr, lens_ptr = decodes.pointers
        rc = self.quant.shm_decode_step(
            ctypes.addressof(self._table), hidden.data_ptr(), out.data_ptr(), rows, positions.data_ptr(),
            meta.slot_mapping.data_ptr(), rows_ptr, table_ptr, decodes.block_table.shape[1], lens_ptr,
            self._scratch.data_ptr(),
        )
        if rc != 0:
            raise RuntimeError(f"the native decode step failed (status {rc}).")
        return out
