"""Weights in GGML block formats, as GGUF files ship them, and reading them from a GGUF file.

A `QuantizedWeight` is a 2-D weight [n, k] kept as its GGML blocks: a uint8 tensor [n, row_bytes]
(each row of the weight a run of blocks; row-blocked, so rows can be permuted, sliced and
concatenated as byte rows). The kernels in kernels/quant_kernels.c multiply fp32 activations
with it, dequantizing in registers; `dequantize()` (gguf.quants.dequantize, what transformers'
GGUF loader uses) is the reference those kernels are tested against and the fallback where the
kernels do not run (no compiler, CUDA).

`read_gguf(path, hf_config)` yields the file's tensors (handles that read a share: model/checkpoint.py)
under the checkpoint names transformers gives them (each family declares its names, model/models/), with the rules transformers' GGUF
loader applies (the q/k row permutation of llama files, whole rows of blocks moving; Gemma's
norms stored as 1 + w), so that the values equal those of transformers' dequantized model.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Union

import numpy as np
import torch

from shmvllm.model.checkpoint import CheckpointTensor, read_byte_columns
from shmvllm.model.gguf_file import GGML_BLOCKS, GGUFFile, unpermute_rows

# GGML type id -> (name, values per block, bytes per block): the formats the kernels run.
FORMATS: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    30: ("BF16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    8: ("Q8_0", 32, 34),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    20: ("IQ4_NL", 32, 18),
    23: ("IQ4_XS", 256, 136),
    39: ("MXFP4", 32, 17),
}
FORMAT_IDS = {name: ident for ident, (name, _, _) in FORMATS.items()}

Q4_1_R8 = 1003
"""Not a GGML type: Q4_1 rows repacked at load in groups of 8 (quant_kernels.c's T_Q4_1_R8, the
8-row GEMV pass's interleave: per group and block the 8 rows' nibble dwords side by side, then
their d, then their m). The same bytes as the rows, [n, row_bytes] with n a multiple of 8; the
builds with that pass repack a Linear's Q4_1 parts once loaded (Linear.repack)."""
_LAYOUTS: dict[int, tuple[str, int, int]] = {Q4_1_R8: ("Q4_1 in groups of 8", 32, 20)}


def format_name(qtype: int) -> str:
    known = FORMATS.get(qtype) or _LAYOUTS.get(qtype)
    return known[0] if known else _GGML_NAMES.get(qtype, f"ggml type {qtype}")


# The names of GGML types shmvllm does not run, for messages (ggml.h; without importing gguf).
_GGML_NAMES = {9: "Q8_1", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 21: "IQ3_S", 22: "IQ2_S", 24: "I8",
               25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 34: "TQ1_0", 35: "TQ2_0", 40: "NVFP4",
               41: "Q1_0"}

