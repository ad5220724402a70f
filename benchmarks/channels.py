"""The benchmarks' own channels for the engine process, plugged in through MPClient(channel=...).

- ZeroMQ, the peer: two pyzmq PUSH/PULL pairs over ipc:// sockets in a private temporary
  directory (what vLLM uses), bound by the frontend, connected by the engine, unbounded queues.
  ZeroMQ never reports a dead peer: the product's pid and poll checks notice it.
- Timed: wraps either endpoint on the engine's side and adds up the seconds the engine's busy
  loop spends in non-waiting channel calls (try_send, send, try_recv with its decoding) into an
  8-byte file the frontend reads (`engine_channel_seconds`). Encoding is the same codec for both
  transports and happens before try_send, so it is not counted.

Both implement shmvllm.boundary.channel.Endpoint; the engine opens its side by the opener the
Addresses name, so this module must be importable in the engine process (it is: the engine gets
the frontend's sys.path).
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import shutil
import struct
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from shmvllm.boundary import channel as shm
from shmvllm.boundary.channel import Addresses, ChannelTimeout, Endpoint

_MODULE = __name__
_TIMING_DIR = Path(tempfile.gettempdir())


class ZmqEndpoint(Endpoint):
    max_message = 1 << 62  # the queues are unbounded: every message fits

    def __init__(self, ctx: Any, push: Any, pull: Any, owned_dir: Optional[str]) -> None:
        import zmq

        self._zmq = zmq
        self._ctx, self._push, self._pull, self._owned_dir = ctx, push, pull, owned_dir

    def send(self, data: bytes, timeout: Optional[float] = None) -> None:
        if not self.try_send(data):
            raise ConnectionError("no peer is connected to the zmq socket")

    def try_send(self, data: "bytes | bytearray") -> bool:
        try:  # unbounded queues: only a missing peer makes it block; a reused buffer is copied
            self._push.send(data, self._zmq.NOBLOCK, copy=type(data) is not bytes)
        except self._zmq.Again:
            return False
        return True

    def recv(self, decode: Callable[[Any], Any], timeout: Optional[float]) -> Any:
        try:  # what is already there costs one call, as with the ring
            return decode(self._pull.recv(self._zmq.NOBLOCK))
        except self._zmq.Again:
            pass
        if not self._pull.poll(None if timeout is None else int(timeout * 1000)):
            raise ChannelTimeout("nothing received on the zmq socket")
        return decode(self._pull.recv())

    def try_recv(self, decode: Callable[[Any], Any]) -> Any:
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

    def remove_orphaned(self) -> None:
        pass  # the frontend's socket directory: close() of the frontend's side removes it


def _zmq_socket(ctx: Any, kind: int, path: str, bind: bool) -> Any:
    import zmq

    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)  # unbounded queues: a send never blocks on a slow peer
    sock.setsockopt(zmq.RCVHWM, 0)
    (sock.bind if bind else sock.connect)(f"ipc://{path}")
    return sock


def open_zmq_frontend(engine_opener: str = f"{_MODULE}:open_zmq_engine") -> tuple[Endpoint, Addresses]:
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
    return ZmqEndpoint(ctx, push, pull, sock_dir), Addresses(engine_opener, to_engine, to_frontend)


def open_zmq_engine(addresses: Addresses) -> Endpoint:
    import zmq

    ctx = zmq.Context(io_threads=1)
    pull = _zmq_socket(ctx, zmq.PULL, addresses.to_engine, bind=False)
    push = _zmq_socket(ctx, zmq.PUSH, addresses.to_frontend, bind=False)
    return ZmqEndpoint(ctx, push, pull, None)


# ---- timing the engine's channel calls ----------------------------------------------------


def timing_file(addresses: Addresses) -> Path:
    key = hashlib.sha1(f"{addresses.to_engine}|{addresses.to_frontend}".encode()).hexdigest()[:16]
    return _TIMING_DIR / f"shmvllm-channel-seconds-{key}"


class TimedEndpoint(Endpoint):
    """Another endpoint, with the seconds of its non-waiting calls added up into a file."""

    def __init__(self, inner: Endpoint, path: Path) -> None:
        self.inner, self.max_message = inner, inner.max_message
        self._file = open(path, "r+b")
        self._map = mmap.mmap(self._file.fileno(), 8)
        self._seconds = 0.0

    def _add(self, started: float) -> None:
        self._seconds += time.perf_counter() - started
        struct.pack_into("<d", self._map, 0, self._seconds)

    def send(self, data: bytes, timeout: Optional[float] = None) -> None:
        started = time.perf_counter()
        try:
            self.inner.send(data, timeout)
        finally:
            self._add(started)

    def try_send(self, data: bytes) -> bool:
        started = time.perf_counter()
        try:
            return self.inner.try_send(data)
        finally:
            self._add(started)

    def recv(self, decode: Callable[[Any], Any], timeout: Optional[float]) -> Any:
        return self.inner.recv(decode, timeout)  # a wait for work, not the channel's cost

    def try_recv(self, decode: Callable[[Any], Any]) -> Any:
        started = time.perf_counter()
        try:
            return self.inner.try_recv(decode)
        finally:
            self._add(started)

    def close(self) -> None:
        self._map.close()
        self._file.close()
        self.inner.close()

    def remove_orphaned(self) -> None:
        self.inner.remove_orphaned()


def open_timed_shm_engine(addresses: Addresses) -> Endpoint:
    return TimedEndpoint(shm.open_engine(addresses), timing_file(addresses))


def open_timed_zmq_engine(addresses: Addresses) -> Endpoint:
    return TimedEndpoint(open_zmq_engine(addresses), timing_file(addresses))


def _with_timing_file(endpoint: Endpoint, addresses: Addresses) -> tuple[Endpoint, Addresses]:
    timing_file(addresses).write_bytes(struct.pack("<d", 0.0))
    return endpoint, addresses


def open_timed_shm_frontend() -> tuple[Endpoint, Addresses]:
    endpoint, addresses = shm.open_frontend()
    addresses = Addresses(f"{_MODULE}:open_timed_shm_engine", addresses.to_engine, addresses.to_frontend)
    return _with_timing_file(endpoint, addresses)


def open_timed_zmq_frontend() -> tuple[Endpoint, Addresses]:
    return _with_timing_file(*open_zmq_frontend(f"{_MODULE}:open_timed_zmq_engine"))


CHANNELS = {"shm": open_timed_shm_frontend, "zmq": open_timed_zmq_frontend}


def engine_channel_seconds(addresses: Addresses) -> float:
    """What the engine's TimedEndpoint has added up so far."""
    return struct.unpack("<d", timing_file(addresses).read_bytes()[:8])[0]


def remove_timing_file(addresses: Addresses) -> None:
    timing_file(addresses).unlink(missing_ok=True)


@contextlib.contextmanager
def engine_channel(factory: Callable[[], tuple[Endpoint, Addresses]]) -> Iterator[None]:
    """LLM(...) built inside this reaches its engine process over `factory`'s channel: the
    benchmark swaps the client's channel from outside, the product has no such argument."""
    from shmvllm.engine import core_client

    original = core_client.EngineCoreClient.make_client

    def make_client(config: Any, multiprocess: bool = True, started: Optional[Callable[[], None]] = None,
                    prestarted: Any = None) -> Any:
        if not multiprocess:
            return original(config, multiprocess=False)
        return core_client.MPClient(config, channel=factory, started=started, prestarted=prestarted)

    core_client.EngineCoreClient.make_client = staticmethod(make_client)  # type: ignore[method-assign]
    try:
        yield
    finally:
        core_client.EngineCoreClient.make_client = staticmethod(original)  # type: ignore[method-assign]
