"""Transparent huge pages for the KV cache and the streamed weights on the CPU.

Decode attention reads, per request, every KV-cache block it has; one block of one head (16
tokens x 64 dims x 4 bytes) is one 4 KiB page, and a request's blocks are scattered. With 4 KiB
pages each block costs a TLB miss and a page walk that the hardware prefetcher does not cross;
with 2 MiB pages a miss covers 512 blocks (measured: 64 decodes over 104 tokens of scattered
blocks, 30 layers, 31-33 ms against 35-46 ms). Where THP is in `madvise` mode (the default of
many distributions; `always` needs nothing), memory gets huge pages only when asked, before it
is first touched: `advise_huge_pages` asks, with MADV_HUGEPAGE (the cache is mapped as blocks
are first written). ``SHMVLLM_HUGE_PAGES=0`` turns it off. It is advice: elsewhere (another OS,
THP off, CUDA tensors) it does nothing and the cache works the same. Only the 2 MiB-aligned
interior of the tensor is advised: the pages at its ends may hold other allocations.

The weights a decode token streams (the repacked layers, the lm_head: ~96 MB a token for SmolLM2)
cross a 4 KiB page every 4 KiB too: `huge_page_buffer` gives the loader one fresh anonymous
mapping for them, advised before it is written.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import sys
from typing import Callable, Optional

import torch

from shmvllm import envs

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14


@functools.lru_cache(maxsize=1)
def _madvise() -> Optional[Callable[[int, int, int], int]]:
    if not sys.platform.startswith("linux") or not envs.SHMVLLM_HUGE_PAGES():
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def advise_huge_pages(tensor: torch.Tensor) -> int:
    """Asks for huge pages where `tensor` is first touched; returns the bytes advised (0: none)."""
    madvise = _madvise()
    if madvise is None or tensor.device.type != "cpu":
        return 0
    start = tensor.data_ptr()
    end = start + tensor.untyped_storage().nbytes() - tensor.storage_offset() * tensor.element_size()
    first, last = -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE
    if last <= first or madvise(first, last - first, MADV_HUGEPAGE) != 0:
        return 0
    return last - first


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of `nbytes` in a fresh private anonymous mapping starting on a 2 MiB boundary,
    advised MADV_HUGEPAGE before anything touches it (unadvised where SHMVLLM_HUGE_PAGES=0 or
    elsewhere than Linux); the tensor keeps the mapping alive."""
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=flags) if flags else mmap.mmap(-1, nbytes + HUGE_PAGE)
    whole = torch.frombuffer(region, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    buffer = whole[start:start + nbytes]
    advise_huge_pages(buffer)  # the mapping is ours to its end: its whole 2 MiB pages from `start`
    return buffer
