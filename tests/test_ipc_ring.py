"""The ring in one process: layout, wrap-around, fragments, timeouts, closing, properties."""

from __future__ import annotations

import ctypes
import gc
import os
import pickle
import random
import signal
import struct
import sys
import threading
import time
from typing import Union

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ipc import Channel, PeerClosedError, RingBuffer, RingCorruptedError, native_available
from ipc import layout as L
from ipc.wait import Waiter


def _u64(ring: RingBuffer, off: int) -> int:
    return struct.unpack_from("=Q", ring._mv, off)[0]


@pytest.fixture
def pair(pure_python):
    """A creator (producer) and an attacher (consumer) of a 1 KiB ring, closed afterwards."""
    tx = RingBuffer.create(1024, pure_python=pure_python)
    rx = RingBuffer.attach(tx.name, pure_python=pure_python)
    yield tx, rx
    rx.close()
    tx.close()


def _pump(tx: RingBuffer, messages: list, errors: list) -> threading.Thread:
    def run() -> None:
        try:
            for m in messages:
                tx.push(m, timeout=20)
        except BaseException as exc:  # noqa: BLE001 - reported to the test thread
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_header_layout(pair):
    tx, rx = pair
    assert _u64(tx, L.OFF_MAGIC) == L.MAGIC and _u64(tx, L.OFF_VERSION) == L.VERSION
    assert _u64(tx, L.OFF_CAPACITY) == 1024 == rx.capacity
    assert _u64(tx, L.OFF_MAX_RECORD) == 256 and tx.max_payload == 248
    import os

    assert _u64(tx, L.OFF_CREATOR_PID) == os.getpid() == _u64(tx, L.OFF_ATTACHER_PID)
    assert tx.peer_pid == rx.peer_pid == os.getpid()
    assert tx.is_creator and not rx.is_creator


def test_records_are_aligned_and_counted(pair):
    tx, rx = pair
    for n, step in [(0, 8), (1, 16), (8, 16), (9, 24), (248, 256)]:
        before = _u64(tx, L.OFF_TAIL)
        tx.push(b"a" * n)
        assert _u64(tx, L.OFF_TAIL) - before == step
        length, kind, magic = struct.unpack_from("=IHH", tx._mv, L.DATA + before % 1024)
        assert (length, kind, magic) == (n, L.KIND_MSG, L.RECORD_MAGIC)
        assert rx.pop() == b"a" * n
        assert _u64(tx, L.OFF_HEAD) == _u64(tx, L.OFF_TAIL)


def test_wrap_around_pads_to_the_end(pair):
    tx, rx = pair
    for _ in range(6):  # 6 * 152 = 912: the next 152-byte record no longer fits before 1024
        tx.push(b"x" * 144)
        rx.pop()
    tx.push(b"wrapped" * 20)
    length, kind, _ = struct.unpack_from("=IHH", tx._mv, L.DATA + 912)
    assert (kind, length) == (L.KIND_PAD, 1024 - 912 - 8)
    assert _u64(tx, L.OFF_TAIL) == 1024 + 152
    assert rx.pop() == b"wrapped" * 20
    for i in range(500):  # many laps with mixed sizes
        msg = bytes([i % 251]) * (i * 37 % 249)
        tx.push(msg)
        assert rx.pop() == msg


def test_full_ring_times_out_and_then_drains(pair):
    tx, rx = pair
    pushed = []
    while True:
        try:
            tx.push(b"m%03d" % len(pushed) + b"." * 60, timeout=0)
        except TimeoutError:
            break
        pushed.append(len(pushed))
    assert len(pushed) == 1024 // 72
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        tx.push(b"one more" * 8, timeout=0.05)
    assert 0.04 < time.monotonic() - t0 < 1.0
    assert [int(rx.pop()[1:4]) for _ in pushed] == pushed
    assert rx.try_pop() is None


def test_each_side_notes_the_cpu_it_publishes_from():
    """The native ring writes 1 + the publishing CPU next to the tail (push) and the head (pop),
    which a waiter compares with its own CPU (spin_until in _native.c)."""
    if not native_available():
        pytest.fail("the C helper did not build (cc is expected on this machine)")
    with RingBuffer.create(1024) as tx, RingBuffer.attach(tx.name) as rx:
        assert (_u64(tx, L.OFF_P_CPU), _u64(tx, L.OFF_C_CPU)) == (0, 0)
        cpus = {cpu + 1 for cpu in os.sched_getaffinity(0)}
        tx.push(b"x")
        assert _u64(tx, L.OFF_P_CPU) in cpus and _u64(tx, L.OFF_C_CPU) == 0
        assert rx.pop() == b"x"
        assert _u64(tx, L.OFF_C_CPU) in cpus


