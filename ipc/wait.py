"""How a side of a ring waits: spin briefly, optionally nap, then sleep (a futex, or a semaphore).

1. spin (`spin_us`): re-check the condition after every pause instruction, yielding the CPU
   every ~2 µs;
   the fastest answer, at the price of a busy core.
2. nap (`nap_window_s`, default 0: no nap): sleep in short naps that grow (`NAP_FIRST_US`,
   doubling up to `NAP_MAX_US`), re-checking the condition after each, until the window ends.
   The "sleeping" flag stays clear, so the other side's publish never has to post the
   semaphore (a futex wake of a sleeping process, tens of µs on the other side's critical
   path): as in the LMAX Disruptor's SleepingWaitStrategy, the waiter pays for its own wake-up,
   up to a nap late, with a timer wake-up per nap (~20 µs of CPU in a VM, ~100 µs after a
   long nap, when the caches have gone cold). Waits that recur at a steady pace (a peer's
   steps) cost fewer wake-ups: when the last `RECENT_WAITS` waits all took at least T, the
   phase starts with one nap until `EXPECTED_FRACTION` x T and goes on with the longest naps
   (a ~10 ms wait: 2-3 wake-ups instead of ~15); and when that point lies beyond the window,
   there is no nap at all: the waiter would sleep anyway, so it sleeps at once. A wait
   shorter than its predecessors is answered up to that first nap late, once (the next wait
   expects less).
3. sleep: arm the flag and block (no CPU until woken, whatever the wait). On Linux (a "futex
   ring", the default there) the waiter sleeps in the kernel on its own sleeping flag, a word of
   the ring's header, with FUTEX_WAIT, and the other side wakes it with FUTEX_WAKE on that word
   right after publishing: no named semaphore, no file in /dev/shm, and the whole
   arm-check-sleep-disarm is one C call (`ipc_sleep_*` in `_native.c`); woken with nothing there
   yet (a big message's producer wakes us before its copy: `ipc_push`), that call spins for the
   publish before it returns. Elsewhere (a
   "semaphore ring") it sleeps on a named POSIX semaphore that the other side posts.

All phases release the GIL: the spin, the nap and the futex sleep run inside the C helper, and
the semaphore sleep is a ctypes call (or posix_ipc's `acquire`, which releases the GIL too). So a
thread waiting on a ring never starves the other threads of its process.

No wake-up is lost (the sleep/wake handshake): before sleeping, the waiter sets its "sleeping"
flag, runs a seq_cst fence and re-checks the condition (and, on a futex ring, the peer's
"closed" flag); the other side publishes its counter (or its "closed" flag), runs a seq_cst
fence and reads the flag, waking the waiter if it was set. With a fence on both sides, at least
one of them sees the other's store. On a futex ring the waker clears the flag before
FUTEX_WAKE and the waiter sleeps only while the flag still reads 1 (the kernel checks that
atomically with the wake), so a wake that comes between the waiter's re-check and its
FUTEX_WAIT is not lost either (the full argument is at `ring_sleep` in `_native.c`); on a
semaphore ring the post stays counted until the waiter takes it. The spin and the nap only load
the other side's counter (acquire, like every look at it) and set no flag, so they need no
handshake: a publish they miss is seen by the sleep's re-check, which follows them.

A sleeping waiter also wakes every `poll_interval` seconds to ask `check_peer` whether the
other side is still alive, so a dead peer is noticed within about that interval (only when the
condition does not hold: /proc is not read on the wake-up path); a napping waiter asks it after
every `poll_interval` of naps. A peer found gone is reported
only if the condition still does not hold when looked at again: a peer that pushes its last
message and then closes (or dies) between our look at the counter and our look at the peer
would otherwise be reported gone with that message unread. The peer's close follows its last
publish, and our look at its state (an acquire load) precedes that second look at the counter,
so whoever sees the peer gone also sees everything it published.

Signals: a Python signal handler that raises (a SIGALRM timeout, say) interrupts a blocked
wait, as it would `time.sleep`. posix_ipc's `acquire` runs the handler itself on EINTR and
replaces any exception but KeyboardInterrupt with its own SignalError, so the sleep calls libc's
`sem_clockwait` through ctypes on the same named semaphore instead: a signal makes it return
EINTR to Python, where the handler runs, and raises from the wait if it raises (nothing is held
that would need undoing). Where libc has no `sem_clockwait` (glibc < 2.30, not Linux), the
sleep is posix_ipc's, and only KeyboardInterrupt gets through. The spin and the nap return to
Python at least every nap (the C nap returns early on EINTR), where the handler runs too.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import functools
import math
import os
import sys
import time
import weakref
from typing import Callable, Optional

import posix_ipc

# The nap phase's schedule: the first nap, doubled after each look up to the longest. A message
# that lands during a nap waits for its end: at most NAP_MAX_US (plus the kernel's timer slack,
# 50 µs by default) late. A waiter that naps through 100 ms looks ~110 times (~0.1-0.5% of a core).
NAP_FIRST_US = 50.0
NAP_MAX_US = 1000.0
RECENT_WAITS = 4  # how many past waits predict the next one (their shortest does)
EXPECTED_FRACTION = 0.9  # of that shortest wait, napped through in one go


class _LibcSemaphore:
    """A named semaphore opened (again) through libc, to sleep on it with ctypes: the call
    releases the GIL, and a signal ends it with EINTR back in Python (see the module docstring)."""

    def __init__(self, libc: ctypes.CDLL, handle: int) -> None:
        self._handle = ctypes.c_void_p(handle)
        self._clockwait = libc.sem_clockwait
        self._deadline = (ctypes.c_long * 2)()  # struct timespec
        self._deadline_ref = ctypes.byref(self._deadline)
        weakref.finalize(self, libc.sem_close, self._handle)

    @classmethod
    def open(cls, name: str) -> Optional["_LibcSemaphore"]:
        """The semaphore `name` (which exists) through libc; None where that is not possible."""
        libc = _libc()
        if libc is None:
            return None
        handle = libc.sem_open(name.encode(), 0)
        return cls(libc, handle) if handle else None

    def wait(self, timeout: float) -> bool:
        """True if acquired within `timeout` s; False on a timeout or a signal (whose handler
        runs, and may raise, on return)."""
        end = time.clock_gettime_ns(time.CLOCK_MONOTONIC) + int(timeout * 1e9)
        self._deadline[0], self._deadline[1] = divmod(end, 1_000_000_000)
        if self._clockwait(self._handle, time.CLOCK_MONOTONIC, self._deadline_ref) == 0:
            return True
        err = ctypes.get_errno()
        if err in (errno.ETIMEDOUT, errno.EINTR, errno.EAGAIN):
            return False
        raise OSError(err, f"sem_clockwait: {os.strerror(err)}")


@functools.lru_cache(maxsize=1)
def _libc() -> Optional[ctypes.CDLL]:
    """libc with sem_open / sem_clockwait / sem_close set up for ctypes, or None."""
    if not hasattr(time, "CLOCK_MONOTONIC"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.sem_open.restype = ctypes.c_void_p
        libc.sem_open.argtypes = [ctypes.c_char_p, ctypes.c_int]
        libc.sem_clockwait.restype = ctypes.c_int
        libc.sem_close.argtypes = [ctypes.c_void_p]
    except (OSError, AttributeError):  # no such functions here (glibc < 2.30, macOS)
        return None
    return libc


_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # <linux/futex.h>
# SYS_futex where Python code makes the syscall itself (the pure-Python ring, no C helper).
_SYS_FUTEX = {"x86_64": 202, "aarch64": 98, "arm64": 98, "riscv64": 98, "ppc64le": 221, "ppc64": 221, "s390x": 238}


@functools.lru_cache(maxsize=1)
def _syscall() -> Optional[Callable[..., int]]:
    """libc's syscall(2) for SYS_futex from Python, or None where that is not possible."""
    number = _SYS_FUTEX.get(os.uname().machine) if sys.platform.startswith("linux") else None
    libc = _libc()
    if number is None or libc is None:
        return None
    call = libc.syscall
    call.restype = ctypes.c_long
    return functools.partial(call, ctypes.c_long(number))


