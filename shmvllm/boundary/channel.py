"""The channel between the frontend and the engine process, and its one flow-control rule.

`Endpoint` is one side of a bidirectional channel of whole byte messages. The product's is
`ShmEndpoint`: two `ipc.RingBuffer`s (frontend -> engine, engine -> frontend), created by the
frontend (`open_frontend`), attached by the engine by name (`open_engine`); receiving hands the
decoder the message in the ring's own memory. Other implementations (benchmarks/ has one over
ZeroMQ, and one that times the engine's channel calls) plug in through `Addresses.opener`, the
function the engine process calls to open its side.

Flow control (the whole rule; nothing else in shmvllm waits for room):

- The engine never blocks on a send. `EngineOutbox.send` pushes an encoded message if the
  output ring has room, else keeps it, in order, in a local queue that the busy loop flushes
  as far as the ring allows at every turn. A message longer than the ring can take in one go
  travels as pieces (first byte 0xC1, which msgpack never uses) that `FrontendInbox` joins.
- The engine always drains its input: every turn of its busy loop takes every message (or
  fragment) the input ring holds, whatever the outbox holds.
- Back-pressure: while the outbox holds more than `OUTBOX_RING_MULTIPLE` rings' worth of bytes,
  the engine takes no step, so it admits no new request and produces nothing; requests that
  arrive meanwhile wait in the scheduler's queue. The outbox is so bounded by that limit plus
  one step's outputs.
- The frontend's sends may simply block (with a timeout, to watch the engine's health).

Why this cannot deadlock: a deadlock needs a cycle of waits. The engine waits on nothing the
frontend holds: it never waits for room, and when it waits for input it wakes within
`FLUSH_POLL_S` to flush whenever its outbox is not empty. The frontend waits either for room
in the input ring, which the engine empties within one turn of its loop (one step), or for
output, which the engine's outbox delivers as soon as the frontend has read what the ring
holds. So every wait of the frontend ends within about one engine step, and the engine never
waits on the frontend: no cycle, whatever the rings' sizes or the messages' lengths (tested
with rings of a few KiB both ways: tests/test_boundary.py).

The creator removes the rings on `close()`; `remove_orphaned` is for the engine when the
frontend died without closing, and `open_frontend` sweeps the rings of runs where both
processes died.
"""

from __future__ import annotations

import collections
import os
import time
from abc import ABC, abstractmethod
from typing import Any, Callable, Optional

import msgspec

from ipc import RingTimeoutError
from shmvllm import envs
from shmvllm.boundary.messages import decode_from_engine, make_encoder

RING_CAPACITY = 4 << 20  # bytes per ring; SHMVLLM_RING_CAPACITY overrides it
# A receive that found nothing in time, or a send that found no room: the channel's own
# TimeoutError (a TimeoutError raised by a signal handler during the wait is not one).
ChannelTimeout = RingTimeoutError
OUTBOX_RING_MULTIPLE = 4  # the engine stops stepping while its outbox holds more than this many rings' bytes
FLUSH_POLL_S = 0.001  # how long an engine with a non-empty outbox waits for input before it flushes again
POLL_S = 0.25  # how often a blocked side (either) looks at its peer process
LAST_WORDS_S = 1.0  # how long a failing engine tries to deliver its EngineFailed before it exits
ABORT_SEND_TIMEOUT_S = 1.0  # how long the frontend's abort waits for room on a full input ring, then gives up
SHUTDOWN_SEND_TIMEOUT_S = 1.0  # the same for SHUTDOWN (the engine is terminated then)
DEAD_ENGINE_EXIT_S = 1.0  # how long an engine found dead (and its data-parallel peers) gets to exit before the kill
# The frontend naps through each step's wait before it sleeps, so that the engine's send does
# not have to wake it (a futex wake on the engine's critical path), only where the engine's
# threads leave it a core (`frontend_nap_window()`); a window that covers the short steps the
# wake-up would weigh on (benchmarks/results/ipc_latency.md, "The frontend's wait").
FRONTEND_NAP_WINDOW_S = 0.02
# No spin: the engine answers after a step, or after its own wake-up, so a spin would mostly
# burn CPU the engine may need.
FRONTEND_SPIN_US = 0.0

Decode = Callable[[Any], Any]