def test_push_many_without_a_timeout_waits_for_space_and_delivers_in_order(pure_python):
    """A batch bigger than the ring: push_many waits for space (the C helper spins, then the ring
    sleeps) while a slow consumer drains it, stalling once for longer than the spin."""
    with RingBuffer.create(1024, pure_python=pure_python, spin_us=300) as tx, RingBuffer.attach(
        tx.name, pure_python=pure_python
    ) as rx:
        messages = [b"%04d" % i + b"." * (i % 90) for i in range(600)]
        got: list = []

        def drain() -> None:
            stalled = False
            while len(got) < len(messages):
                got.extend(rx.pop_many(timeout=20))
                time.sleep(0.05 if len(got) >= 40 and not stalled else 0.0002)
                stalled = stalled or len(got) >= 40

        consumer = threading.Thread(target=drain)
        consumer.start()
        tx.push_many(messages)
        consumer.join(30)
        assert got == messages
        assert tx.wakeups()["space"] > 0, "the producer never slept for space: the test did not test the wait"


def test_pop_timeout_try_pop_and_wait_readable(pair):
    tx, rx = pair
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        rx.pop(timeout=0.05)
    assert time.monotonic() - t0 >= 0.04
    assert rx.try_pop() is None
    assert rx.wait_readable(timeout=0.01) is False
    threading.Timer(0.05, tx.push, args=(b"late",)).start()
    assert rx.wait_readable(timeout=5) is True
    assert rx.pop(timeout=0) == b"late"
    with pytest.raises(ValueError, match="timeout"):
        rx.pop(timeout=-1)


def test_any_buffer_type_is_accepted(pair):
    import array

    tx, rx = pair
    tx.push(bytearray(b"ba"))
    tx.push(memoryview(b"xxmvxx")[2:4])
    tx.push(array.array("i", [1, 2]))
    assert [rx.pop(), rx.pop(), rx.pop()] == [b"ba", b"mv", array.array("i", [1, 2]).tobytes()]


def test_fragmented_message_bigger_than_the_ring(pair):
    tx, rx = pair
    big = bytes(range(256)) * 40  # 10 KiB through a 1 KiB ring
    errors: list = []
    thread = _pump(tx, [big, b"after"], errors)
    assert rx.pop(timeout=20) == big
    assert rx.consume(bytes, timeout=20) == b"after"
    thread.join()
    assert not errors


def test_fragmented_push_timeout_is_aborted_cleanly(pair):
    tx, rx = pair
    with pytest.raises(TimeoutError):
        tx.push(b"z" * 3000, timeout=0.05)  # FIRST..MIDDLE fit, then the ring is full
    assert rx.try_pop() is None  # a partial message is never delivered
    tx.push(b"next", timeout=1)  # announces ABORT first
    assert rx.pop(timeout=1) == b"next"
    errors: list = []
    thread = _pump(tx, [b"q" * 3000], errors)
    assert rx.pop(timeout=20) == b"q" * 3000
    thread.join()
    assert not errors


def test_consume_reads_in_place_and_frees_even_if_fn_raises(pair):
    tx, rx = pair
    tx.push(b"hello")
    assert rx.consume(lambda view: (type(view), view.readonly, view.tobytes())) == (memoryview, False, b"hello")
    tx.push(b"boom")
    with pytest.raises(ZeroDivisionError):
        rx.consume(lambda view: 1 / 0)
    assert rx.try_pop() is None
    leaked = []
    tx.push(b"kept")
    rx.consume(leaked.append)
    with pytest.raises(ValueError):
        leaked[0].tobytes()  # the view was released when consume returned


def test_signal_in_a_blocked_pop_is_a_spurious_wakeup():
    """A handler that returns leaves the pop blocked (no posix_ipc.SignalError); a handler that
    raises (Ctrl-C) gets through."""
    tx = RingBuffer.create(1024, spin_us=0, poll_interval=30)
    rx = RingBuffer.attach(tx.name, spin_us=0, poll_interval=30)  # asleep on its semaphore
    main = threading.get_ident()
    handled: list = []
    previous = signal.signal(signal.SIGUSR1, lambda *_: handled.append(True))
    try:
        threading.Timer(0.1, signal.pthread_kill, args=(main, signal.SIGUSR1)).start()
        threading.Timer(0.3, tx.push, args=(b"after the signal",)).start()
        assert rx.pop(timeout=5) == b"after the signal"
        assert handled
        signal.signal(signal.SIGUSR1, signal.default_int_handler)
        threading.Timer(0.1, signal.pthread_kill, args=(main, signal.SIGUSR1)).start()
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            rx.pop(timeout=5)
        assert time.monotonic() - t0 < 1.0
    finally:
        signal.signal(signal.SIGUSR1, previous)
        rx.close()
        tx.close()


