"""A checkpoint tensor read in part: each layer asks for its rank's rows or input columns of a
weight, and only those bytes are read (safetensors here; GGUF blocks in quant.read_gguf).

A tensor is a handle (`CheckpointTensor`: name, shape, `rows(a, b)`, `columns(a, b)`), not its
values, so a tensor-parallel rank never holds more than its share of one. Reads go through
pread on the file, not through a mapping of it: the pages a rank's share skips are never mapped
into it, so its resident memory is its share (a column share of a row-major tensor reads whole
rows in bounded chunks and keeps the columns).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Optional, Union

import numpy as np
import torch

if TYPE_CHECKING:
    from shmvllm.model.quant import QuantizedWeight

Values = Union[torch.Tensor, "QuantizedWeight"]

CHUNK_BYTES = 4 << 20  # a column read's transient buffer of whole rows

_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}


def read_into(fd: int, offset: int, out: np.ndarray) -> None:
    """Fills the contiguous array `out` with the file's bytes from `offset`."""
    view = memoryview(out).cast("B")
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise OSError(f"the file ends {len(view) - done} bytes early at offset {offset + done}.")
        done += got


def read_byte_columns(fd: int, offset: int, rows: int, row_bytes: int, start: int, stop: int) -> np.ndarray:
    """uint8 [rows, stop - start]: bytes [start, stop) of every row of a row-major array at `offset`."""
    out = np.empty((rows, stop - start), dtype=np.uint8)
    chunk = max(1, CHUNK_BYTES // max(row_bytes, 1))
    buf = np.empty(min(chunk, rows) * row_bytes, dtype=np.uint8)
    for first in range(0, rows, chunk):
        count = min(chunk, rows - first)
        part = buf[: count * row_bytes]
        read_into(fd, offset + first * row_bytes, part)
        out[first : first + count] = part.reshape(count, row_bytes)[:, start:stop]
    return out


class CheckpointTensor:
    """One tensor of a checkpoint: `name`, `shape` (values, outermost first), and reads of a
    share of it. `block_values`: the values of a GGML block along the last dimension when the
    tensor is read as blocks (a column share then starts and stops on block boundaries), else 1."""

    name: str
    shape: tuple[int, ...]
    block_values: int = 1

    def rows(self, start: int, stop: int, out: Optional[torch.Tensor] = None) -> Values:
        """Rows [start, stop) of the first dimension (of a 1-D tensor: its values). `out`: read
        straight into it where the dtypes agree (returned then), else a new tensor."""
        raise NotImplementedError

    def columns(self, start: int, stop: int) -> Values:
        """Values [start, stop) of the last dimension of every row of a 2-D tensor."""
        raise NotImplementedError

    def whole(self, out: Optional[torch.Tensor] = None) -> Values:
        return self.rows(0, self.shape[0], out) if self.shape else self.rows(0, 1, out)

    def _check_rows(self, start: int, stop: int) -> None:
        n = self.shape[0] if self.shape else 1
        if not 0 <= start <= stop <= n:
            raise ValueError(f"checkpoint tensor {self.name!r} of shape {self.shape}: rows [{start}, {stop}) out of range.")

    def _check_columns(self, start: int, stop: int) -> None:
        if len(self.shape) != 2 or not 0 <= start <= stop <= self.shape[1]:
            raise ValueError(f"checkpoint tensor {self.name!r} of shape {self.shape}: columns [{start}, {stop}) out of range.")


class SafetensorsTensor(CheckpointTensor):
    """A tensor of a .safetensors file, read by offset (the file's JSON header gives dtype,
    shape and data offsets)."""

    def __init__(self, fd: int, name: str, dtype: torch.dtype, shape: tuple[int, ...], offset: int) -> None:
        self.fd, self.name, self.dtype, self.shape, self.offset = fd, name, dtype, shape, offset
        self.itemsize = torch.empty(0, dtype=dtype).element_size()
        self.row_values = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1

    def rows(self, start: int, stop: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        self._check_rows(start, stop)
        shape = (stop - start, *self.shape[1:]) if self.shape else ()
        if out is None or out.dtype != self.dtype or not out.is_contiguous() or tuple(out.shape) != shape:
            target = torch.empty(shape, dtype=self.dtype)
        else:
            target = out
        if target.numel():
            read_into(self.fd, self.offset + start * self.row_values * self.itemsize, target.view(-1).view(torch.uint8).numpy())
        if out is not None and target is not out:
            out.copy_(target)
            return out
        return target

    def columns(self, start: int, stop: int) -> torch.Tensor:
        self._check_columns(start, stop)
        if (start, stop) == (0, self.shape[1]):  # every column (size 1): one contiguous read
            return self.rows(0, self.shape[0])
        size = self.itemsize
        data = read_byte_columns(self.fd, self.offset, self.shape[0], self.shape[1] * size, start * size, stop * size)
        return torch.from_numpy(data).view(self.dtype)


def safetensors_tensors(paths: list[Path]) -> Iterator[tuple[str, CheckpointTensor]]:
    """(name, handle) for every tensor of the files; a handle reads while its file is open
    (until the next file begins)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            (length,) = struct.unpack("<Q", os.pread(fd, 8, 0))
            header = json.loads(os.pread(fd, length, 8))
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                if info["dtype"] not in _SAFETENSORS_DTYPES:
                    raise ValueError(f"{str(path)!r}: tensor {name!r} has dtype {info['dtype']}, which shmvllm does not read.")
                yield name, SafetensorsTensor(fd, name, _SAFETENSORS_DTYPES[info["dtype"]], tuple(info["shape"]),
                                              8 + length + info["data_offsets"][0])
        finally:
            os.close(fd)


class DerivedTensor(CheckpointTensor):
    """Entry `index` of a stacked tensor (a [n, a, b] weight or [n, b] bias), some of its last
    dimension's `columns`, the weight transposed to [columns, a]: one expert's projection of a
    checkpoint that stacks its experts (gpt-oss). The entry is read (once) when first asked for."""

    def __init__(self, name: str, source: CheckpointTensor, index: int, columns: slice, transpose: bool) -> None:
        self.name, self.source, self.index, self.take, self.transpose = name, source, index, columns, transpose
        width = len(range(source.shape[-1])[columns])
        self.shape = (width, source.shape[1]) if transpose else (width, *source.shape[1:-1])
        self._values: Optional[torch.Tensor] = None

    def _all(self) -> torch.Tensor:
        if self._values is None:
            entry = self.source.rows(self.index, self.index + 1)[0]
            if not isinstance(entry, torch.Tensor):
                raise ValueError(f"checkpoint tensor {self.source.name!r}: stacked blocks cannot be re-laid out.")
            entry = entry[..., self.take]
            self._values = (entry.transpose(0, 1) if self.transpose else entry).contiguous()
        return self._values

    def rows(self, start: int, stop: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        self._check_rows(start, stop)
        values = self._all()[start:stop]
        if out is not None:
            out.copy_(values.view(out.shape))
            return out
        return values

    def columns(self, start: int, stop: int) -> torch.Tensor:
        self._check_columns(start, stop)
        return self._all()[:, start:stop]
