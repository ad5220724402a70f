"""The broadcast ring between processes: every reader gets every message intact and in order,
a slow reader holds the writer back without loss, a dead reader or writer is reported, the
closed writer's messages are drained first, idle readers sleep, nothing stays in /dev/shm."""

from __future__ import annotations

import os
import random
import signal
import struct
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import pytest

from ipc import PeerClosedError, PeerDeadError, RingTimeoutError
from ipc.broadcast import MAX_READERS, BroadcastReader, BroadcastWriter, broadcast_native_available

ROOT = Path(__file__).resolve().parents[1]
SHM = Path("/dev/shm")

# python -c READER <ring name> <index> <pure> <slow every N (0: never)>: checks seq + crc of
# every message until the writer closes, prints "ready" once attached and "<count> <crc of all>".
READER = r"""
import struct, sys, time, zlib
from ipc import PeerClosedError
from ipc.broadcast import BroadcastReader
name, index, pure, slow = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4])
reader = BroadcastReader.attach(name, index, pure_python=pure, poll_interval=0.05)
print("ready", flush=True)
count, total = 0, 0
while True:
    try:
        msg = reader.pop(timeout=60)
    except PeerClosedError:
        break
    seq, crc = struct.unpack_from("=QI", msg)
    if seq != count:
        print(f"bad order: message {count} arrived as {seq}", flush=True)
        sys.exit(1)
    if zlib.crc32(memoryview(msg)[12:]) != crc:
        print(f"message {seq} is corrupted", flush=True)
        sys.exit(1)
    total = zlib.crc32(msg, total)
    count += 1
    if slow and count % slow == 0:
        time.sleep(0.002)
print(count, total, flush=True)
"""


