"""The pure-Python fallback of `_native.c`: same layout, same results, semaphore operations as fences.

Used when no C compiler is available (or with ``IPC_PURE_PYTHON=1``). Python has no atomics or
fences of its own, so this relies on two things, both written down here:

- POSIX (XBD 4.12, "Memory Synchronization") lists sem_post and sem_trywait among the functions
  that synchronize memory with respect to other threads. `_fence()` posts and then takes a
  process-private semaphore, which glibc implements as a release RMW followed by an acquire RMW
  on one word: no load or store moves across the pair, on x86-64 and on aarch64 (where a store
  release is never reordered with a later load acquire).
- The counters are 8-byte aligned and accessed as items of a memoryview cast to "Q", which
  CPython reads and writes with a fixed-size 8-byte memcpy that compilers emit as one
  load/store, single-copy atomic on both architectures for aligned addresses, so the peer
  never sees a torn counter. (struct.pack_into would not do: it zeroes the target before
  writing it, and its standard-size formats go byte by byte.)

Each public function mirrors the C function of the same name (without the ``ipc_`` prefix).
"""

from __future__ import annotations

import struct
import sys
import time

import posix_ipc

from ipc import layout as L
from ipc.segment import new_name
from ipc.wait import futex_wait_py

_HEADER = struct.Struct("=IHH")


