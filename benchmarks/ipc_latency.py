"""IPC latency between two processes: the ring against iceoryx2, pipes, ZeroMQ and multiprocessing.

    flock /tmp/shmvllm-cpu.lock python benchmarks/ipc_latency.py --quick \\
        --json benchmarks/results/ipc_latency.json --plot benchmarks/results/ipc_latency.png
    python benchmarks/ipc_latency.py --payloads 64B --transports shm,pipe --repeats 2   # a quick look

Payloads: raw bytes (64 B, 1 KiB, 64 KiB, 1 MiB) and engine-shaped msgspec messages
(shmvllm.boundary.messages): an EngineCoreRequest with 32 and with 2,048 prompt token ids, and an
EngineCoreOutputs batch of 64 one-token outputs, encoded, sent, decoded, re-encoded and sent back
(the ring decodes in place from its memory, the others from bytes), in rings of the size the
engine's are. Peers: `pip install -e .[bench]`.

For each transport and payload, a child process echoes what the parent sends:

- busy:   round trips back to back (ping-pong), both sides polling; median and p99 round trip;
- paced:  one round trip every 1 ms, so the receiver has gone to sleep each time (for iceoryx2,
          whose subscriber cannot block, it waits on an iceoryx2 event the sender notifies);
- msgs/s: one-way throughput, the parent sending back to back, acknowledged once at the end
          of a pass (the ring sends it in batches: `push_many` / `pop_many`, one published tail
          per batch); a round makes TPUT_PASSES passes in a row and keeps the fastest.

A round runs busy, then msgs/s, then paced, each in a steady state: the busy run follows 0.1 s
of unmeasured busy round trips, the throughput pass follows the busy run at once (two processes
that polled are on two CPUs by then), the paced run follows 150 unmeasured paced round trips
(BUSY_WARMUP_S, PACED_WARMUP: where the kernel puts the two processes when a mode begins is a
transient of its own, tens of µs a wake-up until it settles).

Rounds: the speed of a shared machine drifts by tens of percent from one second to the next, so
a case measured in one stretch can be judged on a slow second. For each payload the benchmark
runs `--repeats` rounds; a round is REPETITIONS repetitions, each running every case once (a
fresh echo process each time, so that no polling peer stays alive beside the others) in an order
rotated by one case per repetition, with its share of the busy and paced round trips and its
throughput passes; the round keeps each case's better repetition per mode (the round trips of
the lower median, the higher rate). A row's median and p99 are over the kept round trips of all
rounds together, its msg/s the median of the rounds' rates; the rows carry the rounds' medians
and rates too (`rtt_us_round_medians`, `msgs_per_s_rounds`), the table their range. The floor
runs as one more case in the rounds of the 64 B payload (or of the first payload chosen).

Transports (`transport` in the JSON, `variant` where there are several):
- shm: ipc.RingBuffer, one ring per direction;
- iceoryx2: publish-subscribe of a fixed-size payload type, `send_copy` (copy) or a loaned
  sample written in place (loan); the `bench` extra of the package (pip install iceoryx2);
- pipe: a raw os.pipe per direction (length-prefixed writes, reads into a buffer), and
  multiprocessing.Pipe (send_bytes / recv_bytes);
- zmq: pyzmq PUSH/PULL over ipc:// (when pyzmq is installed);
- queue: multiprocessing.Queue;
- floor: two processes bouncing a counter between two cache lines in C (`ipc_floor.c`, built
  here with the system compiler): the machine's limit, no queue logic at all.

The table's CHECK lines: the ring's median round trip below every peer's, busy and paced, at
64 B, 1 KiB and 64 KiB; its one-way msg/s the highest of every row; its 64 B busy round trip
within 10x the floor. A CHECK holds only if it holds on the medians and in every round (against
every peer's figure of that round): "won 2/3 rounds" fails. Exit status 1 if one fails. Run it
alone on the machine: it needs two idle cores.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import hashlib
import json
import multiprocessing as mp
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ipc and shmvllm of this checkout

CASES = (
    ("shm", "ring"),
    ("iceoryx2", "copy"),
    ("iceoryx2", "loan"),
    ("pipe", "os.pipe"),
    ("pipe", "multiprocessing"),
    ("zmq", "push/pull"),
    ("queue", "multiprocessing"),
)
RAW_SIZES = {"64B": 64, "1KiB": 1024, "64KiB": 64 << 10, "1MiB": 1 << 20}
MESSAGES = ("req32", "req2048", "out64")
CHECKED = ("64B", "1KiB", "64KiB")  # the payloads of the acceptance checks
FLOOR_FACTOR = 10.0
PACE_S = 0.001
BATCH = 64  # messages per push_many / pop_many in the ring's throughput run
# A round's one-way rate is the fastest of this many back-to-back passes: a pass lasts 1-70 ms
# for the ring (1 MiB: 3 ms), so one preemption or a peer's burst on the shared cores decides a
# single pass; noise only ever slows a pass down, for every transport alike.
TPUT_PASSES = 3
REPEATS = {True: 3, False: 5}  # rounds per payload by default, with --quick and without
# A round is this many repetitions of every case, interleaved, and keeps each case's better one
# (per mode): a preemption, or a placement that holds for a whole repetition (the echo process
# is fresh each time), then decides a round only when it hits both, for every transport alike.
REPETITIONS = 2
MIN_BUSY, MIN_PACED = 50, 20  # round trips a case makes in a round at least
# The paced run follows the busy one in the same two processes. When both sides polled during the
# busy run, the kernel has left them on two CPUs; a sleeper is then woken on its own idle CPU (a
# virtual CPU the host has to wake: tens of µs) for the next ~50-100 wake-ups, until the
# scheduler settles them. A transport whose receiver blocked in the busy run as well has settled
# there already. So every case makes this many paced round trips, unmeasured, first: the paced
# row is the steady state of one round trip a millisecond, whatever ran before it.
PACED_WARMUP = 150
# The busy run is likewise preceded by round trips for this long (at least Counts.warmup of them):
# two pollers that start on one CPU (the echo process is often woken onto its parent's) hand the
# CPU to each other until the kernel spreads them, within ~100 ms; a busy row is a sustained
# ping-pong, not that start.
BUSY_WARMUP_S = 0.1
FLOOR = ("floor", "cacheline")
ROUNDS_OF = {"rtt_us_median": "rtt_us_round_medians", "msgs_per_s": "msgs_per_s_rounds"}  # a row's figure -> its rounds'
BIG = 64 << 10  # raw payloads from this size are received in place where the transport can
_LEN = struct.Struct("=I")


def label(transport: str, variant: str) -> str:
    return transport if transport in ("shm", "zmq", "queue") else f"{transport} {variant}"


@dataclass
class Counts:
    busy: int
    paced: int
    tput: int
    paced_warmup: int = PACED_WARMUP  # paced round trips made, unmeasured, before the measured ones

    @property
    def warmup(self) -> int:
        return max(5, self.busy // 10)

    def per_round(self, repeats: int) -> "Counts":
        """One round's share of `repeats`: the round trips divided among the rounds (at least
        MIN_BUSY / MIN_PACED, at most the total), and whole throughput passes."""
        return Counts(min(self.busy, max(MIN_BUSY, self.busy // repeats)),
                      min(self.paced, max(MIN_PACED, self.paced // repeats)), self.tput, self.paced_warmup)


def counts_for(size: int, quick: bool) -> Counts:
    if size >= 1 << 20:
        return Counts(50, 50, 100)
    if size >= 16 << 10:
        return Counts(500, 200, 1000) if quick else Counts(5000, 1000, 10000)
    return Counts(2000, 200, 10000) if quick else Counts(20000, 1000, 100000)


@dataclass
class Payload:
    """What is sent: raw bytes, or a message with its encode/decode (see benchmarks/ipc_latency.py)."""

    name: str
    make: Callable[[], Any]  # -> the object sent; a top-level function (it runs in the child too)
    codec: Optional[Callable[[], tuple[Callable, Callable]]] = None  # -> (encode, decode)
    ring_capacity: Optional[int] = None  # the rings' capacity when the user of the messages has one; else ring_geometry()


def raw_payload(name: str) -> Payload:
    return Payload(name, _RawMaker(RAW_SIZES[name]))


class _RawMaker:
    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self) -> bytes:
        return hashlib.shake_256(b"ipc.bench").digest(self.size)


def _message(name: str) -> Any:
    from shmvllm.boundary import messages as m
    from shmvllm.sampling_params import SamplingParams

    if name.startswith("req"):
        ids = m.EngineCoreRequest.pack_token_ids(range(int(name[3:])))
        params = SamplingParams(max_tokens=64, temperature=0.8, top_p=0.95)
        return m.EngineCoreRequest("req-0000001", ids, params, arrival_time=time.time())
    outputs = m.EngineCoreOutputs(timestamp=time.time())
    for i in range(64):  # a decode step: each request's one new token, a row of the columns
        outputs.add_tokens(f"req-{i:07d}", [1000 + i])
    return outputs


class _MessageMaker:
    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self) -> Any:
        return _message(self.name)


class _MessageCodec:
    """The engine's codec: requests decoded as the engine does, outputs as the frontend does."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self) -> tuple[Callable, Callable]:
        from shmvllm.boundary import messages as m

        decode = m.decode_to_engine if self.name.startswith("req") else m.decode_from_engine
        return m.make_encoder().encode, decode


