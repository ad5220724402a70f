"""The channel between the frontend and the engine process: shared-memory rings or ZeroMQ.

Both transports carry the same msgspec messages with the same msgpack encoding, so comparing
them measures the channel and nothing else:

- "shm": two `ipc.RingBuffer`s (frontend -> engine, engine -> frontend), created by the frontend,
  attached by the engine by name. Receiving decodes straight from the ring's memory; sending
  encodes to bytes, which the C helper copies into the ring in the same call that publishes
  them. A side blocked on a dead peer gets `ipc.PeerGoneError`.
- "zmq": two pyzmq PUSH/PULL pairs over ipc:// sockets in a private temporary directory (what
  vLLM uses), bound by the frontend, connected by the engine. ZeroMQ never reports a dead
  peer: both sides watch their peer process themselves (see core_client and core_proc).

`open_frontend(kind)` creates the channel and returns the frontend's `Endpoint` and the
`Addresses` the engine passes to `open_engine`. The creator removes everything on `close()`;
`remove_orphaned` is for the engine when the frontend died without closing, and `open_frontend`
sweeps the rings of runs where both processes died.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from abc import ABC, abstractmethod
from typing import Any, Callable, Optional

import msgspec

from ipc import RingTimeoutError

TRANSPORTS = ("shm", "zmq")
RING_CAPACITY = 4 << 20  # bytes per ring; SHMVLLM_RING_CAPACITY overrides it
RING_CAPACITY_ENV = "SHMVLLM_RING_CAPACITY"
# A receive that found nothing in time: the channel's own TimeoutError (a TimeoutError raised by
# a signal handler during the wait is not one, and goes up to the caller).
ChannelTimeout = RingTimeoutError
FULL_RETRY_S = 0.005  # how long a send with `while_full` waits for room between two calls of it
# The frontend waits for each step's outputs by napping through this window before it sleeps
# on the ring's semaphore (see ipc.wait). While it naps, the engine's send is a copy and a
# counter store; once it sleeps, the send also wakes it: a futex wake of another process,
# 23-31 µs on a 2-core VM, on the engine's critical path at every step. The naps are paid in
# the frontend's CPU instead (~100 µs a wait for a 10 ms step, against ~75 µs to be woken), so
# they are only worth it where the frontend has a core of its own: when the engine's torch
# threads take every core, each nap's wake-up preempts one of them and holds up the other at the
# next barrier (SmolLM2-135M single-sequence decode on 2 cores: 3.5% slower with naps). Hence
# `frontend_nap_window()`. 20 ms covers the tiny model's steps in benchmarks/e2e_overhead.py
# (1 and ~10 ms); a step that outlasts it (a 64-sequence step of a 135M model, ~170 ms, where the
# wake-up is < 0.1%) makes the waiter, seeing its recent waits do, sleep at once.
FRONTEND_NAP_WINDOW_S = 0.02
# No spin before napping or sleeping: the engine answers after a step, or after waking up when
# idle (tens of µs at least), so a spin would mostly burn CPU that on two cores the engine may
# need (the ipc default, 200 µs, is 14% of a core at 1.4 ms steps).
FRONTEND_SPIN_US = 0.0

Decode = Callable[[Any], Any]


def ring_capacity() -> int:
    """The rings' capacity: $SHMVLLM_RING_CAPACITY (bytes, a multiple of 8 in [256, 512 MiB]),
    else RING_CAPACITY."""
    from ipc import layout

    raw = os.environ.get(RING_CAPACITY_ENV)
    if raw is None:
        return RING_CAPACITY
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value % 8 or not layout.MIN_CAPACITY <= value <= layout.MAX_CAPACITY:
        raise ValueError(
            f"{RING_CAPACITY_ENV} must be a multiple of 8 in [{layout.MIN_CAPACITY}, {layout.MAX_CAPACITY}] "
            f"bytes, got {raw!r}."
        )
    return value


def _check_shm_space(capacity: int) -> None:
    """A clear error, before anything is created, when /dev/shm cannot hold both rings."""
    from ipc import SharedMemoryFullError, layout
    from ipc.segment import SEMAPHORE_BYTES, SHM_DIR, free_bytes

    needed = 2 * (layout.HEADER_SIZE + capacity + 2 * SEMAPHORE_BYTES)
    free = free_bytes()
    if free is not None and free < needed:
        raise SharedMemoryFullError(
            needed, free, SHM_DIR,
            f"the two frontend<->engine rings ({RING_CAPACITY_ENV}={capacity} bytes each)",
        ).with_hint(
            f"free space in {SHM_DIR}, set {RING_CAPACITY_ENV} to fewer bytes (messages longer than "
            "a quarter of it travel in fragments), or pass transport='zmq'"
        )


def frontend_nap_window() -> float:
    """FRONTEND_NAP_WINDOW_S when the engine's torch threads (OMP_NUM_THREADS, which the engine
    process inherits, else torch's default of one per core) leave this process a core; else 0."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        engine_threads = int(os.environ.get("OMP_NUM_THREADS", "")) or cores
    except ValueError:
        engine_threads = cores
    return FRONTEND_NAP_WINDOW_S if engine_threads < cores else 0.0


