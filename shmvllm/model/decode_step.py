"""A decoder's decode step as one native call (kernels/decode_step.c).

On the CPU with fp32 activations, a step whose tokens are all decodes of at most FEW_ROWS
requests (the GEMV regime: single-request latency) runs every layer in C: Python embeds the
tokens, then makes one call, in which one OpenMP team runs the whole step (one parallel region a
token; see decode_step.c). The families' options (where the norms sit, (1 + w) norms, q/k
norms, activation, residual scale, per layer the rotary table, score scale, window and
soft-capping) are data in the table; `fallback_reasons` names what still decodes layer by
layer. The C driver calls the same kernels as the layer-by-layer modules, each
output value computed the same way whatever the threads' split (so the hidden states are
identical bit for bit, see tests/test_quant_model.py); this module lays out, once, a table of
every layer's weights (GGML block parts or plain fp32 rows), norms and KV-cache pointers, and
re-lays it (and the step's scratch buffer) when the cache is re-bound or the thread count
changes. A greedy decode burst (`burst`) is one call and one parallel region too: per token
the embedding row, the step, the lm_head and the argmax, the stop rule between tokens
(decode_step.c's shm_decode_burst). ``SHMVLLM_FUSED_DECODE=0`` turns it off (the modules then
run as for any other step).
Where its time goes: benchmarks/results/decode_profile.md.
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from shmvllm import envs
from shmvllm.model.attention import AttentionMetadata
from shmvllm.model.kernels import cpu_kernels, quant_kernels
from shmvllm.model.linear import FEW_ROWS, Linear
from shmvllm.model.moe import GLU_KERNELS, MoEMLP, native_options
from shmvllm.model.native_linear import NativeLinear, linear_table, linear_tables
from shmvllm.model.quant import FORMAT_IDS
from shmvllm.model.step_table import BurstTable, WaitingFn
from shmvllm.model.step_table import LayerTable as _Layer, ModelTable as _Model, function_address as _fn


def enabled() -> bool:
    return envs.SHMVLLM_FUSED_DECODE()


def _norm_weight(norm: Any) -> Optional[torch.Tensor]:
    """The fp32 factor an RMSNorm scales by: (offset + weight) where it has an offset."""
    if norm is None:
        return None
    return norm.scale if norm.offset else norm.weight


def fallback_reasons(model: Any) -> list[str]:
    """Why the native step cannot run `model` (a DecoderModel); empty: it can (on a CPU with the
    kernels). What the step leaves to the layer-by-layer path: rotary tables that depend on the
    sequence's length (dynamic NTK, LongRoPE past its threshold) or rotate part of each head
    (partial rotary), non-fp32 weights or norms, and gpt-oss's attention sinks and experts."""
    reasons = []
    for key, table in model.rotary.items():
        if table.length_dependent:
            reasons.append(f"rope {key!r} depends on the sequence length ({table.rope_type})")
        if table.rotary_dim != table.head_dim:
            reasons.append(f"rope {key!r} rotates {table.rotary_dim} of {table.head_dim} features (partial rotary)")
    for layer in model.layers:
        attn = layer.self_attn
        for linear in (attn.qkv_proj, attn.o_proj, *_mlp_linears(layer.mlp)):
            if linear.blocks is None and (linear.weight.dtype != torch.float32 or linear.weight.device.type != "cpu"):
                reasons.append(f"weights of dtype {linear.weight.dtype} on {linear.weight.device.type}")
                break
        if attn.attn.sinks is not None:
            reasons.append("attention sinks")
        if isinstance(layer.mlp, MoEMLP) and not native_options(layer.mlp.options):
            reasons.append("experts with biases, clamped SwiGLU or a router bias (gpt-oss)")
        norms = [getattr(layer, name) for name in layer.norm_names if name is not None]
        if attn.qk_norm is not None:
            norms += [attn.q_norm, attn.k_norm]
        if any(_norm_weight(norm).dtype != torch.float32 for norm in norms):
            reasons.append("norm weights that are not fp32")
        if reasons:
            break
    return sorted(set(reasons))


def _mlp_linears(mlp: Any) -> list[Linear]:
    if isinstance(mlp, MoEMLP):
        return [mlp.gate, *(linear for expert in mlp.experts for linear in (expert.gate_up_proj, expert.down_proj))]
    return [mlp.gate_up_proj, mlp.down_proj]