def _messages(count: int, seed: int, max_payload: int):
    rng = random.Random(seed)
    block = rng.randbytes(1 << 16)
    for seq in range(count):
        r = rng.random()
        size = rng.randrange(129) if r < 0.9 else rng.randrange(2049) if r < 0.995 else rng.randrange(3 * max_payload)
        start = rng.randrange(len(block) - size) if size < len(block) else 0
        payload = (block * (1 + size // len(block)))[start : start + size]
        yield struct.pack("=QI", seq, zlib.crc32(payload)) + payload


def _reader(name: str, index: int, pure: bool = False, slow: int = 0) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", READER, name, str(index), "1" if pure else "0", str(slow)],
        cwd=ROOT, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _leftovers(name: str) -> list[str]:
    stem = name.lstrip("/")
    return [p.name for p in SHM.iterdir() if stem in p.name]


def _broadcast(count: int, readers: int, capacity: int, pure: bool = False, slow: tuple[int, ...] = ()) -> None:
    writer = BroadcastWriter.create(readers, capacity, pure_python=pure, poll_interval=0.05)
    procs = [_reader(writer.name, i, pure, slow[i] if i < len(slow) else 0) for i in range(readers)]
    try:
        expected = 0
        for msg in _messages(count, 7, writer.max_payload):
            writer.push(msg, timeout=60)
            expected = zlib.crc32(msg, expected)
        writer.close()
        for proc in procs:
            out, _ = proc.communicate(timeout=120)
            assert proc.returncode == 0, out
            assert out.split() == [str(count), str(expected)]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        writer.close()
    assert _leftovers(writer.name) == []


def test_native_helper_builds():
    assert broadcast_native_available()


def test_hundred_thousand_messages_to_three_readers():
    """10^5 messages of random sizes (some fragmented), a 64 KiB ring that wraps ~1000 times."""
    _broadcast(100_000, 3, 1 << 16)


def test_slow_reader_holds_the_writer_back_without_loss():
    _broadcast(5_000, 3, 1 << 12, slow=(0, 10, 0))


def test_pure_python_fallback():
    _broadcast(3_000, 2, 1 << 12, pure=True)


def test_reader_killed_while_the_writer_waits():
    """The writer, blocked on a full ring by a reader that stopped reading, raises
    PeerDeadError within the poll interval of that reader's kill -9."""
    poll = 0.2
    writer = BroadcastWriter.create(2, 1 << 12, poll_interval=poll)
    live = _reader(writer.name, 0)
    stuck = subprocess.Popen(
        [sys.executable, "-c", "import sys,time; from ipc.broadcast import BroadcastReader as R; "
         "r = R.attach(sys.argv[1], 1); print('ready', flush=True); time.sleep(600)", writer.name],
        cwd=ROOT, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert stuck.stdout.readline().strip() == "ready"
    killed_at: list[float] = []

    def kill_later() -> None:
        time.sleep(0.5)
        killed_at.append(time.monotonic())
        os.kill(stuck.pid, signal.SIGKILL)

    threading.Thread(target=kill_later, daemon=True).start()
    try:
        with pytest.raises(PeerDeadError, match=f"reader 1 \\(pid {stuck.pid}\\)"):
            for msg in _messages(100_000, 3, writer.max_payload):
                writer.push(msg, timeout=30)
        raised_at = time.monotonic()
        assert killed_at, "the writer raised before the reader was killed"
        assert raised_at - killed_at[0] < poll + 0.3
    finally:
        stuck.wait()
        writer.close()
        live.communicate(timeout=30)
    assert _leftovers(writer.name) == []


def test_writer_killed_reader_raises_and_closed_writer_drains_first():
    code = (
        "import sys,time; from ipc.broadcast import BroadcastWriter as W; w = W.create(1, 1 << 12); "
        "print(w.name, flush=True); w.push(b'last', timeout=5); time.sleep(600)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    name = proc.stdout.readline().strip()
    reader = BroadcastReader.attach(name, 0, poll_interval=0.05)
    assert reader.pop(timeout=5) == b"last"
    proc.kill()
    proc.wait()
    started = time.monotonic()
    with pytest.raises(PeerDeadError, match=f"writer process {proc.pid}"):
        reader.pop(timeout=5)
    assert time.monotonic() - started < 1.0
    reader.close()
    from ipc import sweep_stale_segments

    sweep_stale_segments()
    assert _leftovers(name) == []

    writer = BroadcastWriter.create(1, 1 << 12, poll_interval=0.05)
    reader = BroadcastReader.attach(writer.name, 0, poll_interval=0.05)
    writer.push(b"a")
    writer.push(b"b" * 2000, timeout=5)  # fragmented
    writer.close()
    assert reader.pop(timeout=1) == b"a"
    assert reader.pop(timeout=1) == b"b" * 2000
    with pytest.raises(PeerClosedError):
        reader.pop(timeout=1)
    assert _leftovers(writer.name) == []


def test_timeouts_closed_reader_and_bad_arguments():
    writer = BroadcastWriter.create(2, 1 << 12, poll_interval=0.05)
    try:
        a = BroadcastReader.attach(writer.name, 0)
        b = BroadcastReader.attach(writer.name, 1)
        with pytest.raises(RingTimeoutError):
            a.pop(timeout=0.05)
        # a reader that closed does not hold the writer back
        b.close()
        for _ in range(100):
            writer.push(b"x" * 100, timeout=1)
            assert a.pop(timeout=1) == b"x" * 100
        with pytest.raises(RingTimeoutError):
            for _ in range(100):
                writer.push(b"y" * 100, timeout=0.05)
        with pytest.raises(ValueError, match="index must be"):
            BroadcastReader.attach(writer.name, 2)
    finally:
        writer.close()
    with pytest.raises(ValueError, match="num_readers"):
        BroadcastWriter.create(MAX_READERS + 1)
    with pytest.raises(ValueError, match="capacity"):
        BroadcastWriter.create(1, 100)


def test_idle_reader_sleeps():
    writer = BroadcastWriter.create(1, 1 << 12, poll_interval=0.1)
    proc = _reader(writer.name, 0)
    try:
        time.sleep(0.3)
        before = _cpu_seconds(proc.pid)
        time.sleep(2.0)
        used = _cpu_seconds(proc.pid) - before
        assert used < 0.05 * 2.0, f"an idle reader used {used:.3f} s of CPU in 2 s"
    finally:
        writer.close()
        proc.communicate(timeout=10)


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