class PeerMissingError(ConnectionError):
    """The zmq peer is not connected (it died, or never came): sending cannot succeed."""


class Addresses(msgspec.Struct, frozen=True):
    """What the engine needs to reach the frontend: ring names or socket paths."""

    kind: str
    to_engine: str
    to_frontend: str


class Endpoint(ABC):
    """One side of the channel: sends to the peer, receives from it."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()

    @abstractmethod
    def send(self, msg: Any, timeout: Optional[float] = None, while_full: Optional[Callable[[], None]] = None) -> None:
        """Encodes and sends; ChannelTimeout if it could not within `timeout` s (a full ring).

        while_full: called over and over while the message waits for room (the frontend drains
        the engine's outputs there: the engine may be waiting for room on the other ring).
        """

    @abstractmethod
    def recv(self, decode: Decode, timeout: Optional[float]) -> Any:
        """The next message passed through `decode`; ChannelTimeout when none came in `timeout` s."""

    @abstractmethod
    def try_recv(self, decode: Decode) -> Any:
        """The next message decoded, or None when none is there (never blocks)."""

    @abstractmethod
    def close(self) -> None:
        """Closes this side; the creator also removes the channel's files and segments."""


class ShmEndpoint(Endpoint):
    def __init__(self, send_ring: Any, recv_ring: Any) -> None:
        super().__init__()
        self._send_ring, self._recv_ring = send_ring, recv_ring
        self._push, self._consume = send_ring.push, recv_ring.consume
        # The engine polls this after every step: the ring's own method, without a Python frame
        # of ours around it (each costs a few µs when a step has just evicted the caches).
        self.try_recv = recv_ring.try_consume  # type: ignore[method-assign]

    def send(self, msg: Any, timeout: Optional[float] = None, while_full: Optional[Callable[[], None]] = None) -> None:
        # bytes, not a reused bytearray: a bytes push is one C call (reserve, copy, publish)
        # instead of two and a slice copy in between
        buf = self._encoder.encode(msg)
        if while_full is None or len(buf) > self._send_ring.max_payload:
            # A fragmented message cannot be retried in pieces (a timed-out push aborts it).
            self._push(buf, timeout)
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        wait = 0.0  # a full ring calls while_full at once, then every FULL_RETRY_S
        while True:
            try:
                self._push(buf, wait if deadline is None else max(min(wait, deadline - time.monotonic()), 0.0))
                return
            except ChannelTimeout:
                if deadline is not None and time.monotonic() >= deadline:
                    raise
            while_full()
            wait = FULL_RETRY_S

    def recv(self, decode: Decode, timeout: Optional[float]) -> Any:
        return self._consume(decode, timeout)

    def try_recv(self, decode: Decode) -> Any:  # replaced per instance in __init__
        return self._recv_ring.try_consume(decode)

    def close(self) -> None:
        self._send_ring.close()
        self._recv_ring.close()


class ZmqEndpoint(Endpoint):
    def __init__(self, ctx: Any, push: Any, pull: Any, owned_dir: Optional[str]) -> None:
        super().__init__()
        import zmq

        self._zmq = zmq
        self._ctx, self._push, self._pull, self._owned_dir = ctx, push, pull, owned_dir

    def send(self, msg: Any, timeout: Optional[float] = None, while_full: Optional[Callable[[], None]] = None) -> None:
        # The queue is unbounded, so the only reason to block is a peer that is not there.
        try:
            self._push.send(self._encoder.encode(msg), self._zmq.NOBLOCK)
        except self._zmq.Again:
            raise PeerMissingError("no peer is connected to the zmq socket") from None

    def recv(self, decode: Decode, timeout: Optional[float]) -> Any:
        try:  # what is already there costs one call, as with the ring
            return decode(self._pull.recv(self._zmq.NOBLOCK))
        except self._zmq.Again:
            pass
        if not self._pull.poll(None if timeout is None else int(timeout * 1000)):
            raise ChannelTimeout("nothing received on the zmq socket")
        return decode(self._pull.recv())

    def try_recv(self, decode: Decode) -> Any:
        try:
            data = self._pull.recv(self._zmq.NOBLOCK)
        except self._zmq.Again:
            return None
        return decode(data)

    def close(self) -> None:
        self._push.close(linger=0)
        self._pull.close(linger=0)
        self._ctx.term()
        if self._owned_dir is not None:
            shutil.rmtree(self._owned_dir, ignore_errors=True)


def _zmq_socket(ctx: Any, kind: int, path: str, bind: bool) -> Any:
    import zmq

    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)  # unbounded queues: a send never blocks on a slow peer
    sock.setsockopt(zmq.RCVHWM, 0)
    (sock.bind if bind else sock.connect)(f"ipc://{path}")
    return sock


