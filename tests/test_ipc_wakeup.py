"""Sleeping and waking: no lost wake-up under random sleeps on both sides (futex rings, native and
pure Python, and semaphore rings), the batch path, a dead peer noticed within the poll interval
while we sleep, close() waking a sleeper at once, the futex primitive itself, and a big message
waking its consumer before its copy."""

from __future__ import annotations

import mmap
import ctypes
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import ipc.ring as ring_module
from ipc import PeerClosedError, PeerDeadError, RingBuffer, native_available, sweep_stale_segments
from ipc import layout as L
from ipc.wait import futex_wait, futex_wake

ROOT = Path(__file__).resolve().parents[1]
SHM = Path("/dev/shm")

# python -c ECHO <to-child ring> <to-parent ring> <count> <seed> <pure> <batch>: pops each message
# (or a batch of them) and pushes it back, sleeping a random 0-300 µs before each pop and push.
ECHO = r"""
import random, sys, time
from ipc import RingBuffer
rx_name, tx_name, count, seed, pure, batch = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1", sys.argv[6] == "1"
opts = dict(spin_us=0, poll_interval=30, pure_python=pure)
rx, tx = RingBuffer.attach(rx_name, **opts), RingBuffer.attach(tx_name, **opts)
rng = random.Random(seed)
done = 0
while done < count:
    time.sleep(rng.random() * 3e-4)
    got = rx.pop_many(timeout=20) if batch else [rx.pop(timeout=20)]
    time.sleep(rng.random() * 3e-4)
    if batch:
        tx.push_many(got, timeout=20)
    else:
        tx.push(got[0], timeout=20)
    done += len(got)
"""

KINDS = [
    pytest.param(False, False, id="futex-native"),
    pytest.param(True, False, id="futex-python"),
    pytest.param(False, True, id="semaphore-native"),
]


def _require_native(pure: bool) -> None:
    if not pure and not native_available():
        pytest.fail("the C helper did not build (cc is expected on this machine)")


def _create(capacity: int, pure: bool, semaphore: bool, monkeypatch, **opts) -> RingBuffer:
    if semaphore:
        monkeypatch.setattr(ring_module, "futex_supported", lambda native: False)
    ring = RingBuffer.create(capacity, pure_python=pure, **opts)
    assert ring.wake == (L.WAKE_SEMAPHORE if semaphore else L.WAKE_FUTEX)
    return ring


def _ring_files(name: str) -> list[Path]:
    base = name.lstrip("/")
    return [p for p in SHM.iterdir() if p.name.startswith((base, f"sem.{base}"))]


# (ring capacity, message sizes): small records in a 512-byte ring; records of 4-20 KiB in a
# 256 KiB ring, so that push_many publishes in the middle of a batch (PUBLISH_EVERY in _native.c).
SIZES = {"small": (512, (1, 120)), "large": (1 << 18, (4096, 20000))}


@pytest.mark.parametrize("pure, semaphore", KINDS)
@pytest.mark.parametrize("batch", [False, True], ids=["single", "batch"])
@pytest.mark.parametrize("size", list(SIZES))
def test_no_lost_wakeup_with_random_sleeps_on_both_sides(pure, semaphore, batch, size, monkeypatch):
    """Every wait sleeps (no spin) and nothing polls (30 s): a lost wake-up is a 20 s timeout.
    Both sides sleep at random before each pop and push, so each of them is found asleep, or
    just going to sleep, or awake, by the other's publish; the ring fills up, so the producers
    sleep for space too. Messages come back in order and intact."""
    _require_native(pure)
    capacity, (low, high) = SIZES[size]
    count = (400 if pure else 1500) if size == "small" else (100 if pure else 400)
    opts = dict(spin_us=0, poll_interval=30)
    down = _create(capacity, pure, semaphore, monkeypatch, **opts)
    up = _create(capacity, pure, semaphore, monkeypatch, **opts)
    child = subprocess.Popen(
        [sys.executable, "-c", ECHO, down.name, up.name, str(count), "7", "1" if pure else "0", "1" if batch else "0"],
        cwd=ROOT,
    )
    rng = random.Random(11)
    try:
        messages = [rng.randbytes(rng.randrange(low, high)) for _ in range(count)]
        received: list[bytes] = []
        sender_error: list[BaseException] = []

        def send() -> None:
            try:
                for i in range(0, count, 8):
                    time.sleep(rng.random() * 3e-4)
                    chunk = messages[i : i + 8]
                    if batch:
                        down.push_many(chunk, timeout=20)
                    else:
                        for m in chunk:
                            down.push(m, timeout=20)
            except BaseException as exc:  # noqa: BLE001 - reported below
                sender_error.append(exc)

        sender = threading.Thread(target=send)
        sender.start()
        recv_rng = random.Random(13)
        while len(received) < count:
            time.sleep(recv_rng.random() * 3e-4)
            received += up.pop_many(timeout=20) if batch else [up.pop(timeout=20)]
        sender.join(30)
        assert not sender_error, sender_error
        assert received == messages
        assert child.wait(timeout=30) == 0
        woken = down.wakeups()["data"] + up.wakeups()["data"]
        assert woken > 0, "no side was ever found asleep: the test did not test the wake-up"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        names = [down.name, up.name]
        down.close()
        up.close()
    assert not [p for n in names for p in _ring_files(n)]