def message_payloads() -> dict[str, Payload]:
    """The engine's messages, in rings of the engine's capacity (4 MiB unless
    SHMVLLM_RING_CAPACITY says otherwise), as between the frontend and the engine."""
    from shmvllm.boundary.channel import ring_capacity

    return {name: Payload(name, _MessageMaker(name), _MessageCodec(name), ring_capacity()) for name in MESSAGES}


# ----------------------------------------------------------------------------- endpoints


@dataclass
class Endpoint:
    send: Callable[[Any], Any]
    recv: Callable[[], Any]
    close: Callable[[], Any]
    send_paced: Optional[Callable[[Any], Any]] = None  # the paced run's (a receiver that sleeps)
    recv_paced: Optional[Callable[[], Any]] = None
    send_many: Optional[Callable[[Any, int], Any]] = None  # the throughput run's
    recv_many: Optional[Callable[[int], Any]] = None
    echo: Optional[Callable[[], Any]] = None  # receive one message and send it back (busy)

    echo_paced: Optional[Callable[[], Any]] = None

    def __post_init__(self) -> None:
        if self.echo is None:
            send, recv = self.send, self.recv
            self.echo = lambda: send(recv())
        if self.send_paced is None and self.recv_paced is None:  # the paced run uses the busy calls
            self.echo_paced = self.echo
        self.send_paced = self.send_paced or self.send
        self.recv_paced = self.recv_paced or self.recv
        if self.echo_paced is None:
            send_paced, recv_paced = self.send_paced, self.recv_paced
            self.echo_paced = lambda: send_paced(recv_paced())
        if self.send_many is None:
            send = self.send

            def send_many(obj: Any, count: int) -> None:
                for _ in range(count):
                    send(obj)

            self.send_many = send_many
        if self.recv_many is None:
            recv = self.recv

            def recv_many(count: int) -> None:
                for _ in range(count):
                    recv()

            self.recv_many = recv_many


