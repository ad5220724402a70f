"""Segment hygiene: 0600 permissions, unguessable names, unlink on close/exit/error, sweeping."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ipc import RingBuffer, native_available, sweep_stale_segments
from ipc.segment import pid_alive
from ipc.wait import futex_supported

ROOT = Path(__file__).resolve().parents[1]
SHM = Path("/dev/shm")


FUTEX = futex_supported(native_available())  # futex rings have no semaphores next to them


def _files(name: str) -> list[Path]:
    base = name.lstrip("/")
    return [SHM / base] + ([] if FUTEX else [SHM / f"sem.{base}-d", SHM / f"sem.{base}-s"])


def _run_child(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_name_and_permissions():
    ring = RingBuffer.create(4096)
    try:
        assert re.fullmatch(rf"/ipcring-{os.getpid()}-[0-9a-f]{{16}}", ring.name)
        for path in _files(ring.name):
            mode = path.stat().st_mode
            assert stat.S_IMODE(mode) == 0o600, f"{path} has mode {oct(stat.S_IMODE(mode))}"
            assert path.stat().st_uid == os.getuid()
    finally:
        ring.close()
    assert not any(p.exists() for p in _files(ring.name))


def test_names_do_not_repeat():
    rings = [RingBuffer.create(256) for _ in range(20)]
    try:
        assert len({r.name for r in rings}) == 20
    finally:
        for r in rings:
            r.close()


def test_attacher_close_leaves_the_ring_to_its_creator():
    ring = RingBuffer.create(4096)
    peer = RingBuffer.attach(ring.name)
    peer.close()
    assert all(p.exists() for p in _files(ring.name))
    ring.close()
    ring.close()  # idempotent
    assert not any(p.exists() for p in _files(ring.name))


@pytest.mark.parametrize(
    "ending",
    ["pass", "raise RuntimeError('boom')", "import sys; sys.exit(3)"],
    ids=["normal-exit", "uncaught-exception", "sys-exit"],
)
def test_creator_exit_without_close_unlinks(ending):
    out = _run_child(f"from ipc import RingBuffer\nr = RingBuffer.create(4096)\nprint(r.name, flush=True)\n{ending}\n")
    name = out.stdout.strip()
    assert name.startswith("/ipcring-"), out.stderr
    assert not any(p.exists() for p in _files(name))


def test_sweep_removes_only_rings_of_dead_creators():
    mine = RingBuffer.create(4096)
    try:
        out = _run_child(
            "import os, signal\nfrom ipc import RingBuffer\nr = RingBuffer.create(4096)\n"
            "print(r.name, flush=True)\nos.kill(os.getpid(), signal.SIGKILL)\n"
        )
        dead = out.stdout.strip()
        assert all(p.exists() for p in _files(dead)), "a killed creator cannot unlink"
        removed = sweep_stale_segments()
        assert set(removed) >= {dead} | (set() if FUTEX else {dead + "-d", dead + "-s"})
        assert not any(p.exists() for p in _files(dead))
        assert all(p.exists() for p in _files(mine.name)), "sweep removed a live creator's ring"
        assert mine.name not in sweep_stale_segments()
    finally:
        mine.close()


def test_pid_alive_sees_zombies_and_recycled_pids():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    while True:  # wait until it exited but is not yet reaped: a zombie
        state = Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state == "Z":
            break
        time.sleep(0.01)
    assert not pid_alive(child.pid)
    child.wait()
    assert not pid_alive(child.pid)
    assert pid_alive(os.getpid())
    assert not pid_alive(os.getpid(), start_time=1)  # same pid, different process