# GGUF metadata value types (gguf.GGUFValueType) -> size in bytes of a fixed-size value
_GGUF_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor of a GGUF file's header: `shape` innermost dimension first (as GGUF lists it),
    `offset` the absolute byte offset of its data in the file."""

    name: str
    shape: tuple[int, ...]
    qtype: int
    offset: int

    @property
    def nbytes(self) -> int:
        _, values, nbytes = FORMATS[self.qtype]
        count = 1
        for d in self.shape:
            count *= d
        return count // values * nbytes


def gguf_tensor_infos(path: Union[str, Path]) -> list[GGUFTensorInfo]:
    """The tensor infos of a GGUF v2/v3 file, read from its header alone (the key/value metadata
    skipped, no gguf import: milliseconds where gguf.GGUFReader parses every field, minutes for a
    262k-token vocabulary on a loaded machine). A file that is not GGUF is a ValueError naming it."""
    path = Path(path)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        try:
            return _read_tensor_infos(m)
        except (struct.error, IndexError) as exc:
            raise ValueError(f"{str(path)!r} is not a readable GGUF file (header ends early: {exc}).") from None
        except ValueError as exc:
            raise ValueError(f"{str(path)!r}: {exc}") from None


def check_gguf_formats(path: Union[str, Path]) -> dict[str, str]:
    """{tensor name: GGML format name} of a GGUF file, from its header (gguf_tensor_infos). A
    tensor in a format the kernels do not run is a ValueError naming the tensor and the format."""
    infos = gguf_tensor_infos(path)
    check_formats((info.name, info.qtype) for info in infos)
    return {info.name: FORMATS[info.qtype][0] for info in infos}


def check_formats(tensors: Iterable[tuple[str, int]]) -> None:
    """A ValueError naming the first (name, GGML format id) the kernels do not run."""
    for name, qtype in tensors:
        if qtype not in FORMATS:
            raise ValueError(
                f"GGUF tensor {name!r} is in GGML format {format_name(qtype)}, which shmvllm does not run; "
                f"supported: {sorted(FORMAT_IDS)}."
            )


def _read_tensor_infos(m: "mmap.mmap") -> list[GGUFTensorInfo]:
    if m[:4] != b"GGUF":
        raise ValueError("not a GGUF file (no GGUF magic)")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", m, 4)
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
    pos = 24

    def string(pos: int) -> tuple[str, int]:
        (length,) = struct.unpack_from("<Q", m, pos)
        return m[pos + 8 : pos + 8 + length].decode("utf-8", errors="replace"), pos + 8 + length

    def skip_value(kind: int, pos: int) -> int:
        if kind in _GGUF_SCALAR_BYTES:
            return pos + _GGUF_SCALAR_BYTES[kind]
        if kind == _GGUF_STRING:
            return pos + 8 + struct.unpack_from("<Q", m, pos)[0]
        if kind == _GGUF_ARRAY:
            item, count = struct.unpack_from("<IQ", m, pos)
            pos += 12
            if item in _GGUF_SCALAR_BYTES:
                return pos + count * _GGUF_SCALAR_BYTES[item]
            for _ in range(count):
                pos = skip_value(item, pos)
            return pos
        raise ValueError(f"unknown GGUF metadata value type {kind}")

    alignment = 32  # GGUF's default, unless general.alignment says otherwise
    for _ in range(n_kv):
        key, pos = string(pos)
        (kind,) = struct.unpack_from("<I", m, pos)
        if key == "general.alignment" and kind == 4:
            (alignment,) = struct.unpack_from("<I", m, pos + 4)
        pos = skip_value(kind, pos + 4)
    raw = []
    for _ in range(n_tensors):
        name, pos = string(pos)
        (dims,) = struct.unpack_from("<I", m, pos)
        shape = struct.unpack_from(f"<{dims}Q", m, pos + 4)
        pos += 4 + 8 * dims
        qtype, offset = struct.unpack_from("<IQ", m, pos)
        raw.append((name, shape, qtype, offset))
        pos += 12
    data_start = (pos + alignment - 1) // alignment * alignment
    return [GGUFTensorInfo(name, tuple(shape), qtype, data_start + offset) for name, shape, qtype, offset in raw]


@dataclass
class QuantizedWeight:
    """A weight [n, k] as GGML blocks of format `qtype`: data is uint8 [n, row_bytes]."""

    data: torch.Tensor
    qtype: int
    k: int

    def __post_init__(self) -> None:
        if self.qtype not in FORMATS and self.qtype not in _LAYOUTS:
            raise ValueError(f"GGML format {format_name(self.qtype)} is not supported; supported: {sorted(FORMAT_IDS)}.")
        _, values, nbytes = FORMATS.get(self.qtype) or _LAYOUTS[self.qtype]
        if self.qtype == Q4_1_R8 and self.data.shape[0] % 8:
            raise ValueError(f"{format_name(Q4_1_R8)} holds whole groups of 8 rows, got {self.data.shape[0]} rows.")
        if self.data.dtype != torch.uint8 or self.data.dim() != 2:
            raise ValueError(f"quantized weight data must be a 2-D uint8 tensor, got {self.data.dtype} {tuple(self.data.shape)}.")
        if self.k % values != 0 or self.data.shape[1] != self.k // values * nbytes:
            raise ValueError(
                f"{format_name(self.qtype)} rows of {self.k} values take {self.k // values * nbytes} bytes, "
                f"got {self.data.shape[1]} (k must be a multiple of {values})."
            )

    @property
    def n(self) -> int:
        return self.data.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def name(self) -> str:
        return format_name(self.qtype)

    def rows(self, start: int, count: int) -> "QuantizedWeight":
        if self.qtype == Q4_1_R8 and (start % 8 or count % 8):
            raise ValueError(f"rows [{start}, {start + count}) of {format_name(Q4_1_R8)} do not fall on groups of 8 rows.")
        return QuantizedWeight(self.data[start : start + count], self.qtype, self.k)

    def plain(self) -> "QuantizedWeight":
        """The weight as GGML rows: itself, or a repacked one's rows gathered back (a copy)."""
        if self.qtype != Q4_1_R8:
            return self
        # [groups, blocks, 160] -> per row r: d at 128 + 2r, m at 144 + 2r, nibble dword t at 32t + 4r
        groups = self.data.numpy().reshape(self.n // 8, -1, 160)
        nibbles = groups[:, :, :128].reshape(self.n // 8, -1, 4, 8, 4).transpose(0, 3, 1, 2, 4)
        d = groups[:, :, 128:144].reshape(self.n // 8, -1, 8, 2).transpose(0, 2, 1, 3)
        m = groups[:, :, 144:160].reshape(self.n // 8, -1, 8, 2).transpose(0, 2, 1, 3)
        nibbles = nibbles.reshape(self.n // 8, 8, -1, 16)
        rows = np.concatenate((d, m, nibbles), axis=3).reshape(self.n, -1)
        return QuantizedWeight(torch.from_numpy(np.ascontiguousarray(rows)), FORMAT_IDS["Q4_1"], self.k)

    def dequantize(self) -> torch.Tensor:
        """fp32 [n, k]: gguf.quants.dequantize, the reference arithmetic."""
        from gguf.quants import dequantize

        plain = self.plain()
        values = dequantize(plain.data.numpy(), plain.qtype)
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(self.n, self.k)


def concat(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """Stacks weights of one format and width along rows (fused projections)."""
    first = weights[0]
    for w in weights[1:]:
        if w.qtype != first.qtype or w.k != first.k:
            raise ValueError(f"cannot stack {w.name} [{w.n}, {w.k}] onto {first.name} [{first.n}, {first.k}].")
    if _adjacent([w.data for w in weights]):  # one after the other in one storage (a mapped file): a view
        rows = sum(w.n for w in weights)
        return QuantizedWeight(first.data.as_strided((rows, first.data.shape[1]), first.data.stride()), first.qtype, first.k)
    # numpy's copy: torch.cat would run an OpenMP region per call, and on a loaded machine (at
    # start-up the frontend loads its tokenizer on the other core) each waits for a core
    stacked = np.concatenate([w.data.numpy() for w in weights])
    return QuantizedWeight(torch.from_numpy(stacked), first.qtype, first.k)


def _adjacent(parts: list[torch.Tensor]) -> bool:
    storage = parts[0].untyped_storage().data_ptr()
    for before, after in zip(parts, parts[1:]):
        if not (before.is_contiguous() and after.is_contiguous()) or after.untyped_storage().data_ptr() != storage:
            return False
        if after.data_ptr() != before.data_ptr() + before.numel() * before.element_size():
            return False
    return True


def quantize(weight: torch.Tensor, qtype: int) -> QuantizedWeight:
    """fp32 [n, k] -> blocks of `qtype` with gguf.quants.quantize (llama.cpp's reference quantizer)."""
    from gguf.quants import quantize as gguf_quantize

    values = weight.detach().to(torch.float32).cpu().numpy()
    blocks = gguf_quantize(values, qtype)
    data = torch.from_numpy(np.ascontiguousarray(blocks).view(np.uint8).reshape(values.shape[0], -1))
    return QuantizedWeight(data.clone(), qtype, values.shape[1])


_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

Tensor = Union[torch.Tensor, QuantizedWeight]


def gguf_architecture(path: Path) -> str:
    return GGUFFile(path).architecture


def checkpoint_name(gguf_name: str, layer_names: dict[str, str]) -> str:
    """blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight, with the family's
    `layer_names` (GGUF name after "blk.N." -> checkpoint name after "model.layers.N.")."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem.startswith("blk."):
        _, layer, local = stem.split(".", 2)
        if local in layer_names:
            return f"model.layers.{layer}.{layer_names[local]}.{suffix}"
    elif stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{suffix}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no place in this model family (known: {sorted(layer_names)}).")


class GGUFTensorRef(CheckpointTensor):
    """A tensor of a mapped GGUF file, read in part: rows of a 2-D weight in blocks are views of
    the file's mapped pages (a rank touches only its rows), input columns (whole blocks) are read
    with pread into a copy of their own, 1-D and F32 tensors are fp32 copies of the part asked
    for. `dequantize`: every part as fp32 (gguf.quants.dequantize, transformers' values).
    `heads`: llama.cpp interleaved these q/k rows within each of this many heads; a rows read
    takes whole heads and undoes it on them. `minus_one`: Gemma's norms, stored as 1 + w."""

    def __init__(self, path: Path, mapped: torch.Tensor, name: str, qtype: int, shape: tuple[int, ...], data: np.ndarray,
                 offset: int, dequantize: bool, heads: int = 0, minus_one: bool = False) -> None:
        self.path, self.mapped, self.name, self.qtype, self.shape = path, mapped, name, qtype, shape
        self.data, self.offset = data, offset  # a view of the mapped file, and where it starts
        self.dequantize, self.heads, self.minus_one = dequantize, heads, minus_one
        self.dense = self.qtype == FORMAT_IDS["F32"] or len(self.shape) == 1
        self.block_values = 1 if (self.dense or dequantize) else FORMATS[self.qtype][1]

    @property
    def k(self) -> int:
        return self.shape[-1]

    def _row_bytes(self) -> int:
        return self.data.shape[-1] * self.data.itemsize

    def _values(self, data: np.ndarray) -> torch.Tensor:
        """fp32 values of raw rows of this tensor's type."""
        if self.qtype != FORMAT_IDS["F32"]:
            data = _dequantize_np(np.ascontiguousarray(data).view(np.uint8).reshape(data.shape[0], -1), self.qtype)
        values = np.array(data, dtype=np.float32).reshape(data.shape[0], -1)
        return torch.from_numpy(values)

    def rows(self, start: int, stop: int, out: Optional[torch.Tensor] = None) -> Tensor:
        self._check_rows(start, stop)
        data = self.data
        if len(self.shape) == 1:
            values = data if self.qtype == FORMAT_IDS["F32"] else _dequantize_np(data, self.qtype)
            values = np.array(values[start:stop], dtype=np.float32)
            if self.minus_one:
                values = values - np.float32(1.0)  # transformers' Gemma rule; the model adds it back
            result: Tensor = torch.from_numpy(values)
        else:
            part = data[start:stop]
            permuted = self.heads > 0
            if permuted:
                per_head = self.shape[0] // self.heads
                if start % per_head or stop % per_head:
                    raise ValueError(f"{self.name!r}: rows [{start}, {stop}) are not whole heads of {per_head} rows.")
                part = unpermute_rows(part, (stop - start) // per_head)
            if self.dense or self.dequantize:
                result = self._values(part)
            elif permuted:
                result = QuantizedWeight(torch.from_numpy(np.ascontiguousarray(part).view(np.uint8).reshape(part.shape[0], -1)),
                                         self.qtype, self.k)
            else:
                row_bytes = self._row_bytes()
                begin = self.offset + start * row_bytes
                result = QuantizedWeight(self.mapped[begin : begin + (stop - start) * row_bytes].view(stop - start, row_bytes),
                                         self.qtype, self.k)
        if out is not None and isinstance(result, torch.Tensor):
            out.copy_(result.view(out.shape))
            return out
        return result

    def columns(self, start: int, stop: int) -> Tensor:
        self._check_columns(start, stop)
        if self.heads:
            raise ValueError(f"{self.name!r}: a column share of permuted q/k rows is not a layer's share.")
        if (start, stop) == (0, self.shape[1]):  # every column (size 1): the rows' view of the mapping, no copy
            return self.rows(0, self.shape[0])
        values, nbytes = GGML_BLOCKS[self.qtype]
        lo, hi = start // values * values, -(-stop // values) * values
        if (lo, hi) != (start, stop) and not (self.dense or self.dequantize):
            raise ValueError(f"{self.name!r} columns [{start}, {stop}) do not fall on {values}-value block boundaries.")
        with open(self.path, "rb") as f:
            data = read_byte_columns(f.fileno(), self.offset, self.shape[0], self._row_bytes(),
                                     lo // values * nbytes, hi // values * nbytes)
        if self.dense or self.dequantize:
            if self.qtype == FORMAT_IDS["F32"]:
                return torch.from_numpy(data.view(np.float32).copy())[:, start - lo : stop - lo]
            return self._values(data)[:, start - lo : stop - lo].contiguous()
        return QuantizedWeight(torch.from_numpy(data), self.qtype, stop - start)


def read_gguf(path: Path, hf_config: Any, family: Any, dequantize: bool = False) -> Iterator[tuple[str, GGUFTensorRef]]:
    """(checkpoint name, GGUFTensorRef) for every tensor of the file, its values unread. `family`
    (decoder.Family) names the tensors and says which of transformers' GGUF rules apply: the
    llama q/k row permutation, Gemma's norms stored as 1 + w. dequantize: every read as fp32,
    any GGML format gguf-py reads; else 2-D quantized / half weights read as QuantizedWeight."""
    reader = GGUFFile(path)
    from shmvllm.model.models import check_gguf_architecture

    check_gguf_architecture(reader.architecture)
    if not dequantize:  # the kernels run every tensor's format (the header read above says)
        check_formats((tensor.name, tensor.tensor_type) for tensor in reader.tensors)
    # one storage over the whole mapping: neighbouring tensors stack into one view (concat)
    mapped = torch.frombuffer(reader.buffer, dtype=torch.uint8)
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    permute = reader.architecture in family.gguf_permute_qk
    for tensor in reader.tensors:
        name = checkpoint_name(tensor.name, family.gguf_names)
        if len(tensor.shape) == 3 or "*" in name:  # stacked experts: weights [n_expert, rows, k], biases [n_expert, rows]
            yield from _experts(Path(path), mapped, tensor, name, dequantize)
            continue
        permuted = heads if permute and ".attn_q." in tensor.name else kv_heads if permute and ".attn_k." in tensor.name else 0
        minus_one = family.gguf_norms_minus_one and tensor.name.endswith("norm.weight")
        shape = tuple(int(d) for d in reversed(tensor.shape))
        yield name, GGUFTensorRef(Path(path), mapped, name, tensor.tensor_type, shape, tensor.data, tensor.offset,
                                  dequantize, permuted, minus_one)


def _experts(path: Path, mapped: torch.Tensor, tensor: Any, name: str, dequantize: bool) -> Iterator[tuple[str, GGUFTensorRef]]:
    """One (checkpoint name, handle) per expert of a stacked expert tensor: `name` holds "*" where
    the expert's index goes; each expert's rows a view of the mapped file."""
    if "*" not in name or len(tensor.shape) not in (2, 3):
        raise ValueError(f"GGUF tensor {tensor.name!r} of shape {tensor.shape} is not a stacked expert tensor of this family ({name!r}).")
    shape = tuple(int(d) for d in reversed(tensor.shape[:-1]))  # one expert's
    for expert in range(tensor.data.shape[0]):
        rows = tensor.data[expert]
        yield name.replace("*", str(expert)), GGUFTensorRef(path, mapped, name.replace("*", str(expert)), tensor.tensor_type,
                                                            shape, rows, tensor.offset + expert * rows.nbytes, dequantize)


def _dequantize_np(data: np.ndarray, qtype: int) -> np.ndarray:
    from gguf.quants import dequantize

    return dequantize(data, qtype)
