"""The native decode step's table as ctypes structures (decode_step.c's shm_part, shm_linear,
shm_layer, shm_model and shm_burst), without torch: the torch model's step (decode_step.py) and the
engine's first requests before torch (first_requests.py) fill the same layout."""

from __future__ import annotations

import ctypes

_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


class Part(ctypes.Structure):
    _fields_ = [("offset", _i64), ("n", _i64), ("row_bytes", _i64), ("type", _i64), ("w", _ptr)]


class NativeLinear(ctypes.Structure):
    _fields_ = [("parts", ctypes.POINTER(Part)), ("num_parts", _i64), ("n", _i64), ("k", _i64), ("bias", _ptr)]


class LayerTable(ctypes.Structure):
    _fields_ = [
        ("attn_in_norm", _ptr), ("attn_out_norm", _ptr), ("mlp_in_norm", _ptr), ("mlp_out_norm", _ptr),
        ("q_norm", _ptr), ("k_norm", _ptr),
        ("qkv", NativeLinear), ("o", NativeLinear), ("gate_up", NativeLinear), ("down", NativeLinear),
        ("k_cache", _ptr), ("v_cache", _ptr), ("cos_table", _ptr), ("sin_table", _ptr),
        ("scale", _f32), ("softcap", _f32), ("window", _i64),
        ("router", NativeLinear), ("expert_gate_up", ctypes.POINTER(NativeLinear)), ("expert_down", ctypes.POINTER(NativeLinear)),
        ("num_experts", _i64), ("top_k", _i64), ("norm_topk", _i64), ("expert_intermediate", _i64),
    ]


class ModelTable(ctypes.Structure):
    _fields_ = [
        ("num_layers", _i64), ("hidden", _i64), ("num_heads", _i64), ("kv_heads", _i64), ("head_dim", _i64),
        ("intermediate", _i64), ("num_slots", _i64), ("block_size", _i64),
        ("eps", _f32), ("residual_scale", _f32), ("fused_residual", _i64), ("qk_norm_width", _i64),
        ("max_len", _i64), ("threads", _i64),
        ("layers", ctypes.POINTER(LayerTable)), ("final_norm", _ptr),
        ("rms_norm", _ptr), ("rotary", _ptr), ("write_kv", _ptr), ("attention_task", _ptr),
        ("attention_combine", _ptr), ("glu", _ptr), ("linear_rows", _ptr),
        ("moe_slots", _i64), ("max_experts", _i64),
    ]


# shm_burst's input_waiting: non-zero when the engine has input waiting (a NULL one is never asked)
WaitingFn = ctypes.CFUNCTYPE(ctypes.c_int)


class BurstTable(ctypes.Structure):
    """decode_step.c's shm_burst: the embedding and lm_head of a greedy decode burst and its stop rule."""

    _fields_ = [
        ("embedding", _ptr), ("embedding_type", _i64), ("embedding_row_bytes", _i64), ("lm_head", NativeLinear),
        ("head_norms", _ptr),
        ("stops", ctypes.POINTER(_i64)), ("masked", ctypes.POINTER(_i64)),
        ("num_stops", _i64), ("num_masked", _i64), ("masked_tokens", _i64),
        ("input_waiting", WaitingFn),
    ]


def function_address(lib: ctypes.CDLL, name: str) -> int:
    """The address of `lib`'s function `name`, for a table's function pointers."""
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