# python -c IDLE create|attach <name or capacity>: creates (printing its name) or attaches, then idles.
IDLE = r"""
import sys, time
from ipc import RingBuffer
if sys.argv[1] == "create":
    ring = RingBuffer.create(int(sys.argv[2]))
    print(ring.name, flush=True)
else:
    ring = RingBuffer.attach(sys.argv[2])
    print("ready", flush=True)
time.sleep(600)
"""
POLL = 0.25


def _sleep_until_killed(ring: RingBuffer, child: subprocess.Popen, blocked_in: str) -> float:
    """Blocks in pop (empty ring) or push (full ring) while the child is killed 0.3 s later;
    returns how long after the kill PeerDeadError came."""
    killed_at: list[float] = []

    def kill() -> None:
        time.sleep(0.3)
        killed_at.append(time.monotonic())
        os.kill(child.pid, signal.SIGKILL)

    threading.Thread(target=kill, daemon=True).start()
    with pytest.raises(PeerDeadError):
        if blocked_in == "pop":
            ring.pop(timeout=20)
        else:
            while True:
                ring.push(b"x" * 100, timeout=20)
    return time.monotonic() - killed_at[0]


@pytest.mark.parametrize("blocked_in", ["pop", "push"])
@pytest.mark.parametrize("survivor", ["creator", "attacher"])
def test_peer_killed_while_we_sleep_is_noticed_within_the_poll_interval(survivor, blocked_in):
    if survivor == "creator":
        ring = RingBuffer.create(4096, spin_us=0, poll_interval=POLL)
        child = subprocess.Popen([sys.executable, "-c", IDLE, "attach", ring.name], cwd=ROOT, stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "ready"
    else:
        child = subprocess.Popen([sys.executable, "-c", IDLE, "create", "4096"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
        ring = RingBuffer.attach(child.stdout.readline().strip(), spin_us=0, poll_interval=POLL)
    name = ring.name
    try:
        late = _sleep_until_killed(ring, child, blocked_in)
        # The sleeper looks at its peer once per poll interval; the slack is for a loaded machine.
        assert late < POLL + 0.25, f"PeerDeadError came {late:.3f} s after the kill (poll interval {POLL} s)"
    finally:
        child.kill()
        child.wait()
        ring.close()
    if survivor == "attacher":
        assert name in sweep_stale_segments()  # the killed creator could not unlink its ring
    assert not _ring_files(name)


@pytest.mark.parametrize("pure", [False, True], ids=["native", "python"])
def test_close_wakes_a_futex_sleeper_at_once(pure):
    _require_native(pure)
    tx = RingBuffer.create(4096, pure_python=pure)
    rx = RingBuffer.attach(tx.name, spin_us=0, poll_interval=30, pure_python=pure)
    try:
        threading.Timer(0.2, tx.close).start()
        t0 = time.monotonic()
        with pytest.raises(PeerClosedError):
            rx.pop(timeout=20)
        assert time.monotonic() - t0 < 5.0  # woken by close, not by the 30 s poll
    finally:
        rx.close()
        tx.close()


def test_futex_primitive_waits_wakes_and_times_out():
    mem = mmap.mmap(-1, 4096)
    word = ctypes.c_uint32.from_buffer(mem)
    address = ctypes.addressof(word)
    t0 = time.monotonic()
    assert futex_wait(address, 1, 5.0) == 0  # the word is 0, not 1: returns at once
    assert futex_wait(address, 0, 0.05) == 1  # nobody wakes it: timeout
    assert time.monotonic() - t0 < 3.0

    def wake() -> None:
        time.sleep(0.1)
        word.value = 1
        futex_wake(address)

    threading.Thread(target=wake).start()
    assert futex_wait(address, 0, 10.0) == 0
    assert word.value == 1
    with pytest.raises(ValueError, match="timeout"):
        futex_wait(address, 0, -1)
    del word
    mem.close()


@pytest.mark.parametrize("consumer_pure", [False, True], ids=["native-consumer", "python-consumer"])
def test_a_big_message_wakes_a_sleeping_consumer_once_before_its_copy(consumer_pure):
    """A native push of a message of 16 KiB to 1 MiB wakes the sleeping consumer before it copies
    the payload (the commit wakes it again if it went back to sleep). Messages of that size, each
    pushed while the consumer sleeps, arrive in order and intact, with a native consumer (which
    spins for the publish after such a wake-up, so about one wake-up a message) and a pure-Python
    one (which sleeps again). That the wake-up comes before the copy: the next test."""
    _require_native(False)
    count = 40
    tx = RingBuffer.create(1 << 20)
    rx = RingBuffer.attach(tx.name, spin_us=0, poll_interval=30, pure_python=consumer_pure)
    rng = random.Random(5)
    messages = [rng.randbytes(rng.choice((16384, 40000, 65536))) for _ in range(count)]
    received: list[bytes] = []
    failed: list[BaseException] = []

    def consume() -> None:
        try:
            for _ in range(count):
                received.append(rx.pop(timeout=20))
        except BaseException as exc:  # noqa: BLE001 - reported below
            failed.append(exc)

    consumer = threading.Thread(target=consume)
    consumer.start()
    try:
        for message in messages:
            deadline = time.monotonic() + 10
            while not rx._ops.load(L.OFF_C_SLEEPING):  # the consumer is asleep before each push
                assert time.monotonic() < deadline, "the consumer never went to sleep"
                time.sleep(0.0005)
            tx.push(message)
        consumer.join(30)
        assert not failed, failed
        assert received == messages
        wakes = tx.wakeups()["data"]
        if consumer_pure:
            assert wakes >= count
        else:
            assert count <= wakes <= count + count // 4, wakes
    finally:
        rx.close()
        tx.close()


@pytest.mark.parametrize("size, cleared_before_copy", [(16384, True), ((1 << 20) + 8, False), (8192, False)])
def test_a_big_push_clears_the_sleeping_flag_before_it_copies(size, cleared_before_copy):
    """The order of the early wake-up, without timing: the payload is copied from the ring's own
    header, starting at the consumer's sleeping flag, so the message holds the flag as it was when
    the copy ran. From 16 KiB to 1 MiB the flag is already cleared (the consumer woken before the
    copy); below and above, it is cleared by the commit, after the copy. One wake-up either way."""
    _require_native(False)
    capacity = 1 << 18 if size <= 1 << 16 else 1 << 23
    tx = RingBuffer.create(capacity)
    rx = RingBuffer.attach(tx.name)
    try:
        tx.push(bytes(size + 8192))  # the next record starts past the range it is copied from
        rx.pop()
        base = tx._address
        rx._ops.store(L.OFF_C_SLEEPING, 1)  # as a consumer does before it sleeps (none sleeps here)
        push = ring_module._native_lib().fast.ipc_push
        assert push(ctypes.c_void_p(base), ctypes.c_void_p(base + L.OFF_C_SLEEPING), size) == 1
        flag_during_copy = int.from_bytes(rx.pop(timeout=5)[:8], sys.byteorder)
        assert flag_during_copy == (0 if cleared_before_copy else 1)
        assert rx._ops.load(L.OFF_C_SLEEPING) == 0
        assert tx.wakeups()["data"] == 1
    finally:
        rx.close()
        tx.close()
