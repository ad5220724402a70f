"""The runner's side: token bitmasks -> -inf on the logits of disallowed tokens.

A bitmask row is ceil(vocab / 32) int32 words, bit t % 32 of word t // 32 set when token t is
allowed. Each byte of the mask picks one row of a [256, 8] table of 0 / -inf, so a whole row of
additive mask comes from one index_select over the mask's bytes, into a buffer that grows to the
largest batch seen and is then reused; `index_add_` adds it to the constrained rows only. On
CPU this is several times faster than xgrammar's own CPU kernel on a 49k vocabulary (one pass
of vectorized torch ops instead of a bit loop), and the same code runs on CUDA.
"""

from __future__ import annotations

import time
from typing import Optional

import numpy as np
import torch


class TokenBitmaskApplier:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
        self._table = torch.where(bits.bool(), 0.0, float("-inf")).to(torch.float32).to(device)  # [256, 8]
        self._byte_index: Optional[torch.Tensor] = None  # int64 [capacity]
        self._additive: Optional[torch.Tensor] = None  # float32 [capacity, 8]
        self.apply_s = 0.0

    def apply(self, logits: torch.Tensor, rows: np.ndarray, bitmask: np.ndarray) -> None:
        """logits: [num_rows, vocab] (in place); rows: the logits row of each bitmask row."""
        started = time.perf_counter()
        num, words = bitmask.shape
        width = logits.shape[1]
        if words * 32 < width:
            raise ValueError(f"a bitmask of {words} words covers {words * 32} tokens, fewer than the logits' {width}.")
        mask_bytes = torch.from_numpy(np.ascontiguousarray(bitmask)).view(torch.uint8).reshape(-1)
        count = mask_bytes.numel()
        if self._byte_index is None or self._byte_index.numel() < count:
            self._byte_index = torch.empty(count, dtype=torch.int64, device=self.device)
            self._additive = torch.empty((count, 8), dtype=torch.float32, device=self.device)
        index = self._byte_index[:count]
        index.copy_(mask_bytes)
        additive = torch.index_select(self._table, 0, index, out=self._additive[:count]).view(num, words * 32)
        additive = additive[:, :width]
        if logits.dtype != torch.float32:
            additive = additive.to(logits.dtype)
        if num == logits.shape[0] and np.array_equal(rows, np.arange(num)):
            logits.add_(additive)
        else:
            logits.index_add_(0, torch.from_numpy(rows.astype(np.int64)).to(self.device), additive)
        self.apply_s += time.perf_counter() - started
