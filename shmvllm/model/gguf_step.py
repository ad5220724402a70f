"""A llama-family GGUF decoder run by the native decode step without torch.

The engine serves its first requests with it while torch imports (engine/first_requests.py).
The table decode_step.c reads is laid out from numpy views of the mapped GGUF blocks as the
torch loader lays out the model's: q and k rows unpermuted (llama.cpp's interleave undone on
whole rows of blocks) and stacked with v in one copy, gate and up as two parts of one linear
(each output row is computed from its own row of blocks, so the parts' split changes nothing),
the fp32 norms as mapped, the RoPE tables computed in numpy as rotary.py computes them, the KV
cache the reserved memory the torch runner takes later (kv_memory). The embedding rows and
the lm_head (the embedding's blocks where tied) run through the quantized kernels by pointer:
the same calls the torch modules make. The Q4_1 blocks run as the file's rows here, not repacked
(Linear.repack): a repack of the layers (~40-50 ms) would sit on the first token's path.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any, Optional

import numpy as np

from shmvllm import envs
from shmvllm.model.gguf_file import GGUFFile, unpermute_rows
from shmvllm.model.step_table import LayerTable, ModelTable, NativeLinear, Part, function_address

# what the native decode step's layer table holds as `rows`: the C side's FEW_ROWS (linear.py)
MAX_ROWS = 4
ARCHITECTURES = ("llama",)  # GGUF files of the llama layout: pre norms, SiLU GLU, q/k interleaved
_BLOCK_FORMATS = {2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 20, 23}  # GGML block types the kernels run (quant.FORMATS)


def unsupported(config: Any) -> Optional[str]:
    """Why an engine of `config` (EngineConfig) cannot serve requests with this step, or None."""
    model = config.model_config
    hf = model.hf_config
    if not (envs.SHMVLLM_FUSED_DECODE() and envs.SHMVLLM_NATIVE_KERNELS()):
        return "the native decode step is off (SHMVLLM_FUSED_DECODE / SHMVLLM_NATIVE_KERNELS)"
    if model.device != "cpu" or model.dtype != "float32" or model.quantization not in (None, "gguf"):
        return f"device {model.device}, dtype {model.dtype}, quantization {model.quantization}: not the GGUF blocks in fp32 on the CPU"
    if config.speculative_config is not None or model.is_embedding:
        return "speculative decoding or an embedding model"
    from shmvllm.model.registry import gguf_source

    if gguf_source(model.model_dir) is None:
        return "not a GGUF model"
    if getattr(hf, "model_type", None) not in ARCHITECTURES:
        return f"model_type {getattr(hf, 'model_type', None)!r} (the step serves {ARCHITECTURES})"
    rope = getattr(hf, "rope_parameters", None) or {"rope_type": "default"}
    if rope.get("rope_type", "default") != "default" or getattr(hf, "rope_scaling", None):
        return f"rope_type {rope.get('rope_type')!r}"
    if (getattr(hf, "hidden_act", "silu") != "silu" or getattr(hf, "attention_bias", False) or getattr(hf, "mlp_bias", False)
            or getattr(hf, "sliding_window", None)):
        return "biases, a sliding window or an activation other than SiLU"
    return None


def _rope_tables(hf: Any, head_dim: int, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos twice and sin with its first half negated [positions, head_dim], fp32, as rotary.py's
    default tables: the inverse frequencies are torch's bits (the power rounded once from double,
    its reciprocal and the products in fp32); cos and sin of each product are rounded once from
    double, within an ulp of torch's fp32 cos and sin."""
    base = float((getattr(hf, "rope_parameters", None) or {}).get("rope_theta", getattr(hf, "rope_theta", 10000.0)))
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = np.float32(1.0) / (base ** exponents.astype(np.float64)).astype(np.float32)
    freqs = np.arange(positions, dtype=np.int64).astype(np.float32)[:, None] * inv_freq[None, :]
    cos = np.cos(freqs.astype(np.float64)).astype(np.float32)
    sin = np.sin(freqs.astype(np.float64)).astype(np.float32)
    return np.ascontiguousarray(np.concatenate((cos, cos), axis=1)), np.ascontiguousarray(np.concatenate((-sin, sin), axis=1))


