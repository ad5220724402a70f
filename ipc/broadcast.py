"""A single-producer, many-consumer broadcast ring in named POSIX shared memory.

One process creates the ring for `num_readers` readers (`BroadcastWriter.create`); each reader
attaches by name and its own index (`BroadcastReader.attach`). Every message the writer pushes
is read by every reader, in order. Each reader has its own cursor (`head`) on its own cache
line; the writer reuses bytes only once every reader that has not closed has moved past them,
so a slow reader holds the writer back (bounded by the capacity), never loses a message.

Layout (native-endian u64 words; a 4096-byte header, then `capacity` bytes of records):

    0     magic, version, capacity, num_readers, writer pid + start time, writer closed
    64    tail: bytes published by the writer (the writer's line)
    128   "writer sleeping" flag (set by the writer, taken by a reader that frees space)
    256 + 128 i   reader i: head, pid, start time, closed (reader i's line)
    320 + 128 i   "reader i sleeping" flag (set by reader i, taken by the writer)

Records are framed as in the SPSC ring (`ipc.layout`): an 8-byte header (u32 payload length,
u16 kind, u16 magic) and the payload padded to 8 bytes; a record never crosses the end of the
buffer (a PAD record fills the rest); a message longer than `max_payload` (a record is at most
capacity/4) travels as FIRST (u64 total, data), MIDDLE..., LAST, and ABORT drops a fragmented
message the writer gave up on (a timeout between fragments).

Memory ordering (x86-64 and aarch64), with the C helper (`_broadcast.c`):

- The writer copies the payload and writes the record header (Python, plain stores), then
  stores `tail` with release semantics (`bc_store`: ``stlr`` on aarch64, a plain store under
  x86-64's TSO) followed by a seq_cst fence. A reader loads `tail` with acquire semantics
  (``ldar``), so every byte it reads below that tail was written before it: no flag-before-data
  race, since the tail *is* the flag and it is published last. The Python copy precedes the C
  call that publishes it in the same thread's program order, and a release store orders every
  earlier access of the thread.
- A reader reads its record, then stores its `head` with release semantics; the writer loads
  every head with acquire semantics (`bc_min_head`) before it overwrites the space behind the
  lowest one, so no reader's read of a slot can see the writer's next lap.
- Sleep and wake-up (no lost notification): a waiter stores its sleeping flag, runs a seq_cst
  fence (inside `bc_store`) and looks at the condition again; a publisher stores its counter,
  runs a seq_cst fence, and takes the flag (`bc_take`, an atomic exchange), posting the
  waiter's semaphore if it was set. With a full fence between each side's store and its load,
  at least one side sees the other's store (Dekker): either the waiter sees the new counter
  and does not sleep, or the publisher sees the flag and posts. The exchange makes at most one
  post per sleep.

Without a C compiler the same happens in Python with POSIX semaphore operations as full fences
(the argument of `ipc._pyops`).

Waiting: a bounded spin (`spin_us`, GIL released, yielding the CPU), then sleep on the
waiter's named semaphore, waking every `poll_interval` to check that the other side lives (pid
and start time, as in the SPSC ring): a reader raises PeerDeadError when the writer died, or
PeerClosedError once the closed writer's messages are all read; the writer raises
PeerDeadError naming the reader that died while it holds the writer back. An idle side burns
no CPU: it sleeps on a semaphore, waking `1 / poll_interval` times a second.

Cleanup: the writer (the creator) unlinks the segment and its semaphores on close, or when
garbage-collected; what a kill -9 leaves carries the writer's pid in its name
(``/ipcring-<pid>-...``), which `ipc.sweep_stale_segments` removes once that pid is dead.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import struct
import subprocess
import sys
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

import posix_ipc

from ipc import _native
from ipc.ring import PeerClosedError, PeerDeadError, RingClosedError, RingCorruptedError, RingError
from ipc.segment import (
    SEMAPHORE_BYTES,
    Segment,
    check_free_space,
    new_name,
    pid_alive,
    process_start_time,
    unlink_quietly,
)
from ipc.wait import Doorbell, RingTimeoutError, check_wait_params

T = TypeVar("T")

MAGIC = int.from_bytes(b"IPCBCST1", "little")
VERSION = 1
HEADER_SIZE = 4096
DATA = HEADER_SIZE
OFF_MAGIC, OFF_VERSION, OFF_CAPACITY, OFF_NUM_READERS = 0, 8, 16, 24
OFF_WRITER_PID, OFF_WRITER_START, OFF_WRITER_CLOSED = 32, 40, 48
OFF_TAIL = 64
OFF_W_SLEEPING = 128
OFF_READERS = 256
READER_STRIDE = 128
R_HEAD, R_PID, R_START, R_CLOSED, R_SLEEPING = 0, 8, 16, 24, 64
MAX_READERS = (HEADER_SIZE - OFF_READERS) // READER_STRIDE
MIN_CAPACITY = 256
MAX_CAPACITY = 1 << 30

KIND_MSG, KIND_FIRST, KIND_MIDDLE, KIND_LAST, KIND_ABORT, KIND_PAD = 1, 2, 3, 4, 5, 6
RECORD_MAGIC = 0x5B1F
_HEADER = struct.Struct("=IHH")
_U64 = struct.Struct("=Q")

DEFAULT_SPIN_US = 200.0
SOURCE = Path(__file__).with_name("_broadcast.c")


def _reader_off(index: int, field: int) -> int:
    return OFF_READERS + index * READER_STRIDE + field


def _align8(n: int) -> int:
    return (n + 7) & ~7


# ---------------------------------------------------------------- the atomics, two ways


class _NativeOps:
    """`_broadcast.c` with the segment's base address bound."""

    def __init__(self, libs: tuple[ctypes.CDLL, ctypes.CDLL], anchor: ctypes.Array) -> None:
        fast, nogil = libs
        base = ctypes.c_void_p(ctypes.addressof(anchor))
        self.load = functools.partial(fast.bc_load, base)
        self.store = functools.partial(fast.bc_store, base)
        self.take = functools.partial(fast.bc_take, base)
        self.min_head = functools.partial(fast.bc_min_head, base)
        self.spin_data = functools.partial(nogil.bc_spin_data, base)
        self.spin_space = functools.partial(nogil.bc_spin_space, base)