def futex_wait_py(address: int, expected: int, timeout_ns: int) -> int:
    """FUTEX_WAIT through ctypes (GIL released): `ipc_futex_wait`'s results, 0 woken or the word
    differed, 1 timeout, 2 signal."""
    ts = (ctypes.c_long * 2)(*divmod(max(timeout_ns, 0), 1_000_000_000))
    if _syscall()(ctypes.c_void_p(address), _FUTEX_WAIT, ctypes.c_uint32(expected), ctypes.byref(ts), None, 0) == 0:
        return 0
    err = ctypes.get_errno()
    return 1 if err == errno.ETIMEDOUT else 2 if err == errno.EINTR else 0


def futex_wake_py(address: int, n: int) -> int:
    """FUTEX_WAKE through ctypes: how many sleepers were woken."""
    return max(0, _syscall()(ctypes.c_void_p(address), _FUTEX_WAKE, n, None, None, 0))


def futex_supported(native: bool) -> bool:
    """Whether this process can sleep on and wake a futex: Linux, with the C helper (`native`)
    or with a known SYS_futex for ctypes."""
    return sys.platform.startswith("linux") and (native or _syscall() is not None)


def futex_wait(address: int, expected: int, timeout: float) -> int:
    """Sleeps while the aligned 32-bit word at `address` (in a shared mapping) equals `expected`,
    at most `timeout` seconds, with the GIL released. Returns 0 when woken (or the word had
    changed), 1 on timeout, 2 when a signal ended the sleep (its Python handler has run, and
    raises from here if it raises). For any ipc structure that sleeps on a word of its own;
    the waker changes the word first, then calls `futex_wake`: no wake-up can be lost."""
    if not timeout >= 0:
        raise ValueError(f"timeout must be >= 0, got {timeout}")
    ext = _ext()
    if ext is not None:
        return ext.futex_wait(address, expected, int(timeout * 1e9))
    if _syscall() is None:
        raise OSError(errno.ENOSYS, "futexes need Linux")
    return futex_wait_py(address, expected, int(timeout * 1e9))


