"""The cost of the engine's messages themselves: msgspec encode and decode of an EngineCoreRequest
with 32 and with 2,048 prompt token ids (decoded as the engine does, `decode_to_engine`) and of
an EngineCoreOutputs of 64 one-token outputs (decoded as the frontend does,
`decode_from_engine`): the same messages as benchmarks/ipc_latency.py's req32 / req2048 / out64.
Encoding is timed twice: `encode` (a new bytes object) and `encode_into` (one reused bytearray,
as the engine's outbox and `ipc.Channel` send).

    flock /tmp/shmvllm-cpu.lock python benchmarks/ipc_messages.py --against /path/to/other/checkout \\
        --json benchmarks/results/ipc_messages.json --plot benchmarks/results/ipc_messages.png

Every figure is measured in a fresh Python process (`--worker`) importing shmvllm from one
checkout: this one, and with `--against DIR` another (the code before a change) in the same run.
A round measures each side once, the sides' order alternating from round to round; within a
process each operation is timed as the fastest of 5 timeit repeats of N calls (the least
disturbed by other programs), and a row's figure is the median over the rounds (`--rounds`,
default 7), with the rounds' range; the ratios are of the fastest rounds (the noise of a shared
machine only ever adds). Prints the table and, with --against, CHECK lines: `out64` encodes
(`encode_into`) and decodes faster here (the change measured last: a decode step's outputs as
columns; each checkout builds `out64` as its own engine sends it), and no figure is slower
beyond the noise (this one's fastest round slower than the other's slowest).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import timeit
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parents[1]
MESSAGES = ("req32", "req2048", "out64")
# encode_into: into one reused bytearray, as the engine's outbox sends (then one copy into the ring)
OPS = ("encode", "encode_into", "decode")
CALLS = 2000


def _message(name: str) -> Any:
    from shmvllm.boundary import messages as m
    from shmvllm.sampling_params import SamplingParams

    if name.startswith("req"):
        ids = m.EngineCoreRequest.pack_token_ids(range(int(name[3:])))
        params = SamplingParams(max_tokens=64, temperature=0.8, top_p=0.95)
        return m.EngineCoreRequest("req-0000001", ids, params, arrival_time=1.0)
    outputs = m.EngineCoreOutputs(timestamp=1.0)
    for i in range(64):  # a decode step: each request's one new token, as that checkout's engine sends it
        if hasattr(outputs, "add_tokens"):
            outputs.add_tokens(f"req-{i:07d}", [1000 + i])  # a row of the columns
        else:  # a checkout from before the columns: one struct per request
            outputs.outputs.append(m.EngineCoreOutput(request_id=f"req-{i:07d}", new_token_ids=[1000 + i]))
    return outputs


def worker() -> dict:
    """One process's figures: {message: {"encode_us", "decode_us", "bytes"}}."""
    from shmvllm.boundary import messages as m

    encoder = m.make_encoder()
    encode, encode_into, reused = encoder.encode, encoder.encode_into, bytearray(4096)
    out = {}
    for name in MESSAGES:
        msg = _message(name)
        buf = encode(msg)
        decode = m.decode_to_engine if name.startswith("req") else m.decode_from_engine
        assert type(decode(buf)).__name__ == type(msg).__name__, decode(buf)
        timed = {}
        ops = (("encode_us", lambda: encode(msg)), ("encode_into_us", lambda: encode_into(msg, reused)),
               ("decode_us", lambda: decode(buf)))
        for op, fn in ops:
            timed[op] = min(timeit.repeat(fn, number=CALLS, repeat=5)) / CALLS * 1e6
        out[name] = dict(timed, bytes=len(buf))
    return out


