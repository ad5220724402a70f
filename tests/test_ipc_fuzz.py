"""Fuzz: random and mutated frames give a message, "nothing yet" or RingCorruptedError —
never a crash, a hang, or any other exception; whether the records were pushed or loaned
(reserve/commit, some committed shorter) and whether they are read by copy or in place
(pop_view/release)."""

from __future__ import annotations

import random
import struct
from collections import Counter

import pytest

from ipc import RingBuffer, RingCorruptedError, RingTimeoutError, native_available
from ipc import layout as L

CAPACITY = 1024
COUNTERS = (L.OFF_TAIL, L.OFF_P_HEAD_CACHE, L.OFF_HEAD, L.OFF_C_TAIL_CACHE)


def _set(ring: RingBuffer, off: int, value: int) -> None:
    struct.pack_into("=Q", ring._mv, off, value % (1 << 64))


def _reset(ring: RingBuffer, rng: random.Random) -> int:
    base = rng.randrange(0, 1 << 40) * 8
    for off in COUNTERS:
        _set(ring, off, base)
    return base


def _random_record(rng: random.Random) -> bytes:
    length = rng.choice([0, 1, 7, 8, 100, 248, 249, 1016, 1 << 20, rng.randrange(1 << 32)])
    kind = rng.choice([0, 1, 2, 3, 4, 5, 6, 7, 255, rng.randrange(1 << 16)])
    magic = L.RECORD_MAGIC if rng.random() < 0.8 else rng.randrange(1 << 16)
    body = rng.randbytes(rng.randrange(0, 64))
    if kind == L.KIND_FIRST and rng.random() < 0.5:
        body = struct.pack("=Q", rng.choice([0, 100, 300, 5000, (1 << 64) - 1])) + body
    return struct.pack("=IHH", length % (1 << 32), kind, magic) + body


def _mutate(tx: RingBuffer, rng: random.Random) -> None:
    """Puts one malformed ring state in place (reaching into the shared memory, as a bad peer would)."""
    base = _reset(tx, rng)
    mode = rng.randrange(5)
    if mode == 0:  # random bytes, random published amount
        start = rng.randrange(0, CAPACITY, 8)
        tx._mv[L.DATA + start : L.DATA + CAPACITY] = rng.randbytes(CAPACITY - start)
        _set(tx, L.OFF_HEAD, base + start)
        _set(tx, L.OFF_C_TAIL_CACHE, base + start)
        _set(tx, L.OFF_TAIL, base + start + rng.randrange(0, CAPACITY - start + 1, 8))
    elif mode == 1:  # crafted record headers, back to back
        blob = b"".join(_random_record(rng) for _ in range(rng.randrange(1, 6)))[:CAPACITY]
        blob += bytes(-len(blob) % 8)
        tx._mv[L.DATA : L.DATA + len(blob)] = blob
        _set(tx, L.OFF_TAIL, base + rng.choice([len(blob), rng.randrange(0, len(blob) + 1, 8)]))
    elif mode == 2:  # a valid stream (fragments included, loaned records too), then a few flipped bytes
        for _ in range(rng.randrange(1, 4)):
            try:
                _send(tx, rng, rng.choice([0, 5, 60, 240, 500, 700]))
            except TimeoutError:
                break
        for _ in range(rng.randrange(1, 4)):
            pos = L.DATA + rng.randrange(CAPACITY)
            tx._mv[pos] ^= 1 << rng.randrange(8)
    elif mode == 3:  # garbage counters
        _set(tx, L.OFF_TAIL, rng.choice([base - 8, base + 3, base + CAPACITY + 8, rng.randrange(1 << 64)]))
    else:  # a valid stream whose published tail lies
        _send(tx, rng, rng.randrange(200))
        _set(tx, L.OFF_TAIL, base + rng.randrange(0, 2 * CAPACITY, 8))


def _send(tx: RingBuffer, rng: random.Random, n: int) -> None:
    """A message of `n` random bytes, pushed, or written into a loan (when it fits in one
    record), which is sometimes reserved larger and committed at `n` bytes."""
    data = rng.randbytes(n)
    if n > tx.max_payload or rng.random() < 0.5:
        tx.push(data, timeout=0)
        return
    view = tx.reserve(rng.randrange(n, tx.max_payload + 1) if rng.random() < 0.5 else n, timeout=0)
    view[:n] = data
    tx.commit(n)


def _take_view(rx: RingBuffer) -> "bytes | None":
    try:
        view = rx.pop_view(timeout=0)
    except RingTimeoutError:
        return None
    data = bytes(view)
    rx.release()
    return data


def _drain(rx: RingBuffer, in_place: bool) -> str:
    for _ in range(CAPACITY // 8 + 2):  # every message consumes >= 8 bytes of a finite ring
        try:
            msg = _take_view(rx) if in_place else rx.try_pop()
        except RingCorruptedError:
            return "corrupted"
        if msg is None:
            return "nothing"
        assert isinstance(msg, bytes)
    raise AssertionError("the consumer kept taking messages from a finite ring")


@pytest.mark.parametrize("pure_python, cases", [(False, 10_000), (True, 2_000)], ids=["native", "python"])
def test_fuzz_random_frames(pure_python, cases):
    if not pure_python and not native_available():
        pytest.fail("the C helper did not build")
    rng = random.Random(20240601)
    tx = RingBuffer.create(CAPACITY, pure_python=pure_python)
    outcomes: Counter = Counter()
    try:
        for _ in range(cases):
            _mutate(tx, rng)
            rx = RingBuffer.attach(tx.name, pure_python=pure_python)
            outcomes[_drain(rx, in_place=rng.random() < 0.5)] += 1
            try:  # the producer side meets the same state
                _send(tx, rng, rng.randrange(300))
            except (TimeoutError, RingCorruptedError):
                pass
    finally:
        tx.close()
    assert sum(outcomes.values()) == cases
    assert outcomes["corrupted"] > cases // 3 and outcomes["nothing"] > cases // 20, outcomes