class DecodeStep:
    """The native decode step of one DecoderModel; `run` returns None where it does not apply.
    `steps`: how many steps it ran (what tests check to see that a model did not fall back).
    With `set_head` (the embedding and the lm_head), `burst` decodes greedy tokens in one call
    (`bursts`: how many such calls ran)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.quant = quant_kernels()
        self.cpu = cpu_kernels()
        self._table: Optional[_Model] = None
        self._keep: list[Any] = []  # the ctypes arrays the table points into
        self._cache_ptr = None
        self._scratch: Optional[torch.Tensor] = None
        self.steps = 0
        self.bursts = 0
        self._head: Optional[tuple[Any, Linear]] = None  # (the embedding, the lm_head) for bursts
        self._burst: Optional[BurstTable] = None
        self._burst_work: Optional[np.ndarray] = None
        self._callback: tuple[Optional[Callable[[], bool]], Any] = (None, WaitingFn())

    def usable(self) -> bool:
        return self.quant is not None and self.cpu is not None and not fallback_reasons(self.model)

    def _linear(self, linear: Linear) -> NativeLinear:
        return linear_table(linear, self._keep)

    def _build(self) -> _Model:
        model = self.model
        self._keep = []
        first = model.layers[0]
        layers = (_Layer * len(model.layers))()
        eps = {model.norm.eps}
        for i, layer in enumerate(model.layers):
            a = layer.self_attn
            cache_k, cache_v = a.attn.k_cache, a.attn.v_cache
            if not (cache_k.is_contiguous() and cache_v.is_contiguous() and cache_k.dtype == torch.float32):
                raise ValueError("the fused decode step needs contiguous fp32 KV caches.")
            norms = [getattr(layer, name) if name is not None else None for name in layer.norm_names]
            qk = (a.q_norm, a.k_norm) if a.qk_norm is not None else (None, None)
            eps |= {norm.eps for norm in (*norms, *qk) if norm is not None}
            pointers = [w.data_ptr() if w is not None else None for w in map(_norm_weight, (*norms, *qk))]
            rope = model.rotary[a.rope] if a.rope is not None else None
            mlp = layer.mlp
            if isinstance(mlp, MoEMLP):
                none = NativeLinear(None, 0, 0, 0, None)
                mlp_fields = (none, none)
                gate_up = linear_tables([e.gate_up_proj for e in mlp.experts], self._keep)
                down = linear_tables([e.down_proj for e in mlp.experts], self._keep)
                moe = (self._linear(mlp.gate), gate_up, down, mlp.num_experts, mlp.top_k, int(mlp.norm_topk_prob),
                       mlp.intermediate_size)
            else:
                mlp_fields = (self._linear(mlp.gate_up_proj), self._linear(mlp.down_proj))
                moe = (NativeLinear(None, 0, 0, 0, None), None, None, 0, 0, 0, 0)
            layers[i] = _Layer(
                *pointers, self._linear(a.qkv_proj), self._linear(a.o_proj), *mlp_fields, cache_k.data_ptr(),
                cache_v.data_ptr(), rope.cos_cache.data_ptr() if rope is not None else None,
                rope.sin_cache.data_ptr() if rope is not None else None,
                a.attn.scale, a.attn.softcap or 0.0, a.attn.sliding_window or 0, *moe,
            )
        self._keep.append(layers)
        if len(eps) != 1:
            raise ValueError("the fused decode step needs one rms_norm eps for all norms.")
        attn = first.self_attn.attn
        k_cache = attn.k_cache
        max_len = k_cache.shape[1] * k_cache.shape[2]
        for table in model.rotary.values():
            max_len = min(max_len, table.cos_cache.shape[0])
        cpu = self.cpu
        moes = [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoEMLP)]
        # the gate-up and activation buffers hold a dense layer's rows or every chosen expert's
        intermediate = max(m.top_k * m.intermediate_size if isinstance(m, MoEMLP) else m.intermediate_size
                           for m in (layer.mlp for layer in model.layers))
        return _Model(
            len(model.layers), model.norm.weight.shape[0], attn.num_heads, attn.num_kv_heads, attn.head_dim,
            intermediate, k_cache.shape[1] * k_cache.shape[2], k_cache.shape[2],
            model.norm.eps, first.residual_scale, int(first.fused_residual),
            attn.head_dim if first.self_attn.qk_norm == "head" else 0, max_len, torch.get_num_threads(),
            layers, _norm_weight(model.norm).data_ptr(),
            _fn(cpu, "shm_rms_norm"), _fn(cpu, "shm_rotary"), _fn(cpu, "shm_write_kv_cache"),
            _fn(cpu, "shm_attention_task"), _fn(cpu, "shm_attention_combine"), _fn(cpu, GLU_KERNELS[first.mlp.activation]),
            _fn(cpu, "shm_linear_rows"),
            max((m.top_k for m in moes), default=0), max((m.num_experts for m in moes), default=0),
        )

    def _ensure_table(self) -> bool:
        """Lays out the table and scratch for the bound KV cache and thread count; False: no cache yet."""
        k_cache = self.model.layers[0].self_attn.attn.k_cache
        if k_cache is None:
            return False
        if self._table is None or self._cache_ptr != k_cache.data_ptr() or self._table.threads != torch.get_num_threads():
            self._table = self._build()
            self._cache_ptr = k_cache.data_ptr()
            floats = self.quant.shm_decode_scratch_floats(ctypes.addressof(self._table), FEW_ROWS)
            self._scratch = torch.empty(floats, dtype=torch.float32)
            self._burst = None
        return True

    def set_head(self, embedding: Any, lm_head: Linear) -> None:
        """The model's embedding (a VocabEmbedding) and lm_head, whose logits are the argmax's
        input as they are (no scale or soft-capping): what `burst` needs."""
        self._head = (embedding, lm_head)

    def _burst_table(self) -> BurstTable:
        embedding, lm_head = self._head
        blocks = embedding.blocks
        if blocks is not None:
            source = (blocks.data.data_ptr(), blocks.qtype, blocks.data.shape[1])
        else:
            weight = embedding.weight.detach()
            if not weight.is_contiguous() or weight.dtype != torch.float32:
                raise ValueError("the native decode burst needs a contiguous fp32 embedding or GGML blocks.")
            source = (weight.data_ptr(), -1, weight.shape[1] * 4)
        head = linear_table(lm_head, self._keep)
        table = BurstTable(*source, head, self._head_norms(head))
        floats = self.quant.shm_decode_burst_floats(ctypes.addressof(self._table), ctypes.addressof(table))
        self._burst_work = np.empty(floats, dtype=np.float32)
        return table

    def _head_norms(self, head: NativeLinear) -> Optional[int]:
        """The row norms of a lm_head that is one Q8_0 part without bias (kept alive here), for the
        burst's exact greedy head (kernels/greedy_head.c); None where the build or the weight has none."""
        part = head.parts[0]
        if head.num_parts != 1 or part.type != FORMAT_IDS["Q8_0"] or part.n != head.n or head.bias:
            return None
        norms = np.empty(head.n, dtype=np.float32)
        if self.quant.shm_q8_0_row_norms(part.w, part.row_bytes, head.n, head.k, norms.ctypes.data) != 0:
            return None
        self._keep.append(norms)
        return norms.ctypes.data

    def burst(self, token: int, position: int, block_table: np.ndarray, count: int, stops: Sequence[int],
              masked: Sequence[int], masked_tokens: int,
              input_waiting: Optional[Callable[[], bool]]) -> Optional[list[int]]:
        """1 to `count` greedy tokens of one sequence in one native call (decode_step.c's
        shm_decode_burst), from `token` at `position`: each the argmax of its logits, `masked`
        excluded for the first `masked_tokens`; it ends after a token in `stops`, or when
        `input_waiting()` (None: never asked) says so after a token. `block_table`: the
        sequence's int32 blocks, holding position + count slots. None: no head set or no KV cache."""
        if self._head is None or not self._ensure_table():
            return None
        if self._burst is None:
            self._burst = self._burst_table()
        table = self._burst
        stop_ids = (ctypes.c_int64 * max(len(stops), 1))(*stops)
        masked_ids = (ctypes.c_int64 * max(len(masked), 1))(*masked)
        table.stops, table.num_stops = stop_ids, len(stops)
        table.masked, table.num_masked, table.masked_tokens = masked_ids, len(masked), max(masked_tokens, 0)
        if self._callback[0] is not input_waiting:  # a C function pointer made once per callable
            self._callback = (input_waiting, WaitingFn() if input_waiting is None else WaitingFn(input_waiting))
        table.input_waiting = self._callback[1]
        block_table = np.ascontiguousarray(block_table, dtype=np.int32)
        tokens = np.empty(count, dtype=np.int64)
        n = self.quant.shm_decode_burst(
            ctypes.addressof(self._table), ctypes.addressof(table), token, position, block_table.ctypes.data, count,
            tokens.ctypes.data, self._scratch.data_ptr(), self._burst_work.ctypes.data,
        )
        if n < 0:
            raise RuntimeError(f"the native decode burst failed (status {n}).")
        self.steps += n
        self.bursts += 1
        return tokens[:n].tolist()

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
        if not self._ensure_table():
            return None
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
        self.steps += 1
        return out