class GGUFStep:
    """The step over `gguf_path`'s blocks for `hf` (HFConfig) with the KV cache at `kv_address`
    ([layers, 2, kv_heads, num_blocks, block_size, head_dim] fp32), contexts up to `max_len`,
    on `threads` OpenMP threads."""

    def __init__(self, gguf_path: Path, hf: Any, kv_address: int, num_blocks: int, block_size: int, max_len: int,
                 threads: int) -> None:
        from shmvllm.model.kernels import cpu_kernels, quant_kernels

        self.quant, cpu = quant_kernels(), cpu_kernels()
        if self.quant is None or cpu is None:
            raise RuntimeError("the native kernels could not be built")
        self.file = GGUFFile(gguf_path)
        tensors = {t.name: t for t in self.file.tensors}
        for t in tensors.values():
            if len(t.data.shape) == 2 and t.tensor_type not in _BLOCK_FORMATS:
                raise ValueError(f"GGUF tensor {t.name!r} has GGML type {t.tensor_type}, which the step does not run")
        self.hidden = int(hf.hidden_size)
        heads, layers = int(hf.num_attention_heads), int(hf.num_hidden_layers)
        kv_heads = int(getattr(hf, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(hf, "head_dim", None) or self.hidden // heads)
        intermediate = int(hf.intermediate_size)
        self.vocab = int(hf.vocab_size)
        self._keep: list[Any] = []
        self.embedding = tensors["token_embd.weight"]
        self.lm_head = tensors.get("output.weight", self.embedding)
        self.cos, self.sin = _rope_tables(hf, head_dim, max_len)
        region = kv_heads * num_blocks * block_size * head_dim * 4  # bytes of one (layer, K or V) region
        table = (LayerTable * layers)()
        eps = float(hf.rms_norm_eps)
        for i in range(layers):
            def t(name: str) -> Any:
                return tensors[f"blk.{i}.{name}.weight"]

            qkv = np.concatenate((unpermute_rows(t("attn_q").data, heads), unpermute_rows(t("attn_k").data, kv_heads), t("attn_v").data))
            qtype = t("attn_q").tensor_type
            if not t("attn_k").tensor_type == t("attn_v").tensor_type == qtype:
                raise ValueError(f"layer {i}'s q, k and v are of different GGML types")
            base = kv_address + 2 * i * region
            table[i] = LayerTable(
                self._norm(t("attn_norm")), None, self._norm(t("ffn_norm")), None, None, None,
                self._linear([(qkv, qtype)], self.hidden), self._linear([(t("attn_output").data, t("attn_output").tensor_type)], heads * head_dim),
                self._linear([(t("ffn_gate").data, t("ffn_gate").tensor_type), (t("ffn_up").data, t("ffn_up").tensor_type)], self.hidden),
                self._linear([(t("ffn_down").data, t("ffn_down").tensor_type)], intermediate),
                base, base + region, self.cos.ctypes.data, self.sin.ctypes.data,
                head_dim ** -0.5, 0.0, 0, NativeLinear(None, 0, 0, 0, None), None, None, 0, 0, 0, 0,
            )
        self._keep.append(table)
        self.final_norm = self._norm(tensors["output_norm.weight"])
        self.table = ModelTable(
            layers, self.hidden, heads, kv_heads, head_dim, intermediate, num_blocks * block_size, block_size,
            eps, 1.0, 1, 0, min(max_len, num_blocks * block_size), threads, table, self.final_norm,
            function_address(cpu, "shm_rms_norm"), function_address(cpu, "shm_rotary"), function_address(cpu, "shm_write_kv_cache"),
            function_address(cpu, "shm_attention_task"), function_address(cpu, "shm_attention_combine"),
            function_address(cpu, "shm_silu_and_mul"), function_address(cpu, "shm_linear_rows"), 0, 0,
        )
        floats = self.quant.shm_decode_scratch_floats(ctypes.addressof(self.table), MAX_ROWS)
        self.scratch = np.empty(floats, dtype=np.float32)
        self.rows_index = np.arange(MAX_ROWS, dtype=np.int64)

    def _norm(self, tensor: Any) -> int:
        if tensor.tensor_type != 0:
            raise ValueError(f"GGUF tensor {tensor.name!r} is not fp32")
        return tensor.data.ctypes.data

    def _linear(self, parts: list[tuple[np.ndarray, int]], k: int) -> NativeLinear:
        rows, offset = [], 0
        for data, qtype in parts:
            data = np.ascontiguousarray(data)
            self._keep.append(data)
            rows.append(Part(offset, data.shape[0], data.shape[1], qtype, data.ctypes.data))
            offset += data.shape[0]
        array = (Part * len(rows))(*rows)
        self._keep.append(array)
        return NativeLinear(array, len(rows), offset, k, None)

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        """fp32 rows [len(tokens), hidden] of the embedding (int64 ids in the vocabulary)."""
        e = self.embedding
        ids = np.ascontiguousarray(tokens, dtype=np.int64)
        out = np.empty((ids.shape[0], self.hidden), dtype=np.float32)
        rc = self.quant.shm_qdequant_rows(out.ctypes.data, e.data.ctypes.data, e.data.shape[1], e.tensor_type,
                                          ids.ctypes.data, ids.shape[0], e.data.shape[0], self.hidden)
        if rc != 0:
            raise RuntimeError(f"shm_qdequant_rows failed ({rc})")
        return out

    def forward(self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray, block_table: np.ndarray,
                seq_lens: np.ndarray) -> np.ndarray:
        """Final-normed hidden states [rows, hidden] of `tokens` (<= MAX_ROWS rows; row i at
        positions[i] written to KV slot slots[i], attending over block_table[i]'s first
        seq_lens[i] positions; rows of one sequence see each other's KV: all are written first)."""
        rows = tokens.shape[0]
        hidden = self.embed(tokens)
        out = np.empty_like(hidden)
        positions = np.ascontiguousarray(positions, dtype=np.int64)
        slots = np.ascontiguousarray(slots, dtype=np.int64)
        block_table = np.ascontiguousarray(block_table, dtype=np.int32)
        seq_lens = np.ascontiguousarray(seq_lens, dtype=np.int32)
        rc = self.quant.shm_decode_step(
            ctypes.addressof(self.table), hidden.ctypes.data, out.ctypes.data, rows, positions.ctypes.data,
            slots.ctypes.data, self.rows_index.ctypes.data, block_table.ctypes.data, block_table.shape[1],
            seq_lens.ctypes.data, self.scratch.ctypes.data,
        )
        if rc != 0:
            raise RuntimeError(f"the native decode step failed (status {rc})")
        return out

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """fp32 logits [rows, vocab] of final-normed hidden states, through the lm_head's blocks."""
        w = self.lm_head
        x = np.ascontiguousarray(hidden, dtype=np.float32)
        rows = x.shape[0]
        out = np.empty((rows, self.vocab), dtype=np.float32)
        rc = self.quant.shm_qgemm(out.ctypes.data, self.vocab, x.ctypes.data, self.hidden, w.data.ctypes.data,
                                  w.data.shape[1], w.tensor_type, None, None, self.vocab, rows, self.vocab, self.hidden)
        if rc != 0:
            raise RuntimeError(f"shm_qgemm failed ({rc}) on the lm_head")
        return out
