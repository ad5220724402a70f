"""The KV cache's huge-page advice: taken for the aligned interior of a big CPU tensor, and
backed by huge pages once touched where the kernel's THP mode allows it; the weights' buffer
(huge_page_buffer): a fresh mapping on a 2 MiB boundary, advised before it is touched."""

from __future__ import annotations

import mmap
import re
from pathlib import Path

import pytest
import torch

from shmvllm.worker import huge_pages
from shmvllm.worker.huge_pages import HUGE_PAGE, advise_huge_pages, huge_page_buffer

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _anon_huge_bytes(start: int, end: int) -> int:
    """AnonHugePages of this process's mappings that overlap [start, end)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        header = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if header:
            low, high = int(header.group(1), 16), int(header.group(2), 16)
            inside = low < end and high > start
        elif inside and line.startswith("AnonHugePages:"):
            total += int(line.split()[1]) * 1024
    return total


@pytest.mark.skipif(not THP_MODE.exists() or "[never]" in THP_MODE.read_text(), reason="the kernel has THP off")
def test_a_big_tensor_gets_huge_pages_when_touched() -> None:
    # Fresh pages, as a real (GiB-sized, so mmapped) KV cache gets; a smaller torch.empty may
    # reuse heap memory that earlier tests already touched.
    memory = mmap.mmap(-1, 32 * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    cache = torch.frombuffer(memory, dtype=torch.float32)
    advised = advise_huge_pages(cache)
    assert advised >= 30 * HUGE_PAGE
    cache.fill_(1.0)
    assert _anon_huge_bytes(cache.data_ptr(), cache.data_ptr() + cache.numel() * 4) >= HUGE_PAGE
    del cache
    memory.close()


def test_advice_is_skipped_where_it_cannot_apply(monkeypatch) -> None:
    assert advise_huge_pages(torch.empty(1000)) == 0  # smaller than one aligned huge page
    assert advise_huge_pages(torch.empty(0)) == 0
    huge_pages._madvise.cache_clear()
    monkeypatch.setenv("SHMVLLM_HUGE_PAGES", "0")
    try:
        assert advise_huge_pages(torch.empty(16 * HUGE_PAGE // 4)) == 0
    finally:
        huge_pages._madvise.cache_clear()


@pytest.mark.skipif(not THP_MODE.exists() or "[never]" in THP_MODE.read_text(), reason="the kernel has THP off")
def test_the_weights_buffer_starts_on_a_huge_page_and_gets_them() -> None:
    buffer = huge_page_buffer(5 * HUGE_PAGE + 100)
    assert buffer.numel() == 5 * HUGE_PAGE + 100 and buffer.data_ptr() % HUGE_PAGE == 0
    buffer.fill_(7)
    assert _anon_huge_bytes(buffer.data_ptr(), buffer.data_ptr() + buffer.numel()) >= HUGE_PAGE
    assert int(buffer[-1]) == 7
    assert huge_page_buffer(0).numel() == 0


@pytest.mark.skipif(not THP_MODE.exists() or "[madvise]" not in THP_MODE.read_text(), reason="THP not on advice")
def test_the_weights_buffer_is_not_advised_when_turned_off(monkeypatch) -> None:
    huge_pages._madvise.cache_clear()
    monkeypatch.setenv("SHMVLLM_HUGE_PAGES", "0")
    try:
        buffer = huge_page_buffer(4 * HUGE_PAGE)
        buffer.fill_(1)
        assert _anon_huge_bytes(buffer.data_ptr(), buffer.data_ptr() + buffer.numel()) == 0
    finally:
        huge_pages._madvise.cache_clear()
