"""IPC latency between two processes: the shared-memory ring against ZeroMQ and multiprocessing.

For each transport and payload, a child process echoes what the parent sends:

- busy:   round trips back to back (ping-pong); median and p99 round-trip time;
- paced:  one round trip every 1 ms, so the receiver has gone idle (asleep) each time;
- msgs/s: one-way throughput, the parent sending back to back (busy rows only).

Transports: `shm` (ipc.RingBuffer, one ring per direction), `zmq` (pyzmq PUSH/PULL over
ipc://, as vLLM uses), `pipe` (multiprocessing.Pipe send_bytes/recv_bytes), `queue`
(multiprocessing.Queue), and `floor` (two processes bouncing a counter between two cache
lines in C: the machine's limit, no queue logic at all).
Payloads: raw bytes of 64 B, 1 KiB, 64 KiB and 1 MiB, and engine-shaped msgspec messages
(shmvllm.engine.messages): an EngineCoreRequest with 32 and with 2,048 prompt token ids, and an
EngineCoreOutputs batch of 64 one-token outputs, encoded, sent, decoded, re-encoded and sent back
(shm through ipc.Channel, decoding in place; the others encode to bytes and decode from them).

    python benchmarks/ipc_latency.py --quick --json out.json --plot ipc_latency.png

Prints a table with the shm/zmq ratio of every row. Run it alone on the machine
(`flock /tmp/shmvllm-cpu.lock ...` here): it needs both cores.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TRANSPORTS = ("shm", "zmq", "pipe", "queue")
PAYLOADS = ("64B", "1KiB", "64KiB", "1MiB", "req32", "req2048", "out64")
RAW_SIZES = {"64B": 64, "1KiB": 1024, "64KiB": 64 << 10, "1MiB": 1 << 20}
BIG = ("64KiB", "1MiB")
PACE_S = 0.001
# Acceptance: the shm ring's median round trip as a share of ZeroMQ's.
BUSY_LIMITS = {"64B": 0.10, "1KiB": 0.10, "64KiB": 0.25}
PACED_LIMIT = 0.5
SPIN_US: list = [None]  # the ring's spin before sleeping (None: its default); --spin-us sets it


@dataclass
class Counts:
    busy: int
    paced: int
    tput: int

    @property
    def warmup(self) -> int:
        return max(5, self.busy // 10)


def counts_for(payload: str, quick: bool) -> Counts:
    big = payload in ("1MiB",)
    medium = payload in ("64KiB", "req2048")
    if quick:
        return Counts(50, 50, 100) if big else Counts(500, 200, 1000) if medium else Counts(2000, 200, 10000)
    return Counts(500, 200, 500) if big else Counts(5000, 1000, 10000) if medium else Counts(20000, 1000, 100000)


# ----------------------------------------------------------------------------- messages


def make_payload(payload: str) -> tuple[Any, Any]:
    """(the object sent, the msgspec type to decode it as; None for raw bytes)."""
    if payload in RAW_SIZES:
        return os.urandom(RAW_SIZES[payload]), None
    from shmvllm.engine import messages as m
    from shmvllm.sampling_params import SamplingParams

    if payload.startswith("req"):
        ids = m.EngineCoreRequest.pack_token_ids(range(int(payload[3:])))
        params = SamplingParams(max_tokens=64, temperature=0.8, top_p=0.95)
        return m.EngineCoreRequest("req-0000001", ids, params, arrival_time=time.time()), m.EngineCoreRequestMsg
    outputs = [m.EngineCoreOutput(request_id=f"req-{i:07d}", new_token_ids=[1000 + i]) for i in range(64)]
    return m.EngineCoreOutputs(outputs=outputs, timestamp=time.time()), m.EngineCoreOutputs


def encoded_size(obj: Any) -> int:
    if isinstance(obj, bytes):
        return len(obj)
    import msgspec

    return len(msgspec.msgpack.encode(obj))


# ----------------------------------------------------------------------------- endpoints


def _typed(send_raw: Callable, recv_raw: Callable, decode_type: Any) -> tuple[Callable, Callable]:
    """Wraps a bytes transport with msgspec encoding when the payload is a message."""
    if decode_type is None:
        return send_raw, recv_raw
    import msgspec

    encode = msgspec.msgpack.Encoder().encode
    decode = msgspec.msgpack.Decoder(type=decode_type).decode
    return (lambda obj: send_raw(encode(obj))), (lambda: decode(recv_raw()))


def shm_capacity(payload: str) -> int:
    size = RAW_SIZES.get(payload, 0)
    return 8 << 20 if size >= (1 << 20) else 1 << 20


@dataclass
class Endpoint:
    send: Callable[[Any], Any]
    recv: Callable[[], Any]
    close: Callable[[], Any]
    echo: Optional[Callable[[], Any]] = None  # receive one message and send it back

    def __post_init__(self) -> None:
        if self.echo is None:
            self.echo = lambda: self.send(self.recv())


def endpoint(transport: str, handles: dict, side: str, decode_type: Any, big: bool) -> Endpoint:
    """One side ("parent" or "child") of a transport.

    For big raw payloads (64 KiB, 1 MiB) each transport receives without copying, as its
    documentation advises: zmq through `recv(copy=False).buffer` (and the echo sends that
    buffer back with copy=False), the ring by reading the message in place (`consume`, and the
    echo pushes straight from the ring's memory into the other ring).
    """
    if transport == "shm":
        from ipc import Channel, RingBuffer

        if side == "parent":
            tx, rx = handles["rings"]
        else:
            tx = RingBuffer.attach(handles["names"][1], **handles["options"])
            rx = RingBuffer.attach(handles["names"][0], **handles["options"])
        close = lambda: (tx.close(), rx.close())  # noqa: E731
        if decode_type is not None:
            return Endpoint(Channel(tx).send, Channel(rx, recv_type=decode_type).recv, close)
        if big:
            return Endpoint(tx.push, lambda: rx.consume(len), close, echo=lambda: rx.consume(tx.push))
        return Endpoint(tx.push, rx.pop, close)
    if transport == "zmq":
        import zmq

        ctx = zmq.Context()
        push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        for sock in (push, pull):
            sock.setsockopt(zmq.LINGER, 0)
        a, b = handles["paths"]
        if side == "parent":
            push.bind(a)
            pull.bind(b)
        else:
            pull.connect(a)
            push.connect(b)
        if big:
            send_raw = lambda data: push.send(data, copy=False)  # noqa: E731
            recv_raw = lambda: pull.recv(copy=False).buffer  # noqa: E731
        else:
            send_raw, recv_raw = push.send, pull.recv
        send, recv = _typed(send_raw, recv_raw, decode_type)
        return Endpoint(send, recv, lambda: (push.close(), pull.close(), ctx.term()))
    if transport == "pipe":
        conn = handles["conns"][0 if side == "parent" else 1]
        send, recv = _typed(conn.send_bytes, conn.recv_bytes, decode_type)
        return Endpoint(send, recv, conn.close)
    if transport == "queue":
        to_child, to_parent = handles["queues"]
        tx, rx = (to_child, to_parent) if side == "parent" else (to_parent, to_child)
        send, recv = _typed(tx.put, rx.get, decode_type)
        return Endpoint(send, recv, lambda: None)
    raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")


def child_main(transport: str, payload: str, handles: dict, counts: Counts) -> None:
    """The echo side: busy and paced round trips, then a throughput run acknowledged once."""
    obj, decode_type = make_payload(payload)
    end = endpoint(transport, handles, "child", decode_type, payload in BIG)
    gc.disable()
    echo, recv = end.echo, end.recv
    for _ in range(counts.warmup + counts.busy + counts.paced):
        echo()
    for _ in range(counts.tput):
        recv()
    end.send(obj)
    recv()  # the parent's "done": keeps our end open until the parent has read the ack
    end.close()


# ----------------------------------------------------------------------------- parent


def _round_trips(send: Callable, recv: Callable, obj: Any, n: int, pace: float) -> list[float]:
    rtts = []
    next_at = time.perf_counter()
    for _ in range(n):
        if pace:
            next_at += pace
            delay = next_at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
        t0 = time.perf_counter_ns()
        send(obj)
        recv()
        rtts.append((time.perf_counter_ns() - t0) / 1000.0)
    return rtts


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]


def make_handles(transport: str, payload: str, ctx: mp.context.BaseContext) -> tuple[dict, dict, Callable]:
    """(the parent's handles, what the child gets, cleanup)."""
    if transport == "shm":
        from ipc import RingBuffer

        options = {} if SPIN_US[0] is None else {"spin_us": SPIN_US[0]}
        rings = tuple(RingBuffer.create(shm_capacity(payload), **options) for _ in range(2))
        child = {"names": [r.name for r in rings], "options": options}
        return {"rings": rings}, child, lambda: [r.close() for r in rings]
    if transport == "zmq":
        tmp = tempfile.mkdtemp(prefix="ipcbench-")
        paths = [f"ipc://{tmp}/a", f"ipc://{tmp}/b"]
        return {"paths": paths}, {"paths": paths}, lambda: [Path(p[6:]).unlink(missing_ok=True) for p in paths] + [os.rmdir(tmp)]
    if transport == "pipe":
        conns = ctx.Pipe(duplex=True)
        return {"conns": conns}, {"conns": conns}, lambda: None
    queues = (ctx.Queue(), ctx.Queue())
    return {"queues": queues}, {"queues": queues}, lambda: [q.close() for q in queues]


def run_case(transport: str, payload: str, quick: bool, ctx: mp.context.BaseContext) -> list[dict]:
    counts = counts_for(payload, quick)
    obj, decode_type = make_payload(payload)
    parent_handles, child_handles, cleanup = make_handles(transport, payload, ctx)
    child = ctx.Process(target=child_main, args=(transport, payload, child_handles, counts), daemon=True)
    child.start()
    try:
        end = endpoint(transport, parent_handles, "parent", decode_type, payload in BIG)
        send, recv = end.send, end.recv
        gc.collect()
        gc.disable()
        try:
            _round_trips(send, recv, obj, counts.warmup, 0.0)
            busy = _round_trips(send, recv, obj, counts.busy, 0.0)
            paced = _round_trips(send, recv, obj, counts.paced, PACE_S)
            t0 = time.perf_counter()
            for _ in range(counts.tput):
                send(obj)
            recv()
            tput = counts.tput / (time.perf_counter() - t0)
            send(obj)
        finally:
            gc.enable()
        child.join(timeout=60)
        if child.exitcode != 0:
            raise RuntimeError(f"{transport}/{payload} echo process exited with {child.exitcode}")
        end.close()
    finally:
        if child.is_alive():
            child.kill()
            child.join()
        cleanup()
    size = encoded_size(obj)
    row = dict(transport=transport, payload=payload, payload_bytes=size)
    return [
        dict(row, mode="busy", rtt_us_median=statistics.median(busy), rtt_us_p99=_p99(busy), msgs_per_s=tput),
        dict(row, mode="paced", rtt_us_median=statistics.median(paced), rtt_us_p99=_p99(paced), msgs_per_s=None),
    ]


def _floor_child(name: str, batches: int, iters: int) -> None:
    from ipc import RingBuffer

    ring = RingBuffer.attach(name)
    for _ in range(batches):
        ring.floor_pingpong(iters, 1)


def run_floor(quick: bool, ctx: mp.context.BaseContext) -> list[dict]:
    """Two processes, two cache lines, C spinning: the round trip no transport can beat here."""
    from ipc import RingBuffer, native_available

    if not native_available():
        return []
    batches, iters = (21, 5000) if quick else (51, 20000)
    ring = RingBuffer.create(4096)
    child = ctx.Process(target=_floor_child, args=(ring.name, batches, iters), daemon=True)
    child.start()
    try:
        means = [ring.floor_pingpong(iters, 0) / 1000.0 for _ in range(batches)]
        child.join(timeout=60)
    finally:
        if child.is_alive():
            child.kill()
            child.join()
        ring.close()
    return [
        dict(transport="floor", payload="cacheline", payload_bytes=8, mode="busy",
             rtt_us_median=statistics.median(means), rtt_us_p99=max(means), msgs_per_s=None)
    ]


# ----------------------------------------------------------------------------- report


def ratio_checks(rows: list[dict]) -> list[tuple[str, str, float, float, bool]]:
    """(payload, mode, shm/zmq median ratio, limit, ok) for every payload and mode."""
    by_key = {(r["transport"], r["payload"], r["mode"]): r for r in rows}
    checks = []
    for payload in PAYLOADS:
        for mode in ("busy", "paced"):
            shm, zmq = by_key.get(("shm", payload, mode)), by_key.get(("zmq", payload, mode))
            if shm is None or zmq is None:
                continue
            ratio = shm["rtt_us_median"] / zmq["rtt_us_median"]
            limit = PACED_LIMIT if mode == "paced" else BUSY_LIMITS.get(payload, 1.0)
            checks.append((payload, mode, ratio, limit, ratio <= limit and ratio < 1.0))
    return checks


def format_table(rows: list[dict]) -> str:
    by_key = {(r["transport"], r["payload"], r["mode"]): r for r in rows}
    checks = {(p, m): (ratio, limit, ok) for p, m, ratio, limit, ok in ratio_checks(rows)}
    head = "| payload | bytes | mode | " + " | ".join(f"{t} µs (p99)" for t in TRANSPORTS)
    head += " | shm/zmq | limit | " + " | ".join(f"{t} msg/s" for t in TRANSPORTS) + " |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for payload in PAYLOADS:
        for mode in ("busy", "paced"):
            cells = [by_key.get((t, payload, mode)) for t in TRANSPORTS]
            if not any(cells):
                continue
            size = next(c for c in cells if c)["payload_bytes"]
            lat = [f"{c['rtt_us_median']:.1f} ({c['rtt_us_p99']:.0f})" if c else "-" for c in cells]
            rate = [f"{c['msgs_per_s']:,.0f}" if c and c["msgs_per_s"] else "" for c in cells]
            ratio, limit, ok = checks.get((payload, mode), (float("nan"), float("nan"), False))
            verdict = f"{ratio:.3f} {'ok' if ok else 'FAIL'}"
            lines.append(f"| {payload} | {size} | {mode} | " + " | ".join(lat) + f" | {verdict} | ≤{limit:g} | " + " | ".join(rate) + " |")
    floor = by_key.get(("floor", "cacheline", "busy"))
    if floor:
        lines.append(f"\nfloor (C, two cache lines, both sides spinning): {floor['rtt_us_median']:.2f} µs per round trip")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_key = {(r["transport"], r["payload"], r["mode"]): r for r in rows}
    colors = {"shm": "#1b9e77", "zmq": "#d95f02", "pipe": "#7570b3", "queue": "#e7298a"}
    fig, axes = plt.subplots(3, 1, figsize=(12, 14))
    width = 0.2
    panels = [("busy", "rtt_us_median", "busy round trip, median (µs, log)"),
              ("paced", "rtt_us_median", "paced (1 ms apart) round trip, median (µs, log)"),
              ("busy", "msgs_per_s", "one-way throughput (messages/s, log)")]
    for ax, (mode, key, title) in zip(axes, panels):
        for i, transport in enumerate(TRANSPORTS):
            values = [(by_key.get((transport, p, mode)) or {}).get(key) or 0 for p in PAYLOADS]
            bars = ax.bar([x + (i - 1.5) * width for x in range(len(PAYLOADS))], values, width,
                          label=transport, color=colors[transport])
            if transport == "shm" and key == "rtt_us_median":
                for bar, value in zip(bars, values):
                    ax.annotate(f"{value:.1f}", (bar.get_x() + bar.get_width() / 2, value), ha="center",
                                va="bottom", fontsize=8)
        labels = list(PAYLOADS)
        if key == "rtt_us_median":
            for x, payload in enumerate(PAYLOADS):
                shm, zmq = by_key.get(("shm", payload, mode)), by_key.get(("zmq", payload, mode))
                if shm and zmq:
                    labels[x] += f"\nshm/zmq {shm[key] / zmq[key]:.3f}"
        floor = by_key.get(("floor", "cacheline", "busy"))
        if floor and mode == "busy" and key == "rtt_us_median":
            ax.axhline(floor["rtt_us_median"], color="gray", linestyle=":", label=f"C floor {floor['rtt_us_median']:.2f} µs")
        ax.set_yscale("log")
        ax.set_xticks(range(len(PAYLOADS)))
        ax.set_xticklabels(labels)
        ax.set_title(title)
        ax.grid(axis="y", which="both", alpha=0.3)
        ax.legend(loc="upper right", fontsize=8, ncol=5)
    fig.suptitle("IPC between two processes: shared-memory ring vs ZeroMQ vs multiprocessing")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer round trips (done in under 2 minutes)")
    parser.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
    parser.add_argument("--plot", metavar="PATH.png", help="draw the results")
    parser.add_argument("--spin-us", type=float, help="shm ring spin before sleeping (default: the ring's)")
    parser.add_argument("--transports", default=",".join(TRANSPORTS), help="comma-separated subset")
    parser.add_argument("--payloads", default=",".join(PAYLOADS), help="comma-separated subset")
    args = parser.parse_args(argv)
    transports = [t for t in args.transports.split(",") if t]
    payloads = [p for p in args.payloads.split(",") if p]
    for name, chosen, allowed in (("transport", transports, TRANSPORTS), ("payload", payloads, PAYLOADS)):
        bad = sorted(set(chosen) - set(allowed))
        if bad:
            parser.error(f"unknown {name}(s) {bad}; choose from {allowed}")

    if args.spin_us is not None:
        SPIN_US[0] = args.spin_us
    ctx = mp.get_context("spawn")
    started = time.monotonic()
    rows = run_floor(args.quick, ctx)
    for payload in payloads:
        for transport in transports:
            rows.extend(run_case(transport, payload, args.quick, ctx))
            print(f"  {transport:5s} {payload:8s} done ({time.monotonic() - started:.0f} s)", file=sys.stderr)
    print(format_table(rows))
    failed = [c for c in ratio_checks(rows) if not c[4]]
    print(f"\n{len(ratio_checks(rows)) - len(failed)}/{len(ratio_checks(rows))} shm/zmq ratios within their limits"
          f" ({time.monotonic() - started:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.plot:
        plot(rows, args.plot)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