def test_close_wakes_peer_after_drain(pair):
    tx, rx = pair
    tx.push(b"last words")
    threading.Timer(0.05, tx.close).start()
    assert rx.pop(timeout=5) == b"last words"
    t0 = time.monotonic()
    with pytest.raises(PeerClosedError):
        rx.pop(timeout=5)
    assert time.monotonic() - t0 < 1.0
    with pytest.raises(ValueError, match="closed"):
        tx.push(b"after close")


def test_waiter_looks_at_the_peer_before_the_condition():
    """The peer publishes its last message and closes between the waiter's two looks: the wait
    returns (the message is there), and raises only when nothing came."""
    published = []

    def peer_publishes_and_closes() -> None:
        published.append(True)
        raise PeerClosedError("the peer closed")

    waiter = Waiter(
        spin=lambda ns: 0, arm=lambda: bool(published), disarm=lambda: None, sleep=lambda ns: 0,
        check_peer=peer_publishes_and_closes, spin_us=0, poll_interval=0.01,
    )
    waiter.wait(None)
    assert published == [True]
    published.clear()
    empty = Waiter(
        spin=lambda ns: 0, arm=lambda: False, disarm=lambda: None, sleep=lambda ns: 0,
        check_peer=peer_publishes_and_closes, spin_us=0, poll_interval=0.01,
    )
    with pytest.raises(PeerClosedError):
        empty.wait(None)


def test_pickles_as_attach(pair):
    tx, rx = pair
    clone = pickle.loads(pickle.dumps(tx))
    assert clone.name == tx.name and not clone.is_creator
    clone.push(b"via clone")
    assert rx.pop() == b"via clone"


def test_native_and_python_sides_interoperate():
    if not native_available():
        pytest.fail("the C helper did not build")
    tx = RingBuffer.create(512)
    rx = RingBuffer.attach(tx.name, pure_python=True)
    back = RingBuffer.attach(tx.name)
    try:
        for i in range(300):
            msg = bytes([i % 256]) * (i % 200)
            tx.push(msg)
            assert rx.pop() == msg
        assert rx.native is False and tx.native is True and back.native is True
    finally:
        rx.close()
        back.close()
        tx.close()


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match="1004"):
        RingBuffer.create(1000 + 4)
    with pytest.raises(ValueError, match="128"):
        RingBuffer.create(128)
    with pytest.raises(FileNotFoundError, match="ipcring-nope"):
        RingBuffer.attach("/ipcring-nope")


def test_corrupted_counters_raise(pair):
    tx, rx = pair
    tx.push(b"fine")
    struct.pack_into("=Q", tx._mv, L.OFF_TAIL, 10**12)
    struct.pack_into("=Q", tx._mv, L.OFF_C_TAIL_CACHE, 10**12)
    with pytest.raises(RingCorruptedError, match="counters"):
        rx.pop(timeout=0)
    with pytest.raises(RingCorruptedError, match="counters"):
        tx.push(b"x" * 200, timeout=0)


def test_gc_of_creator_unlinks(pure_python):
    from pathlib import Path

    ring = RingBuffer.create(256, pure_python=pure_python)
    path = Path("/dev/shm") / ring.name[1:]
    assert path.exists()
    del ring
    gc.collect()
    assert not path.exists() and not Path(f"/dev/shm/sem.{path.name}-d").exists()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(min_value=0, max_value=3 * 1024), max_size=25), st.randoms(use_true_random=False))
def test_property_popped_equals_pushed(pure_python, sizes, rnd):
    tx = RingBuffer.create(1024, pure_python=pure_python)
    rx = RingBuffer.attach(tx.name, pure_python=pure_python)
    try:
        messages = [rnd.randbytes(n) for n in sizes]
        errors: list = []
        thread = _pump(tx, messages, errors)
        popped = [rx.pop(timeout=20) for _ in messages]
        thread.join()
        assert not errors
        assert popped == messages
        assert rx.try_pop() is None
    finally:
        rx.close()
        tx.close()


class _Ping(msgspec.Struct, tag="ping"):
    seq: int
    payload: bytes = b""