class _PythonOps:
    """The same operations without a C compiler: POSIX semaphore calls as full fences (see
    `ipc._pyops`), counters as aligned 8-byte items of a memoryview (single-copy atomic)."""

    def __init__(self, buf: memoryview) -> None:
        self._words = buf[:HEADER_SIZE].cast("Q")
        self._fence_sem = posix_ipc.Semaphore(new_name() + "-f", posix_ipc.O_CREX, mode=0o600, initial_value=0)
        self._fence_sem.unlink()

    def _fence(self) -> None:
        self._fence_sem.release()
        self._fence_sem.acquire(0)

    def load(self, off: int) -> int:
        value = self._words[off >> 3]
        self._fence()
        return value

    def store(self, off: int, value: int) -> None:
        self._fence()
        self._words[off >> 3] = value
        self._fence()

    def take(self, off: int) -> int:
        self._fence()
        if not self._words[off >> 3]:
            return 0
        self._words[off >> 3] = 0  # a racing re-arm lost here costs one extra wake-up, never a lost one
        self._fence()
        return 1

    def min_head(self, n: int) -> int:
        heads = [self.load(_reader_off(i, R_HEAD)) for i in range(n) if not self.load(_reader_off(i, R_CLOSED))]
        return min(heads, default=(1 << 64) - 1)

    def spin_data(self, head: int, ns: int) -> int:
        return self._spin(ns, lambda: self.load(OFF_TAIL) != head)

    def spin_space(self, need: int, n: int, ns: int) -> int:
        return self._spin(ns, lambda: self.min_head(n) >= need)

    @staticmethod
    def _spin(ns: int, ready: Callable[[], bool]) -> int:
        deadline = time.perf_counter_ns() + ns
        while not ready():
            if time.perf_counter_ns() >= deadline:
                return int(ready())
            time.sleep(0)
        return 1


