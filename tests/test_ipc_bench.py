"""ipc.bench's harness: a ring case runs end to end, and an echo process that dies before it
attaches to the rings is an error, not a wait without end."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest

from ipc import RingBuffer
from ipc import bench


def _exit_at_once() -> None:
    os._exit(3)


def test_a_child_that_dies_before_attaching_is_an_error_not_a_hang():
    ctx = mp.get_context("spawn")
    rings = tuple(RingBuffer.create(64 << 10) for _ in range(2))
    try:
        child = ctx.Process(target=_exit_at_once)
        child.start()
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="exited with 3 before it attached"):
            bench._wait_attached(rings, child, timeout=30)
        assert time.monotonic() - started < 10
        child.join()
    finally:
        for ring in rings:
            ring.close()


def test_a_ring_case_runs_end_to_end():
    rows = bench.run_case("shm", "", bench.raw_payload("64B"), quick=True, ctx=mp.get_context("spawn"))
    assert [r["mode"] for r in rows] == ["busy", "paced"]
    assert rows[0]["payload_bytes"] == 64 and rows[0]["msgs_per_s"] > 0 and rows[0]["rtt_us_median"] > 0
