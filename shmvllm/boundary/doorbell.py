"""One doorbell for N engines: how a data-parallel frontend waits on N output rings at once.

Each of the N engines has its own channel (two SPSC rings: the rings stay single-producer,
single-consumer). The frontend does not spin over N rings: it sleeps on one named POSIX
semaphore (`ipc.wait.Doorbell`) that every engine posts after each message it puts on its output ring
(`RungEndpoint`), then drains the rings that hold something.

No wake-up is lost. The frontend's wait is: `clear()` (take every post made so far, with
sem_trywait), then look at every ring, then, if none held a message, `wait()` (sem_timedwait).
An engine's send is: publish the message (the ring's release store of its tail), then post.
Take a message M that the frontend has not read when it starts `wait()`, and M's post P:
- if P was taken by `clear()`, then M's publication happened before P, and P before that
  sem_trywait returned (a semaphore's post and the wait that takes it synchronize: release /
  acquire), which came before the look at M's ring: the look saw M, and the frontend read it,
  which contradicts the assumption;
- otherwise P is still counted (only the frontend takes posts, and a counting semaphore adds
  every post, whatever the other engines post at the same time), so `wait()` returns at once.
So a message is either seen by the look that follows `clear()` or makes the next `wait()`
return. A post whose message an earlier look already read costs one empty look (a spurious
wake-up), never a lost one. Posting is a user-space atomic increment unless the frontend sleeps
(glibc wakes the futex only when there are waiters), so the engines pay for it only when the
frontend is asleep and has to be woken anyway.

The semaphore is ipc's `Doorbell`, named as ipc's segments are (creator pid, 64 random bits),
so that `ipc.sweep_stale_segments` removes it when the frontend died without closing it.
"""

from __future__ import annotations

from typing import Any, Optional

import msgspec

from ipc.wait import Doorbell
from shmvllm.boundary.channel import Addresses, Decode, Endpoint
from shmvllm.boundary.channel import open_engine as _open_engine
from shmvllm.boundary.channel import open_frontend as _open_frontend


class RungEndpoint(Endpoint):
    """An engine's endpoint that rings the doorbell after every message it sends."""

    def __init__(self, inner: Endpoint, doorbell: Doorbell) -> None:
        self._inner, self._doorbell = inner, doorbell
        self.max_message = inner.max_message
        self.try_recv = inner.try_recv  # type: ignore[method-assign]

    def send(self, data: bytes, timeout: Optional[float] = None) -> None:
        self._inner.send(data, timeout)
        self._doorbell.ring()

    def try_send(self, data: bytes) -> bool:
        if self._inner.try_send(data):
            self._doorbell.ring()
            return True
        return False

    def recv(self, decode: Decode, timeout: Optional[float]) -> Any:
        return self._inner.recv(decode, timeout)

    def try_recv(self, decode: Decode) -> Any:  # replaced per instance in __init__
        return self._inner.try_recv(decode)

    def close(self) -> None:
        try:
            self._inner.close()
        finally:
            self._doorbell.close()

    def remove_orphaned(self) -> None:
        self._inner.remove_orphaned()  # the sweep takes the doorbell too (it carries the frontend's pid)


def open_frontend_rung(doorbell: Doorbell) -> tuple[Endpoint, Addresses]:
    """One engine's channel (the ordinary rings), whose engine side rings `doorbell`."""
    endpoint, addresses = _open_frontend()
    return endpoint, msgspec.structs.replace(addresses, opener=f"{__name__}:open_engine", doorbell=doorbell.name)


def open_engine(addresses: Addresses) -> Endpoint:
    """The engine's side of `open_frontend_rung`'s channel."""
    if addresses.doorbell is None:
        raise ValueError(f"{addresses!r} names no doorbell")
    inner = _open_engine(addresses)
    try:
        return RungEndpoint(inner, Doorbell.attach(addresses.doorbell))
    except BaseException:
        inner.close()
        raise
