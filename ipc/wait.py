"""How a side of a ring waits: spin briefly, then sleep on a named semaphore.

Both phases release the GIL: the spin runs inside the C helper (a ctypes CDLL call), and
posix_ipc's `acquire` releases the GIL while it blocks. So a thread waiting on a ring never
starves the other threads of its process.

No wake-up is lost (the sleep/wake handshake): before sleeping, the waiter sets its "sleeping"
flag, runs a seq_cst fence and re-checks the condition (`arm`); the other side publishes its
counter, runs a seq_cst fence and reads the flag, posting the semaphore if it was set. With a
fence on both sides, at least one of them sees the other's store (see `_native.c`).

A sleeping waiter also wakes every `poll_interval` seconds to ask `check_peer` whether the
other side is still alive, so a dead peer is noticed within about that interval (only when the
condition does not hold: /proc is not read on the wake-up path). A peer found gone is reported
only if the condition still does not hold when looked at again: a peer that pushes its last
message and then closes (or dies) between our look at the counter and our look at the peer
would otherwise be reported gone with that message unread. The peer's close follows its last
publish, and our look at its state (an acquire load) precedes that second look at the counter,
so whoever sees the peer gone also sees everything it published.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import posix_ipc


class Doorbell:
    """A named POSIX semaphore (0600) that one side sleeps on and the other side rings."""

    def __init__(self, sem: posix_ipc.Semaphore) -> None:
        self._sem = sem
        self.name = sem.name

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

        A signal interrupts the sleep (EINTR, posix_ipc.SignalError): that is a spurious
        wake-up, not an error. The Python handler runs as soon as we are back in bytecode and
        raises from there if it wants to (KeyboardInterrupt); a handler that returns (SIGCHLD,
        SIGUSR1, a profiler's timer) must not turn a blocked pop or push into an exception.
        """
        try:
            self._sem.acquire(max(timeout, 0.0))
        except (posix_ipc.BusyError, posix_ipc.SignalError):
            return False
        return True


class Waiter:
    """One side's wait for one condition (data to read, or space to write).

    spin(*args, ns) -> true if the condition held within ns nanoseconds (GIL released);
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
    ) -> None:
        if spin_us < 0:
            raise ValueError(f"spin_us must be >= 0, got {spin_us}")
        if poll_interval <= 0:
            raise ValueError(f"poll_interval must be > 0, got {poll_interval}")
        self._spin, self._arm, self._disarm = spin, arm, disarm
        self._bell, self._check_peer = bell, check_peer
        self.spin_ns = int(spin_us * 1000)
        self.poll_interval = poll_interval

    def wait(self, deadline: Optional[float], *args: int) -> None:
        """Returns once the condition holds; TimeoutError at `deadline` (time.monotonic())."""
        spin_ns = self.spin_ns
        if deadline is not None:
            spin_ns = min(spin_ns, int((deadline - time.monotonic()) * 1e9))
        if spin_ns > 0 and self._spin(*args, spin_ns):
            return
        slept = False
        while True:
            if self._arm(*args):
                return
            if slept:
                try:
                    self._check_peer()
                except BaseException:
                    if self._arm(*args):  # the peer's last publish landed between our two looks
                        return
                    self._disarm()
                    raise
            step = self.poll_interval
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._disarm()
                    raise TimeoutError("timed out waiting on the ring")
                step = min(step, remaining)
            try:
                self._bell.wait(step)
            finally:
                self._disarm()
            slept = True