def _run(checkout: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(checkout))
    done = subprocess.run([sys.executable, __file__, "--worker"], env=env, cwd=checkout, check=True,
                          capture_output=True, text=True, timeout=600)
    return json.loads(done.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", metavar="DIR", help="another checkout, measured in the same run")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--plot", metavar="PATH.png")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker()))
        return 0
    sides = {"this": HERE} | ({"other": Path(args.against).resolve()} if args.against else {})
    rounds: dict[str, list[dict]] = {side: [] for side in sides}
    started = time.monotonic()
    for r in range(args.rounds):
        order = list(sides) if r % 2 == 0 else list(sides)[::-1]
        for side in order:
            rounds[side].append(_run(sides[side]))
        print(f"  round {r + 1}/{args.rounds} ({time.monotonic() - started:.0f} s)", file=sys.stderr)
    rows = []
    for side, results in rounds.items():
        for name in MESSAGES:
            for op in (f"{op}_us" for op in OPS):
                values = [res[name][op] for res in results]
                rows.append(dict(side=side, checkout=str(sides[side]), message=name, op=op[:-3],
                                 bytes=results[0][name]["bytes"], us_median=statistics.median(values), us_rounds=values))
    by = {(r["side"], r["message"], r["op"]): r for r in rows}
    print("| message | bytes | op | this µs [rounds] |" + (" other µs [rounds] | this / other (fastest) |" if args.against else ""))
    print("|---|---|---|---|" + ("---|---|" if args.against else ""))
    checks = []
    for name in MESSAGES:
        for op in OPS:
            this = by[("this", name, op)]
            cells = [f"{this['us_median']:.2f} [{min(this['us_rounds']):.2f}-{max(this['us_rounds']):.2f}]"]
            if args.against:
                other = by[("other", name, op)]
                ratio = min(this["us_rounds"]) / min(other["us_rounds"])
                cells += [f"{other['us_median']:.2f} [{min(other['us_rounds']):.2f}-{max(other['us_rounds']):.2f}]",
                          f"{ratio:.2f}"]
                if name == "out64" and op in ("encode_into", "decode"):
                    checks.append((f"CHECK {'ok  ' if ratio < 1 else 'FAIL'} {name} {op} faster: fastest round "
                                   f"{min(this['us_rounds']):.2f} µs vs {min(other['us_rounds']):.2f} µs (ratio {ratio:.2f})", ratio < 1))
                slower = min(this["us_rounds"]) > max(other["us_rounds"])
                checks.append((f"CHECK {'FAIL' if slower else 'ok  '} {name} {op} not slower beyond the noise: "
                               f"[{min(this['us_rounds']):.2f}-{max(this['us_rounds']):.2f}] vs "
                               f"[{min(other['us_rounds']):.2f}-{max(other['us_rounds']):.2f}] µs", not slower))
            print(f"| {name} | {this['bytes']} | {op} | " + " | ".join(cells) + " |")
    print()
    for line, _ in checks:
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.plot:
        _plot(rows, args.plot, bool(args.against))
    return 0 if all(ok for _, ok in checks) else 1


def _plot(rows: list[dict], path: str, against: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{m}\n{op}" for m in MESSAGES for op in OPS]
    fig, ax = plt.subplots(figsize=(12, 4.5))
    sides = ("other", "this") if against else ("this",)
    width = 0.8 / len(sides)
    for i, side in enumerate(sides):
        cells = [next(r for r in rows if r["side"] == side and r["message"] == m and r["op"] == op)
                 for m in MESSAGES for op in OPS]
        values = [c["us_median"] for c in cells]
        spread = [[v - min(c["us_rounds"]) for v, c in zip(values, cells)], [max(c["us_rounds"]) - v for v, c in zip(values, cells)]]
        ax.bar([x + (i - (len(sides) - 1) / 2) * width for x in range(len(labels))], values, width, yerr=spread,
               capsize=2, label={"this": "after", "other": "before"}[side] if against else side)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels)
    ax.set_ylabel("µs per call (median of rounds; bars: range)")
    ax.set_title("The engine's messages: msgspec encode / decode")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