_PIECE = 0xC1  # a first byte msgpack never uses: this message is a piece of a longer one
_MORE, _LAST = 0, 1
_TOOK_A_PIECE = object()  # what FrontendInbox._take returns for a piece that is not the last


class Addresses(msgspec.Struct, frozen=True):
    """What the engine needs to reach the frontend: the function that opens its side
    ("module:function", called with these Addresses) and the two directions' names;
    `doorbell`: the semaphore a data-parallel engine rings after each send
    (shmvllm.boundary.doorbell), None for one engine."""

    opener: str
    to_engine: str
    to_frontend: str
    doorbell: Optional[str] = None


class Endpoint(ABC):
    """One side of the channel: whole byte messages, in order, each way.

    max_message: the longest message `try_send` takes (longer ones go through `send`, or in
    pieces through an `EngineOutbox`).
    """

    max_message: int

    @abstractmethod
    def send(self, data: bytes, timeout: Optional[float] = None) -> None:
        """Sends one message of any length; blocks while there is no room, ChannelTimeout
        after `timeout` s (nothing of the message is delivered then). The peer's death raises
        (ipc.PeerGoneError for the rings)."""

    @abstractmethod
    def try_send(self, data: "bytes | bytearray") -> bool:
        """Sends one message of at most `max_message` bytes if there is room now; never blocks.
        `data` may be a buffer its owner reuses after the call: an endpoint copies what it keeps."""

    @abstractmethod
    def recv(self, decode: Decode, timeout: Optional[float]) -> Any:
        """`decode(message)` of the next message (the view is valid only during the call);
        ChannelTimeout when none came in `timeout` s."""

    @abstractmethod
    def try_recv(self, decode: Decode) -> Any:
        """The next message decoded, or None when no whole one is there (never blocks)."""

    @abstractmethod
    def close(self) -> None:
        """Closes this side; the creator also removes the channel's segments."""

    def remove_orphaned(self) -> None:
        """The engine's side, after the frontend died without closing: removes what it left."""


class ShmEndpoint(Endpoint):
    """The rings' methods themselves, bound per instance: the engine sends and polls after every
    step, when a Python frame of ours around each call would be slow (the step has evicted the
    caches); the common case of each is one call into the ring's C helper (the message copied in,
    or decoded in place from the ring's memory and freed)."""

    def __init__(self, send_ring: Any, recv_ring: Any) -> None:
        self._send_ring, self._recv_ring = send_ring, recv_ring
        self.max_message = send_ring.max_payload
        self.send = send_ring.push  # type: ignore[method-assign]
        self.try_send = send_ring.try_push  # type: ignore[method-assign]
        self.recv = recv_ring.consume  # type: ignore[method-assign]
        self.try_recv = recv_ring.try_consume  # type: ignore[method-assign]

    # The methods below are replaced per instance in __init__.
    def send(self, data: bytes, timeout: Optional[float] = None) -> None:
        self._send_ring.push(data, timeout)

    def try_send(self, data: "bytes | bytearray") -> bool:
        return self._send_ring.try_push(data)

    def recv(self, decode: Decode, timeout: Optional[float]) -> Any:
        return self._recv_ring.consume(decode, timeout)

    def try_recv(self, decode: Decode) -> Any:
        return self._recv_ring.try_consume(decode)

    def close(self) -> None:
        self._send_ring.close()
        self._recv_ring.close()

    def remove_orphaned(self) -> None:
        from ipc import sweep_stale_segments

        sweep_stale_segments()