def futex_wake(address: int, n: int = 1) -> int:
    """Wakes up to `n` processes sleeping in `futex_wait` on the word at `address`."""
    ext = _ext()
    if ext is not None:
        return ext.futex_wake(address, n)
    if _syscall() is None:
        raise OSError(errno.ENOSYS, "futexes need Linux")
    return futex_wake_py(address, n)


def _ext():
    from ipc.ring import _native_lib  # the C helper, built once per process

    lib = _native_lib()
    return None if lib is None else lib.ext


class RingTimeoutError(TimeoutError):
    """A wait on a ring ran out of time (a TimeoutError of the ring's own, so that a caller can
    tell it from a TimeoutError that a signal handler raised during the wait)."""


def check_wait_params(spin_us: float, nap_window_s: float, poll_interval: float) -> None:
    """ValueError naming the field when a wait setting is out of range (NaN included)."""
    if not spin_us >= 0:
        raise ValueError(f"spin_us must be >= 0, got {spin_us}")
    if not (nap_window_s >= 0 and math.isfinite(nap_window_s)):
        raise ValueError(f"nap_window_s must be a finite number >= 0, got {nap_window_s}")
    if not poll_interval > 0:
        raise ValueError(f"poll_interval must be > 0, got {poll_interval}")


class Doorbell:
    """A named counting POSIX semaphore (0600): one process sleeps on it, one or more ring it.

    The ring's semaphore wake-up (two per ring, where there are no futexes) and a data-parallel
    frontend's wait on N engines (shmvllm.boundary.doorbell) are both this.
    """

    def __init__(self, sem: posix_ipc.Semaphore, creator: bool) -> None:
        self._sem = sem
        self.name: str = sem.name
        self._creator = creator
        self._closed = False
        self._sleeper = _LibcSemaphore.open(sem.name)  # None: sleep with posix_ipc

    @classmethod
    def create(cls, name: Optional[str] = None) -> "Doorbell":
        """A new semaphore at 0, named `name` or, by default, like ipc's segments (creator pid and
        64 random bits, so that `sweep_stale_segments` removes it after a killed creator)."""
        from ipc.segment import new_name

        name = new_name() + "-bell" if name is None else name
        return cls(posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=0o600, initial_value=0), True)

    @classmethod
    def attach(cls, name: str) -> "Doorbell":
        return cls(posix_ipc.Semaphore(name), False)

    def ring(self) -> None:
        self._sem.release()

    def clear(self) -> None:
        """Takes every ring so far (a waiter, before it looks at what the rings announce)."""
        acquire = self._sem.acquire
        try:
            while True:
                acquire(0)
        except posix_ipc.BusyError:
            pass

    def wait(self, timeout: float) -> bool:
        """Sleeps until rung or `timeout` seconds pass (GIL released); True if rung.

        A signal ends the sleep early (False): its handler runs on return and raises from
        here if it raises; one that returns (SIGCHLD, SIGUSR1, a profiler's timer) leaves the
        wait going. (With posix_ipc's sleep only KeyboardInterrupt gets through: see the module
        docstring.)
        """
        timeout = max(timeout, 0.0)
        if self._sleeper is not None:
            return self._sleeper.wait(timeout)
        try:
            self._sem.acquire(timeout)
        except (posix_ipc.BusyError, posix_ipc.SignalError):
            return False
        return True

    def close(self) -> None:
        """Closes it here; the creator also removes it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._sem.close()
        finally:
            if self._creator:
                try:
                    posix_ipc.unlink_semaphore(self.name)
                except posix_ipc.ExistentialError:
                    pass


def semaphore_sleep(arm: Callable[..., int], disarm: Callable[[], None], bell: Doorbell) -> Callable[..., int]:
    """The sleep of a semaphore ring, with the interface of the C `ipc_sleep_*`:
    sleep(*args, timeout_ns) -> 1 the condition holds, 0 not yet (the caller loops). A closed
    peer posts the semaphore (it stays counted), so this never needs to report one (2)."""

    def sleep(*args: int) -> int:
        if arm(*args[:-1]):
            return 1
        try:
            bell.wait(args[-1] / 1e9)
        finally:
            disarm()
        return 0

    return sleep


class Waiter:
    """One side's wait for one condition (data to read, or space to write).

    spin(*args, ns) -> true if the condition held within ns nanoseconds (GIL released);
    nap(*args, window_ns, first_ns, max_ns) -> the same, napping (see the module docstring);
    sleep(*args, timeout_ns) -> arms the flag, sleeps until woken or timeout_ns, disarms: 1 the
    condition holds, 2 the peer closed, 0 not yet (GIL released);
    arm(*args) -> true if the condition already holds (then the sleeping flag is withdrawn);
    disarm() clears the sleeping flag; check_peer() raises if waiting is hopeless.
    """

    def __init__(
        self,
        spin: Callable[..., int],
        arm: Callable[..., int],
        disarm: Callable[[], None],
        sleep: Callable[..., int],
        check_peer: Callable[[], None],
        spin_us: float,
        poll_interval: float,
        nap: Optional[Callable[..., int]] = None,
        nap_window_s: float = 0.0,
    ) -> None:
        check_wait_params(spin_us, nap_window_s, poll_interval)
        if nap is None and nap_window_s > 0:
            raise ValueError(f"nap_window_s={nap_window_s} needs a nap function")
        self._spin, self._nap, self._arm, self._disarm = spin, nap, arm, disarm
        self._sleep, self._check_peer = sleep, check_peer
        self.spin_ns = int(spin_us * 1000)
        self.nap_window_s = nap_window_s
        self.poll_interval = poll_interval
        self._recent: collections.deque[float] = collections.deque(maxlen=RECENT_WAITS)

    def wait(self, deadline: Optional[float], *args: int, spin: bool = True) -> None:
        """Returns once the condition holds; TimeoutError at `deadline` (time.monotonic()).
        spin=False: skip the spin phase (the caller has just spun)."""
        started = time.monotonic()
        self._wait(started, deadline, args, spin)
        if self.nap_window_s > 0:
            self._recent.append(time.monotonic() - started)

    def _wait(self, started: float, deadline: Optional[float], args: tuple, spin: bool) -> None:
        spin_ns = self.spin_ns if spin else 0
        if deadline is not None:
            spin_ns = min(spin_ns, int((deadline - started) * 1e9))
        if spin_ns > 0 and self._spin(*args, spin_ns):
            return
        if self.nap_window_s > 0 and self._nap_through(started, deadline, args):
            return
        while True:
            step = self.poll_interval
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    if self._arm(*args):
                        return
                    self._disarm()
                    raise RingTimeoutError("timed out waiting on the ring")
                step = min(step, remaining)
            if self._sleep(*args, int(step * 1e9)) == 1:
                return
            if self._look_at_peer(args):  # after each poll interval, and at once when it closed
                return

    def _nap_through(self, started: float, deadline: Optional[float], args: tuple) -> bool:
        """The nap phase: True once the condition holds, False when the window (or the deadline)
        ran out. Looks at the peer after every `poll_interval` of naps."""
        now = time.monotonic()
        end = now + self.nap_window_s
        if deadline is not None:
            end = min(end, deadline)
        expected = now
        if len(self._recent) == RECENT_WAITS:
            expected = started + EXPECTED_FRACTION * min(self._recent)
            if expected >= end:  # recent waits outlasted the window: this one will sleep anyway
                return False
        first_ns, max_ns = int(NAP_FIRST_US * 1000), int(NAP_MAX_US * 1000)
        look_at = now + self.poll_interval
        while now < end:
            if expected - now > NAP_MAX_US * 1e-6:  # one nap until shortly before it is expected
                ns = int((min(expected, end, look_at) - now) * 1e9)
                found = self._nap(*args, ns, ns, ns)
            else:
                found = self._nap(*args, int((min(end, look_at) - now) * 1e9), first_ns, max_ns)
            if found:
                return True
            first_ns = max_ns  # the schedule goes on where it was, not from the first nap
            now = time.monotonic()
            if now >= look_at:
                if self._look_at_peer(args):
                    return True
                look_at = now + self.poll_interval
        return False

    def look_at_peer(self, *args: int) -> bool:
        """For a caller that slept a poll interval through itself: raises if the peer is gone
        (and the condition still does not hold); True if the condition holds by now."""
        return self._look_at_peer(args)

    def _look_at_peer(self, args: tuple) -> bool:
        """False if the peer is there; True if it is gone but the condition holds by now (its
        last publish landed between our look at the counter and our look at the peer); else
        raises what check_peer raised."""
        try:
            self._check_peer()
        except BaseException:
            if self._arm(*args):
                return True
            self._disarm()
            raise
        return False