class _Pong(msgspec.Struct, tag="pong"):
    seq: int


def test_channel_sends_and_receives_typed_messages(pair):
    tx, rx = pair
    sender = Channel(tx, send_type=Union[_Ping, _Pong])
    receiver = Channel(rx, recv_type=Union[_Ping, _Pong])
    assert receiver.try_recv() is None
    big = _Ping(2, bytes(range(256)) * 12)  # 3 KiB: fragments in a 1 KiB ring, decoded reassembled
    thread = threading.Thread(target=lambda: [sender.send(m, timeout=20) for m in (_Ping(1), big, _Pong(3))])
    thread.start()
    assert [receiver.recv(timeout=20) for _ in range(3)] == [_Ping(1), big, _Pong(3)]
    thread.join()
    with pytest.raises(TypeError, match="str"):
        sender.send("not a message")
    tx.push(msgspec.msgpack.encode({"type": "nope"}))
    with pytest.raises(msgspec.ValidationError):
        receiver.recv(timeout=1)
    sender.send(_Pong(4))
    assert receiver.recv(timeout=1) == _Pong(4)  # the malformed message was consumed


def test_kept_references_to_push_and_pop_respect_close_and_fragments(pair):
    """push/pop may be C fast paths bound to the ring: a reference kept before close() raises
    like the methods afterwards, and a fragmented message in progress goes the slow way."""
    tx, rx = pair
    push, pop = tx.push, rx.pop
    big = bytes(range(256)) * 12  # fragments in a 1 KiB ring
    thread = threading.Thread(target=push, args=(big,), kwargs={"timeout": 20})
    thread.start()
    assert pop(timeout=20) == big
    thread.join()
    push(b"last")
    assert pop() == b"last"
    tx.close()
    with pytest.raises(ValueError, match="closed"):
        push(b"after close")
    rx.close()
    with pytest.raises(ValueError, match="closed"):
        pop()


def test_a_ring_sized_for_its_message_holds_records_of_half_its_capacity(pure_python):
    tx = RingBuffer.create(4096, max_record=2048, pure_python=pure_python)
    rx = RingBuffer.attach(tx.name, pure_python=pure_python)
    try:
        assert tx.max_payload == rx.max_payload == 2040
        import random

        rng = random.Random(5)
        for size in [2040, 2040, 2040, 0, 2041, 5000, 17] + [rng.randrange(3000) for _ in range(100)]:
            data = rng.randbytes(size)
            threading.Thread(target=tx.push, args=(data, 10), daemon=True).start()
            assert rx.pop(timeout=10) == data
        tx.reserve(2040)
        tx.commit()
        assert len(rx.pop(timeout=1)) == 2040
    finally:
        rx.close()
        tx.close()
    for bad in (2056, 8, 1000 + 4, 2048.0):
        with pytest.raises(ValueError, match="max_record must be a multiple of 8"):
            RingBuffer.create(4096, max_record=bad, pure_python=pure_python)


def _address(view: memoryview) -> int:
    c = ctypes.c_char.from_buffer(view)
    address = ctypes.addressof(c)
    del c  # the export ends here: the ring may then free the view
    return address


def test_payloads_4k_aliased_with_their_source_copy_intact(pure_python):
    """Records whose payload lies 8..56 bytes past its source modulo 4 KiB (the copy the C helper
    runs backward) and every other placement arrive intact, at sizes from 64 bytes to 96 KiB.
    Where a source lands is the allocator's choice: the test goes on until every aliased
    distance has been seen (a few thousand records; at most 30,000)."""
    tx = RingBuffer.create(256 << 10, pure_python=pure_python)
    rx = RingBuffer.attach(tx.name, pure_python=pure_python)
    rnd = random.Random(7)
    header = sys.getsizeof(b"") - 1  # a bytes object's data starts this far into it
    aliased: set = set()
    try:
        for i in range(30000):
            if i >= 3000 and {8, 16, 24, 32, 40, 48, 56} <= aliased:
                break
            n = rnd.choice((rnd.randrange(64, 4096), rnd.randrange(4096, 96 << 10), 64 + rnd.randrange(8) * 8 + 1))
            data = rnd.randbytes(n)
            tx.push(data)
            placed = rx.consume(lambda view: (bytes(view), _address(view)))
            assert placed[0] == data, (i, n)
            aliased.add((placed[1] - (id(data) + header)) % 4096)
            tx.push_many([data])
            assert rx.pop() == data, (i, n)
        assert {8, 16, 24, 32, 40, 48, 56} <= aliased
    finally:
        rx.close()
        tx.close()