def _typed(send_raw: Callable, recv_raw: Callable, payload: Payload) -> tuple[Callable, Callable]:
    if payload.codec is None:
        return send_raw, recv_raw
    encode, decode = payload.codec()
    return (lambda obj: send_raw(encode(obj))), (lambda: decode(recv_raw()))


def _ring_endpoint(handles: dict, side: str, payload: Payload) -> Endpoint:
    from ipc import RingBuffer

    if side == "parent":
        tx, rx = handles["rings"]
    else:
        tx = RingBuffer.attach(handles["names"][1], prefault=True)
        rx = RingBuffer.attach(handles["names"][0], prefault=True)
    close = lambda: (tx.close(), rx.close())  # noqa: E731
    encode, decode = payload.codec() if payload.codec is not None else (None, None)

    def send_many(obj: Any, count: int) -> None:
        while count > 0:
            n = min(count, BATCH)
            tx.push_many([encode(obj) for _ in range(n)] if encode else [obj] * n)
            count -= n

    def recv_many(count: int) -> None:
        while count > 0:
            batch = rx.pop_many(min(count, BATCH))
            if decode is not None:
                for data in batch:
                    decode(data)
            count -= len(batch)

    if payload.codec is not None:
        return Endpoint(lambda obj: tx.push(encode(obj)), lambda: rx.consume(decode), close, send_many=send_many, recv_many=recv_many)
    if handles["size"] >= BIG:
        # As iceoryx2's loan row: each message written once into shared memory (push: reserve,
        # copy, commit in one C call) and read where it lies (consume), the echo copying from one
        # ring's record into the other's; reserve / pop_view from Python measure the same.

        def recv_in_place(count: int) -> None:
            for _ in range(count):
                rx.consume(len)

        return Endpoint(tx.push, lambda: rx.consume(len), close, send_many=send_many, recv_many=recv_in_place,
                        echo=lambda: rx.consume(tx.push))
    return Endpoint(tx.push, rx.pop, close, send_many=send_many, recv_many=recv_many)


def _pipe_endpoint(handles: dict, side: str, payload: Payload) -> Endpoint:
    """Length-prefixed messages on a raw pipe per direction: one write, reads into a buffer.
    (The pipes travel to the child as multiprocessing Connections; only their fds are used.)"""
    reader, writer = handles["ends"][side]
    r, w = reader.fileno(), writer.fileno()
    buf = bytearray(max(4096, handles["size"] + 8))
    view = memoryview(buf)
    write, readinto = os.write, os.readv

    def send_raw(data: bytes) -> None:
        out = memoryview(_LEN.pack(len(data)) + data)
        while out:
            out = out[write(w, out):]

    def recv_raw() -> bytes:
        got = readinto(r, [view[:4]])
        while got < 4:
            got += readinto(r, [view[got:4]])
        n = _LEN.unpack_from(buf)[0]
        got = 0
        while got < n:
            got += readinto(r, [view[got:n]])
        return bytes(view[:n])

    send, recv = _typed(send_raw, recv_raw, payload)
    return Endpoint(send, recv, lambda: (reader.close(), writer.close()))


def _iceoryx2_endpoint(handles: dict, side: str, payload: Payload, loan: bool) -> Endpoint:
    import iceoryx2 as iox

    iox.set_log_level(iox.LogLevel.Error)
    size = handles["size"]
    kind = ctypes.c_uint8 * size
    node = iox.NodeBuilder.new().create(iox.ServiceType.Ipc)
    out_name, in_name = handles["services"] if side == "parent" else handles["services"][::-1]

    def service(name: str) -> Any:
        return (
            node.service_builder(iox.ServiceName.new(name))
            .publish_subscribe(kind)
            .enable_safe_overflow(False)
            .subscriber_max_buffer_size(256)
            .open_or_create()
        )

    def event(name: str) -> Any:
        return node.service_builder(iox.ServiceName.new(name + "-event")).event().open_or_create()

    out_service, in_service = service(out_name), service(in_name)
    pub = out_service.publisher_builder().backpressure_strategy(iox.BackpressureStrategy.RetryUntilDelivered).create()
    sub = in_service.subscriber_builder().create()
    give_up = time.monotonic() + 30
    while out_service.dynamic_config.number_of_subscribers < 1 or in_service.dynamic_config.number_of_publishers < 1:
        if time.monotonic() > give_up:  # a sample sent before the peer subscribed would be lost
            raise TimeoutError(f"iceoryx2: the other side did not connect to {out_name} / {in_name}")
        time.sleep(0.001)
    pub.update_connections()
    notifier = event(out_name).notifier_builder().create()
    listener = event(in_name).listener_builder().create()
    string_at, memmove = ctypes.string_at, ctypes.memmove

    if loan:

        def send_raw(data: bytes) -> None:
            sample = pub.loan_uninit()
            memmove(sample.payload_ptr, data, len(data))
            sample.assume_init().send()

    else:
        send_copy = pub.send_copy

        def send_raw(data: bytes) -> None:
            send_copy(kind.from_buffer_copy(data))

    def recv_raw(wait: Optional[Callable[[], Any]] = None) -> bytes:
        """The next sample's bytes: polls, calling `wait` (if any) between two empty looks."""
        while True:
            sample = sub.receive()
            if sample is not None:
                data = string_at(sample.payload_ptr, size)
                sample.delete()
                return data
            if wait is not None:
                wait()

    def send_paced_raw(data: bytes) -> None:
        send_raw(data)
        notifier.notify()

    def recv_paced_raw() -> bytes:
        return recv_raw(listener.blocking_wait)

    send, recv = _typed(send_raw, recv_raw, payload)
    send_paced, recv_paced = _typed(send_paced_raw, recv_paced_raw, payload)
    keep = (node, pub, sub, notifier, listener)

    def close() -> None:
        for port in keep[:0:-1]:
            port.delete()

    if loan and payload.codec is None and size >= BIG:  # read in place, echo from sample to sample

        def recv_in_place() -> int:
            while True:
                sample = sub.receive()
                if sample is not None:
                    sample.delete()
                    return size

        def echo() -> None:
            while True:
                sample = sub.receive()
                if sample is not None:
                    break
            out = pub.loan_uninit()
            memmove(out.payload_ptr, sample.payload_ptr, size)
            out.assume_init().send()
            sample.delete()

        return Endpoint(send, recv_in_place, lambda: close(), send_paced=send_paced, recv_paced=recv_paced, echo=echo)

    return Endpoint(send, recv, close, send_paced=send_paced, recv_paced=recv_paced)


