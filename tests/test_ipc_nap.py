"""The wait's nap phase (`nap_window_s`): a message that lands while the consumer naps costs the
producer no semaphore post; after the window the consumer sleeps on the semaphore as before;
timeouts, a closed or dead peer and bad settings are handled as in the other phases. Also the
`prefault` option, which maps the segment up front."""

from __future__ import annotations

import math
import pickle
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import ipc.ring as ring_module
from ipc import PeerClosedError, PeerDeadError, RingBuffer
from ipc.wait import NAP_FIRST_US, NAP_MAX_US, RECENT_WAITS, Waiter

ROOT = Path(__file__).resolve().parents[1]
# A child that attaches to the ring named in argv[1], says so, and idles until killed.
ATTACH_AND_IDLE = "import sys, time\nfrom ipc import RingBuffer\nr = RingBuffer.attach(sys.argv[1])\nprint('ready', flush=True)\ntime.sleep(600)\n"


def _count_posts(side: RingBuffer, kind: str = "data") -> Any:
    """The wake-ups of `kind` ("data": the producer's, "space": the consumer's) from now on,
    read at each use as `posts[0]` (the ring's own counters, kept in C)."""
    start = side.wakeups()[kind]

    class Posts:
        def __getitem__(self, i: int) -> int:
            return side.wakeups()[kind] - start

    return Posts()


def _napping_pair(pure_python: bool, nap_window_s: float, poll_interval: float = 30.0):
    """A producer (creator) and a consumer that naps for `nap_window_s` after a zero spin. The
    long poll interval keeps the sleeping phase from finding a message by its periodic look."""
    tx = RingBuffer.create(4096, spin_us=0, pure_python=pure_python)
    rx = RingBuffer.attach(
        tx.name, spin_us=0, poll_interval=poll_interval, nap_window_s=nap_window_s, pure_python=pure_python
    )
    return tx, rx


def test_message_pushed_while_napping_needs_no_post(pure_python):
    tx, rx = _napping_pair(pure_python, nap_window_s=20.0)
    posts = _count_posts(tx)
    try:
        threading.Timer(0.2, tx.push, args=(b"during the nap",)).start()
        t0 = time.monotonic()
        assert rx.pop(timeout=10) == b"during the nap"
        assert 0.15 < time.monotonic() - t0 < 5.0
        assert posts[0] == 0, "the producer posted although the consumer was napping, not sleeping"
    finally:
        rx.close()
        tx.close()


def test_message_pushed_after_the_window_wakes_the_sleeper(pure_python):
    tx, rx = _napping_pair(pure_python, nap_window_s=0.05)
    posts = _count_posts(tx)
    try:
        threading.Timer(0.5, tx.push, args=(b"after the nap",)).start()
        t0 = time.monotonic()
        assert rx.pop(timeout=20) == b"after the nap"
        assert time.monotonic() - t0 < 5.0  # the post woke it, not its 30 s poll
        assert posts[0] == 1
    finally:
        rx.close()
        tx.close()


def test_producer_naps_for_space_too(pure_python):
    """The producer's wait for space naps as well: the consumer's release then posts nothing."""
    tx = RingBuffer.create(1024, spin_us=0, poll_interval=30, nap_window_s=20.0, pure_python=pure_python)
    rx = RingBuffer.attach(tx.name, spin_us=0, pure_python=pure_python)
    space_posts = _count_posts(rx, "space")
    try:
        sent = 0
        with pytest.raises(TimeoutError):
            while True:
                tx.push(b"x" * 100, timeout=0)
                sent += 1
        threading.Timer(0.2, rx.pop).start()
        tx.push(b"x" * 100, timeout=10)  # blocks until the timer's pop made room
        assert space_posts[0] == 0
        assert [len(rx.pop(timeout=1)) for _ in range(sent)] == [100] * sent
    finally:
        rx.close()
        tx.close()


def test_timeout_cuts_the_nap_window_short(pure_python):
    tx, rx = _napping_pair(pure_python, nap_window_s=20.0)
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            rx.pop(timeout=0.2)
        assert 0.19 < time.monotonic() - t0 < 2.0
        assert rx.try_pop() is None and not rx.wait_readable(timeout=0.05)
    finally:
        rx.close()
        tx.close()


def test_peer_closed_while_napping_is_noticed(pure_python):
    tx, rx = _napping_pair(pure_python, nap_window_s=20.0, poll_interval=0.1)
    try:
        threading.Timer(0.2, tx.close).start()
        t0 = time.monotonic()
        with pytest.raises(PeerClosedError):
            rx.pop()
        assert time.monotonic() - t0 < 2.0
    finally:
        rx.close()
        tx.close()


