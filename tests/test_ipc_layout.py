"""The segment layout: ipc/layout.py and the #defines of ipc/_native.c agree, and every line of
the header is written by one side only, with each side's private caches on a line of their own."""

from __future__ import annotations

import re
from pathlib import Path

from ipc import layout as L

SOURCE = Path(L.__file__).with_name("_native.c").read_text()
DEFINES = {name: int(value, 0) for name, value in re.findall(r"^#define (\w+) \(?(-?(?:0x[0-9A-Fa-f]+|\d+))u?\)?$", SOURCE, re.M)}


def test_every_define_of_the_c_helper_matches_the_layout():
    shared = [name for name in DEFINES if hasattr(L, name)]
    assert {"OFF_TAIL", "OFF_HEAD", "OFF_P_HEAD_CACHE", "OFF_C_TAIL_CACHE", "OFF_C_SLEEPING", "OFF_WAKE", "DATA"} <= set(shared)
    mismatched = {name: (DEFINES[name], getattr(L, name)) for name in shared if DEFINES[name] != getattr(L, name)}
    assert not mismatched, f"_native.c vs layout.py: {mismatched}"
    offsets = [name for name in DEFINES if name.startswith("OFF_")]
    assert set(offsets) <= set(shared), f"offsets in _native.c unknown to layout.py: {set(offsets) - set(shared)}"


def _line(offset: int) -> int:
    return offset // 64


def test_published_counters_and_private_caches_have_lines_of_their_own():
    producer_private = {L.OFF_P_HEAD_CACHE, L.OFF_P_PENDING, L.OFF_P_RECORD_POS}
    consumer_private = {L.OFF_C_TAIL_CACHE, L.OFF_C_PENDING}
    lines = {
        "tail": {_line(L.OFF_TAIL), _line(L.OFF_P_CPU)},  # the producer's CPU travels with the tail
        "head": {_line(L.OFF_HEAD), _line(L.OFF_C_CPU)},
        "producer private": {_line(o) for o in producer_private},
        "consumer private": {_line(o) for o in consumer_private},
        "consumer sleeping": {_line(L.OFF_C_SLEEPING)},
        "producer sleeping": {_line(L.OFF_P_SLEEPING)},
        "identity": {_line(L.OFF_MAGIC), _line(L.OFF_ATTACHER_START)},
    }
    for name, found in lines.items():
        assert len(found) == 1, f"{name} spans lines {found}"
    owners = [next(iter(found)) for found in lines.values()]
    assert len(set(owners)) == len(owners), f"two of {list(lines)} share a cache line: {owners}"
    offsets = [v for k, v in vars(L).items() if k.startswith("OFF_")]
    assert all(o % 8 == 0 and o + 8 <= L.HEADER_SIZE for o in offsets)