def open_frontend(kind: str) -> tuple[Endpoint, Addresses]:
    """Creates the channel; returns the frontend's endpoint and the engine's addresses."""
    if kind == "shm":
        from ipc import RingBuffer, sweep_stale_segments

        sweep_stale_segments()  # what runs killed with kill -9 (both processes) left behind
        capacity = ring_capacity()
        _check_shm_space(capacity)
        to_engine = RingBuffer.create(capacity, prefault=True)
        try:
            to_frontend = RingBuffer.create(
                capacity, prefault=True, spin_us=FRONTEND_SPIN_US, nap_window_s=frontend_nap_window()
            )
        except BaseException:
            to_engine.close()
            raise
        return ShmEndpoint(to_engine, to_frontend), Addresses(kind, to_engine.name, to_frontend.name)
    if kind == "zmq":
        import zmq

        sock_dir = tempfile.mkdtemp(prefix="shmvllm-zmq-")
        ctx = zmq.Context(io_threads=1)
        try:
            to_engine = os.path.join(sock_dir, "to_engine")
            to_frontend = os.path.join(sock_dir, "to_frontend")
            push = _zmq_socket(ctx, zmq.PUSH, to_engine, bind=True)
            pull = _zmq_socket(ctx, zmq.PULL, to_frontend, bind=True)
        except BaseException:
            ctx.destroy(linger=0)
            shutil.rmtree(sock_dir, ignore_errors=True)
            raise
        return ZmqEndpoint(ctx, push, pull, sock_dir), Addresses(kind, to_engine, to_frontend)
    raise ValueError(f"transport must be one of {TRANSPORTS}, got {kind!r}")


def open_engine(addresses: Addresses) -> Endpoint:
    """The engine's endpoint, attached to the channel the frontend created."""
    if addresses.kind == "shm":
        from ipc import RingBuffer

        recv_ring = RingBuffer.attach(addresses.to_engine, prefault=True)
        try:
            send_ring = RingBuffer.attach(addresses.to_frontend, prefault=True)
        except BaseException:
            recv_ring.close()
            raise
        return ShmEndpoint(send_ring, recv_ring)
    if addresses.kind == "zmq":
        import zmq

        ctx = zmq.Context(io_threads=1)
        pull = _zmq_socket(ctx, zmq.PULL, addresses.to_engine, bind=False)
        push = _zmq_socket(ctx, zmq.PUSH, addresses.to_frontend, bind=False)
        return ZmqEndpoint(ctx, push, pull, None)
    raise ValueError(f"transport must be one of {TRANSPORTS}, got {addresses.kind!r}")


def remove_orphaned(addresses: Addresses) -> None:
    """Removes what a frontend that died without closing left of this channel."""
    if addresses.kind == "shm":
        from ipc import sweep_stale_segments

        sweep_stale_segments()
    elif addresses.kind == "zmq":
        shutil.rmtree(os.path.dirname(addresses.to_engine), ignore_errors=True)
