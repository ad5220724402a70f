"""Byte layout of a ring segment (mirrored by the #defines in `_native.c`).

A segment is a 4096-byte header followed by `capacity` bytes of records. All counters are
native-endian u64, 8-byte aligned. Each 64-byte line is written by one side only, and what a
side writes on every message but the other side never reads (its private caches) has a line of
its own, so that the peer's loads of a published counter never miss on a line its owner keeps
dirtying for itself:

    0    magic, version, capacity, max_record, creator pid + start time, attacher pid + start time
    64   tail (published by the producer), and the CPU the producer last published from
    128  the producer's private line: its cached head, the pending tail and record position, how
         often it woke the consumer (and close() adds its wake-ups there)
    192  head (published by the consumer), and the CPU the consumer last freed space from
    256  the consumer's private line: its cached tail, the pending head, how often it woke the
         producer
    320  "consumer sleeping" flag: set by the consumer, cleared by either side; the futex word
         the consumer sleeps on (see wait.py and `_native.c`)
    384  "producer sleeping" flag, the same for the producer
    448  creator closed, attacher closed, how sleepers are woken (WAKE_FUTEX / WAKE_SEMAPHORE)

`_native.c` has the same offsets as #defines; tests/test_ipc_layout.py checks that they agree.

A record is an 8-byte header (u32 payload length, u16 kind, u16 magic) and its payload, padded
to 8 bytes. A record never crosses the end of the buffer: a PAD record fills the rest instead.
A message longer than max_payload (a record of at most max_record: capacity/4 unless the creator
chose up to capacity/2) is sent as FIRST (u64 total
length, then data), MIDDLE..., LAST; ABORT drops a fragmented message the producer gave up on.
"""

from __future__ import annotations

MAGIC = int.from_bytes(b"IPCRING1", "little")
VERSION = 2
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
OFF_P_CPU = 72  # 1 + the producer's CPU at its last publish (0: unknown); see spin_until in _native.c
OFF_P_HEAD_CACHE = 128
OFF_P_PENDING = 136
OFF_P_RECORD_POS = 144
OFF_P_WAKES = 152
OFF_HEAD = 192
OFF_C_CPU = 200  # 1 + the consumer's CPU at its last release (0: unknown)
OFF_C_TAIL_CACHE = 256
OFF_C_PENDING = 264
OFF_C_WAKES = 272
OFF_C_SLEEPING = 320
OFF_P_SLEEPING = 384
OFF_CREATOR_CLOSED = 448
OFF_ATTACHER_CLOSED = 456
OFF_WAKE = 464

# How a sleeping side is woken, chosen by the creator (OFF_WAKE): a futex on its sleeping flag
# (Linux), or a pair of named POSIX semaphores next to the segment (elsewhere).
WAKE_FUTEX = 1
WAKE_SEMAPHORE = 2

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


def record_size(payload: int) -> int:
    """The bytes a record of `payload` bytes takes in the ring: its 8-byte header and the payload,
    padded to 8."""
    return (8 + payload + 7) & ~7


def max_record_for(capacity: int) -> int:
    """The largest record (header included): a quarter of the capacity, 8-aligned."""
    return (capacity // 4) & ~7
