"""The ring between processes: stress with checksums, lost wake-ups, peer death, idle cost, GIL."""

from __future__ import annotations

import os
import random
import struct
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import pytest

from ipc import PeerDeadError, RingBuffer, sweep_stale_segments

ROOT = Path(__file__).resolve().parents[1]

# Runs in a child process: python -c CHILD <role> <ring name(s)> <args...>
CHILD = r"""
import random, struct, sys, time, zlib
from ipc import RingBuffer

def messages(count, seed, max_payload):
    rng = random.Random(seed)
    block = rng.randbytes(1 << 16)
    for seq in range(count):
        r = rng.random()
        size = rng.randrange(257) if r < 0.9 else rng.randrange(4097) if r < 0.99 else rng.randrange(3 * max_payload)
        start = rng.randrange(len(block) - size) if size < len(block) else 0
        payload = (block * (1 + size // len(block)))[start:start + size]
        yield struct.pack("=QI", seq, zlib.crc32(payload)) + payload

role, name = sys.argv[1], sys.argv[2]
if role == "produce":
    count, seed, spin_us, poll, pure = int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]), float(sys.argv[6]), sys.argv[7] == "1"
    ring = RingBuffer.attach(name, spin_us=spin_us, poll_interval=poll, pure_python=pure)
    for msg in messages(count, seed, ring.max_payload):
        ring.push(msg, timeout=30)
    ring.close()
elif role == "echo":
    spin_us, poll = float(sys.argv[4]), float(sys.argv[5])
    rx = RingBuffer.attach(name, spin_us=spin_us, poll_interval=poll)
    tx = RingBuffer.attach(sys.argv[3], spin_us=spin_us, poll_interval=poll)
    while True:
        msg = rx.pop(timeout=30)
        tx.push(msg, timeout=30)
        if msg == b"stop":
            break
elif role == "attach-idle":
    ring = RingBuffer.attach(name)
    print("ready", flush=True)
    time.sleep(600)
elif role == "create-idle":
    ring = RingBuffer.create(int(name))
    print(ring.name, flush=True)
    time.sleep(600)
"""


def _child(*args: object) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, *map(str, args)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )


def _check_stream(ring: RingBuffer, count: int) -> int:
    """Pops `count` checksummed messages; asserts none is lost, duplicated, reordered or corrupted."""
    total_bytes = 0
    for expected in range(count):
        msg = ring.pop(timeout=30)
        seq, crc = struct.unpack_from("=QI", msg)
        assert seq == expected, f"message {expected} arrived as {seq}"
        assert zlib.crc32(memoryview(msg)[12:]) == crc, f"message {seq} is corrupted"
        total_bytes += len(msg)
    return total_bytes


@pytest.mark.parametrize(
    "count, spin_us, poll, pure",
    [
        pytest.param(200_000, 50.0, 0.1, False, id="spin-200k"),
        # No spinning and no periodic wake-up: every wait sleeps, and a lost wake-up would hang
        # for 30 s and fail the pop(timeout=30).
        pytest.param(200_000, 0.0, 30.0, False, id="sleep-200k-lost-wakeup"),
        pytest.param(20_000, 20.0, 30.0, True, id="python-fallback-20k"),
    ],
)
def test_two_process_stream_with_checksums(count, spin_us, poll, pure):
    ring = RingBuffer.create(1 << 16, spin_us=spin_us, poll_interval=poll, pure_python=pure)
    child = _child("produce", ring.name, count, 1234, spin_us, poll, int(pure))
    try:
        total_bytes = _check_stream(ring, count)
        assert total_bytes > count * 12
        assert ring.try_pop() is None
        assert child.wait(timeout=30) == 0
    finally:
        child.kill()
        child.wait()
        ring.close()


def test_ping_pong_never_loses_a_wakeup():
    """Every message makes the other side sleep and be woken: 2 x 20,000 handshakes."""
    out = RingBuffer.create(4096, spin_us=0, poll_interval=30)
    back = RingBuffer.create(4096, spin_us=0, poll_interval=30)
    child = _child("echo", out.name, back.name, 0, 30)
    rng = random.Random(7)
    try:
        for i in range(20_000):
            msg = i.to_bytes(4, "little") * rng.randrange(1, 64)
            out.push(msg, timeout=10)
            assert back.pop(timeout=10) == msg
            if i % 1000 == 0:  # let the echo side fall properly asleep now and then
                time.sleep(0.0005)
        out.push(b"stop")
        assert back.pop(timeout=10) == b"stop"
        assert child.wait(timeout=10) == 0
    finally:
        child.kill()
        child.wait()
        out.close()
        back.close()


def _block_until_peer_killed(ring: RingBuffer, child: subprocess.Popen, blocked_in: str) -> None:
    """Kills `child` (the ring's peer) 0.3 s from now while we block in pop or push; the blocked
    call must raise PeerDeadError naming it within 1 s of the kill."""
    assert ring.peer_pid == child.pid
    killed_at: list = []

    def kill() -> None:
        killed_at.append(time.monotonic())
        child.kill()

    threading.Timer(0.3, kill).start()
    with pytest.raises(PeerDeadError, match=str(child.pid)):
        if blocked_in == "pop":
            ring.pop()
        else:
            while True:  # fill the ring, then block on the full ring
                ring.push(b"x" * 100)
    assert time.monotonic() - killed_at[0] < 1.0


