"""Named POSIX shared memory: create (0600, unguessable name), attach, unlink, sweep.

Names are ``/ipcring-<creator pid>-<16 hex digits>`` (64 random bits); the ring's semaphores
append a suffix to the same name (``/dev/shm/sem.ipcring-...`` on Linux). Carrying the creator's
pid in the name lets `sweep_stale_segments` find what a crashed (kill -9) creator left behind.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
from pathlib import Path
from typing import Optional

import posix_ipc

PREFIX = "ipcring-"
SHM_DIR = Path("/dev/shm")
_NAME_RE = re.compile(r"^(?:sem\.)?" + re.escape(PREFIX) + r"(\d+)-[0-9a-f]{16}")


def new_name() -> str:
    """A fresh POSIX name for a segment: recognisable prefix, creator pid, 64 random bits."""
    return f"/{PREFIX}{os.getpid()}-{secrets.token_hex(8)}"


def process_start_time(pid: int) -> int:
    """The process's start time in clock ticks since boot (Linux), 0 where unknown.

    Stored next to a pid so that a recycled pid is not mistaken for the original process.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    return int(stat.rsplit(")", 1)[1].split()[19])


def pid_alive(pid: int, start_time: int = 0) -> bool:
    """Whether `pid` runs (zombies count as dead) and, if `start_time` is given, is the same process."""
    if pid <= 0:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:
        return _kill_probe(pid)
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X", "x"):
        return False
    return not start_time or int(fields[19]) == start_time


def _kill_probe(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Segment:
    """A mapped POSIX shared-memory object. Only the creator unlinks it (see ring.py); the
    mapping lives as long as this object, so no thread can touch unmapped memory."""

    def __init__(self, name: str, shm: posix_ipc.SharedMemory, creator: bool) -> None:
        self.name = name
        self.size = shm.size
        self.creator = creator
        try:
            self.buf = mmap.mmap(shm.fd, shm.size)
        finally:
            shm.close_fd()

    @classmethod
    def create(cls, size: int, name: Optional[str] = None) -> "Segment":
        if size <= 0:
            raise ValueError(f"size must be positive, got {size}")
        name = name or new_name()
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=size)
        try:
            return cls(name, shm, creator=True)
        except BaseException:
            posix_ipc.unlink_shared_memory(name)
            raise

    @classmethod
    def attach(cls, name: str) -> "Segment":
        return cls(name, posix_ipc.SharedMemory(name), creator=False)


def unlink_quietly(unlink, name: str) -> bool:
    """Calls a posix_ipc unlink function; False if the name was already gone."""
    try:
        unlink(name)
    except posix_ipc.ExistentialError:
        return False
    return True


def sweep_stale_segments(shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlinks every ipcring segment and semaphore whose creator process is dead.

    Returns the POSIX names removed. Only Linux-style /dev/shm listings can be swept; elsewhere
    this returns an empty list.
    """
    if not shm_dir.is_dir():
        return []
    removed = []
    for entry in sorted(shm_dir.iterdir()):
        match = _NAME_RE.match(entry.name)
        if not match or pid_alive(int(match.group(1))):
            continue
        if entry.name.startswith("sem."):
            name, unlink = "/" + entry.name[4:], posix_ipc.unlink_semaphore
        else:
            name, unlink = "/" + entry.name, posix_ipc.unlink_shared_memory
        if unlink_quietly(unlink, name):
            removed.append(name)
    return removed
