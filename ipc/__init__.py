"""ipc: a lock-free single-producer/single-consumer ring in POSIX shared memory, and a typed
msgspec channel over it. Knows nothing of LLMs; imports no torch.

    ring = RingBuffer.create(1 << 20)          # in the creating process
    peer = RingBuffer.attach(ring.name)        # in the other process
    ring.push(b"hello"); peer.pop() == b"hello"
"""

from ipc.ring import (
    LoanError,
    PeerClosedError,
    PeerDeadError,
    PeerGoneError,
    RingBuffer,
    RingClosedError,
    RingCorruptedError,
    RingError,
    native_available,
    unlink_ring,
)
from ipc.segment import SharedMemoryFullError, sweep_stale_segments
from ipc.wait import RingTimeoutError

__all__ = [
    "Channel",
    "LoanError",
    "PeerClosedError",
    "PeerDeadError",
    "PeerGoneError",
    "RingBuffer",
    "RingClosedError",
    "RingCorruptedError",
    "RingError",
    "RingTimeoutError",
    "SharedMemoryFullError",
    "native_available",
    "sweep_stale_segments",
    "unlink_ring",
]


def __getattr__(name: str):
    if name == "Channel":  # msgspec is imported only by users of the typed channel
        from ipc.channel import Channel

        return Channel
    raise AttributeError(f"module 'ipc' has no attribute {name!r}")