def endpoint(transport: str, variant: str, handles: dict, side: str, payload: Payload) -> Endpoint:
    """One side ("parent" or "child") of a transport."""
    if transport == "shm":
        return _ring_endpoint(handles, side, payload)
    if transport == "iceoryx2":
        return _iceoryx2_endpoint(handles, side, payload, loan=variant == "loan")
    if transport == "pipe" and variant == "os.pipe":
        return _pipe_endpoint(handles, side, payload)
    if transport == "pipe":
        conn = handles["conns"][0 if side == "parent" else 1]
        send, recv = _typed(conn.send_bytes, conn.recv_bytes, payload)
        return Endpoint(send, recv, conn.close)
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
        if payload.codec is None and handles["size"] >= BIG:  # zero-copy frames, as pyzmq advises
            send_raw = lambda data: push.send(data, copy=False)  # noqa: E731
            recv_raw = lambda: pull.recv(copy=False).buffer  # noqa: E731
        else:
            send_raw, recv_raw = push.send, pull.recv
        send, recv = _typed(send_raw, recv_raw, payload)
        return Endpoint(send, recv, lambda: (push.close(), pull.close(), ctx.term()))
    if transport == "queue":
        to_child, to_parent = handles["queues"]
        tx, rx = (to_child, to_parent) if side == "parent" else (to_parent, to_child)
        send, recv = _typed(tx.put, rx.get, payload)
        return Endpoint(send, recv, lambda: None)
    raise ValueError(f"transport must be one of {sorted({t for t, _ in CASES})}, got {transport!r}")


def child_main(transport: str, variant: str, payload: Payload, handles: dict, counts: Counts, warmups: Any) -> None:
    """The echo side of one round: busy round trips, throughput passes acknowledged once each, paced
    round trips. `warmups` (a shared integer) says how many round trips the parent's busy
    warm-up makes: it writes the number before the last of them (see `_warm_up`)."""
    obj = payload.make()
    end = endpoint(transport, variant, handles, "child", payload)
    gc.disable()
    send, recv, echo = end.send, end.recv, end.echo
    echoed = 0
    while echoed < warmups.value:
        echo()
        echoed += 1
    for _ in range(counts.busy):
        echo()
    for _ in range(TPUT_PASSES):
        end.recv_many(counts.tput)
        send(obj)
    echo_paced = end.echo_paced
    for _ in range(counts.paced_warmup + counts.paced):
        echo_paced()
    recv()  # the parent's "done": keeps our end open until the parent has read the last echo
    end.close()


# ----------------------------------------------------------------------------- parent


def _warm_up(send: Callable, recv: Callable, obj: Any, least: int, seconds: float, warmups: Any) -> None:
    """Round trips for `seconds` (at least `least`), then tells the echo process how many there
    were and makes the last one. The echo reads the number after each echo and stops once it has
    echoed that many: written after our n-th reply and before the (n+1)-th send, it is read either
    after the n-th echo (n+1 > n: it goes on) or after the (n+1)-th (it stops): never one early."""
    n, end = 0, time.perf_counter() + seconds
    while n < least or time.perf_counter() < end:
        send(obj)
        recv()
        n += 1
    warmups.value = n + 1
    send(obj)
    recv()


def _round_trips(send: Callable, recv: Callable, obj: Any, n: int, pace: float) -> list[float]:
    rtts = []
    next_at = time.perf_counter()
    clock = time.perf_counter_ns
    for _ in range(n):
        if pace:
            next_at += pace
            delay = next_at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
        t0 = clock()
        send(obj)
        recv()
        rtts.append((clock() - t0) / 1000.0)
    return rtts


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]


def encoded_size(payload: Payload, obj: Any) -> int:
    return len(obj) if payload.codec is None else len(payload.codec()[0](obj))


RECORDS_PER_RING = 2  # a raw payload's ring holds this many of its records (2: max_record = capacity/2)


