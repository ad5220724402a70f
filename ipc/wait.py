"""How a side of a ring waits: spin briefly, optionally nap, then sleep on a named semaphore.

1. spin (`spin_us`): re-check the condition every few hundred ns, yielding the CPU every ~2 µs;
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
3. sleep: arm the flag and block on the semaphore (no CPU until woken, whatever the wait).

All phases release the GIL: the spin and the nap run inside the C helper (a ctypes CDLL call),
and posix_ipc's `acquire` releases the GIL while it blocks. So a thread waiting on a ring never
starves the other threads of its process.

No wake-up is lost (the sleep/wake handshake): before sleeping, the waiter sets its "sleeping"
flag, runs a seq_cst fence and re-checks the condition (`arm`); the other side publishes its
counter, runs a seq_cst fence and reads the flag, posting the semaphore if it was set. With a
fence on both sides, at least one of them sees the other's store (see `_native.c`). The spin
and the nap only load the other side's counter (acquire, like every look at it) and set no
flag, so they need no handshake: a publish they miss is seen by `arm`, which follows them.

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
    """A named POSIX semaphore (0600) that one side sleeps on and the other side rings."""

    def __init__(self, sem: posix_ipc.Semaphore) -> None:
        self._sem = sem
        self.name = sem.name
        self._sleeper = _LibcSemaphore.open(sem.name)  # None: sleep with posix_ipc

    @classmethod
    def create(cls, name: str) -> "Doorbell":
        return cls(posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=0o600, initial_value=0))

    @classmethod
    def attach(cls, name: str) -> "Doorbell":
        return cls(posix_ipc.Semaphore(name))

    def ring(self) -> None:
        self._sem.release()

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


class Waiter:
    """One side's wait for one condition (data to read, or space to write).

    spin(*args, ns) -> true if the condition held within ns nanoseconds (GIL released);
    nap(*args, window_ns, first_ns, max_ns) -> the same, napping (see the module docstring);
    arm(*args) -> true if the condition already holds (then the sleeping flag is withdrawn);
    disarm() clears the sleeping flag; check_peer() raises if waiting is hopeless.
    """

    def __init__(
        self,
        spin: Callable[..., int],
        arm: Callable[..., int],
        disarm: Callable[[], None],
        bell: Doorbell,
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
        self._bell, self._check_peer = bell, check_peer
        self.spin_ns = int(spin_us * 1000)
        self.nap_window_s = nap_window_s
        self.poll_interval = poll_interval
        self._recent: collections.deque[float] = collections.deque(maxlen=RECENT_WAITS)

    def wait(self, deadline: Optional[float], *args: int) -> None:
        """Returns once the condition holds; TimeoutError at `deadline` (time.monotonic())."""
        started = time.monotonic()
        self._wait(started, deadline, args)
        if self.nap_window_s > 0:
            self._recent.append(time.monotonic() - started)

    def _wait(self, started: float, deadline: Optional[float], args: tuple) -> None:
        spin_ns = self.spin_ns
        if deadline is not None:
            spin_ns = min(spin_ns, int((deadline - started) * 1e9))
        if spin_ns > 0 and self._spin(*args, spin_ns):
            return
        if self.nap_window_s > 0 and self._nap_through(started, deadline, args):
            return
        slept = False
        while True:
            if self._arm(*args):
                return
            if slept and self._look_at_peer(args):
                return
            step = self.poll_interval
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._disarm()
                    raise RingTimeoutError("timed out waiting on the ring")
                step = min(step, remaining)
            try:
                self._bell.wait(step)
            finally:
                self._disarm()
            slept = True

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
