"""A single-producer/single-consumer byte ring in named POSIX shared memory.

One process creates the ring (`RingBuffer.create`), another attaches by name
(`RingBuffer.attach`); one side pushes, the other pops. Layout: see `ipc.layout`.

Memory ordering — what makes a popped message complete on x86-64 *and* aarch64:

- With the C helper (`_native.c`, built at first import): the producer copies the payload and
  writes the record header, then stores `tail` with release semantics
  (``__atomic_store_n(..., __ATOMIC_RELEASE)``: ``stlr`` on aarch64, a plain store on x86-64,
  whose TSO already keeps stores in order). The consumer loads `tail` with acquire semantics
  (``ldar``), so every byte it then reads was written before that tail; it reads the record,
  then stores `head` with release semantics, so the producer (which loads `head` with acquire)
  overwrites the space only after the consumer has finished reading it. The payload copy done
  by Python (a memoryview slice assignment) happens before the C call that publishes it, in
  program order of the same thread, and the release store orders all earlier accesses.
- The sleep/wake handshake needs a store-load fence on both architectures (x86-64 reorders a
  store with a later load): the C helper runs ``__atomic_thread_fence(__ATOMIC_SEQ_CST)``
  (``mfence``/``lock``-prefixed op; ``dmb ish``) between publishing a counter and reading the
  peer's "sleeping" flag, and between setting the flag and re-reading the peer's counter.
- Without a C compiler, `_pyops.PythonOps` does the same with POSIX semaphore operations as
  full fences (see that module for the argument).
- How a sleeping side is woken (a futex on its flag word, or a named semaphore) and why no
  wake-up is lost: see `ipc.wait` and `ring_sleep` in `_native.c`.

Pure-Python stores to shared memory alone would be enough on x86-64 but not on aarch64, which
is why the Python paths never publish a counter themselves.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import sys
import struct
import time
import weakref
from typing import Any, Callable, Optional, TypeVar

import posix_ipc

from ipc import _native
from ipc import layout as L
from ipc._pyops import PythonOps
from ipc.segment import SEMAPHORE_BYTES, Segment, check_free_space, pid_alive, process_start_time, unlink_quietly
from ipc.wait import (
    Doorbell,
    RingTimeoutError,
    Waiter,
    check_wait_params,
    futex_supported,
    futex_wake_py,
    semaphore_sleep,
)

T = TypeVar("T")

_U64 = struct.Struct("=Q")
_MASK = L.PEEK_FIELD_MASK
_MSG = L.KIND_MSG
_TAIL_WORD, _HEAD_WORD = L.OFF_TAIL // 8, L.OFF_HEAD // 8
_PENDING_WORD = L.OFF_P_PENDING // 8
# In place of a partial message while the consumer holds a view from pop_view: every whole-message
# fast path tests `_partial is None`, so they all go to the slow path, which refuses (LoanError).
_LOANED = bytearray()
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23 if sys.platform == "linux" else None)  # Linux >= 5.14
# Long enough to cover a peer that answers within a couple of hundred µs (a wake-up on this
# kind of machine costs 10-30 µs, a cold msgspec decode about as much); cheap because the spin
# yields the CPU every ~2 µs (sched_yield) and releases the GIL.
DEFAULT_SPIN_US = 200.0
# (pid, start time, closed flag) offsets of a side, keyed by "is the creator".
_SIDES = {
    True: (L.OFF_CREATOR_PID, L.OFF_CREATOR_START, L.OFF_CREATOR_CLOSED),
    False: (L.OFF_ATTACHER_PID, L.OFF_ATTACHER_START, L.OFF_ATTACHER_CLOSED),
}


class RingError(Exception):
    """Base class of the ring's own errors."""


class RingCorruptedError(RingError):
    """The ring's memory holds something no correct peer writes (a malformed frame)."""


class PeerGoneError(RingError):
    """Waiting is hopeless: the other side is gone."""


class PeerDeadError(PeerGoneError):
    """The peer process died (or became a zombie) without closing the ring."""


class PeerClosedError(PeerGoneError):
    """The peer closed its end of the ring (after everything it pushed was popped)."""


class LoanError(RingError, RuntimeError):
    """A loan used out of turn: a second `reserve` before `commit`, a `pop_view` before the
    previous view's `release`, another push or pop while one is out, a commit or release of
    nothing."""


class RingClosedError(RingError, ValueError):
    """This end of the ring is closed (a ValueError, like I/O on a closed file)."""


@functools.lru_cache(maxsize=1)
def _native_lib() -> Optional[_native.NativeLib]:
    return _native.load()


def native_available() -> bool:
    """Whether rings use the C helper (True) or the pure-Python fallback (False)."""
    return _native_lib() is not None