def ring_geometry(size: int) -> tuple[int, int]:
    """(capacity, max_record) of the smallest ring that holds RECORDS_PER_RING records of a
    message of `size` bytes, in whole pages: 64 KiB at least, 8 MiB at most. Small, because a
    ring's records go round all of it: the fewer lines it has, the more of them are still in
    the caches when they are written again."""
    from ipc.layout import record_size

    capacity = min(max(-(-RECORDS_PER_RING * record_size(size) // 4096) * 4096, 64 << 10), 8 << 20)
    return capacity, (capacity // RECORDS_PER_RING) & ~7


def make_handles(transport: str, variant: str, size: int, ctx: Any, capacity: Optional[int] = None) -> tuple[dict, dict, Callable]:
    """(the parent's handles, what the child gets, cleanup)."""
    if transport == "shm":
        from ipc import RingBuffer

        geometry = dict(capacity=capacity) if capacity else dict(zip(("capacity", "max_record"), ring_geometry(size)))
        rings = tuple(RingBuffer.create(**geometry, prefault=True) for _ in range(2))
        return {"rings": rings, "size": size}, {"names": [r.name for r in rings], "size": size}, lambda: [r.close() for r in rings]
    if transport == "iceoryx2":
        tag = f"ipcbench/{os.getpid()}-{time.monotonic_ns()}"
        handles = {"services": [tag + "/to-child", tag + "/to-parent"], "size": size}
        return handles, handles, lambda: None
    if transport == "pipe" and variant == "os.pipe":
        down, up = ctx.Pipe(duplex=False), ctx.Pipe(duplex=False)  # (reader, writer) each
        ends = {"parent": (up[0], down[1]), "child": (down[0], up[1])}
        return {"ends": ends, "size": size}, {"ends": ends, "size": size}, lambda: None
    if transport == "zmq":
        tmp = tempfile.mkdtemp(prefix="ipcbench-")
        paths = [f"ipc://{tmp}/a", f"ipc://{tmp}/b"]
        handles = {"paths": paths, "size": size}
        return handles, handles, lambda: shutil.rmtree(tmp, ignore_errors=True)
    if transport == "pipe":
        conns = ctx.Pipe(duplex=True)
        return {"conns": conns}, {"conns": conns}, lambda: None
    queues = (ctx.Queue(), ctx.Queue())
    return {"queues": queues}, {"queues": queues}, lambda: [q.close() for q in queues]


def _wait_attached(rings: tuple, child: Any, timeout: float = 60.0) -> None:
    """Until the echo process has attached to both rings: before that a ring knows no peer whose
    death it could notice, so a child that dies while starting would leave us waiting forever."""
    deadline = time.monotonic() + timeout
    while not all(ring.peer_pid for ring in rings):
        if not child.is_alive():
            raise RuntimeError(f"the echo process exited with {child.exitcode} before it attached to the rings")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the echo process did not attach to the rings within {timeout:.0f} s")
        time.sleep(0.001)


def run_round(transport: str, variant: str, payload: Payload, counts: Counts, ctx: Any) -> dict:
    """One round of one case, with its own echo process: {"payload_bytes", "busy" (round trips,
    µs), "paced" (µs), "msgs_per_s" (the fastest throughput pass's rate)}."""
    obj = payload.make()
    size = encoded_size(payload, obj)
    parent_handles, child_handles, cleanup = make_handles(transport, variant, size, ctx, payload.ring_capacity)
    warmups = ctx.RawValue("q", 1 << 62)  # the busy warm-up's round trips, once the parent knows
    child = ctx.Process(target=child_main, args=(transport, variant, payload, child_handles, counts, warmups), daemon=True)
    child.start()
    if transport == "pipe" and variant == "os.pipe":  # the child has its ends now: close ours
        for conn in child_handles["ends"]["child"]:
            conn.close()
    try:
        if transport == "shm":
            _wait_attached(parent_handles["rings"], child)
        end = endpoint(transport, variant, parent_handles, "parent", payload)
        send, recv = end.send, end.recv
        gc.collect()
        gc.disable()
        try:
            _warm_up(send, recv, obj, counts.warmup, BUSY_WARMUP_S, warmups)
            busy = _round_trips(send, recv, obj, counts.busy, 0.0)
            rate = 0.0
            for _ in range(TPUT_PASSES):  # right after the busy run: the processes are where it left them
                t0 = time.perf_counter()
                end.send_many(obj, counts.tput)
                recv()
                rate = max(rate, counts.tput / (time.perf_counter() - t0))
            _round_trips(end.send_paced, end.recv_paced, obj, counts.paced_warmup, PACE_S)
            paced = _round_trips(end.send_paced, end.recv_paced, obj, counts.paced, PACE_S)
            send(obj)
        finally:
            gc.enable()
        child.join(timeout=60)
        if child.exitcode != 0:
            raise RuntimeError(f"{label(transport, variant)}/{payload.name} echo process exited with {child.exitcode}")
        end.close()
    finally:
        if child.is_alive():
            child.kill()
            child.join()
        cleanup()
    return dict(payload_bytes=size, busy=busy, paced=paced, msgs_per_s=rate)


def merge_rounds(transport: str, variant: str, payload: str, rounds: list[dict]) -> list[dict]:
    """The busy and the paced row of a case from its rounds (`run_round`'s results): median and
    p99 over the round trips of all rounds, msg/s the median of the rounds' rates, and the
    rounds' own medians and rates."""
    row = dict(transport=transport, variant=variant, payload=payload, payload_bytes=rounds[0]["payload_bytes"])
    out = []
    for mode in ("busy", "paced"):
        pooled = [rtt for r in rounds for rtt in r[mode]]
        rates = [r["msgs_per_s"] for r in rounds] if mode == "busy" else None
        out.append(dict(row, mode=mode, rtt_us_median=statistics.median(pooled), rtt_us_p99=_p99(pooled),
                        msgs_per_s=statistics.median(rates) if rates else None,
                        rtt_us_round_medians=[statistics.median(r[mode]) for r in rounds], msgs_per_s_rounds=rates))
    return out


def better_of(repetitions: list[dict]) -> dict:
    """A round from its repetitions of one case (`run_round`'s results): per mode the round trips
    of the repetition with the lower median, the higher of their rates."""
    return dict(payload_bytes=repetitions[0]["payload_bytes"],
                busy=min((r["busy"] for r in repetitions), key=statistics.median),
                paced=min((r["paced"] for r in repetitions), key=statistics.median),
                msgs_per_s=max(r["msgs_per_s"] for r in repetitions))


def rotated(cases: list, round_index: int) -> list:
    """The order of the cases in a round: round r starts at case r mod n, so that each case is
    first (and last) in as many rounds as any other."""
    k = round_index % len(cases) if cases else 0
    return list(cases[k:]) + list(cases[:k])


def run_payload(payload: Payload, cases: list, repeats: int, quick: bool, ctx: Any, floor_program: Optional[str] = None,
                progress: Callable[[str], Any] = lambda line: None) -> list[dict]:
    """`repeats` rounds of every case (and, with `floor_program`, of the floor) on one payload,
    each of REPETITIONS interleaved repetitions (the order rotated by one case for each), merged
    into rows."""
    counts = counts_for(encoded_size(payload, payload.make()), quick).per_round(repeats * REPETITIONS)
    jobs = list(cases) + ([FLOOR] if floor_program else [])
    results: dict[tuple, list] = {job: [[] for _ in range(repeats)] for job in jobs}
    for r in range(repeats):
        for k in range(REPETITIONS):
            for job in rotated(jobs, r * REPETITIONS + k):
                if job == FLOOR:
                    results[job][r].append(floor_round(floor_program, quick, repeats * REPETITIONS))
                else:
                    results[job][r].append(run_round(*job, payload, counts, ctx))
                progress(f"round {r + 1}/{repeats}.{k + 1} {payload.name:8s} {label(*job):24s}")
    rows = []
    for job in jobs:
        if job == FLOOR:
            rows.extend(merge_floor([min(reps, key=statistics.median) for reps in results[job]]))
        else:
            rows.extend(merge_rounds(*job, payload.name, [better_of(reps) for reps in results[job]]))
    return rows


def build_floor() -> Optional[str]:
    """The floor program, compiled into a private temporary directory; None without a compiler."""
    from ipc._native import find_compiler

    cc = find_compiler()
    if cc is None:
        return None
    out = Path(tempfile.mkdtemp(prefix="ipcbench-floor-")) / "floor"
    subprocess.run([cc, "-O2", "-o", str(out), str(Path(__file__).with_name("ipc_floor.c"))], check=True, capture_output=True)
    return str(out)


def floor_round(program: str, quick: bool, repeats: int) -> list[float]:
    """One round of the floor: two processes, two cache lines, C spinning, the round trip no
    transport can beat here; the mean µs of each batch of round trips."""
    batches, iters = (21, 5000) if quick else (51, 20000)
    batches = max(5, batches // repeats)
    out = subprocess.run([program, str(batches), str(iters)], check=True, capture_output=True, text=True, timeout=120)
    return [float(line) / 1000.0 for line in out.stdout.split()]


def merge_floor(rounds: list[list[float]]) -> list[dict]:
    """The floor's row: the median of the rounds' medians (of their batch means), the slowest
    batch as its p99."""
    medians = [statistics.median(means) for means in rounds]
    return [dict(transport=FLOOR[0], variant=FLOOR[1], payload="cacheline", payload_bytes=8, mode="busy",
                 rtt_us_median=statistics.median(medians), rtt_us_p99=max(m for means in rounds for m in means),
                 msgs_per_s=None, rtt_us_round_medians=medians, msgs_per_s_rounds=None)]


# ----------------------------------------------------------------------------- report


def _index(rows: list[dict]) -> dict:
    return {(r["transport"], r["variant"], r["payload"], r["mode"]): r for r in rows}


def rounds_won(shm: Optional[list], peers: list[Optional[list]], wins: Callable[[float, list[float]], bool]) -> Optional[tuple[int, int]]:
    """(rounds in which `wins(shm's figure, the peers' figures)` holds, rounds), comparing the
    figures of the same round; None when a row has no rounds or not as many as the others."""
    if not shm or any(not p or len(p) != len(shm) for p in peers):
        return None
    return sum(bool(wins(value, [p[i] for p in peers])) for i, value in enumerate(shm)), len(shm)


def _won(counted: Optional[tuple[int, int]]) -> str:
    return f", won {counted[0]}/{counted[1]} rounds" if counted else ""


def _every_round(ok: bool, counted: Optional[tuple[int, int]]) -> bool:
    """A CHECK holds on the medians and in every round."""
    return ok and (counted is None or counted[0] == counted[1])


def checks(rows: list[dict]) -> list[tuple[str, bool]]:
    """(CHECK line, ok) for every acceptance target the rows allow to judge; ok: it holds on the
    medians and in every round (the line says in how many rounds the ring won)."""
    by_key, out = _index(rows), []
    payloads = list(dict.fromkeys(r["payload"] for r in rows if r["transport"] == "shm"))
    for payload in payloads:
        for mode in ("busy", "paced"):
            shm = by_key.get(("shm", "ring", payload, mode))
            peers = [r for (t, v, p, m), r in by_key.items() if p == payload and m == mode and t not in ("shm", "floor")]
            if shm is None or not peers:
                continue
            if payload in CHECKED:
                best = min(peers, key=lambda r: r["rtt_us_median"])
                ok = shm["rtt_us_median"] < best["rtt_us_median"]
                won = rounds_won(shm.get("rtt_us_round_medians"), [p.get("rtt_us_round_medians") for p in peers],
                                 lambda value, others: value < min(others))
                ok = _every_round(ok, won)
                out.append((f"CHECK {'ok  ' if ok else 'FAIL'} {payload} {mode}: shm {shm['rtt_us_median']:.2f} µs < best peer "
                            f"{label(best['transport'], best['variant'])} {best['rtt_us_median']:.2f} µs "
                            f"(ratio {shm['rtt_us_median'] / best['rtt_us_median']:.3f}){_won(won)}", ok))
            if mode == "busy" and shm.get("msgs_per_s"):
                best = max(peers, key=lambda r: r.get("msgs_per_s") or 0)
                ok = shm["msgs_per_s"] > (best.get("msgs_per_s") or 0)
                won = rounds_won(shm.get("msgs_per_s_rounds"), [p.get("msgs_per_s_rounds") for p in peers],
                                 lambda value, others: value > max(others))
                ok = _every_round(ok, won)
                out.append((f"CHECK {'ok  ' if ok else 'FAIL'} {payload} one-way: shm {shm['msgs_per_s']:,.0f} msg/s > best peer "
                            f"{label(best['transport'], best['variant'])} {best['msgs_per_s']:,.0f} "
                            f"(ratio {shm['msgs_per_s'] / best['msgs_per_s']:.2f}){_won(won)}", ok))
    floor, shm64 = by_key.get((*FLOOR, "cacheline", "busy")), by_key.get(("shm", "ring", "64B", "busy"))
    if floor and shm64:
        ratio = shm64["rtt_us_median"] / floor["rtt_us_median"]
        ok = ratio <= FLOOR_FACTOR
        won = rounds_won(shm64.get("rtt_us_round_medians"), [floor.get("rtt_us_round_medians")],
                         lambda value, others: value <= FLOOR_FACTOR * others[0])
        ok = _every_round(ok, won)
        out.append((f"CHECK {'ok  ' if ok else 'FAIL'} 64B busy: shm {shm64['rtt_us_median']:.2f} µs <= {FLOOR_FACTOR:g}x floor "
                    f"{floor['rtt_us_median']:.3f} µs (ratio {ratio:.1f}x){_won(won)}", ok))
    return out


def _spread(values: Optional[list], fmt: Callable[[float], str]) -> str:
    """" [lowest-highest]" of the rounds' figures, or nothing for fewer than two rounds."""
    return f" [{fmt(min(values))}-{fmt(max(values))}]" if values and len(values) > 1 else ""


def _rate(value: float) -> str:
    return f"{value / 1e6:.2f}M" if value >= 1e6 else f"{value / 1e3:.1f}k" if value >= 1e3 else f"{value:.0f}"


def format_table(rows: list[dict]) -> str:
    by_key = _index(rows)
    cases = [c for c in CASES if any(k[:2] == c for k in by_key)]
    payloads = list(dict.fromkeys(r["payload"] for r in rows if r["transport"] != "floor"))
    head = "| payload | bytes | mode | " + " | ".join(f"{label(*c)} µs [rounds] (p99)" for c in cases) + " | shm / best peer |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for payload in payloads:
        for mode in ("busy", "paced"):
            cells = [by_key.get((*c, payload, mode)) for c in cases]
            if not any(cells):
                continue
            size = next(c for c in cells if c)["payload_bytes"]
            lat = [f"{c['rtt_us_median']:.2f}{_spread(c.get('rtt_us_round_medians'), '{:.2f}'.format)} ({c['rtt_us_p99']:.0f})"
                   if c else "-" for c in cells]
            shm, peers = cells[0] if cases[0][0] == "shm" else None, [c for c in cells[1:] if c]
            ratio = f"{shm['rtt_us_median'] / min(p['rtt_us_median'] for p in peers):.3f}" if shm and peers else "-"
            lines.append(f"| {payload} | {size} | {mode} | " + " | ".join(lat) + f" | {ratio} |")
    lines += ["", "| payload | " + " | ".join(f"{label(*c)} msg/s [rounds]" for c in cases) + " | shm / best peer |",
              "|" + "---|" * (len(cases) + 2)]
    for payload in payloads:
        cells = [by_key.get((*c, payload, "busy")) for c in cases]
        rates = [c["msgs_per_s"] if c and c.get("msgs_per_s") else None for c in cells]
        text = [f"{r:,.0f}{_spread(c.get('msgs_per_s_rounds'), _rate)}" if r else "-" for r, c in zip(rates, cells)]
        peers = [r for r in rates[1:] if r]
        ratio = f"{rates[0] / max(peers):.2f}" if rates[0] and peers else "-"
        lines.append(f"| {payload} | " + " | ".join(text) + f" | {ratio} |")
    floor = by_key.get((*FLOOR, "cacheline", "busy"))
    if floor:
        lines.append(f"\nfloor (C, two cache lines, both sides spinning): {floor['rtt_us_median']:.3f} µs per round trip"
                     f"{_spread(floor.get('rtt_us_round_medians'), '{:.3f}'.format)}")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_key = _index(rows)
    cases = [c for c in CASES if any(k[:2] == c for k in by_key)]
    payloads = list(dict.fromkeys(r["payload"] for r in rows if r["transport"] != "floor"))
    fig, axes = plt.subplots(3, 1, figsize=(13, 14))
    width = 0.8 / max(1, len(cases))
    panels = [("busy", "rtt_us_median", "busy round trip, median (µs, log)"),
              ("paced", "rtt_us_median", "paced (1 ms apart, receiver asleep) round trip, median (µs, log)"),
              ("busy", "msgs_per_s", "one-way throughput (messages/s, log)")]
    for ax, (mode, key, title) in zip(axes, panels):
        for i, case in enumerate(cases):
            cells = [by_key.get((*case, p, mode)) or {} for p in payloads]
            values = [c.get(key) or 0 for c in cells]
            rounds = [c.get(ROUNDS_OF[key]) or [v] for c, v in zip(cells, values)]
            spread = [[max(0, v - min(r)) for v, r in zip(values, rounds)], [max(0, max(r) - v) for v, r in zip(values, rounds)]]
            bars = ax.bar([x + (i - (len(cases) - 1) / 2) * width for x in range(len(payloads))], values, width,
                          yerr=spread, error_kw=dict(elinewidth=0.6, capsize=1.5), label=label(*case))
            if case[0] == "shm":
                for bar, value in zip(bars, values):
                    text = f"{value:.2f}" if key == "rtt_us_median" else f"{value / 1e6:.2f}M"
                    ax.annotate(text, (bar.get_x() + bar.get_width() / 2, value), ha="center", va="bottom", fontsize=7)
        floor = by_key.get(("floor", "cacheline", "cacheline", "busy"))
        if floor and mode == "busy" and key == "rtt_us_median":
            ax.axhline(floor["rtt_us_median"], color="gray", linestyle=":", label=f"C floor {floor['rtt_us_median']:.3f} µs")
        ax.set_yscale("log")
        ax.set_xticks(range(len(payloads)))
        ax.set_xticklabels(payloads)
        ax.set_title(title + ", bars: the rounds' range")
        ax.grid(axis="y", which="both", alpha=0.3)
        ax.legend(loc="upper right", fontsize=7, ncol=4)
    fig.suptitle("IPC between two processes: ipc ring vs iceoryx2, pipes, ZeroMQ, multiprocessing")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


IOX2_SHM, IOX2_ROOT = "iox2_", Path("/tmp/iceoryx2")  # iceoryx2's defaults without a config file


def iceoryx2_files() -> set[Path]:
    """What iceoryx2 keeps on disk between its processes: its segments in /dev/shm (a node's
    management segment outlives the node) and the tree under its root directory."""
    found = set(Path("/dev/shm").glob(IOX2_SHM + "*"))
    if IOX2_ROOT.is_dir():
        found |= {IOX2_ROOT, *IOX2_ROOT.rglob("*")}
    return found


def remove_iceoryx2_files(before: set[Path]) -> list[Path]:
    """Removes what the iceoryx2 cases left that was not there before the run (every echo
    process has exited by then), deepest first; a directory someone filled since stays."""
    left = sorted(iceoryx2_files() - before, key=lambda path: len(path.parts), reverse=True)
    for path in left:
        try:
            if path.is_dir() and not path.is_symlink():
                path.rmdir()
            else:
                path.unlink()
        except OSError:
            pass
    return left


def available(transport: str) -> bool:
    module = {"iceoryx2": "iceoryx2", "zmq": "zmq"}.get(transport)
    if module is None:
        return True
    import importlib.util

    return importlib.util.find_spec(module) is not None


def main(argv: Optional[list[str]] = None) -> int:
    payloads = {name: raw_payload(name) for name in RAW_SIZES}
    payloads.update(message_payloads())
    transports = sorted({t for t, _ in CASES})
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer round trips (a couple of minutes)")
    parser.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
    parser.add_argument("--plot", metavar="PATH.png", help="draw the results")
    parser.add_argument("--transports", default=",".join(transports), help="comma-separated subset")
    parser.add_argument("--payloads", default=",".join(payloads), help="comma-separated subset")
    parser.add_argument("--no-floor", action="store_true", help="skip the C floor")
    parser.add_argument("--repeats", type=int, metavar="R",
                        help=f"rounds per payload, each running every case {REPETITIONS} times in a rotated order "
                             f"and keeping the better (default {REPEATS[True]} with --quick, else {REPEATS[False]})")
    args = parser.parse_args(argv)
    repeats = REPEATS[args.quick] if args.repeats is None else args.repeats
    if repeats < 1:
        parser.error(f"--repeats must be at least 1, got {repeats}")
    chosen_t = [t for t in args.transports.split(",") if t]
    chosen_p = [p for p in args.payloads.split(",") if p]
    for name, chosen, allowed in (("transport", chosen_t, transports), ("payload", chosen_p, list(payloads))):
        bad = sorted(set(chosen) - set(allowed))
        if bad:
            parser.error(f"unknown {name}(s) {bad}; choose from {allowed}")
    cases = []
    for case in CASES:
        if case[0] in chosen_t:
            if available(case[0]):
                cases.append(case)
            else:
                print(f"skipping {label(*case)}: its package is not installed (pip install 'shmvllm[bench]')", file=sys.stderr)

    ctx = mp.get_context("spawn")
    started = time.monotonic()
    progress = lambda line: print(f"  {line} done ({time.monotonic() - started:.0f} s)", file=sys.stderr)  # noqa: E731
    floor_program = None if args.no_floor else build_floor()
    floor_with = "64B" if "64B" in chosen_p else chosen_p[0] if chosen_p else None  # the payload whose rounds include the floor
    rows = []
    iceoryx2_before = iceoryx2_files()
    try:
        for name in chosen_p:
            rows.extend(run_payload(payloads[name], cases, repeats, args.quick, ctx,
                                    floor_program if name == floor_with else None, progress))
    finally:
        if floor_program:
            shutil.rmtree(Path(floor_program).parent, ignore_errors=True)
        if any(transport == "iceoryx2" for transport, _ in cases):
            remove_iceoryx2_files(iceoryx2_before)
    print(format_table(rows))
    results = checks(rows)
    print()
    for line, _ in results:
        print(line)
    failed = [line for line, ok in results if not ok]
    print(f"\n{len(results) - len(failed)}/{len(results)} checks hold ({time.monotonic() - started:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.plot:
        plot(rows, args.plot)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
