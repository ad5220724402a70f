"""Loans: the producer writes a record in place (reserve/commit), the consumer reads it in place
(pop_view/release); random sizes around a small ring with a slow consumer, misuse, processes."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import random
import threading
import time

import pytest

from ipc import LoanError, RingBuffer, RingTimeoutError, native_available


@pytest.fixture
def pair(pure_python):
    tx = RingBuffer.create(4096, pure_python=pure_python)
    rx = RingBuffer.attach(tx.name, pure_python=pure_python)
    yield tx, rx
    rx.close()
    tx.close()


def _body(seq: int, n: int) -> bytes:
    return hashlib.shake_128(seq.to_bytes(8, "little")).digest(n)


def test_random_sizes_around_the_ring_with_a_slow_consumer(pair):
    """Reserved sizes from 0 to max_payload, some committed shorter, some cancelled, mixed with
    plain pushes; the consumer takes views and sleeps now and then, so the producer waits for
    room in reserve() and records wrap around the 4 KiB ring many times."""
    tx, rx = pair
    count = 600 if tx.native else 250
    rng = random.Random(7)
    plan = []  # (reserve n, commit m or None: cancelled, via push)
    for _ in range(count):
        n = rng.choice([0, 1, 7, 8, 9, rng.randrange(tx.max_payload + 1), tx.max_payload])
        plan.append((n, None if rng.random() < 0.05 else rng.randrange(n + 1) if rng.random() < 0.3 else n,
                     rng.random() < 0.2))
    sent, errors = [], []

    def produce() -> None:
        try:
            for seq, (n, m, via_push) in enumerate(plan):
                if via_push:
                    tx.push(_body(seq, n), timeout=30)
                    sent.append(_body(seq, n))
                    continue
                view = tx.reserve(n, timeout=30)
                assert len(view) == n
                if m is None:
                    tx.cancel()
                    continue
                view[:m] = _body(seq, m)
                tx.commit(m)
                sent.append(_body(seq, m))
            tx.push(b"end", timeout=30)
        except BaseException as exc:  # noqa: BLE001 - reported to the test thread
            errors.append(exc)

    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    got = []
    slow = random.Random(8)
    while True:
        view = rx.pop_view(timeout=30)
        data = bytes(view)
        if slow.random() < 0.1:
            time.sleep(0.002)  # the producer fills the ring meanwhile
        rx.release()
        if data == b"end":
            break
        got.append(data)
    thread.join(30)
    assert not errors, errors
    assert got == sent
    assert rx.wakeups()["space"] > 0  # the producer did wait for room


def test_a_fragmented_message_comes_as_one_view(pair):
    tx, rx = pair
    big = _body(1, 3 * tx.capacity + 5)
    threading.Thread(target=tx.push, args=(big, 30), daemon=True).start()
    view = rx.pop_view(timeout=30)
    assert bytes(view) == big
    rx.release()
    tx.push(b"after")
    assert rx.pop(timeout=5) == b"after"


def test_misuse_raises(pair):
    tx, rx = pair
    with pytest.raises(LoanError, match="commit"):
        tx.commit()
    with pytest.raises(LoanError, match="cancel"):
        tx.cancel()
    with pytest.raises(ValueError, match="n must be an int in"):
        tx.reserve(tx.max_payload + 1)
    with pytest.raises(ValueError, match="n must be an int in"):
        tx.reserve(-1)
    view = tx.reserve(16)
    with pytest.raises(LoanError, match="not committed"):
        tx.reserve(8)
    with pytest.raises(LoanError, match="not committed"):
        tx.push(b"x")
    with pytest.raises(LoanError, match="not committed"):
        tx.push_many([b"x", b"y"])
    with pytest.raises(ValueError, match=r"n must be an int in \[0, 16\]"):
        tx.commit(17)
    view[:] = b"a" * 16
    tx.commit()
    with pytest.raises(ValueError, match="released"):
        view[0] = 1  # the loan ended with the commit
    with pytest.raises(LoanError, match="commit"):
        tx.commit()
    tx.push(b"second")

    with pytest.raises(LoanError, match="release"):
        rx.release()
    got = rx.pop_view(timeout=5)
    assert bytes(got) == b"a" * 16
    for take in (lambda: rx.pop_view(timeout=0), lambda: rx.pop(timeout=0), rx.pop, rx.try_pop,
                 lambda: rx.consume(bytes), lambda: rx.try_consume(bytes), rx.pop_many):
        with pytest.raises(LoanError, match="not released"):
            take()
    rx.release()
    with pytest.raises(ValueError, match="released"):
        bytes(got)
    assert rx.pop(timeout=5) == b"second"  # nothing was taken or lost by the refused calls
    with pytest.raises(RingTimeoutError):
        rx.pop_view(timeout=0.01)


def test_reserve_waits_for_room_and_times_out(pair):
    tx, rx = pair
    while True:
        try:
            tx.push(b"f" * 512, timeout=0)
        except RingTimeoutError:
            break
    with pytest.raises(RingTimeoutError):
        tx.reserve(512, timeout=0.01)
    timer = threading.Timer(0.05, lambda: (rx.pop_view(), rx.release()))
    timer.start()
    view = tx.reserve(512, timeout=10)  # room made by the consumer's release
    view[:] = b"r" * 512
    tx.commit()
    timer.join()
    rest = []
    while (msg := rx.try_pop()) is not None:
        rest.append(msg)
    assert rest[-1] == b"r" * 512 and all(m == b"f" * 512 for m in rest[:-1])


def _echo_with_loans(names: tuple[str, str], count: int) -> None:
    rx, tx = RingBuffer.attach(names[0]), RingBuffer.attach(names[1])
    for _ in range(count):
        view = rx.pop_view(timeout=30)
        out = tx.reserve(len(view), timeout=30)
        out[:] = view
        tx.commit()
        rx.release()
    rx.close()
    tx.close()


@pytest.mark.skipif(not native_available(), reason="the C helper did not build")
def test_echo_in_place_between_processes():
    """A child echoes every record from one ring's memory into the other's: reserved sizes
    around 64 KiB rings, contents checked on return."""
    to_child, to_parent = RingBuffer.create(1 << 16), RingBuffer.create(1 << 16)
    rng, count = random.Random(3), 300
    child = mp.get_context("spawn").Process(target=_echo_with_loans, args=((to_child.name, to_parent.name), count))
    child.start()
    try:
        for seq in range(count):
            n = rng.randrange(to_child.max_payload + 1)
            view = to_child.reserve(n, timeout=30)
            view[:] = _body(seq, n)
            to_child.commit()
            back = to_parent.pop_view(timeout=30)
            assert bytes(back) == _body(seq, n)
            to_parent.release()
        child.join(30)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()
        to_child.close()
        to_parent.close()