class PythonOps:
    def __init__(self, buf: memoryview) -> None:
        self._buf = buf
        self._words = buf.cast("Q")  # counters: one 8-byte load/store each, see above
        name = new_name() + "-f"
        self._fence_sem = posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=0o600, initial_value=0)
        self._fence_sem.unlink()

    def _fence(self) -> None:
        self._fence_sem.release()
        self._fence_sem.acquire(0)

    def _get(self, off: int) -> int:
        return self._words[off >> 3]

    def _set(self, off: int, value: int) -> None:
        self._words[off >> 3] = value

    def _geometry(self) -> "tuple[int, int] | None":
        cap, max_rec = self._get(L.OFF_CAPACITY), self._get(L.OFF_MAX_RECORD)
        if cap < 64 or cap & 7 or max_rec < 16 or max_rec > cap // 2:
            return None
        return cap, max_rec

    def _free(self, tail: int, head: int, cap: int) -> int:
        if head > tail or tail - head > cap or head & 7:
            return L.BAD_COUNTERS
        return cap - (tail - head)

    def _space_needed(self, n: int, cap: int) -> int:
        rec, room = L.record_size(n), cap - self._get(L.OFF_TAIL) % cap
        return rec if rec <= room else room + rec

    def reserve(self, n: int) -> int:
        geometry = self._geometry()
        if geometry is None:
            return L.BAD_COUNTERS
        cap, max_rec = geometry
        rec = L.record_size(n)
        if n < 0 or rec > max_rec:
            return L.TOO_BIG
        tail = self._get(L.OFF_TAIL)
        pos = tail % cap
        room = cap - pos
        total = rec if rec <= room else room + rec
        free = self._free(tail, self._get(L.OFF_P_HEAD_CACHE), cap)
        if free < total:
            head = self._get(L.OFF_HEAD)
            self._fence()  # acquire: the consumer's reads of freed space precede our writes
            self._set(L.OFF_P_HEAD_CACHE, head)
            free = self._free(tail, head, cap)
            if free < 0:
                return free
            if free < total:
                return L.FULL
        if rec > room:
            _HEADER.pack_into(self._buf, L.DATA + pos, room - 8, L.KIND_PAD, L.RECORD_MAGIC)
            pos = 0
        self._set(L.OFF_P_PENDING, tail + total)
        self._set(L.OFF_P_RECORD_POS, pos)
        return L.DATA + pos + 8

    def commit(self, n: int, kind: int) -> int:
        _HEADER.pack_into(self._buf, L.DATA + self._get(L.OFF_P_RECORD_POS), n, kind, L.RECORD_MAGIC)
        self._fence()  # release: payload and header before the tail that publishes them
        self._set(L.OFF_TAIL, self._get(L.OFF_P_PENDING))
        return self._take_sleeper(L.OFF_C_SLEEPING)

    def push(self, data: bytes, n: int) -> int:
        off = self.reserve(n)
        if off < 0:
            return off
        self._buf[off : off + n] = data
        return self.commit(n, L.KIND_MSG)

    def _take_sleeper(self, flag_off: int) -> int:
        self._fence()  # store-load: our counter before the peer's flag (Dekker)
        if self._get(flag_off) == 0:
            return 0
        self._set(flag_off, 0)
        counter = L.OFF_P_WAKES if flag_off == L.OFF_C_SLEEPING else L.OFF_C_WAKES
        self._set(counter, self._get(counter) + 1)
        return 1

    def peek(self) -> int:
        geometry = self._geometry()
        if geometry is None:
            return L.BAD_COUNTERS
        cap, max_rec = geometry
        head, tail = self._get(L.OFF_HEAD), self._get(L.OFF_C_TAIL_CACHE)
        if tail == head:
            tail = self._get(L.OFF_TAIL)
            self._fence()  # acquire: the tail before the records it publishes
            self._set(L.OFF_C_TAIL_CACHE, tail)
            if tail == head:
                return L.EMPTY
        if head > tail or tail - head > cap or (head | tail) & 7:
            return L.BAD_COUNTERS
        pos, avail, skipped = head % cap, tail - head, 0
        for attempt in range(2):
            if avail < 8:
                return L.TRUNCATED
            length, kind, magic = _HEADER.unpack_from(self._buf, L.DATA + pos)
            if magic != L.RECORD_MAGIC:
                return L.BAD_MAGIC
            if kind != L.KIND_PAD:
                break
            if attempt == 1 or pos == 0 or pos + 8 + length != cap:
                return L.BAD_PAD
            skipped = cap - pos
            avail -= min(skipped, avail)
            pos = 0
        if not L.KIND_MSG <= kind <= L.KIND_ABORT:
            return L.BAD_KIND
        rec = L.record_size(length)
        if rec > max_rec or pos + rec > cap:
            return L.BAD_LENGTH
        if rec > avail:
            return L.TRUNCATED
        self._set(L.OFF_C_PENDING, head + skipped + rec)
        return (kind << 60) | (length << 30) | (L.DATA + pos + 8)

    def release(self) -> int:
        self._fence()  # release: our reads of the record before the head that frees it
        self._set(L.OFF_HEAD, self._get(L.OFF_C_PENDING))
        return self._take_sleeper(L.OFF_P_SLEEPING)

    def _has_data(self) -> bool:
        return self._get(L.OFF_TAIL) != self._get(L.OFF_HEAD)

    def _has_space(self, n: int) -> bool:
        geometry = self._geometry()
        if geometry is None:
            return True
        cap = geometry[0]
        free = self._free(self._get(L.OFF_TAIL), self._get(L.OFF_HEAD), cap)
        return free < 0 or free >= self._space_needed(n, cap)

    def arm_consumer(self) -> int:
        return self._arm(L.OFF_C_SLEEPING, self._has_data)

    def arm_producer(self, n: int) -> int:
        return self._arm(L.OFF_P_SLEEPING, lambda: self._has_space(n))

    def _arm(self, flag_off: int, ready) -> int:
        self._set(flag_off, 1)
        self._fence()  # store-load: our flag before the peer's counter (Dekker)
        if not ready():
            return 0
        self._set(flag_off, 0)
        return 1

    def disarm(self, flag_off: int) -> None:
        self._set(flag_off, 0)

    # The futex sleep of a futex ring (see `ring_sleep` in _native.c for the argument).

    def bind_futex(self, address: int) -> None:
        """The segment's address, for the futex calls on its flag words."""
        self._address = address

    def flag_word(self, flag_off: int) -> int:
        """The address of the 32-bit half of a flag that holds its value: its futex word."""
        return self._address + flag_off + (4 if sys.byteorder == "big" else 0)

    def sleep_consumer(self, closed_off: int, timeout_ns: int) -> int:
        return self._sleep(L.OFF_C_SLEEPING, closed_off, timeout_ns, self._has_data)

    def sleep_producer(self, n: int, closed_off: int, timeout_ns: int) -> int:
        return self._sleep(L.OFF_P_SLEEPING, closed_off, timeout_ns, lambda: self._has_space(n))

    def _sleep(self, flag_off: int, closed_off: int, timeout_ns: int, ready) -> int:
        self._set(flag_off, 1)
        self._fence()  # store-load: our flag before the peer's counter and "closed" (Dekker)
        if ready():
            self._set(flag_off, 0)
            return 1
        if self._get(closed_off):
            self._set(flag_off, 0)
            return 2
        futex_wait_py(self.flag_word(flag_off), 1, timeout_ns)
        self._set(flag_off, 0)
        return int(ready())

    def wake_sleeper(self, flag_off: int) -> int:
        """For close(): 1 if the side sleeping on `flag_off` must be woken (its flag is cleared)."""
        return self._take_sleeper(flag_off)

    def spin_consumer(self, ns: int) -> int:
        return self._spin(ns, self._has_data)

    def spin_producer(self, n: int, ns: int) -> int:
        return self._spin(ns, lambda: self._has_space(n))

    def nap_consumer(self, window_ns: int, first_ns: int, max_ns: int) -> int:
        return self._nap(window_ns, first_ns, max_ns, self._has_data)

    def nap_producer(self, n: int, window_ns: int, first_ns: int, max_ns: int) -> int:
        return self._nap(window_ns, first_ns, max_ns, lambda: self._has_space(n))

    @staticmethod
    def _nap(window_ns: int, first_ns: int, max_ns: int, ready) -> int:
        end, nap = time.monotonic_ns() + window_ns, max(first_ns, 1)
        while not ready():
            left = end - time.monotonic_ns()
            if left <= 0:
                return 0
            time.sleep(min(nap, left) / 1e9)
            nap = min(nap * 2, max(max_ns, nap))
        return 1

    @staticmethod
    def _spin(ns: int, ready) -> int:
        deadline = time.perf_counter_ns() + ns
        while not ready():
            if time.perf_counter_ns() >= deadline:
                return int(ready())
        return 1

    def load(self, off: int) -> int:
        value = self._get(off)
        self._fence()
        return value

    def store(self, off: int, value: int) -> None:
        self._fence()
        self._set(off, value)
        self._fence()
