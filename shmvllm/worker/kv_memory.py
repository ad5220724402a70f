"""The CPU KV cache's memory, mapped and first touched before torch has imported.

An engine that answers READY from its config (`core.limits_before_load`) knows its cache's
layout then (`validation.kv_cache_shape`), while torch still imports. `reserve` (through
`core.reserve_kv_cache`) maps that many
anonymous bytes (2 MiB-aligned, advised MADV_HUGEPAGE as `huge_pages` advises a torch cache) and,
on a thread, writes zeros over the first blocks of every (layer, K/V, KV head) region: the pages
that the padding block and the first requests' blocks fault. Faulting them is kernel work (one
2 MiB page zeroed per region: 180 for SmolLM2, ~0.4 s), done here beside torch's import rather
than in the first step. `ModelRunner.initialize_kv_cache` then `take`s the mapping when its own
shape and element size are the reserved ones (`torch.frombuffer`: no copy), else allocates anew
and the reservation is unmapped. Fresh anonymous pages read as zeros, as the runner expects of
blocks it has not yet zeroed itself.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import threading
import time
from typing import Optional

from shmvllm import envs

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
# blocks of each region touched ahead: the padding block and a short first request's blocks
# (all of them within the region's first huge page where THP applies; 4 KiB pages each elsewhere)
TOUCHED_BLOCKS = 64


class Reservation:
    """`nbytes` of anonymous memory for a cache of `shape` with `itemsize`-byte elements."""

    def __init__(self, shape: tuple[int, ...], itemsize: int) -> None:
        if len(shape) != 6 or any(not isinstance(n, int) or n < 1 for n in shape):
            raise ValueError(f"shape must be 6 positive ints [layers, 2, kv_heads, blocks, block_size, head_dim], got {shape!r}.")
        if itemsize not in (2, 4):
            raise ValueError(f"itemsize must be 2 or 4, got {itemsize!r}.")
        self.shape, self.itemsize = shape, itemsize
        self.nbytes = math.prod(shape) * itemsize
        self.map = mmap.mmap(-1, self.nbytes + HUGE_PAGE)
        view = ctypes.c_char.from_buffer(self.map)
        base = ctypes.addressof(view)
        del view  # a live export would keep the mapping from closing
        self.offset = -base % HUGE_PAGE
        self.address = base + self.offset
        self.advised = False
        if envs.SHMVLLM_HUGE_PAGES() and hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self.map.madvise(mmap.MADV_HUGEPAGE, self.offset, self.nbytes // HUGE_PAGE * HUGE_PAGE)
                self.advised = True
            except OSError:  # advice only: THP off, or a kernel without it
                pass
        self.touch_seconds: Optional[float] = None
        self._thread = threading.Thread(target=self._touch, name="shmvllm-kv-touch", daemon=True)
        self._thread.start()

    def _touch(self) -> None:
        started = time.perf_counter()
        layers, two, kv_heads, blocks, block_size, head_dim = self.shape
        block_bytes = block_size * head_dim * self.itemsize
        region = blocks * block_bytes
        span = min(blocks, TOUCHED_BLOCKS) * block_bytes
        for index in range(layers * two * kv_heads):  # ctypes.memset releases the GIL: torch imports meanwhile
            ctypes.memset(self.address + index * region, 0, span)
        self.touch_seconds = time.perf_counter() - started

    def wait(self) -> None:
        self._thread.join()

    def close(self) -> None:
        self._thread.join()
        self.map.close()


_reserved: Optional[Reservation] = None


def reserve(shape: tuple[int, ...], itemsize: int) -> Reservation:
    """Maps the cache of `shape` for this process's runner to take; replaces an earlier one."""
    global _reserved
    if _reserved is not None:
        _reserved.close()
    _reserved = Reservation(shape, itemsize)
    return _reserved


def take(shape: tuple[int, ...], itemsize: int) -> Optional[Reservation]:
    """The reservation, touched, if it is for `shape` and `itemsize` (then no longer reserved);
    None if there is none or it is another (unmapped then)."""
    global _reserved
    reservation, _reserved = _reserved, None
    if reservation is None:
        return None
    if reservation.shape != tuple(shape) or reservation.itemsize != itemsize:
        logger.info("KV cache memory reserved for %s x %d bytes, the model needs %s x %d: allocated anew",
                    reservation.shape, reservation.itemsize, tuple(shape), itemsize)
        reservation.close()
        return None
    reservation.wait()
    return reservation
