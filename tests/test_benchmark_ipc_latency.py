"""benchmarks/ipc_latency.py's harness: the rounds (rotated order, each round's share of the counts, rows merged
from the rounds, the CHECKs' round counts) on synthetic figures, a tiny real run end to end, and
an echo process that dies before it attaches to the rings is an error, not a wait without end."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

import pytest

from ipc import RingBuffer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import ipc_latency as bench  # noqa: E402


def _exit_at_once() -> None:
    os._exit(3)


def test_a_child_that_dies_before_attaching_is_an_error_not_a_hang():
    ctx = mp.get_context("spawn")
    rings = tuple(RingBuffer.create(64 << 10) for _ in range(2))
    try:
        child = ctx.Process(target=_exit_at_once)
        child.start()
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="exited with 3 before it attached"):
            bench._wait_attached(rings, child, timeout=30)
        assert time.monotonic() - started < 10
        child.join()
    finally:
        for ring in rings:
            ring.close()


def test_each_round_starts_one_case_further():
    cases = ["a", "b", "c"]
    orders = [bench.rotated(cases, r) for r in range(4)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert sorted(order[0] for order in orders[:3]) == cases and sorted(order[-1] for order in orders[:3]) == cases
    assert bench.rotated([], 2) == []


def test_a_round_gets_its_share_of_the_round_trips_and_a_whole_throughput_pass():
    assert bench.Counts(2000, 200, 10000).per_round(3) == bench.Counts(666, 66, 10000)
    assert bench.Counts(2000, 200, 10000).per_round(1) == bench.Counts(2000, 200, 10000)
    # never under the minimums, never more than the total
    assert bench.Counts(500, 200, 1000).per_round(50) == bench.Counts(bench.MIN_BUSY, bench.MIN_PACED, 1000)
    assert bench.Counts(30, 10, 100).per_round(5) == bench.Counts(30, 10, 100)


def _round(busy, paced, rate, size=64):
    return dict(payload_bytes=size, busy=busy, paced=paced, msgs_per_s=rate)


def test_rows_pool_the_round_trips_of_all_rounds_and_take_the_median_rate():
    rounds = [_round([1.0, 2.0, 3.0], [20.0], 100.0), _round([10.0, 11.0, 12.0, 13.0, 14.0], [30.0, 40.0], 300.0),
              _round([4.0], [25.0], 200.0)]
    busy, paced = bench.merge_rounds("shm", "ring", "64B", rounds)
    assert busy["rtt_us_median"] == statistics.median([1, 2, 3, 10, 11, 12, 13, 14, 4]) == 10.0  # pooled, not 4.0 of medians
    assert busy["rtt_us_round_medians"] == [2.0, 12.0, 4.0]
    assert busy["msgs_per_s"] == 200.0 and busy["msgs_per_s_rounds"] == [100.0, 300.0, 200.0]
    assert paced["mode"] == "paced" and paced["rtt_us_median"] == 27.5 and paced["rtt_us_round_medians"] == [20.0, 35.0, 25.0]
    assert paced["msgs_per_s"] is None and paced["msgs_per_s_rounds"] is None
    assert {k: busy[k] for k in ("transport", "variant", "payload", "payload_bytes", "mode")} == dict(
        transport="shm", variant="ring", payload="64B", payload_bytes=64, mode="busy")
    floor, = bench.merge_floor([[0.1, 0.2, 0.3], [0.5, 0.6, 0.9], [0.2, 0.2, 0.2]])
    assert floor["rtt_us_median"] == 0.2 and floor["rtt_us_round_medians"] == [0.2, 0.6, 0.2] and floor["rtt_us_p99"] == 0.9


def test_rounds_interleave_the_cases_and_the_floor(monkeypatch):
    calls = []

    def fake_round(transport, variant, payload, counts, ctx):
        calls.append(transport)
        return _round([float(len(calls))], [1.0], 1e6)

    def fake_floor(program, quick, repeats):
        calls.append("floor")
        return [0.1]

    monkeypatch.setattr(bench, "run_round", fake_round)
    monkeypatch.setattr(bench, "floor_round", fake_floor)
    monkeypatch.setattr(bench, "REPETITIONS", 2)
    cases = [("shm", "ring"), ("pipe", "os.pipe")]
    rows = bench.run_payload(bench.raw_payload("64B"), cases, 3, True, None, floor_program="floor")
    order = ["shm", "pipe", "floor"]
    assert calls == [job for k in range(6) for job in bench.rotated(order, k)]
    shm_busy = next(r for r in rows if r["transport"] == "shm" and r["mode"] == "busy")
    # each round keeps the better (here: the earlier) of its two repetitions
    assert shm_busy["rtt_us_round_medians"] == [float(calls.index("shm", 6 * r) + 1) for r in range(3)] == [1.0, 8.0, 15.0]
    assert [r["transport"] for r in rows] == ["shm", "shm", "pipe", "pipe", "floor"]


def test_a_round_keeps_the_better_repetition_per_mode():
    first = _round([1.0, 9.0, 9.0], [5.0, 5.0], 100.0, size=1024)
    second = _round([2.0, 2.0, 8.0], [4.0, 6.0, 7.0], 50.0, size=1024)
    assert bench.better_of([first, second]) == dict(payload_bytes=1024, busy=[2.0, 2.0, 8.0], paced=[5.0, 5.0], msgs_per_s=100.0)
    assert bench.better_of([first]) == first


def _row(transport, variant, payload, mode, rounds, rates=None):
    return dict(transport=transport, variant=variant, payload=payload, payload_bytes=64, mode=mode,
                rtt_us_median=statistics.median(rounds), rtt_us_p99=max(rounds), rtt_us_round_medians=rounds,
                msgs_per_s=statistics.median(rates) if rates else None, msgs_per_s_rounds=rates)


def test_a_check_holds_on_the_medians_and_in_every_round_against_every_peer():
    rows = [_row("shm", "ring", "64B", "busy", [0.9, 1.1, 2.0], [10.0, 10.0, 1.0]),
            # each peer wins one round, neither has the better median
            _row("pipe", "os.pipe", "64B", "busy", [0.5, 3.0, 3.0], [5.0, 5.0, 5.0]),
            _row("zmq", "push/pull", "64B", "busy", [3.0, 0.5, 3.0], [1.0, 1.0, 1.0]),
            _row("floor", "cacheline", "cacheline", "busy", [0.1, 0.1, 0.5])]
    lines = dict(bench.checks(rows))
    assert lines == {  # better medians, but rounds lost: they fail
        "CHECK FAIL 64B busy: shm 1.10 µs < best peer pipe os.pipe 3.00 µs (ratio 0.367), won 1/3 rounds": False,
        "CHECK FAIL 64B one-way: shm 10 msg/s > best peer pipe os.pipe 5 (ratio 2.00), won 2/3 rounds": False,
        "CHECK FAIL 64B busy: shm 1.10 µs <= 10x floor 0.100 µs (ratio 11.0x), won 2/3 rounds": False,
    }
    table = bench.format_table(rows)
    assert "| 1.10 [0.90-2.00] (2) | 3.00 [0.50-3.00] (3) |" in table
    assert "| 10 [1-10] | 5 [5-5] | 1 [1-1] |" in table and "0.100 µs per round trip [0.100-0.500]" in table
    assert bench._rate(12_345.0) == "12.3k" and bench._rate(9_775_230.0) == "9.78M"
    rows[0] = _row("shm", "ring", "64B", "busy", [0.4, 0.4, 0.4], [10.0, 10.0, 10.0])
    assert [(ok, line.endswith("won 3/3 rounds")) for line, ok in bench.checks(rows)] == [(True, True)] * 3


def test_rows_without_rounds_are_checked_as_before():
    rows = [dict(transport="shm", variant="ring", payload="1KiB", payload_bytes=1024, mode="paced", rtt_us_median=5.0,
                 rtt_us_p99=9.0, msgs_per_s=None),
            dict(transport="pipe", variant="os.pipe", payload="1KiB", payload_bytes=1024, mode="paced", rtt_us_median=4.0,
                 rtt_us_p99=8.0, msgs_per_s=None)]
    assert bench.checks(rows) == [("CHECK FAIL 1KiB paced: shm 5.00 µs < best peer pipe os.pipe 4.00 µs (ratio 1.250)", False)]
    assert "| 5.00 (9) | 4.00 (8) |" in bench.format_table(rows)


@pytest.mark.parametrize("value", ["0", "-2"])
def test_repeats_below_one_is_refused(value, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--repeats", value])
    assert f"--repeats must be at least 1, got {value}" in capsys.readouterr().err


def test_a_tiny_run_end_to_end(tmp_path, capsys):
    out = tmp_path / "rows.json"
    bench.main(["--quick", "--payloads", "64B", "--transports", "shm,pipe", "--repeats", "2", "--json", str(out)])
    rows = json.loads(out.read_text())
    cases = {(r["transport"], r["variant"], r["mode"]) for r in rows}
    assert {("shm", "ring", "busy"), ("shm", "ring", "paced"), ("pipe", "os.pipe", "busy"), ("pipe", "multiprocessing", "paced")} <= cases
    for row in rows:
        assert len(row["rtt_us_round_medians"]) == 2 and row["rtt_us_median"] > 0
        if row["mode"] == "busy" and row["transport"] != "floor":
            assert len(row["msgs_per_s_rounds"]) == 2 and row["msgs_per_s"] == statistics.median(row["msgs_per_s_rounds"])
    assert "won " in capsys.readouterr().out


def test_a_run_with_iceoryx2_leaves_nothing_of_it_behind():
    pytest.importorskip("iceoryx2")
    before = bench.iceoryx2_files()
    bench.main(["--quick", "--payloads", "64B", "--transports", "iceoryx2", "--repeats", "1", "--no-floor"])
    assert bench.iceoryx2_files() == before


@pytest.mark.parametrize("transport,variant", [("shm", "ring"), ("pipe", "os.pipe"), ("queue", "multiprocessing")])
def test_a_round_warms_up_then_measures_exactly_its_counts(transport, variant, monkeypatch):
    """The busy warm-up runs for a time, not a count: the echo process learns its length from the
    parent at the end of it. Whatever the transport's speed, the round ends (no echo left waiting,
    none missing) with exactly the counted round trips measured."""
    monkeypatch.setattr(bench, "BUSY_WARMUP_S", 0.05)
    counts = bench.Counts(busy=60, paced=7, tput=200, paced_warmup=5)
    result = bench.run_round(transport, variant, bench.raw_payload("64B"), counts, mp.get_context("spawn"))
    assert len(result["busy"]) == 60 and len(result["paced"]) == 7
    assert result["msgs_per_s"] > 0 and result["payload_bytes"] == 64


@pytest.mark.parametrize("size", [0, 64, 16376, 16377, 32760, 32761, 65536, 1 << 20, 3 << 20, 5 << 20])
def test_a_case_rings_are_the_smallest_that_hold_two_of_its_records(size):
    from ipc import layout

    capacity, max_record = bench.ring_geometry(size)
    assert capacity % 4096 == 0 and 64 << 10 <= capacity <= 8 << 20 and max_record == capacity // 2
    if capacity < 8 << 20:
        assert max_record >= layout.record_size(size)
    if capacity > 64 << 10:  # a page less would not hold two
        assert (capacity - 4096) // 2 < layout.record_size(size)
    ring = RingBuffer.create(capacity, max_record=max_record)  # a geometry the ring takes
    ring.close()
