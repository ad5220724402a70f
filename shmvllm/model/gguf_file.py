"""A GGUF file, memory-mapped: its metadata and its tensors as views of the file's pages.

gguf-py's GGUFReader builds a numpy view for every part of every metadata field: on a file that
carries a tokenizer (49k tokens, 48k merges) that is seconds of Python. Here the header is walked
once with `struct` (arrays of strings are skipped by their lengths and decoded only when asked
for), and each tensor is a numpy array over a private (copy-on-write) mapping of the file: no
byte is read before a kernel touches it, and the page cache shares the pages between processes.
Only the format is read here; what the tensors mean is quant.py's business.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import numpy as np

# GGUF metadata value types -> struct format (scalars); 8: string, 9: array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32, 7: np.bool_,
          10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
_DEFAULT_ALIGNMENT = 32

# GGML type id -> (values per block, bytes per block), every type a GGUF file may hold (ggml.h);
# which of them shmvllm runs is quant.FORMATS' business.
GGML_BLOCKS: dict[int, tuple[int, int]] = {
    0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 9: (32, 40),
    10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210), 15: (256, 292),
    16: (256, 66), 17: (256, 74), 18: (256, 98), 19: (256, 50), 20: (32, 18), 21: (256, 110), 22: (256, 82),
    23: (256, 136), 24: (1, 1), 25: (1, 2), 26: (1, 4), 27: (1, 8), 28: (1, 8), 29: (256, 56), 30: (1, 2),
    34: (256, 54), 35: (256, 66), 39: (32, 17), 40: (64, 36), 41: (128, 18),
}
_TYPED = {0: np.float32, 1: np.float16}  # kept typed (values); every other type as uint8 rows of blocks


def unpermute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undoes llama.cpp's q/k row interleave (as transformers' LlamaTensorProcessor does), on
    whole rows: the same reshape and swap for a row of blocks as for a row of values."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(2, 1).reshape(rows.shape)


class GGUFFormatError(ValueError):
    """The file is not a GGUF file shmvllm can read (bad magic, version, truncated)."""


@dataclass
class _LazyStrings:
    """An array of strings in the header: where it starts and how many; decoded on demand."""

    offset: int
    count: int


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # GGUF's order: innermost dimension first
    tensor_type: int  # GGML type id
    data: np.ndarray  # a view of the mapped file: typed [..., k] for F32 / F16, uint8 [rows..., row_bytes] otherwise
    offset: int  # where its bytes start in the file


class GGUFFile:
    """`GGUFFile(path)`: `.metadata(key)` (scalars, strings, numeric arrays as numpy, string
    arrays as lists), `.keys`, `.architecture`, `.tensors` (views of the mapping)."""

    def __init__(self, path: Union[str, Path]) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # writable views, never written back
            except ValueError as exc:  # an empty file cannot be mapped
                raise GGUFFormatError(f"{str(self.path)!r} is not a GGUF file: {exc}") from None
        buf = self._map
        if len(buf) < 24 or buf[:4] != b"GGUF":
            raise GGUFFormatError(f"{str(self.path)!r} is not a GGUF file (its first bytes are {bytes(buf[:4])!r}).")
        self.version = _U32.unpack_from(buf, 4)[0]
        if self.version not in (2, 3):
            raise GGUFFormatError(f"{str(self.path)!r} is GGUF version {self.version}; shmvllm reads versions 2 and 3.")
        tensor_count, kv_count = struct.unpack_from("<QQ", buf, 8)
        self._pos = 24
        self._fields: dict[str, Any] = {}
        try:
            for _ in range(kv_count):
                key = self._string()
                self._fields[key] = self._value(self._u32())
            infos = [self._tensor_info() for _ in range(tensor_count)]
        except (struct.error, IndexError, UnicodeDecodeError) as exc:
            raise GGUFFormatError(f"{str(self.path)!r}: the GGUF header is truncated or corrupt ({exc}).") from None
        alignment = int(self._fields.get("general.alignment", _DEFAULT_ALIGNMENT))
        start = -(-self._pos // alignment) * alignment
        self.tensors = [self._tensor(start, *info) for info in infos]

    # ---- metadata ------------------------------------------------------------------------

    @property
    def buffer(self) -> mmap.mmap:
        """The whole file, mapped copy-on-write (what every tensor's data is a view of)."""
        return self._map

    @property
    def keys(self) -> list[str]:
        return list(self._fields)

    def __contains__(self, key: str) -> bool:
        return key in self._fields

    def metadata(self, key: str, default: Any = None) -> Any:
        value = self._fields.get(key, default)
        if isinstance(value, _LazyStrings):
            value = self._fields[key] = self._strings(value)
        return value

    @property
    def architecture(self) -> str:
        arch = self.metadata("general.architecture")
        if not isinstance(arch, str):
            raise GGUFFormatError(f"{str(self.path)!r} has no general.architecture.")
        return arch

    # ---- parsing -------------------------------------------------------------------------

    def _u32(self) -> int:
        value = _U32.unpack_from(self._map, self._pos)[0]
        self._pos += 4
        return value

    def _u64(self) -> int:
        value = _U64.unpack_from(self._map, self._pos)[0]
        self._pos += 8
        return value

    def _string(self) -> str:
        length = self._u64()
        end = self._pos + length
        if end > len(self._map):
            raise IndexError("a string runs past the end of the file")
        text = self._map[self._pos : end].decode("utf-8")
        self._pos = end
        return text

    def _value(self, kind: int) -> Any:
        if kind in _SCALARS:
            fmt = _SCALARS[kind]
            value = struct.unpack_from(fmt, self._map, self._pos)[0]
            self._pos += struct.calcsize(fmt)
            return value
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item, count = self._u32(), self._u64()
            if item in _NUMPY:
                dtype = np.dtype(_NUMPY[item])
                values = np.frombuffer(self._map, dtype=dtype, count=count, offset=self._pos)
                self._pos += count * dtype.itemsize
                return values
            if item == _STRING:  # skipped by lengths now, decoded if someone asks
                lazy = _LazyStrings(self._pos, count)
                unpack, buf, pos = _U64.unpack_from, self._map, self._pos
                for _ in range(count):
                    pos += 8 + unpack(buf, pos)[0]
                self._pos = pos
                return lazy
            return [self._value(item) for _ in range(count)]
        raise GGUFFormatError(f"{str(self.path)!r}: unknown GGUF metadata type {kind}.")

    def _strings(self, lazy: _LazyStrings) -> list[str]:
        out, buf, pos, unpack = [], self._map, lazy.offset, _U64.unpack_from
        for _ in range(lazy.count):
            length = unpack(buf, pos)[0]
            out.append(buf[pos + 8 : pos + 8 + length].decode("utf-8", errors="replace"))
            pos += 8 + length
        return out

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        dims = tuple(self._u64() for _ in range(self._u32()))
        return name, dims, self._u32(), self._u64()

    def _tensor(self, start: int, name: str, dims: tuple[int, ...], kind: int, offset: int) -> GGUFTensor:
        if kind not in GGML_BLOCKS:
            raise GGUFFormatError(f"{str(self.path)!r}: tensor {name!r} has an unknown GGML type {kind}.")
        values, nbytes = GGML_BLOCKS[kind]
        k = dims[0] if dims else 1
        rows = int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1
        if k % values:
            raise GGUFFormatError(f"{str(self.path)!r}: tensor {name!r} rows of {k} values are not whole blocks of {values}.")
        row_bytes = k // values * nbytes
        begin = start + offset
        if begin + rows * row_bytes > len(self._map):
            raise GGUFFormatError(f"{str(self.path)!r}: tensor {name!r} runs past the end of the file.")
        outer = tuple(reversed(dims[1:]))
        if kind in _TYPED:
            data = np.frombuffer(self._map, dtype=_TYPED[kind], count=rows * k, offset=begin).reshape(*outer, k)
        else:
            data = np.frombuffer(self._map, dtype=np.uint8, count=rows * row_bytes, offset=begin).reshape(*outer, row_bytes)
        return GGUFTensor(name, dims, kind, data, begin)
