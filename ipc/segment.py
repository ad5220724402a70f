"""Named POSIX shared memory: create (0600, unguessable name), attach, unlink, sweep.

Names are ``/ipcring-<creator pid>-<16 hex digits>`` (64 random bits); the ring's semaphores
append a suffix to the same name (``/dev/shm/sem.ipcring-...`` on Linux). Carrying the creator's
pid in the name lets `sweep_stale_segments` find what a crashed (kill -9) creator left behind.

Creating a segment allocates all its memory at once (`posix_fallocate`): on a tmpfs that is
short of space, touching a page of a merely truncated file later is a SIGBUS, while a failed
allocation is an error here (`SharedMemoryFullError`, with what was needed and what is free).
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import re
import secrets
import stat
from pathlib import Path
from typing import Collection, Optional

import posix_ipc

logger = logging.getLogger(__name__)

PREFIX = "ipcring-"
SHM_DIR = Path("/dev/shm")
_NAME_RE = re.compile(r"^(?:sem\.)?" + re.escape(PREFIX) + r"(\d+)-[0-9a-f]{16}")
# What a named semaphore takes in SHM_DIR (one page on Linux), for the free-space check.
SEMAPHORE_BYTES = mmap.PAGESIZE


class SharedMemoryFullError(OSError):
    """Not enough free space in the shared-memory filesystem for a new segment.

    needed / free: bytes; where: the directory (a tmpfs, /dev/shm on Linux) that is short."""

    def __init__(
        self, needed: int, free: int, where: Path = SHM_DIR, what: str = "a shared-memory segment", hint: str = ""
    ) -> None:
        self.needed, self.free, self.where, self.what = needed, free, where, what
        self.hint = hint or f"free space in {where} (or enlarge it: mount -o remount,size=... {where}) or use a smaller capacity"
        super().__init__(errno.ENOSPC, f"{what}: {_mib(needed)} needed in {where}, {_mib(free)} free; {self.hint}")

    def with_hint(self, hint: str) -> "SharedMemoryFullError":
        """The same error with another way out suggested (the caller knows its own knobs)."""
        return type(self)(self.needed, self.free, self.where, self.what, hint)

    def __reduce__(self) -> tuple:
        return (type(self), (self.needed, self.free, self.where, self.what, self.hint))


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB ({n} bytes)"


def free_bytes(shm_dir: Path = SHM_DIR) -> Optional[int]:
    """Bytes an unprivileged process may still allocate in `shm_dir`; None where unknown."""
    try:
        st = os.statvfs(shm_dir)
    except (OSError, AttributeError):
        return None
    return st.f_bavail * st.f_frsize


def check_free_space(needed: int, what: str = "a shared-memory segment", shm_dir: Path = SHM_DIR) -> None:
    """SharedMemoryFullError if `shm_dir` has less than `needed` bytes free (where it can tell)."""
    free = free_bytes(shm_dir)
    if free is not None and free < needed:
        raise SharedMemoryFullError(needed, free, shm_dir, what)


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
            _allocate(shm.fd, size)
            return cls(name, shm, creator=True)
        except BaseException:
            shm.close_fd()
            posix_ipc.unlink_shared_memory(name)
            raise

    @classmethod
    def attach(cls, name: str) -> "Segment":
        return cls(name, posix_ipc.SharedMemory(name), creator=False)


def _allocate(fd: int, size: int) -> None:
    """Allocates every byte of the segment now, so that no later page fault can find the
    filesystem full (a SIGBUS); SharedMemoryFullError if it is."""
    if not hasattr(os, "posix_fallocate"):
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise SharedMemoryFullError(size, free_bytes() or 0) from None
        if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENODEV):  # not supported here
            raise


def unlink_quietly(unlink, name: str) -> bool:
    """Calls a posix_ipc unlink function; False if the name was already gone."""
    try:
        unlink(name)
    except posix_ipc.ExistentialError:
        return False
    return True


def sweep_stale_segments(shm_dir: Path = SHM_DIR, creators: Optional[Collection[int]] = None) -> list[str]:
    """Unlinks every ipcring segment and semaphore of ours whose creator process is dead
    (only those of the pids in `creators`, when given: a process tree known to be gone).

    Returns the POSIX names removed. What this user does not own, what is not a regular file
    (a directory, a link) and what cannot be removed is skipped and logged, never an error: an
    entry that anyone can put in the shared /dev/shm must not stop everyone's rings. Only
    Linux-style /dev/shm listings can be swept; elsewhere this returns an empty list.
    """
    try:
        entries = sorted(shm_dir.iterdir()) if shm_dir.is_dir() else []
    except OSError as exc:
        logger.warning("cannot list %s to sweep stale rings: %s", shm_dir, exc)
        return []
    removed = []
    uid = os.getuid()
    for entry in entries:
        match = _NAME_RE.match(entry.name)
        if not match or (creators is not None and int(match.group(1)) not in creators):
            continue
        if pid_alive(int(match.group(1))):
            continue
        try:
            info = entry.lstat()
        except FileNotFoundError:  # removed meanwhile
            continue
        except OSError as exc:
            logger.warning("stale ring sweep: skipping %s: %s", entry, exc)
            continue
        if not stat.S_ISREG(info.st_mode):
            logger.warning("stale ring sweep: skipping %s: not a regular file", entry)
            continue
        if info.st_uid != uid:
            logger.warning("stale ring sweep: skipping %s: owned by uid %d, not by us (uid %d)", entry, info.st_uid, uid)
            continue
        if entry.name.startswith("sem."):
            name, unlink = "/" + entry.name[4:], posix_ipc.unlink_semaphore
        else:
            name, unlink = "/" + entry.name, posix_ipc.unlink_shared_memory
        try:
            if unlink_quietly(unlink, name):
                removed.append(name)
        except (posix_ipc.Error, OSError) as exc:
            logger.warning("stale ring sweep: cannot remove %s: %s", entry, exc)
    return removed
