"""The C kernels' view of a Linear's weights (decode_step.c's and moe.c's shm_linear): its GGML
block parts, or one part of contiguous fp32 rows. Shared by the native decode step and the
mixture-of-experts kernel, so neither imports the other."""

from __future__ import annotations

import ctypes
from typing import Any, Sequence

import torch

from shmvllm.model.linear import Linear
from shmvllm.model.step_table import NativeLinear, Part as _Part


def linear_table(linear: Linear, keep: list[Any]) -> NativeLinear:
    """The C kernels' table of a Linear's weight: its GGML block parts,
    or one part of contiguous fp32 rows; the ctypes array it points into is appended to `keep`."""
    if linear.blocks is not None:
        parts = [(offset, w.n, w.data.shape[1], w.qtype, w.data.data_ptr()) for offset, w in linear.blocks]
    else:
        weight = linear.weight.detach()
        if not weight.is_contiguous() or weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ValueError("the native kernels need contiguous fp32 weights on the CPU.")
        parts = [(0, linear.out_features, 0, -1, weight.data_ptr())]
    array = (_Part * len(parts))(*[_Part(*p) for p in parts])
    keep.append(array)
    bias = linear.bias.data_ptr() if linear.bias is not None else None
    return NativeLinear(array, len(parts), linear.out_features, linear.in_features, bias)


def linear_tables(linears: Sequence[Linear], keep: list[Any]) -> ctypes.Array:
    """One C array of the tables of `linears` (a layer's experts), kept alive in `keep` with what
    it points into."""
    array = (NativeLinear * len(linears))(*[linear_table(linear, keep) for linear in linears])
    keep.append(array)
    return array
