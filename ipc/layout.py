"""Byte layout of a ring segment (mirrored by the #defines in `_native.c`).

A segment is a 4096-byte header followed by `capacity` bytes of records. All counters are
native-endian u64, 8-byte aligned. Each side writes only its own cache line(s):

    0    magic, version, capacity, max_record, creator pid + start time, attacher pid + start time
    64   producer line: tail (published), and the producer's private head cache / pending record
    128  consumer line: head (published), and the consumer's private tail cache / pending head
    192  "consumer sleeping" flag (set by the consumer, cleared by either side)
    256  "producer sleeping" flag
    320  creator closed, attacher closed
    1024 two scratch lines for RingBuffer.floor_pingpong

A record is an 8-byte header (u32 payload length, u16 kind, u16 magic) and its payload, padded
to 8 bytes. A record never crosses the end of the buffer: a PAD record fills the rest instead.
A message longer than max_payload (a record of at most capacity/4) is sent as FIRST (u64 total
length, then data), MIDDLE..., LAST; ABORT drops a fragmented message the producer gave up on.
"""

from __future__ import annotations

MAGIC = int.from_bytes(b"IPCRING1", "little")
VERSION = 1
HEADER_SIZE = 4096
DATA = HEADER_SIZE
MIN_CAPACITY = 256
MAX_CAPACITY = 1 << 29  # offsets and lengths travel in 30-bit fields of ipc_peek's result

OFF_MAGIC = 0
OFF_VERSION = 8
OFF_CAPACITY = 16
OFF_MAX_RECORD = 24
OFF_CREATOR_PID = 32
OFF_CREATOR_START = 40
OFF_ATTACHER_PID = 48
OFF_ATTACHER_START = 56
OFF_TAIL = 64
OFF_P_HEAD_CACHE = 72
OFF_P_PENDING = 80
OFF_P_RECORD_POS = 88
OFF_HEAD = 128
OFF_C_TAIL_CACHE = 136
OFF_C_PENDING = 144
OFF_C_SLEEPING = 192
OFF_P_SLEEPING = 256
OFF_CREATOR_CLOSED = 320
OFF_ATTACHER_CLOSED = 328
OFF_FLOOR = 1024  # two scratch cache lines for the floor ping-pong benchmark

KIND_MSG = 1
KIND_FIRST = 2
KIND_MIDDLE = 3
KIND_LAST = 4
KIND_ABORT = 5
KIND_PAD = 6
RECORD_MAGIC = 0x5A1F

# Results of reserve/push/peek (negative) — same values as in _native.c.
EMPTY = -1
FULL = -1
BAD_COUNTERS = -2
BAD_MAGIC = -3
BAD_KIND = -4
BAD_LENGTH = -5
TRUNCATED = -6
BAD_PAD = -7
TOO_BIG = -8

PEEK_FIELD_MASK = (1 << 30) - 1

PROBLEMS = {
    BAD_COUNTERS: "head/tail counters or ring geometry out of range",
    BAD_MAGIC: "record header has a bad magic number",
    BAD_KIND: "record has an unknown kind",
    BAD_LENGTH: "record length is out of range",
    TRUNCATED: "record is truncated (longer than what was published)",
    BAD_PAD: "padding record does not end at the end of the buffer",
}


def max_record_for(capacity: int) -> int:
    """The largest record (header included): a quarter of the capacity, 8-aligned."""
    return (capacity // 4) & ~7
