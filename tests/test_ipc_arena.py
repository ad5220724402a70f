"""The shared-memory rendezvous arena: rounds between processes see each other's slots, a dead
participant is reported within the poll interval, nothing stays in /dev/shm."""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ipc import PeerDeadError
from ipc.arena import Arena, arena_available

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not arena_available(), reason="the arena needs the C helper")

# python -c PARTICIPANT <name> <index> <rounds>: each round writes (round, index) into its slot,
# publishes, waits, and checks every other slot holds (round, their index).
PARTICIPANT = r"""
import struct, sys
from ipc.arena import Arena
name, index, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
arena = Arena.attach(name, index, poll_interval=0.05)
print("ready", flush=True)
for k in range(1, rounds + 1):
    struct.pack_into("=QQ", arena.slot(k & 1, index), 0, k, index)
    arena.publish(k)
    arena.wait_all(k, timeout=30)
    for i in range(arena.participants):
        got = struct.unpack_from("=QQ", arena.slot(k & 1, i))
        if got != (k, i):
            print(f"round {k}: slot {i} holds {got}", flush=True)
            sys.exit(1)
print("done", flush=True)
"""


def _participant(name: str, index: int, rounds: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", PARTICIPANT, name, str(index), str(rounds)], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _leftovers(name: str) -> list[str]:
    return [p.name for p in Path("/dev/shm").iterdir() if name.lstrip("/") in p.name]


def _assert_done(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0 and out.strip() == "done", out


def _stop(procs: list[subprocess.Popen], arena: Arena) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    arena.close()


def test_rounds_between_three_processes():
    rounds = 3000
    arena = Arena.create(3, 64, poll_interval=0.05)
    procs = [_participant(arena.name, i, rounds) for i in (1, 2)]
    try:
        for k in range(1, rounds + 1):
            struct.pack_into("=QQ", arena.slot(k & 1, 0), 0, k, 0)
            arena.publish(k)
            arena.wait_all(k, timeout=30)
            for i in range(3):
                assert struct.unpack_from("=QQ", arena.slot(k & 1, i)) == (k, i)
        _assert_done(procs)
    finally:
        _stop(procs, arena)
    assert _leftovers(arena.name) == []


def test_dead_participant_is_reported_within_the_poll_interval():
    poll = 0.2
    arena = Arena.create(2, 64, poll_interval=poll)
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys,time; from ipc.arena import Arena; a = Arena.attach(sys.argv[1], 1); "
         "print('ready', flush=True); time.sleep(600)", arena.name],
        cwd=ROOT, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        arena.publish(1)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        started = time.monotonic()
        with pytest.raises(PeerDeadError, match=f"participant 1 \\(pid {proc.pid}\\)"):
            arena.wait_all(1, timeout=10)
        assert time.monotonic() - started < poll + 0.3
    finally:
        arena.close()
    assert _leftovers(arena.name) == []
    with pytest.raises(ValueError, match="slot_bytes"):
        Arena.create(2, 100)


def test_an_unseated_creator_leaves_every_seat_to_the_processes_that_attach():
    arena = Arena.create(2, 64, poll_interval=0.05, seated=False)
    procs = [_participant(arena.name, i, 200) for i in (0, 1)]
    try:
        _assert_done(procs)
        with pytest.raises(ValueError, match=r"index must be an int in \[1, 2\)"):
            Arena.attach(arena.name, 0)  # seat 0 is taken now
    finally:
        _stop(procs, arena)
    assert _leftovers(arena.name) == []
