"""The /dev/shm leak check of conftest counts the segments of this test session's processes
only: what a stranger (another test run on the machine) left is not a leak of ours, and what a
child or grandchild of ours left, however it died, is."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import posix_ipc
import pytest

from conftest import SHM_DIR, leaked_shm_entries, wait_until_dead

ROOT = Path(__file__).resolve().parents[1]

CREATE_AND_DIE = """
import os, signal, sys, time
from ipc import RingBuffer
ring = RingBuffer.create(4096)
print(os.getpid(), ring.name, flush=True)
time.sleep(float(sys.argv[1]))
os.kill(os.getpid(), signal.SIGKILL)
"""


def remove_segments_of(pid: int) -> None:
    for entry in SHM_DIR.iterdir():
        if f"ipcring-{pid}-" in entry.name:
            if entry.name.startswith("sem."):
                posix_ipc.unlink_semaphore("/" + entry.name[4:])
            else:
                posix_ipc.unlink_shared_memory("/" + entry.name)


def python(code: str, *args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], cwd=ROOT, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, **kwargs)


def run_and_read(code: str, *args: str) -> tuple[int, str]:
    """Runs `code`, which prints "<pid of the creator> <ring name>" and dies."""
    proc = python(code, *args, stdout=subprocess.PIPE)
    out, _ = proc.communicate(timeout=60)
    pid, name = out.split()
    wait_until_dead(int(pid), 10.0)
    return int(pid), name.lstrip("/")


def test_a_dead_strangers_segment_is_not_counted():
    """A process outside this session (here: a daemon whose parent had exited, so it is nobody's
    descendant here) creates a ring and dies of kill -9: another run's leftover, not ours."""
    stranger = """
    import os, sys, time
    parent = os.getpid()
    if os.fork():
        os._exit(0)  # the daemon below is an orphan: reparented away from this session
    while os.getppid() == parent:
        time.sleep(0.01)
    os.execv(sys.executable, [sys.executable, "-c", sys.argv[1], "0"])
    """
    pid, name = run_and_read(stranger, CREATE_AND_DIE)
    try:
        assert (SHM_DIR / name).exists()
        assert name not in leaked_shm_entries()
    finally:
        remove_segments_of(pid)


@pytest.mark.parametrize("depth", ["child", "grandchild"])
def test_a_dead_segment_of_this_session_is_counted(depth):
    """A child pytest started, or a grandchild (as an engine's worker is), dies of kill -9
    after creating a ring: the check sees it."""
    code = CREATE_AND_DIE
    if depth == "grandchild":
        code = """
        import subprocess, sys
        subprocess.run([sys.executable, "-c", sys.argv[1], "0.5"], check=False)
        """
    pid, name = run_and_read(code, *([CREATE_AND_DIE] if depth == "grandchild" else ["0"]))
    try:
        assert name in leaked_shm_entries()
    finally:
        remove_segments_of(pid)
    assert name not in leaked_shm_entries()