class EngineOutbox:
    """The engine's sending side of the rule above: `send` never blocks."""

    def __init__(self, endpoint: Endpoint, limit_bytes: int) -> None:
        self.endpoint = endpoint
        self.limit_bytes = limit_bytes
        self._encode_into = make_encoder().encode_into
        # Encoded into one reused buffer (msgspec's encode_into writes only into a bytearray, so
        # not straight into the ring): no allocation per message, one copy into the ring.
        self._buf = bytearray(4096)
        self._queue: collections.deque[bytes] = collections.deque()
        self._queued_bytes = 0

    def send(self, msg: Any) -> None:
        buf = self._buf
        self._encode_into(msg, buf)
        if len(buf) > self.endpoint.max_message:
            self._queue_pieces(bytes(buf))
            self._buf = bytearray(4096)  # not the largest message's memory for good
        elif self._queue or not self.endpoint.try_send(buf):
            self._queue.append(bytes(buf))
            self._queued_bytes += len(buf)
        if self._queue:
            self.flush()

    def _queue_pieces(self, data: bytes) -> None:
        step = self.endpoint.max_message - 2
        view = memoryview(data)
        for start in range(0, len(data), step):
            flag = _LAST if start + step >= len(data) else _MORE
            piece = bytes((_PIECE, flag)) + view[start : start + step]
            self._queue.append(piece)
            self._queued_bytes += len(piece)

    def flush(self) -> None:
        """Sends what waits, in order, as far as there is room."""
        queue, try_send = self._queue, self.endpoint.try_send
        while queue and try_send(queue[0]):
            self._queued_bytes -= len(queue.popleft())

    @property
    def pending(self) -> bool:
        return bool(self._queue)

    @property
    def backlogged(self) -> bool:
        """Over the limit: the engine takes no step until the frontend has read some."""
        return self._queued_bytes > self.limit_bytes

    def drain_for(self, seconds: float) -> bool:
        """Flushes for up to `seconds` (the engine's last words before it exits); True if all went."""
        deadline = time.monotonic() + seconds
        while True:
            self.flush()
            if not self._queue or time.monotonic() >= deadline:
                return not self._queue
            time.sleep(FLUSH_POLL_S)


class FrontendInbox:
    """The frontend's receiving side: decodes the engine's messages, joining pieces."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self._pieces: list[bytes] = []

    def _take(self, buf: Any) -> Any:
        if buf[0] != _PIECE:
            return decode_from_engine(buf)
        self._pieces.append(bytes(buf[2:]))
        if buf[1] != _LAST:
            return _TOOK_A_PIECE
        data, self._pieces = b"".join(self._pieces), []
        return decode_from_engine(data)

    def recv(self, timeout: Optional[float]) -> Any:
        """The next whole message; ChannelTimeout when none came in `timeout` s (the pieces
        taken so far stay for the next call)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            msg = self.endpoint.recv(self._take, remaining)
            if msg is not _TOOK_A_PIECE:
                return msg

    def try_recv(self) -> Any:
        """The next whole message, or None when none is there yet (never blocks)."""
        while (msg := self.endpoint.try_recv(self._take)) is _TOOK_A_PIECE:
            pass
        return msg


def ring_capacity() -> int:
    """The rings' capacity: $SHMVLLM_RING_CAPACITY (bytes, a multiple of 8 in the ring's bounds),
    else RING_CAPACITY."""
    from ipc import layout

    value = envs.SHMVLLM_RING_CAPACITY()
    if value is None:
        return RING_CAPACITY
    if value % 8 or not layout.MIN_CAPACITY <= value <= layout.MAX_CAPACITY:
        raise ValueError(
            f"SHMVLLM_RING_CAPACITY must be a multiple of 8 in [{layout.MIN_CAPACITY}, {layout.MAX_CAPACITY}] "
            f"bytes, got {value}."
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
            f"the two frontend<->engine rings (SHMVLLM_RING_CAPACITY={capacity} bytes each)",
        ).with_hint(
            f"free space in {SHM_DIR}, or set SHMVLLM_RING_CAPACITY to fewer bytes (messages longer than "
            "a quarter of it travel in fragments)"
        )


def frontend_nap_window() -> float:
    """FRONTEND_NAP_WINDOW_S when the engine's torch threads (OMP_NUM_THREADS, which the engine
    process inherits, else torch's default of one per core) leave this process a core; else 0."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    engine_threads = envs.OMP_NUM_THREADS() or cores
    return FRONTEND_NAP_WINDOW_S if engine_threads < cores else 0.0


def open_frontend() -> tuple[Endpoint, Addresses]:
    """Creates the rings; returns the frontend's endpoint and the engine's addresses."""
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
    return ShmEndpoint(to_engine, to_frontend), Addresses(f"{__name__}:open_engine", to_engine.name, to_frontend.name)


def open_engine(addresses: Addresses) -> Endpoint:
    """The engine's endpoint, attached to the rings the frontend created."""
    from ipc import RingBuffer

    recv_ring = RingBuffer.attach(addresses.to_engine, prefault=True)
    try:
        send_ring = RingBuffer.attach(addresses.to_frontend, prefault=True)
    except BaseException:
        recv_ring.close()
        raise
    return ShmEndpoint(send_ring, recv_ring)
