"""A rendezvous arena in named POSIX shared memory: n participants, one data slot each (two,
alternating), and a sequence word each, for collectives between processes (an all-reduce:
everyone writes its slot, publishes, waits for all, reads all slots).

Layout (native-endian u64 words): a 4096-byte header, then the slots.

    0     magic, version, participants, slot bytes, creator pid + start time
    256 + 128 i   participant i: seq (the last round it published), pid, start time
    4096 + (parity * n + i) * slot_bytes   participant i's slot for rounds of that parity

Round k: each participant writes its slot of parity k % 2, then stores seq = k (release, then a
seq_cst fence: `_broadcast.c`'s `bc_store`), then waits until every seq >= k (acquire loads:
`bc_spin_all_ge`), then reads the slots of parity k % 2. Reuse is safe with two parities: a
participant writes round k + 2's slot only after it saw everyone publish round k + 1, which each
of them did only after reading round k's slots.

Waiting: a spin (GIL released, yielding the CPU), then naps that grow from 20 µs to 1 ms, each
followed by another look; every `poll_interval` of waiting, the participants that have not
published are checked (pid and start time): a dead one is PeerDeadError. Rounds happen only
inside a step, when every participant is expected within moments, so the nap phase never meets
an idle engine. Needs the C helper (`arena_available()`); callers keep a portable fallback.

The creator unlinks the segment on close (or when garbage-collected); a kill -9 leaves a
``/ipcring-<creator pid>-...`` name that `ipc.sweep_stale_segments` removes.
"""

from __future__ import annotations

import ctypes
import functools
import os
import time
import weakref
from typing import Optional

import posix_ipc

from ipc.broadcast import native_libs
from ipc.ring import PeerDeadError, RingCorruptedError
from ipc.segment import Segment, check_free_space, pid_alive, process_start_time, unlink_quietly
from ipc.wait import RingTimeoutError

MAGIC = int.from_bytes(b"IPCARNA1", "little")
VERSION = 1
HEADER_SIZE = 4096
OFF_PARTICIPANTS, OFF_SLOT_BYTES, OFF_CREATOR_PID, OFF_CREATOR_START = 16, 24, 32, 40
OFF_SEATS = 256
SEAT_STRIDE = 128
S_SEQ, S_PID, S_START = 0, 8, 16
MAX_PARTICIPANTS = (HEADER_SIZE - OFF_SEATS) // SEAT_STRIDE
SPIN_US = 100.0
NAP_FIRST_S, NAP_MAX_S = 20e-6, 1e-3


def arena_available() -> bool:
    return native_libs() is not None


def _unlink(name: str, creator_pid: int) -> None:
    if os.getpid() == creator_pid:
        unlink_quietly(posix_ipc.unlink_shared_memory, name)