@functools.lru_cache(maxsize=1)
def native_libs() -> Optional[tuple[ctypes.CDLL, ctypes.CDLL]]:
    """(GIL-keeping, GIL-releasing) handles of the compiled helper; None without a compiler
    (or with IPC_PURE_PYTHON=1). Cached like the SPSC ring's helper (see `ipc._native`)."""
    if os.environ.get("IPC_PURE_PYTHON") == "1":
        return None
    cc = _native.find_compiler()
    if cc is None:
        return None
    flags = ["-O2", "-shared", "-fPIC", "-std=gnu11"]
    key = hashlib.sha256(SOURCE.read_bytes() + cc.encode() + " ".join(flags).encode()).hexdigest()[:16]
    filename = f"ipc_broadcast-{key}-{platform.machine()}-{sys.implementation.cache_tag}.so"
    for base in _native._cache_dirs():
        try:
            target = _native.private_dir(base) / filename
            if not target.exists():
                _native.build(cc, flags, target, SOURCE)
            libs = ctypes.PyDLL(str(target)), ctypes.CDLL(str(target))
        except subprocess.CalledProcessError:
            return None
        except (OSError, subprocess.SubprocessError):
            continue
        i64, u64, ptr = ctypes.c_int64, ctypes.c_uint64, ctypes.c_void_p
        for lib in libs:
            for name, restype, argtypes in (
                ("bc_load", u64, [ptr, i64]),
                ("bc_store", None, [ptr, i64, u64]),
                ("bc_take", ctypes.c_int, [ptr, i64]),
                ("bc_min_head", u64, [ptr, i64]),
                ("bc_spin_data", ctypes.c_int, [ptr, u64, i64]),
                ("bc_spin_space", ctypes.c_int, [ptr, u64, i64, i64]),
                ("bc_spin_all_ge", ctypes.c_int, [ptr, i64, i64, i64, u64, i64]),
            ):
                fn = getattr(lib, name)
                fn.restype, fn.argtypes = restype, argtypes
        return libs
    return None


def broadcast_native_available() -> bool:
    """Whether broadcast rings use the C helper (True) or the pure-Python fallback."""
    return native_libs() is not None


def _deadline(timeout: Optional[float]) -> Optional[float]:
    if timeout is None:
        return None
    if timeout < 0:
        raise ValueError(f"timeout must be >= 0 or None, got {timeout}")
    return time.monotonic() + timeout


def _unlink_broadcast(name: str, num_readers: int, creator_pid: int) -> None:
    if os.getpid() != creator_pid:
        return
    unlink_quietly(posix_ipc.unlink_shared_memory, name)
    for suffix in ["-w", *(f"-r{i}" for i in range(num_readers))]:
        unlink_quietly(posix_ipc.unlink_semaphore, name + suffix)


class _Side:
    """What the writer and a reader share: the mapping, the ops, closing."""

    def __init__(self, segment: Segment, spin_us: float, poll_interval: float, pure_python: bool) -> None:
        check_wait_params(spin_us, 0.0, poll_interval)
        self._segment = segment
        self._mv = memoryview(segment.buf)
        self.name = segment.name
        libs = None if pure_python else native_libs()
        if libs is not None:
            self._anchor = (ctypes.c_char * segment.size).from_buffer(segment.buf)
            self._ops: Any = _NativeOps(libs, self._anchor)
        else:
            self._ops = _PythonOps(self._mv)
        self.native = libs is not None
        self._spin_ns = int(spin_us * 1000)
        self.poll_interval = poll_interval
        self._pid = os.getpid()
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise RingClosedError(f"broadcast ring {self.name} is closed")

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError


class BroadcastWriter(_Side):
    """The producing end (the creator). Not thread-safe: one writer thread."""

    def __init__(self, segment: Segment, num_readers: int, **kwargs: Any) -> None:
        super().__init__(segment, **kwargs)
        self.num_readers = num_readers
        self._finalizer: Optional[weakref.finalize] = None
        self._send_abort = False

    @classmethod
    def create(
        cls,
        num_readers: int,
        capacity: int = 1 << 22,
        *,
        spin_us: float = DEFAULT_SPIN_US,
        poll_interval: float = 0.1,
        pure_python: bool = False,
    ) -> "BroadcastWriter":
        """A new ring of `capacity` bytes (a multiple of 8, 256 B .. 1 GiB) for `num_readers`
        readers (1 .. MAX_READERS), owned by this process."""
        if not isinstance(num_readers, int) or not 1 <= num_readers <= MAX_READERS:
            raise ValueError(f"num_readers must be an int in [1, {MAX_READERS}], got {num_readers!r}")
        if not isinstance(capacity, int) or capacity % 8 or not MIN_CAPACITY <= capacity <= MAX_CAPACITY:
            raise ValueError(f"capacity must be a multiple of 8 in [{MIN_CAPACITY}, {MAX_CAPACITY}], got {capacity!r}")
        check_wait_params(spin_us, 0.0, poll_interval)
        check_free_space(HEADER_SIZE + capacity + (num_readers + 1) * SEMAPHORE_BYTES, f"a broadcast ring of capacity {capacity}")
        segment = Segment.create(HEADER_SIZE + capacity)
        finalizer = weakref.finalize(segment, _unlink_broadcast, segment.name, num_readers, os.getpid())
        try:
            writer = cls(segment, num_readers, spin_us=spin_us, poll_interval=poll_interval, pure_python=pure_python)
            writer._finalizer = finalizer
            store, pid = writer._ops.store, os.getpid()
            store(OFF_VERSION, VERSION)
            store(OFF_CAPACITY, capacity)
            store(OFF_NUM_READERS, num_readers)
            store(OFF_WRITER_START, process_start_time(pid))
            store(OFF_WRITER_PID, pid)
            writer._space_bell = Doorbell.create(segment.name + "-w")
            writer._reader_bells = [Doorbell.create(f"{segment.name}-r{i}") for i in range(num_readers)]
            store(OFF_MAGIC, MAGIC)
        except BaseException:
            finalizer()
            raise
        writer.capacity = capacity
        writer.max_payload = (capacity // 4 & ~7) - 8
        return writer

    # ---------------------------------------------------------------- pushing

    def push(self, data: "bytes | bytearray | memoryview", timeout: Optional[float] = None) -> None:
        """Appends one message (any size) for every reader; blocks while the slowest open
        reader has not released enough space.

        Raises RingTimeoutError (nothing of this message was delivered), PeerDeadError (a
        reader that holds the writer back died), or ValueError once closed.
        """
        self._check_open()
        deadline = _deadline(timeout)
        if self._send_abort:
            self._put(b"", KIND_ABORT, deadline)
            self._send_abort = False
        with memoryview(data) as raw, raw.cast("B") as view:
            if len(view) <= self.max_payload:
                self._put(view, KIND_MSG, deadline)
                return
            total, step = len(view), self.max_payload
            first = step - 8
            self._put(view[:first], KIND_FIRST, deadline, total=total)
            try:
                for start in range(first, total, step):
                    end = min(start + step, total)
                    self._put(view[start:end], KIND_LAST if end == total else KIND_MIDDLE, deadline)
            except BaseException:
                self._send_abort = True  # the readers hold a partial message: drop it before the next one
                raise

    def _put(self, view: "bytes | memoryview", kind: int, deadline: Optional[float], total: int = -1) -> None:
        ops, cap = self._ops, self.capacity
        n = len(view) + (8 if total >= 0 else 0)
        rec = _align8(8 + n)
        tail = ops.load(OFF_TAIL)
        pos = tail % cap
        room = cap - pos
        span = rec if rec <= room else room + rec
        need = tail + span - cap
        if need > 0 and ops.min_head(self.num_readers) < need:
            self._wait_space(need, deadline)
        mv = self._mv
        if rec > room:
            _HEADER.pack_into(mv, DATA + pos, room - 8, KIND_PAD, RECORD_MAGIC)
            pos = 0
        off = DATA + pos
        _HEADER.pack_into(mv, off, n, kind, RECORD_MAGIC)
        if total >= 0:
            _U64.pack_into(mv, off + 8, total)
            mv[off + 16 : off + 16 + len(view)] = view
        else:
            mv[off + 8 : off + 8 + n] = view
        ops.store(OFF_TAIL, tail + span)  # release: the record before the tail that publishes it
        take = ops.take
        for i, bell in enumerate(self._reader_bells):
            if take(_reader_off(i, R_SLEEPING)):
                bell.ring()

    def _wait_space(self, need: int, deadline: Optional[float]) -> None:
        ops, n = self._ops, self.num_readers
        spin = self._spin_ns
        if deadline is not None:
            spin = min(spin, int((deadline - time.monotonic()) * 1e9))
        if spin > 0 and ops.spin_space(need, n, spin):
            return
        while True:
            ops.store(OFF_W_SLEEPING, 1)
            if ops.min_head(n) >= need:
                ops.store(OFF_W_SLEEPING, 0)
                return
            self._check_readers(need)
            step = self.poll_interval
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    ops.store(OFF_W_SLEEPING, 0)
                    raise RingTimeoutError(f"timed out waiting for the readers of broadcast ring {self.name}")
                step = min(step, remaining)
            try:
                self._space_bell.wait(step)
            finally:
                ops.store(OFF_W_SLEEPING, 0)

    def _check_readers(self, need: int) -> None:
        """PeerDeadError if a reader still holding bytes below `need` is dead."""
        load = self._ops.load
        for i in range(self.num_readers):
            if load(_reader_off(i, R_CLOSED)) or load(_reader_off(i, R_HEAD)) >= need:
                continue
            pid = load(_reader_off(i, R_PID))
            if pid and not pid_alive(pid, load(_reader_off(i, R_START))):
                if self._ops.min_head(self.num_readers) >= need:
                    return  # it released what we wait for before it died
                raise PeerDeadError(f"reader {i} (pid {pid}) of broadcast ring {self.name} died")

    # ---------------------------------------------------------------- state and closing

    def reader_pids(self) -> list[int]:
        """Each reader's pid (0: not attached yet)."""
        return [self._ops.load(_reader_off(i, R_PID)) for i in range(self.num_readers)]

    def close(self) -> None:
        """Marks the ring closed (readers raise PeerClosedError once they have read everything),
        wakes every reader, and unlinks the segment and its semaphores."""
        if self._closed:
            return
        self._closed = True
        if os.getpid() != self._pid:
            return
        self._ops.store(OFF_WRITER_CLOSED, 1)
        for bell in self._reader_bells:
            bell.ring()
        if self._finalizer is not None:
            self._finalizer()

    def __reduce__(self):
        raise TypeError("a BroadcastWriter cannot be pickled: readers attach by name and index")

    def __repr__(self) -> str:
        return f"BroadcastWriter({self.name!r}, readers={self.num_readers}, capacity={self.capacity}, native={self.native})"


class BroadcastReader(_Side):
    """Reader `index` of a broadcast ring. Not thread-safe: one reading thread."""

    def __init__(self, segment: Segment, index: int, **kwargs: Any) -> None:
        super().__init__(segment, **kwargs)
        self.index = index
        self._partial: Optional[bytearray] = None
        self._partial_total = 0

    @classmethod
    def attach(
        cls,
        name: str,
        index: int,
        *,
        spin_us: float = DEFAULT_SPIN_US,
        poll_interval: float = 0.1,
        pure_python: bool = False,
    ) -> "BroadcastReader":
        """Attaches as reader `index` (0-based) of the ring `name`; reads from the first message."""
        try:
            segment = Segment.attach(name)
        except posix_ipc.ExistentialError:
            raise FileNotFoundError(f"no broadcast ring named {name!r} (its writer may have closed it)") from None
        reader = cls(segment, index, spin_us=spin_us, poll_interval=poll_interval, pure_python=pure_python)
        load = reader._ops.load
        if load(OFF_MAGIC) != MAGIC or load(OFF_VERSION) != VERSION:
            raise RingCorruptedError(f"{name} is not a broadcast ring of version {VERSION}")
        capacity, num = load(OFF_CAPACITY), load(OFF_NUM_READERS)
        if capacity + HEADER_SIZE > segment.size or capacity < MIN_CAPACITY or capacity % 8 or not 1 <= num <= MAX_READERS:
            raise RingCorruptedError(f"{name} claims capacity {capacity} and {num} readers in a {segment.size}-byte segment")
        if not isinstance(index, int) or not 0 <= index < num:
            raise ValueError(f"index must be an int in [0, {num}) for broadcast ring {name}, got {index!r}")
        taken = load(_reader_off(index, R_PID))
        if taken and taken != os.getpid() and pid_alive(taken, load(_reader_off(index, R_START))):
            raise ValueError(f"reader {index} of broadcast ring {name} is taken by pid {taken}")
        try:
            reader._data_bell = Doorbell.attach(f"{name}-r{index}")
            reader._space_bell = Doorbell.attach(name + "-w")
        except posix_ipc.ExistentialError:
            raise FileNotFoundError(f"the semaphores of broadcast ring {name!r} are gone") from None
        reader.capacity, reader.num_readers = capacity, num
        reader.max_payload = (capacity // 4 & ~7) - 8
        pid = os.getpid()
        reader._ops.store(_reader_off(index, R_START), process_start_time(pid))
        reader._ops.store(_reader_off(index, R_PID), pid)
        reader._head = load(_reader_off(index, R_HEAD))
        return reader

    # ---------------------------------------------------------------- reading

    def pop(self, timeout: Optional[float] = None) -> bytes:
        """The next message; blocks while there is none. Raises RingTimeoutError,
        PeerDeadError (the writer died), PeerClosedError (the writer closed and everything it
        pushed was read), or RingCorruptedError on a malformed record."""
        return self.consume(bytes, timeout)

    def consume(self, fn: Callable[[memoryview], T], timeout: Optional[float] = None) -> T:
        """Calls `fn` on the next message, in place in the ring's memory when it came whole,
        then releases it. `fn` must not keep the view. The message is consumed even if `fn` raises."""
        self._check_open()
        deadline = _deadline(timeout)
        while True:
            kind, off, n = self._next_record(deadline)
            if kind == KIND_MSG:
                if self._partial is not None:
                    raise self._corrupted("a whole message inside a fragmented one")
                view = self._mv[off : off + n]
                try:
                    return fn(view)
                finally:
                    view.release()
                    self._release()
            message = self._take_fragment(kind, off, n)
            self._release()
            if message is not None:
                with memoryview(message) as view:
                    return fn(view)

    def _next_record(self, deadline: Optional[float]) -> tuple[int, int, int]:
        """(kind, payload offset, payload length) of the record at our head, skipping padding."""
        ops, cap = self._ops, self.capacity
        head = self._head
        tail = ops.load(OFF_TAIL)  # acquire: the records before the tail that published them
        if tail == head:
            self._wait_data(deadline)
            tail = ops.load(OFF_TAIL)
        if tail < head or tail - head > cap or head & 7:
            raise self._corrupted(f"counters out of range (head {head}, tail {tail})")
        pos = head % cap
        length, kind, magic = _HEADER.unpack_from(self._mv, DATA + pos)
        if magic != RECORD_MAGIC:
            raise self._corrupted(f"bad record magic {magic:#x} at {pos}")
        if kind == KIND_PAD:
            if pos + 8 + length != cap or tail - head <= cap - pos:
                raise self._corrupted(f"bad padding record at {pos}")
            self._pending = head + cap - pos
            head, pos = self._pending, 0
            length, kind, magic = _HEADER.unpack_from(self._mv, DATA)
            if magic != RECORD_MAGIC:
                raise self._corrupted(f"bad record magic {magic:#x} at 0")
        rec = _align8(8 + length)
        if not KIND_MSG <= kind <= KIND_ABORT or rec > cap // 4 or pos + rec > cap or head + rec > tail:
            raise self._corrupted(f"bad record (kind {kind}, length {length}) at {pos}")
        self._pending = head + rec
        return kind, DATA + pos + 8, length

    def _release(self) -> None:
        self._head = self._pending
        self._ops.store(_reader_off(self.index, R_HEAD), self._head)  # release: our reads before the head
        if self._ops.take(OFF_W_SLEEPING):
            self._space_bell.ring()

    def _wait_data(self, deadline: Optional[float]) -> None:
        ops, head = self._ops, self._head
        flag = _reader_off(self.index, R_SLEEPING)
        spin = self._spin_ns
        if deadline is not None:
            spin = min(spin, int((deadline - time.monotonic()) * 1e9))
        if spin > 0 and ops.spin_data(head, spin):
            return
        slept = False
        while True:
            ops.store(flag, 1)
            if ops.load(OFF_TAIL) != head:
                ops.store(flag, 0)
                return
            if slept:
                try:
                    self._check_writer()
                except BaseException:
                    ops.store(flag, 0)
                    if ops.load(OFF_TAIL) != head:  # its last message landed before it went
                        return
                    raise
            step = self.poll_interval
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    ops.store(flag, 0)
                    raise RingTimeoutError(f"timed out waiting on broadcast ring {self.name}")
                step = min(step, remaining)
            try:
                self._data_bell.wait(step)
            finally:
                ops.store(flag, 0)
            slept = True

    def _check_writer(self) -> None:
        load = self._ops.load
        if load(OFF_WRITER_CLOSED):
            raise PeerClosedError(f"the writer closed broadcast ring {self.name}")
        pid = load(OFF_WRITER_PID)
        if pid and pid != os.getpid() and not pid_alive(pid, load(OFF_WRITER_START)):
            raise PeerDeadError(f"writer process {pid} of broadcast ring {self.name} died")

    def _take_fragment(self, kind: int, off: int, n: int) -> Optional[bytearray]:
        partial = self._partial
        if kind == KIND_FIRST:
            total = _U64.unpack_from(self._mv, off)[0] if n >= 8 else -1
            if partial is not None or total <= self.max_payload or total < n - 8:
                raise self._corrupted(f"bad first fragment (total {total})")
            self._partial, self._partial_total = bytearray(self._mv[off + 8 : off + n]), total
            return None
        if partial is None:
            if kind == KIND_ABORT:
                return None
            raise self._corrupted(f"fragment of kind {kind} outside a fragmented message")
        if kind == KIND_ABORT:
            self._partial = None
            return None
        partial += self._mv[off : off + n]
        if len(partial) > self._partial_total or (kind == KIND_LAST and len(partial) != self._partial_total):
            raise self._corrupted(f"fragments add up to {len(partial)} bytes, not {self._partial_total}")
        if kind == KIND_MIDDLE:
            return None
        self._partial = None
        return partial

    def _corrupted(self, problem: str) -> RingCorruptedError:
        self._partial = None
        return RingCorruptedError(f"broadcast ring {self.name}, reader {self.index}: {problem}")

    # ---------------------------------------------------------------- closing

    def close(self) -> None:
        """Leaves the ring: the writer no longer waits for this reader."""
        if self._closed:
            return
        self._closed = True
        if os.getpid() != self._pid:
            return
        self._ops.store(_reader_off(self.index, R_CLOSED), 1)
        if self._ops.take(OFF_W_SLEEPING):
            self._space_bell.ring()

    def __repr__(self) -> str:
        return f"BroadcastReader({self.name!r}, index={self.index}, native={self.native})"


__all__ = [
    "BroadcastReader",
    "BroadcastWriter",
    "MAX_READERS",
    "PeerClosedError",
    "PeerDeadError",
    "RingError",
    "RingTimeoutError",
    "broadcast_native_available",
]