class _NativeOps:
    """The C helper's functions with the segment's base address bound (see `_pyops.PythonOps`)."""

    def __init__(self, lib: _native.NativeLib, anchor: ctypes.Array) -> None:
        base = ctypes.c_void_p(ctypes.addressof(anchor))
        fast, nogil = lib.fast, lib.nogil
        for name in ("push", "reserve", "commit", "peek", "release", "arm_consumer", "disarm", "load", "store", "wake_sleeper"):
            setattr(self, name, functools.partial(getattr(fast, "ipc_" + name), base))
        self.arm_producer = functools.partial(fast.ipc_arm_producer, base)
        for name in ("spin_consumer", "spin_producer", "nap_consumer", "nap_producer", "sleep_consumer", "sleep_producer"):
            setattr(self, name, functools.partial(getattr(nogil, "ipc_" + name), base))
        self.take = self.take_many = self.push_many = None  # extension only
        self.ext, self.base = lib.ext, base.value
        if lib.ext is not None:  # the hot path without ctypes (see _native.py)
            names = ("push", "reserve", "commit", "peek", "release", "take", "take_many", "push_many")
            for name in names + ("sleep_consumer", "sleep_producer"):
                setattr(self, name, functools.partial(getattr(lib.ext, name), base.value))


def _nothing() -> None:
    pass


def unlink_ring(name: str) -> None:
    """Removes a ring's segment and its doorbells' semaphores, whatever is left of them (for a
    ring whose creator was killed before it could)."""
    unlink_quietly(posix_ipc.unlink_shared_memory, name)
    for suffix in ("-d", "-s"):
        unlink_quietly(posix_ipc.unlink_semaphore, name + suffix)


def _unlink_ring(name: str, creator_pid: int) -> None:
    """Finalizer: the creator removes the segment and its semaphores (never a forked child)."""
    if os.getpid() == creator_pid:
        unlink_ring(name)


def _deadline(timeout: Optional[float]) -> Optional[float]:
    if timeout is None:
        return None
    if timeout < 0:
        raise ValueError(f"timeout must be >= 0 or None, got {timeout}")
    return time.monotonic() + timeout