class Arena:
    """Participant `index`'s view of an arena. One thread per participant."""

    def __init__(self, segment: Segment, index: int, poll_interval: float) -> None:
        libs = native_libs()
        if libs is None:
            raise RuntimeError("the arena needs the C helper (ipc/_broadcast.c), which could not be built")
        fast, nogil = libs
        self._segment = segment
        self._anchor = (ctypes.c_char * segment.size).from_buffer(segment.buf)
        base = ctypes.c_void_p(ctypes.addressof(self._anchor))
        self._load = functools.partial(fast.bc_load, base)
        self._store = functools.partial(fast.bc_store, base)
        self._spin = functools.partial(nogil.bc_spin_all_ge, base)
        self.name, self.index, self.poll_interval = segment.name, index, poll_interval
        self._finalizer: Optional[weakref.finalize] = None
        self._closed = False

    @classmethod
    def create(cls, participants: int, slot_bytes: int, poll_interval: float = 0.1, seated: bool = True) -> "Arena":
        """A new arena; this process is participant 0, or (seated=False) only its owner, seat
        0 left to the first process that attaches as index 0."""
        if not isinstance(participants, int) or not 1 <= participants <= MAX_PARTICIPANTS:
            raise ValueError(f"participants must be an int in [1, {MAX_PARTICIPANTS}], got {participants!r}")
        if not isinstance(slot_bytes, int) or slot_bytes < 8 or slot_bytes % 64:
            raise ValueError(f"slot_bytes must be a positive multiple of 64, got {slot_bytes!r}")
        size = HEADER_SIZE + 2 * participants * slot_bytes
        check_free_space(size, f"an arena of {participants} x 2 slots of {slot_bytes} bytes")
        segment = Segment.create(size)
        finalizer = weakref.finalize(segment, _unlink, segment.name, os.getpid())
        try:
            arena = cls(segment, 0, poll_interval)
            arena._finalizer = finalizer
            pid = os.getpid()
            arena._store(8, VERSION)
            arena._store(OFF_PARTICIPANTS, participants)
            arena._store(OFF_SLOT_BYTES, slot_bytes)
            arena._store(OFF_CREATOR_START, process_start_time(pid))
            arena._store(OFF_CREATOR_PID, pid)
            if seated:
                arena._take_seat()
            arena.participants, arena.slot_bytes = participants, slot_bytes
            arena._store(0, MAGIC)
        except BaseException:
            finalizer()
            raise
        return arena

    @classmethod
    def attach(cls, name: str, index: int, poll_interval: float = 0.1) -> "Arena":
        try:
            segment = Segment.attach(name)
        except posix_ipc.ExistentialError:
            raise FileNotFoundError(f"no arena named {name!r}") from None
        arena = cls(segment, index, poll_interval)
        if arena._load(0) != MAGIC or arena._load(8) != VERSION:
            raise RingCorruptedError(f"{name} is not an arena of version {VERSION}")
        n, slot = arena._load(OFF_PARTICIPANTS), arena._load(OFF_SLOT_BYTES)
        if HEADER_SIZE + 2 * n * slot > segment.size:
            raise RingCorruptedError(f"{name} claims {n} x 2 slots of {slot} bytes in {segment.size} bytes")
        first = 1 if arena._load(OFF_SEATS + S_PID) else 0  # seat 0 is free in an arena created unseated
        if not isinstance(index, int) or not first <= index < n:
            raise ValueError(f"index must be an int in [{first}, {n}) for arena {name}, got {index!r}")
        arena._take_seat()
        return arena

    def _take_seat(self) -> None:
        self.participants = self._load(OFF_PARTICIPANTS)
        self.slot_bytes = self._load(OFF_SLOT_BYTES)
        seat = OFF_SEATS + self.index * SEAT_STRIDE
        pid = os.getpid()
        self._store(seat + S_START, process_start_time(pid))
        self._store(seat + S_PID, pid)

    def slot(self, parity: int, index: int) -> memoryview:
        """Participant `index`'s slot for rounds of this parity (0 or 1)."""
        start = HEADER_SIZE + (parity * self.participants + index) * self.slot_bytes
        return memoryview(self._segment.buf)[start : start + self.slot_bytes]

    def publish(self, seq: int) -> None:
        """Round `seq`'s slot is written (release: the slot's bytes before the word)."""
        self._store(OFF_SEATS + self.index * SEAT_STRIDE + S_SEQ, seq)

    def wait_all(self, seq: int, timeout: Optional[float] = None) -> None:
        """Returns once every participant published round `seq` (acquire: their slots are
        readable); PeerDeadError if one that has not died; RingTimeoutError at the timeout."""
        n = self.participants
        if self._spin(OFF_SEATS + S_SEQ, SEAT_STRIDE, n, seq, int(SPIN_US * 1000)):
            return
        started = time.monotonic()
        look_at = started + self.poll_interval
        nap = NAP_FIRST_S
        while True:
            time.sleep(nap)
            nap = min(nap * 2, NAP_MAX_S)
            if self._spin(OFF_SEATS + S_SEQ, SEAT_STRIDE, n, seq, 0):
                return
            now = time.monotonic()
            if now >= look_at:
                self._check_participants(seq)
                look_at = now + self.poll_interval
            if timeout is not None and now - started > timeout:
                raise RingTimeoutError(f"arena {self.name}: round {seq} not complete after {timeout} s")

    def _check_participants(self, seq: int) -> None:
        for i in range(self.participants):
            seat = OFF_SEATS + i * SEAT_STRIDE
            if self._load(seat + S_SEQ) >= seq:
                continue
            pid = self._load(seat + S_PID)
            if pid and not pid_alive(pid, self._load(seat + S_START)):
                raise PeerDeadError(f"participant {i} (pid {pid}) of arena {self.name} died")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._finalizer is not None:
            self._finalizer()