def test_peer_killed_while_napping_is_noticed():
    ring = RingBuffer.create(4096, spin_us=0, poll_interval=0.1, nap_window_s=20.0)
    child = subprocess.Popen([sys.executable, "-c", ATTACH_AND_IDLE, ring.name], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        killed_at: list[float] = []

        def kill() -> None:
            killed_at.append(time.monotonic())
            child.kill()

        threading.Timer(0.2, kill).start()
        with pytest.raises(PeerDeadError, match=str(child.pid)):
            ring.pop()
        assert time.monotonic() - killed_at[0] < 2.0
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
        ring.close()


def test_last_message_of_a_peer_that_closes_during_the_naps_is_delivered():
    """The peer publishes and closes between the nap's look at the counter and its look at
    the peer: the wait returns (the message is there) instead of raising."""
    published: list[bool] = []

    def peer_publishes_and_closes() -> None:
        published.append(True)
        raise PeerClosedError("the peer closed")

    def never_sleeps(timeout_ns: int) -> int:
        raise AssertionError("the nap phase must not reach the sleep")

    waiter = Waiter(
        spin=lambda ns: 0, arm=lambda: bool(published), disarm=lambda: None, sleep=never_sleeps,
        check_peer=peer_publishes_and_closes, spin_us=0, poll_interval=0.01,
        nap=lambda window_ns, first_ns, max_ns: 0, nap_window_s=5.0,
    )
    waiter.wait(None)
    assert published == [True]


class _Condition:
    """A condition that starts to hold `after` seconds from `reset()`; fake bell and nap on it.
    The nap records its arguments and sleeps one nap (never past the condition) per call."""

    def __init__(self, after: float) -> None:
        self.after, self.ready_at, self.naps, self.bell_waits = after, 0.0, [], 0

    def reset(self) -> None:
        self.ready_at, self.naps, self.bell_waits = time.monotonic() + self.after, [], 0

    def holds(self, *args: int) -> int:
        return int(time.monotonic() >= self.ready_at)

    def nap(self, window_ns: int, first_ns: int, max_ns: int) -> int:
        self.naps.append((window_ns, first_ns, max_ns))
        time.sleep(max(min(first_ns, window_ns) / 1e9, 0.0))
        return self.holds()

    def sleep(self, timeout_ns: int) -> int:  # the sleep phase
        if self.holds():
            return 1
        self.bell_waits += 1
        time.sleep(max(min(timeout_ns / 1e9, self.ready_at - time.monotonic()), 0.0))
        return self.holds()

    def waiter(self, nap_window_s: float) -> Waiter:
        return Waiter(
            spin=self.holds, arm=self.holds, disarm=lambda: None, sleep=self.sleep, check_peer=lambda: None,
            spin_us=0, poll_interval=10.0, nap=self.nap, nap_window_s=nap_window_s,
        )


def test_steady_waits_are_napped_through_in_one_nap():
    """After RECENT_WAITS waits of ~60 ms, the next starts with one nap to ~0.9 x 60 ms."""
    cond = _Condition(after=0.06)
    waiter = cond.waiter(nap_window_s=1.0)
    for _ in range(RECENT_WAITS):
        cond.reset()
        waiter.wait(time.monotonic() + 10)
        assert cond.naps[0][1] == NAP_FIRST_US * 1000 and cond.bell_waits == 0  # no history: short first nap
    cond.reset()
    waiter.wait(time.monotonic() + 10)
    window_ns, first_ns, max_ns = cond.naps[0]
    assert window_ns == first_ns == max_ns and 0.045e9 < first_ns < 0.06e9, cond.naps
    assert [n[1] for n in cond.naps[1:]] == [NAP_MAX_US * 1000] * (len(cond.naps) - 1)
    assert cond.bell_waits == 0


def test_waits_that_outlast_the_window_sleep_at_once():
    """Recent waits all longer than the nap window: no nap, straight to the semaphore."""
    cond = _Condition(after=0.06)
    waiter = cond.waiter(nap_window_s=0.02)
    for _ in range(RECENT_WAITS):
        cond.reset()
        waiter.wait(None)
        assert cond.naps and cond.bell_waits == 1
    cond.reset()
    waiter.wait(None)
    assert cond.naps == [] and cond.bell_waits == 1
    cond.after = 0.0  # a short wait (answered by the spin) brings the naps back next time
    cond.reset()
    waiter.wait(None)
    cond.after = 0.01
    cond.reset()
    waiter.wait(None)
    assert cond.naps and cond.bell_waits == 0


@pytest.mark.parametrize("value", [-0.001, math.nan, math.inf])
def test_bad_nap_window_names_the_field(value):
    with pytest.raises(ValueError, match="nap_window_s"):
        RingBuffer.create(4096, nap_window_s=value)
    with RingBuffer.create(4096) as ring:
        with pytest.raises(ValueError, match="nap_window_s"):
            RingBuffer.attach(ring.name, nap_window_s=value)
    with pytest.raises(ValueError, match="nap_window_s"):
        Waiter(lambda ns: 0, lambda: 0, lambda: None, None, lambda: None, 0, 0.1, nap=lambda *a: 0, nap_window_s=value)


def test_nap_window_needs_a_nap_function():
    with pytest.raises(ValueError, match="nap_window_s"):
        Waiter(lambda ns: 0, lambda: 0, lambda: None, None, lambda: None, 0, 0.1, nap_window_s=0.5)


def test_pickled_ring_keeps_its_nap_window():
    with RingBuffer.create(4096, nap_window_s=0.25) as ring:
        clone = pickle.loads(pickle.dumps(ring))
        try:
            assert clone._data_waiter.nap_window_s == 0.25 and not clone.is_creator
        finally:
            clone.close()


@pytest.mark.parametrize("madvise", [True, False], ids=["madvise", "touch"])
def test_prefaulted_ring_works(monkeypatch, madvise):
    if not madvise:  # the fallback for kernels without MADV_POPULATE_WRITE
        monkeypatch.setattr(ring_module, "_MADV_POPULATE_WRITE", None)
    with RingBuffer.create(1 << 16, prefault=True) as tx:
        rx = RingBuffer.attach(tx.name, prefault=True)
        try:
            for i in range(2000):  # several laps around the ring
                tx.push(bytes([i % 251]) * (i % 300))
                assert rx.pop(timeout=1) == bytes([i % 251]) * (i % 300)
        finally:
            rx.close()