class RingBuffer:
    """One direction of a byte pipe between two processes. Not thread-safe per side: one
    producer thread and one consumer thread (in the same or different processes).

    spin_us: how long a waiting side spins (GIL released, yielding the CPU every few µs)
        before it sleeps (see `ipc.wait`).
    nap_window_s: after the spin, how long a waiting side naps (short sleeps that grow to
        `ipc.wait.NAP_MAX_US`, re-checking after each) before it arms its flag and sleeps;
        while it naps the other side's publish wakes nothing. 0 (the default):
        no nap phase. For a side that waits for a peer that answers within the window.
    poll_interval: how often a sleeping side wakes to check that its peer is alive.
    prefault: map every page of the segment into this process when it is created or attached
        (the creator also allocates them), so that the first lap around the ring does not take
        a page fault every few messages (a few µs each, more in a VM); costs ~1.5 ms per 4 MiB
        per side, and the memory is resident from the start.
    """

    def __init__(
        self,
        segment: Segment,
        *,
        spin_us: float,
        poll_interval: float,
        pure_python: bool,
        nap_window_s: float = 0.0,
    ) -> None:
        self._segment = segment
        self._mv = memoryview(segment.buf)
        self._words = self._mv[: L.HEADER_SIZE].cast("Q")  # counters as aligned 8-byte items (see try_consume)
        self.name = segment.name
        self.is_creator = segment.creator
        lib = None if pure_python else _native_lib()
        self._anchor = (ctypes.c_char * segment.size).from_buffer(segment.buf)  # its address, for C
        self._address = ctypes.addressof(self._anchor)
        self._ops: Any = _NativeOps(lib, self._anchor) if lib is not None else PythonOps(self._mv)
        self.native = lib is not None
        self._spin_us, self._poll_interval, self._nap_window_s = spin_us, poll_interval, nap_window_s
        self._pid = os.getpid()
        self._closed = False
        self._partial: Optional[bytearray] = None  # a fragmented message being reassembled, or _LOANED
        self._partial_total = 0
        self._send_abort = False
        self._fast_push = True  # not closed, no aborted fragmented message to announce
        self._gate = bytearray(2)  # [0] / [1]: nonzero while push / pop must not take the C fast path
        self._finalizer: Optional[weakref.finalize] = None
        self._bells: "Optional[tuple[Doorbell, Doorbell]]" = None
        self._loan: Optional[memoryview] = None  # the producer's reserved record, until commit
        self._loan_size = 0
        self._view: Optional[memoryview] = None  # the consumer's record from pop_view, until release
        self._view_in_ring = False  # whether that view's record is still to be freed (not a reassembled copy)

    def _bind(self, wake: int, bells: "Optional[tuple[Doorbell, Doorbell]]") -> None:
        """Hooks the wake-up mechanism (`wake`: layout.WAKE_FUTEX, or WAKE_SEMAPHORE with the
        two semaphores in `bells`) and the C functions into the methods' hot paths."""
        ops = self._ops
        self.wake = wake
        self._op_push, self._op_peek, self._op_release = ops.push, ops.peek, ops.release
        self._op_reserve, self._op_commit = ops.reserve, ops.commit
        disarm_data = functools.partial(ops.disarm, L.OFF_C_SLEEPING)
        disarm_space = functools.partial(ops.disarm, L.OFF_P_SLEEPING)
        peer_closed = _SIDES[not self.is_creator][2]
        self._bells = bells
        if wake == L.WAKE_SEMAPHORE:
            data_bell, space_bell = bells
            self._ring_data, self._ring_space = data_bell.ring, space_bell.ring
            sleep_data = semaphore_sleep(ops.arm_consumer, disarm_data, data_bell)
            sleep_space = semaphore_sleep(ops.arm_producer, disarm_space, space_bell)
        else:
            if self.native:  # commit and release have woken the sleeper in C already
                self._ring_data = self._ring_space = _nothing
            else:
                ops.bind_futex(self._address)
                self._ring_data = functools.partial(futex_wake_py, ops.flag_word(L.OFF_C_SLEEPING), 1)
                self._ring_space = functools.partial(futex_wake_py, ops.flag_word(L.OFF_P_SLEEPING), 1)
            sleep_data = functools.partial(ops.sleep_consumer, peer_closed)
            sleep_space = lambda n, timeout_ns: ops.sleep_producer(n, peer_closed, timeout_ns)  # noqa: E731
        # Whole-message fast paths that wake a sleeper in C: futex rings with the extension only.
        fast = self.native and wake == L.WAKE_FUTEX
        self._op_take = ops.take if fast else None
        self._op_take_many = ops.take_many if fast else None
        self._op_push_many = ops.push_many if fast else None
        self._data_waiter = Waiter(
            ops.spin_consumer, ops.arm_consumer, disarm_data, sleep_data, self._check_peer,
            self._spin_us, self._poll_interval, nap=ops.nap_consumer, nap_window_s=self._nap_window_s,
        )
        self._space_waiter = Waiter(
            ops.spin_producer, ops.arm_producer, disarm_space, sleep_space, self._check_peer,
            self._spin_us, self._poll_interval, nap=ops.nap_producer, nap_window_s=self._nap_window_s,
        )
        self._take_spin_ns = self._data_waiter.spin_ns
        if fast and ops.ext is not None:
            # push and pop as one C call each for the common case (see push_fast in _native.c):
            # instance attributes that shadow the methods. The gate's bytes send the C paths to
            # the methods while they must not run (see _accelerate), also for a caller that
            # kept a reference to them.
            me, cls = weakref.proxy(self), type(self)
            self.push = functools.partial(ops.ext.push_fast, ops.base, self._gate, cls.push, me)  # type: ignore[method-assign]
            self.try_push = functools.partial(ops.ext.try_push_fast, ops.base, self._gate, cls.try_push, me)  # type: ignore[method-assign]
            self.consume = functools.partial(  # type: ignore[method-assign]
                ops.ext.consume_fast, ops.base, self._gate, self._take_spin_ns, cls.consume, cls._consume_rest, me
            )
            self.try_consume = functools.partial(  # type: ignore[method-assign]
                ops.ext.consume_fast, ops.base, self._gate, -1, cls.try_consume, None, me
            )
            self.pop = functools.partial(  # type: ignore[method-assign]
                ops.ext.pop_fast, ops.base, self._gate, self._take_spin_ns,
                0 if self._nap_window_s > 0 else int(self._poll_interval * 1e9),  # naps: the Waiter's
                peer_closed, cls.pop, cls._pop_rest, me,
            )
        capacity = ops.load(L.OFF_CAPACITY)
        self.capacity = capacity
        self.max_payload = ops.load(L.OFF_MAX_RECORD) - 8

    # ---------------------------------------------------------------- construction

    @classmethod
    def create(
        cls,
        capacity: int = 1 << 20,
        *,
        spin_us: float = DEFAULT_SPIN_US,
        poll_interval: float = 0.1,
        pure_python: bool = False,
        nap_window_s: float = 0.0,
        prefault: bool = False,
        max_record: Optional[int] = None,
    ) -> "RingBuffer":
        """A new ring of `capacity` bytes (multiple of 8, 256 B .. 512 MiB) that this process owns.

        Messages up to `max_payload` = `max_record - 8` bytes travel in one record; longer ones in
        fragments. `max_record` (a multiple of 8, 16 .. capacity/2; default capacity/4): a ring
        sized for one kind of message can hold two of them in half the memory.
        """
        if not isinstance(capacity, int) or capacity % 8 or not L.MIN_CAPACITY <= capacity <= L.MAX_CAPACITY:
            raise ValueError(
                f"capacity must be a multiple of 8 in [{L.MIN_CAPACITY}, {L.MAX_CAPACITY}], got {capacity!r}"
            )
        if max_record is None:
            max_record = L.max_record_for(capacity)
        elif type(max_record) is not int or max_record % 8 or not 16 <= max_record <= capacity // 2:
            raise ValueError(f"max_record must be a multiple of 8 in [16, capacity/2 = {capacity // 2}], got {max_record!r}")
        check_wait_params(spin_us, nap_window_s, poll_interval)
        check_free_space(L.HEADER_SIZE + capacity + 2 * SEMAPHORE_BYTES, f"a ring of capacity {capacity}")
        segment = Segment.create(L.HEADER_SIZE + capacity)
        finalizer = weakref.finalize(segment, _unlink_ring, segment.name, os.getpid())
        try:
            ring = cls(
                segment, spin_us=spin_us, poll_interval=poll_interval, pure_python=pure_python, nap_window_s=nap_window_s
            )
            ring._finalizer = finalizer
            wake = L.WAKE_FUTEX if futex_supported(ring.native) else L.WAKE_SEMAPHORE
            ring._init_header(capacity, wake, max_record)
            bells = None
            if wake == L.WAKE_SEMAPHORE:
                bells = Doorbell.create(segment.name + "-d"), Doorbell.create(segment.name + "-s")
            ring._bind(wake, bells)
            if prefault:
                ring._prefault()
        except BaseException:
            finalizer()
            raise
        return ring

    def _init_header(self, capacity: int, wake: int, max_record: int) -> None:
        store, pid = self._ops.store, os.getpid()
        store(L.OFF_VERSION, L.VERSION)
        store(L.OFF_WAKE, wake)
        store(L.OFF_CAPACITY, capacity)
        store(L.OFF_MAX_RECORD, max_record)
        store(L.OFF_CREATOR_PID, pid)
        store(L.OFF_CREATOR_START, process_start_time(pid))
        store(L.OFF_MAGIC, L.MAGIC)

    @classmethod
    def attach(
        cls,
        name: str,
        *,
        spin_us: float = DEFAULT_SPIN_US,
        poll_interval: float = 0.1,
        pure_python: bool = False,
        nap_window_s: float = 0.0,
        prefault: bool = False,
    ) -> "RingBuffer":
        """Attaches to a ring another process created; records our pid as the creator's peer."""
        check_wait_params(spin_us, nap_window_s, poll_interval)
        try:
            segment = Segment.attach(name)
        except posix_ipc.ExistentialError:
            raise FileNotFoundError(f"no ring named {name!r} (its creator may have closed it)") from None
        ring = cls(segment, spin_us=spin_us, poll_interval=poll_interval, pure_python=pure_python, nap_window_s=nap_window_s)
        wake = ring._check_header()
        bells = None
        if wake == L.WAKE_SEMAPHORE:
            try:
                bells = Doorbell.attach(name + "-d"), Doorbell.attach(name + "-s")
            except posix_ipc.ExistentialError:
                raise FileNotFoundError(f"the semaphores of ring {name!r} are gone") from None
        elif not futex_supported(ring.native):
            raise RingError(f"ring {name!r} wakes its sleepers with a futex, which this process cannot use")
        ring._bind(wake, bells)
        pid = os.getpid()
        ring._ops.store(L.OFF_ATTACHER_START, process_start_time(pid))
        ring._ops.store(L.OFF_ATTACHER_PID, pid)
        if prefault:
            ring._prefault()
        return ring

    def _prefault(self) -> None:
        """Maps (and, in the creator, allocates) every page now instead of at first touch."""
        if _MADV_POPULATE_WRITE is not None:
            try:
                self._segment.buf.madvise(_MADV_POPULATE_WRITE)
                return
            except OSError:  # a kernel older than 5.14
                pass
        pages = self._mv[:: mmap.PAGESIZE]  # the first byte of every page: read (or rewrite) them
        if self.is_creator:
            pages[:] = pages.tobytes()  # nobody else writes to a ring before create() returns
        else:
            pages.tobytes()

    def _check_header(self) -> int:
        """RingCorruptedError unless the header is a ring's; returns its wake-up mechanism."""
        load = self._ops.load
        magic, version, capacity = load(L.OFF_MAGIC), load(L.OFF_VERSION), load(L.OFF_CAPACITY)
        if magic != L.MAGIC:
            raise RingCorruptedError(f"{self.name} is not an ipc ring (magic {magic:#x})")
        if version != L.VERSION:
            raise RingCorruptedError(f"{self.name} has layout version {version}, expected {L.VERSION}")
        if capacity + L.HEADER_SIZE > self._segment.size or capacity < L.MIN_CAPACITY or capacity % 8:
            raise RingCorruptedError(f"{self.name} claims capacity {capacity} in a {self._segment.size}-byte segment")
        max_record = load(L.OFF_MAX_RECORD)
        if max_record % 8 or not 16 <= max_record <= capacity // 2:
            raise RingCorruptedError(f"{self.name} claims records of up to {max_record} bytes in a ring of {capacity}")
        wake = load(L.OFF_WAKE)
        if wake not in (L.WAKE_FUTEX, L.WAKE_SEMAPHORE):
            raise RingCorruptedError(f"{self.name} has an unknown wake-up mechanism {wake}")
        return wake

    def __reduce__(self) -> tuple:
        """Pickles as "attach by name", so a ring can be handed to a multiprocessing child."""
        return (_attach_by_name, (self.name, self._spin_us, self._poll_interval, not self.native, self._nap_window_s))

    # ---------------------------------------------------------------- peers and closing

    @property
    def peer_pid(self) -> int:
        """The other side's pid; 0 while nobody has attached to a ring we created."""
        return self._ops.load(L.OFF_ATTACHER_PID if self.is_creator else L.OFF_CREATOR_PID)

    def _check_peer(self) -> None:
        if self._closed:
            raise RingClosedError(f"ring {self.name} is closed")
        pid_off, start_off, closed_off = _SIDES[not self.is_creator]
        load = self._ops.load
        if load(closed_off):
            raise PeerClosedError(f"the peer closed ring {self.name}")
        pid = load(pid_off)
        if pid and pid != os.getpid() and not pid_alive(pid, load(start_off)):
            raise PeerDeadError(f"peer process {pid} of ring {self.name} died")

    def close(self) -> None:
        """Closes our end: wakes a blocked peer (which then raises PeerClosedError once it has
        popped everything) and, for the creator, unlinks the segment and its semaphores.

        The memory stays mapped until the object is garbage-collected, so another thread still
        inside a call on this ring never touches unmapped memory; it raises ValueError instead.
        In a forked child, close() closes only the child's copy: the ring stays open for the
        process that created or attached it.
        """
        if self._closed:
            return
        self._closed = True
        self._fast_push = False
        self._accelerate("push", False)
        self._accelerate("pop", False)
        if os.getpid() != self._pid:
            return
        if self._bells is not None:
            self._ops.store(_SIDES[self.is_creator][2], 1)
            for bell in self._bells:
                bell.ring()
        elif hasattr(self, "wake"):  # a futex ring: wake whichever side sleeps (see ring_sleep)
            self._ops.store(_SIDES[self.is_creator][2], 1)
            for flag, bell in ((L.OFF_C_SLEEPING, self._ring_data), (L.OFF_P_SLEEPING, self._ring_space)):
                if self._ops.wake_sleeper(flag):
                    bell()
        if self._finalizer is not None:
            self._finalizer()

    def wakeups(self) -> dict:
        """How often a sleeping side of this ring had to be woken: "data" by the producer's
        publishes (and close), "space" by the consumer's. A side that spins or naps through its
        wait costs the other side no wake-up (see `ipc.wait`)."""
        return {"data": self._ops.load(L.OFF_P_WAKES), "space": self._ops.load(L.OFF_C_WAKES)}

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "RingBuffer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        role = "creator" if self.is_creator else "attacher"
        return f"RingBuffer({self.name!r}, capacity={self.capacity}, {role}, native={self.native})"

    # ---------------------------------------------------------------- producer

    def push(self, data: "bytes | bytearray | memoryview", timeout: Optional[float] = None) -> None:
        """Appends one message (any size, any bytes-like object); blocks while the ring is full.

        Raises RingTimeoutError, a TimeoutError (nothing was delivered), PeerDeadError / PeerClosedError, or
        RingClosedError (a ValueError) once this end is closed.
        """
        if self._fast_push:
            kind, n = type(data), len(data)
            if kind is bytes and n <= self.max_payload:
                r = self._op_push(data, n)
                if r >= 0:
                    if r:
                        self._ring_data()
                    return
            elif kind is bytearray and n <= self.max_payload:
                off = self._op_reserve(n)
                if off >= 0:
                    self._mv[off : off + n] = data
                    if self._op_commit(n, _MSG):
                        self._ring_data()
                    return
        self._push_slow(data, timeout)

    def try_push(self, data: "bytes | bytearray | memoryview") -> bool:
        """`push(data, timeout=0)`: True if the message went in (after the short spin for room a
        full ring gets), False if there was no room; never sleeps. For a producer that must not
        block (it keeps what did not go for later)."""
        try:
            self.push(data, 0.0)
        except RingTimeoutError:
            return False
        return True

    def push_many(self, messages: "list[bytes]", timeout: Optional[float] = None) -> None:
        """Pushes several messages in order, publishing the tail once for as many of them as fit
        (one wake-up of the consumer at most, instead of one look at its flag per message);
        blocks while the ring is full, raises like `push` (the messages before the one that
        raised were delivered). `messages`: a list of bytes-like objects."""
        if not isinstance(messages, list):
            raise TypeError(f"messages must be a list of bytes-like objects, got {type(messages).__name__}")
        many, done = self._op_push_many, 0
        spin_ns = self._space_waiter.spin_ns if timeout is None else 0  # a timeout: the Waiter's wait
        while done < len(messages):
            if many is not None and self._fast_push:
                done = many(messages, done, spin_ns)
                if done < 0:  # the ring was full, after the C helper's spin if any
                    done = ~done
                    self._push_slow(messages[done], timeout, spun=spin_ns > 0)
                    done += 1
                    continue
                if done == len(messages):
                    return
            self.push(messages[done], timeout)
            done += 1

    def _accelerate(self, name: str, on: bool) -> None:
        """Opens (or closes, so that the method runs) the gate of the C fast path of `name`:
        closed for good once the ring is closed; for push while an aborted fragmented message
        must be announced first, for pop while a fragmented message is being reassembled."""
        self._gate[0 if name == "push" else 1] = 0 if on and not self._closed else 1

    def _push_slow(self, data: "bytes | bytearray | memoryview", timeout: Optional[float], spun: bool = False) -> None:
        """push the slow way; `spun`: the caller spun for space already (the first wait sleeps)."""
        deadline = self._before_push(timeout)
        with memoryview(data) as raw, raw.cast("B") as view:
            if len(view) <= self.max_payload:
                self._put_record(view, L.KIND_MSG, deadline, spun=spun)
            else:
                self._put_fragments(view, deadline)

    def _before_push(self, timeout: Optional[float]) -> Optional[float]:
        """The checks and the announcement every slow push starts with; returns its deadline."""
        if self._closed:
            raise RingClosedError(f"ring {self.name} is closed")
        if self._loan is not None:
            raise LoanError(f"ring {self.name}: a reserved record is not committed yet (commit() or cancel() it first)")
        deadline = _deadline(timeout)
        if self._send_abort:
            self._put_record(b"", L.KIND_ABORT, deadline)
            self._send_abort = False
            self._fast_push = True
            self._accelerate("push", True)
        return deadline

    # ---------------------------------------------------------------- loans (zero-copy)

    def reserve(self, n: int, timeout: Optional[float] = None) -> memoryview:
        """A loan of the next record: a writable view of `n` bytes in the ring's memory, for the
        producer to write the message in place; `commit()` publishes it (`cancel()` drops it).
        `n` is at most `max_payload` (a loan is one record, never fragments). Blocks while the
        ring has no room, raises like `push`. Until the commit, the view is the only way to
        write to this ring: another reserve, push or push_many raises LoanError; after it the
        view is released (using it raises ValueError)."""
        if type(n) is not int or not 0 <= n <= self.max_payload:
            raise ValueError(f"n must be an int in [0, {self.max_payload}] (max_payload: a loan is one record), got {n!r}")
        off = self._op_reserve(n) if self._fast_push else L.FULL
        if off < 0:
            deadline = self._before_push(timeout)
            while (off := self._ops.reserve(n)) < 0:
                if off != L.FULL:
                    raise self._corrupted(off)
                self._space_waiter.wait(deadline, n)
        self._loan, self._loan_size = self._mv[off : off + n], n
        self._fast_push = False
        self._gate[0] = 1
        return self._loan

    def commit(self, n: Optional[int] = None) -> None:
        """Publishes the reserved record, with its first `n` bytes (default: all it reserved) as
        the message: a producer that reserved an upper bound commits what it wrote."""
        loan, size = self._loan, self._loan_size
        if loan is None:
            raise LoanError(f"ring {self.name}: commit() without a reserved record")
        if n is None:
            n = size
        elif type(n) is not int or not 0 <= n <= size:
            raise ValueError(f"n must be an int in [0, {size}] (the bytes reserved), got {n!r}")
        self._end_loan(loan)
        if self._closed:
            raise RingClosedError(f"ring {self.name} is closed: the reserved record was dropped")
        if n != size:  # the record shrinks: the tail to publish moves back by the bytes it gave up
            self._words[_PENDING_WORD] -= L.record_size(size) - L.record_size(n)
        if self._op_commit(n, _MSG):
            self._ring_data()

    def cancel(self) -> None:
        """Drops the reserved record unpublished (the consumer never sees it)."""
        if self._loan is None:
            raise LoanError(f"ring {self.name}: cancel() without a reserved record")
        self._end_loan(self._loan)

    def _end_loan(self, loan: memoryview) -> None:
        loan.release()
        self._loan = None
        self._fast_push = not (self._closed or self._send_abort)
        self._accelerate("push", self._fast_push)

    def pop_view(self, timeout: Optional[float] = None) -> memoryview:
        """The next message, as a view of its record in the ring's memory (of the reassembled
        bytes when it came in fragments), valid until `release()`, which frees the record.
        Blocks while the ring is empty, raises like `pop`. Until the release, no other message
        can be taken from this ring: pop_view, pop, consume and the others raise LoanError;
        after it the view is released (using it raises ValueError; slices of it and arrays made
        from it are the caller's to drop before)."""
        r = self._op_peek()
        if r >= 0 and r >> 60 == _MSG and self._partial is None:
            off = r & _MASK
            view, in_ring = self._mv[off : off + ((r >> 30) & _MASK)], True
        else:
            got = self._next_message(r, _deadline(timeout))
            if type(got) is int:
                off = got & _MASK
                view, in_ring = self._mv[off : off + ((got >> 30) & _MASK)], True
            else:
                view, in_ring = memoryview(got), False
        self._view, self._view_in_ring = view, in_ring
        self._partial = _LOANED
        self._gate[1] = 1
        return view

    def release(self) -> None:
        """Ends the view `pop_view` returned and frees its record."""
        view = self._view
        if view is None:
            raise LoanError(f"ring {self.name}: release() without a view from pop_view()")
        view.release()
        self._view, self._partial = None, None
        self._accelerate("pop", True)
        if self._view_in_ring and self._op_release():
            self._ring_space()

    def _put_fragments(self, view: memoryview, deadline: Optional[float]) -> None:
        total, step = len(view), self.max_payload
        first = step - 8
        self._put_record(view[:first], L.KIND_FIRST, deadline, total=total)
        try:
            for start in range(first, total, step):
                end = min(start + step, total)
                self._put_record(view[start:end], L.KIND_LAST if end == total else L.KIND_MIDDLE, deadline)
        except BaseException:
            self._send_abort = True  # the consumer holds a partial message: drop it before the next one
            self._fast_push = False
            self._accelerate("push", False)
            raise

    def _put_record(
        self, view: "bytes | memoryview", kind: int, deadline: Optional[float], total: int = -1, spun: bool = False
    ) -> None:
        n = len(view) + (8 if total >= 0 else 0)
        while True:
            off = self._ops.reserve(n)
            if off >= 0:
                break
            if off != L.FULL:
                raise self._corrupted(off)
            self._space_waiter.wait(deadline, n, spin=not spun)
            spun = False
        if total >= 0:
            _U64.pack_into(self._mv, off, total)
            off += 8
        self._mv[off : off + len(view)] = view
        if self._ops.commit(n, kind):
            self._ring_data()

    # ---------------------------------------------------------------- consumer

    def pop(self, timeout: Optional[float] = None) -> bytes:
        """Removes and returns the next message; blocks while the ring is empty.

        Raises RingTimeoutError, PeerDeadError, PeerClosedError (once the closed peer's messages
        are all popped), or RingCorruptedError on a malformed frame.
        """
        take = self._op_take
        if take is not None and self._partial is None:
            # One C call: peek, spin (GIL released) while empty, copy out, release.
            r = take(self._take_spin_ns if timeout is None else min(self._take_spin_ns, int(timeout * 1e9)))
            if type(r) is bytes:
                return r
            return self._consume_slow(bytes, r, _deadline(timeout), spun=True)
        r = self._op_peek()
        if r >= 0 and r >> 60 == _MSG and self._partial is None:
            off = r & _MASK
            data = self._mv[off : off + ((r >> 30) & _MASK)].tobytes()
            if self._op_release():
                self._ring_space()
            return data
        return self._consume_slow(bytes, r, _deadline(timeout))

    def consume(self, fn: Callable[[memoryview], T], timeout: Optional[float] = None) -> T:
        """Calls `fn` on the next message, read in place from the ring's memory when it is
        contiguous (a reassembled buffer when it came in fragments), then frees it.

        `fn` must not keep the view (decode or copy out of it). The message is consumed even if
        `fn` raises.
        """
        r = self._op_peek()
        if r >= 0 and r >> 60 == _MSG and self._partial is None:
            return self._deliver(fn, r)
        return self._consume_slow(fn, r, _deadline(timeout))

    def pop_many(self, limit: int = 1 << 16, timeout: Optional[float] = None) -> list:
        """The messages that are there now, up to `limit` (at least one: blocks like `pop` while
        the ring is empty), freed with one publish of the head. For a consumer that drains a
        burst; what `pop` raises."""
        if not isinstance(limit, int) or limit < 1:
            raise ValueError(f"limit must be an int >= 1, got {limit!r}")
        many = self._op_take_many
        if many is not None and self._partial is None:
            batch = many(limit)
            if batch:
                return batch
        batch = [self.pop(timeout)]
        while len(batch) < limit:
            more = many(limit - len(batch)) if many is not None and self._partial is None else None
            if more:
                batch += more
                continue
            message = self.try_pop()
            if message is None:
                break
            batch.append(message)
        return batch

    def try_pop(self) -> Optional[bytes]:
        """The next message, or None if no whole message is there yet (never blocks)."""
        return self.try_consume(bytes)

    def try_consume(self, fn: Callable[[memoryview], T]) -> Optional[T]:
        """`consume` without waiting: None if no whole message is there yet."""
        words = self._words
        if words[_TAIL_WORD] == words[_HEAD_WORD]:
            # Nothing published: a plain look (a stale tail only means "not yet"), no C call. A
            # different tail is read again by the C helper's acquire load before any byte is.
            return None
        r = self._op_peek()
        if r >= 0 and r >> 60 == _MSG and self._partial is None:
            return self._deliver(fn, r)
        if r == L.EMPTY:
            return None
        try:
            return self._consume_slow(fn, r, time.monotonic())
        except RingTimeoutError:
            return None

    def wait_readable(self, timeout: Optional[float] = None) -> bool:
        """Blocks (GIL released) until a message can be popped; False on timeout.

        For a thread that only waits, leaving the popping to another part of the program.
        Raises like `pop` when the peer is gone and the ring is empty.
        """
        if self._op_peek() != L.EMPTY:
            return True
        try:
            self._data_waiter.wait(_deadline(timeout))
        except RingTimeoutError:
            return False
        return True

    def _deliver(self, fn: Callable[[memoryview], T], r: int) -> T:
        off = r & _MASK
        view = self._mv[off : off + ((r >> 30) & _MASK)]
        try:
            return fn(view)
        finally:
            try:
                view.release()  # a BufferError if fn kept an export of it; the record is freed all the same
            finally:
                if self._op_release():
                    self._ring_space()

    def _consume_slow(self, fn: Callable[[memoryview], T], r: int, deadline: Optional[float], spun: bool = False) -> T:
        """The rest of pop/consume after a first look (`r`); `spun`: that look spun already."""
        got = self._next_message(r, deadline, spun)
        if type(got) is int:
            return self._deliver(fn, got)
        with memoryview(got) as view:
            return fn(view)

    def _next_message(self, r: int, deadline: Optional[float], spun: bool = False) -> "int | bytearray":
        """Waits from a first look (`r`; `spun`: that look spun already) for the next message:
        peek's result for a whole record (still in the ring), or the reassembled bytes of a
        fragmented one (its records freed)."""
        if self._closed:
            raise RingClosedError(f"ring {self.name} is closed")
        if self._view is not None:
            raise LoanError(f"ring {self.name}: the view from pop_view() is not released yet (release() it first)")
        while True:
            if r == L.EMPTY:
                self._data_waiter.wait(deadline, spin=not spun)
                spun = False
            elif r < 0:
                raise self._corrupted(r)
            elif r >> 60 == _MSG:
                if self._partial is not None:
                    raise self._corrupted(r, "a whole message inside a fragmented one")
                return r
            else:
                message = self._take_fragment(r)
                if self._op_release():
                    self._ring_space()
                if message is not None:
                    return message
            r = self._op_peek()

    def _consume_rest(self, fn: Callable[[memoryview], T], r: int) -> T:
        """consume after the C fast path spun on an empty ring and then found `r`."""
        return self._consume_slow(fn, r, None, spun=True)

    def _pop_rest(self, r: int, slept: bool) -> bytes:
        """pop after the C fast path's look found `r`, not a whole message: it spun already,
        and if it `slept` a poll interval through, the peer is looked at first."""
        if slept and r == L.EMPTY and self._data_waiter.look_at_peer():
            r = self._op_peek()
        return self._consume_slow(bytes, r, None, spun=True)

    def _take_fragment(self, r: int) -> Optional[bytearray]:
        """Adds a fragment record to the message being reassembled; the message once complete."""
        kind, off, n = r >> 60, r & _MASK, (r >> 30) & _MASK
        partial = self._partial
        if kind == L.KIND_FIRST:
            total = _U64.unpack_from(self._mv, off)[0] if n >= 8 else -1
            if partial is not None or total <= self.max_payload or total < n - 8:
                raise self._corrupted(r, f"bad first fragment (total {total}, in a message: {partial is not None})")
            self._partial, self._partial_total = bytearray(self._mv[off + 8 : off + n]), total
            self._accelerate("pop", False)  # a whole message now would be a corrupted ring
            return None
        if partial is None:
            raise self._corrupted(r, f"fragment of kind {kind} outside a fragmented message")
        if kind == L.KIND_ABORT:
            self._partial = None
            self._accelerate("pop", True)
            return None
        partial += self._mv[off : off + n]
        if len(partial) > self._partial_total or (kind == L.KIND_LAST and len(partial) != self._partial_total):
            raise self._corrupted(r, f"fragments add up to {len(partial)} bytes, not {self._partial_total}")
        if kind == L.KIND_MIDDLE:
            return None
        self._partial = None
        self._accelerate("pop", True)
        return partial

    def _corrupted(self, code: int, problem: Optional[str] = None) -> RingCorruptedError:
        load = self._ops.load
        problem = problem or L.PROBLEMS.get(code, f"unexpected result {code}")
        self._partial = None
        self._accelerate("pop", True)
        return RingCorruptedError(
            f"ring {self.name}: {problem} (head={load(L.OFF_HEAD)}, tail={load(L.OFF_TAIL)}, "
            f"capacity={load(L.OFF_CAPACITY)})"
        )


def _attach_by_name(name: str, spin_us: float, poll_interval: float, pure_python: bool, nap_window_s: float) -> RingBuffer:
    return RingBuffer.attach(
        name, spin_us=spin_us, poll_interval=poll_interval, pure_python=pure_python, nap_window_s=nap_window_s
    )