@pytest.mark.parametrize("blocked_in", ["pop", "push"])
def test_creator_notices_attacher_killed(blocked_in):
    ring = RingBuffer.create(4096)
    child = _child("attach-idle", ring.name)
    try:
        assert child.stdout.readline().strip() == "ready"
        _block_until_peer_killed(ring, child, blocked_in)
    finally:
        child.kill()
        child.wait()
        ring.close()


@pytest.mark.parametrize("blocked_in", ["pop", "push"])
def test_attacher_notices_creator_killed(blocked_in):
    child = _child("create-idle", "4096")
    try:
        name = child.stdout.readline().strip()
        with RingBuffer.attach(name) as ring:
            _block_until_peer_killed(ring, child, blocked_in)
    finally:
        child.kill()
        child.wait()
    removed = sweep_stale_segments()  # the killed creator could not unlink its ring
    assert name in removed


def test_blocked_waiter_is_nearly_idle():
    """A side blocked for ~1 s uses well under 5% of a core (behaviour, with slack)."""
    ring = RingBuffer.create(4096)
    peer = RingBuffer.attach(ring.name)
    try:
        cpu0, wall0 = time.process_time(), time.monotonic()
        with pytest.raises(TimeoutError):
            peer.pop(timeout=1.0)
        cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
        assert wall >= 0.99
        assert cpu / wall < 0.05, f"blocked pop used {cpu / wall:.1%} of a core"
    finally:
        peer.close()
        ring.close()


@pytest.mark.parametrize("spin_us", [0.0, 300_000.0])
def test_waiting_thread_leaves_the_gil_to_others(spin_us):
    """Spinning (in C) and sleeping (on the semaphore) both release the GIL."""
    ring = RingBuffer.create(4096, spin_us=spin_us)
    peer = RingBuffer.attach(ring.name, spin_us=spin_us)
    try:
        waiter = threading.Thread(target=peer.wait_readable, args=(0.4,))
        t0 = time.monotonic()
        waiter.start()
        time.sleep(0.02)  # the waiter is now spinning or sleeping; we need the GIL back
        total = sum(i * i for i in range(50_000))  # pure Python: needs the GIL throughout
        elapsed = time.monotonic() - t0
        waiter.join()
        assert total > 0 and elapsed < 0.3, f"sleep + a 50k-step loop took {elapsed:.3f} s beside a waiter"
    finally:
        peer.close()
        ring.close()


def test_no_native_helper_is_only_a_warning(tmp_path):
    """With no compiler, ipc still works (pure-Python fallback) and says so once."""
    code = (
        "import warnings; warnings.simplefilter('error', RuntimeWarning)\n"
        "from ipc import RingBuffer, native_available\n"
        "try:\n    native_available()\nexcept RuntimeWarning as w:\n    print('warned', w)\n"
    )
    env = dict(os.environ, CC="/nonexistent-cc", PATH=str(tmp_path), IPC_NATIVE_CACHE=str(tmp_path / "cache"))
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert "warned ipc: could not build the C helper" in out.stdout, out.stderr
    code = "from ipc import RingBuffer\nr = RingBuffer.create(256)\nr.push(b'ok'); print(r.native, r.pop()); r.close()"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False b'ok'", out.stderr


def _native_in_child(env: dict) -> subprocess.Popen:
    code = "from ipc import native_available\nprint(native_available(), flush=True)"
    return subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_native_cache_falls_back_when_home_is_unusable(tmp_path):
    """A home that cannot hold ~/.cache builds the helper under $TMPDIR instead of going pure Python."""
    home = tmp_path / "home-is-a-file"
    home.write_text("")
    env = {k: v for k, v in os.environ.items() if k != "IPC_NATIVE_CACHE"}
    env.update(HOME=str(home), TMPDIR=str(tmp_path))
    out, err = _native_in_child(env).communicate(timeout=120)
    assert out.strip() == "True", err
    assert list((tmp_path / f"ipc-ring-{os.getuid()}").glob("ipc_native-*.so"))


def test_native_cache_must_be_private(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    out, err = _native_in_child(dict(os.environ, IPC_NATIVE_CACHE=str(shared))).communicate(timeout=120)
    assert out.strip() == "False" and "not a private directory" in err, err
    assert not list(shared.iterdir())


def test_concurrent_first_builds_race_harmlessly(tmp_path):
    env = dict(os.environ, IPC_NATIVE_CACHE=str(tmp_path / "cache"))
    children = [_native_in_child(env) for _ in range(3)]
    for child in children:
        out, err = child.communicate(timeout=120)
        assert out.strip() == "True", err
    built = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert len(built) == 1 and built[0].endswith(".so"), built  # no temporary file left behind
