"""A typed message channel: msgspec msgpack over a RingBuffer.

Sending encodes into one reused bytearray (no allocation per message once it has grown) and
copies that into a record reserved in the ring (`push` of a bytearray is reserve, copy, commit):
msgspec's `encode_into` writes only into a bytearray, which it grows as it goes, never into a
view of shared memory, so one copy remains. Receiving decodes straight from the ring's memory
(a view of the record, as `pop_view` gives) when the message is contiguous, and from the
reassembled buffer when it came in fragments; msgspec copies out what it keeps, so the record is
freed right after decoding.
"""

from __future__ import annotations

import typing
from typing import Any, Callable, Generic, Optional, TypeVar

import msgspec

from ipc.ring import RingBuffer

S = TypeVar("S")
R = TypeVar("R")


def _classes_of(tp: Any) -> Optional[tuple]:
    """The classes a value of type `tp` may have, for a cheap isinstance check (None: any)."""
    if tp is None or tp is Any:
        return None
    if typing.get_origin(tp) is typing.Union:
        members = [_classes_of(arg) for arg in typing.get_args(tp)]
        if any(m is None for m in members):
            return None
        return tuple(cls for m in members for cls in m)
    return (tp,) if isinstance(tp, type) else None


class Channel(Generic[S, R]):
    """Sends values of `send_type` and receives values of `recv_type` over one ring.

    A ring has one direction, so a side usually uses only one of send/recv; a Union of tagged
    Structs as `recv_type` lets one ring carry several kinds of message.
    """

    def __init__(
        self,
        ring: RingBuffer,
        send_type: Any = None,
        recv_type: Any = Any,
        *,
        enc_hook: Optional[Callable[[Any], Any]] = None,
        dec_hook: Optional[Callable[[type, Any], Any]] = None,
        initial_buffer: int = 4096,
    ) -> None:
        self.ring = ring
        self._send_classes = _classes_of(send_type)
        self._encoder = msgspec.msgpack.Encoder(enc_hook=enc_hook)
        self._decode = msgspec.msgpack.Decoder(type=recv_type, dec_hook=dec_hook).decode
        self._buf = bytearray(initial_buffer)

    def send(self, msg: S, timeout: Optional[float] = None) -> None:
        """Encodes `msg` and pushes it; blocks while the ring is full (see RingBuffer.push)."""
        if self._send_classes is not None and not isinstance(msg, self._send_classes):
            raise TypeError(f"msg must be one of {self._send_classes}, got {type(msg).__name__}")
        self._encoder.encode_into(msg, self._buf)
        self.ring.push(self._buf, timeout)

    def recv(self, timeout: Optional[float] = None) -> R:
        """The next message, decoded; raises msgspec.DecodeError/ValidationError on a message of
        the wrong shape (it is consumed), and what RingBuffer.pop raises."""
        return self.ring.consume(self._decode, timeout)

    def try_recv(self) -> Optional[R]:
        """The next message, or None if no whole message is there yet."""
        return self.ring.try_consume(self._decode)

    def wait_readable(self, timeout: Optional[float] = None) -> bool:
        """Blocks with the GIL released until a message is there; False on timeout."""
        return self.ring.wait_readable(timeout)

    def close(self) -> None:
        self.ring.close()

    def __enter__(self) -> "Channel[S, R]":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
