"""The GEMMs of SmolLM2-135M on GGML blocks (shm_qgemm) against oneDNN's prepacked fp32 GEMM.

For each linear shape of the model (fused qkv, o, fused gate-up, down; the tied lm_head at the
decode row count) and each row count (64: a batch-64 decode step; 512: a prefill chunk), one
call of `block_linear` on random blocks of each GGML format against
`torch.ops.mkldnn._linear_pointwise` on the same shape's weight packed by
`_reorder_linear_weight` (what the dense path, `quantization="none"`, runs). Repetitions are
interleaved (ours, then oneDNN, shape by shape) and the median is kept; a step's figure is the
per-shape medians weighted by how often the model runs each shape (30 layers, one lm_head).

    flock /tmp/shmvllm-cpu.lock python benchmarks/qgemm.py --json benchmarks/results/qgemm.json \\
        --plot benchmarks/results/qgemm.png
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from shmvllm.model.kernels import quant_isas_supported
from shmvllm.model.linear import block_linear
from shmvllm.model.quant import FORMAT_IDS, FORMATS, QuantizedWeight

HIDDEN, INTERMEDIATE, KV, VOCAB, LAYERS = 576, 1536, 192, 49152, 30
# (name, out features n, in features k, calls per step)
LAYER_SHAPES = [("qkv", HIDDEN + 2 * KV, HIDDEN, LAYERS), ("o", HIDDEN, HIDDEN, LAYERS),
                ("gate_up", 2 * INTERMEDIATE, HIDDEN, LAYERS), ("down", HIDDEN, INTERMEDIATE, LAYERS)]
LM_HEAD = ("lm_head", VOCAB, HIDDEN, 1)
# the default model's formats: Q4_1 layers, Q8_0 embedding / lm_head; the rest on the layer shapes
DEFAULT = {"layers": "Q4_1", "lm_head": "Q8_0"}
OTHER_FORMATS = ["Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
_FP16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def random_blocks(name: str, n: int, k: int, rng: np.random.Generator) -> QuantizedWeight:
    qtype = FORMAT_IDS[name]
    _, values, nbytes = FORMATS[qtype]
    blocks = rng.integers(0, 256, size=(n * (k // values), nbytes), dtype=np.uint8)
    for offset in _FP16_FIELDS[name]:
        blocks[:, offset : offset + 2] = (rng.standard_normal(len(blocks)) * 0.05).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return QuantizedWeight(torch.from_numpy(blocks.reshape(n, -1)), qtype, k)


CLOCK = time.perf_counter


def _time(fn: Callable[[], Any], calls: int) -> float:
    started = CLOCK()
    for _ in range(calls):
        fn()
    return (CLOCK() - started) / calls


def measure(shapes: list[tuple[str, int, int, int]], rows: int, fmt_of: Callable[[str], str], repeats: int,
            rng: np.random.Generator) -> list[dict[str, Any]]:
    """Per shape: median seconds of one call, ours and oneDNN's, interleaved."""
    cases = []
    for name, n, k, count in shapes:
        fmt = fmt_of(name)
        blocks = random_blocks(fmt, n, k, rng)
        packed = torch.ops.mkldnn._reorder_linear_weight(blocks.dequantize(), 128)
        x = torch.randn(rows, k)
        residual = torch.randn(rows, n) if name in ("o", "down") else None
        ours = (lambda x=x, b=blocks, r=residual, n=n: block_linear(x, [(0, b)], n, None, r))
        if residual is None:
            theirs = (lambda x=x, p=packed: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""))
        else:
            theirs = (lambda x=x, p=packed, r=residual: torch.ops.mkldnn._linear_pointwise.binary(x, r, p, None, "add"))
        calls = max(1, int(2e8 // (rows * n * k)))  # ~0.2 GFLOP a sample
        ours(), theirs()
        cases.append({"name": name, "format": fmt, "n": n, "k": k, "rows": rows, "count": count,
                      "calls": calls, "fns": (ours, theirs), "ours": [], "onednn": []})
    for rep in range(repeats):
        for case in cases:
            ours, theirs = case["fns"]
            order = [("ours", ours), ("onednn", theirs)]
            for key, fn in (order if rep % 2 == 0 else order[::-1]):
                case[key].append(_time(fn, case["calls"]))
    results = []
    for case in cases:
        ours_s, onednn_s = statistics.median(case["ours"]), statistics.median(case["onednn"])
        flops = 2 * case["rows"] * case["n"] * case["k"]
        results.append({k: case[k] for k in ("name", "format", "n", "k", "rows", "count")} | {
            "ours_ms": ours_s * 1e3, "onednn_ms": onednn_s * 1e3,
            "ours_gflops": flops / ours_s / 1e9, "onednn_gflops": flops / onednn_s / 1e9,
            "ratio": onednn_s / ours_s})
    return results


def step(results: list[dict[str, Any]]) -> dict[str, float]:
    ours = sum(r["ours_ms"] * r["count"] for r in results)
    onednn = sum(r["onednn_ms"] * r["count"] for r in results)
    return {"ours_ms": ours, "onednn_ms": onednn, "ratio": onednn / ours}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7, help="interleaved samples per shape (median kept)")
    parser.add_argument("--rows", default="64,512", help="comma-separated row counts (default 64,512)")
    parser.add_argument("--formats", action=argparse.BooleanOptionalAction, default=True,
                        help="also time the other GGML formats on the layer shapes at each row count")
    parser.add_argument("--threads", type=int, default=0, help="threads for both (default: torch's default)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="with --threads 1: time the calling thread's CPU time instead of the wall clock, "
                             "which other processes' load on a shared machine does not inflate")
    parser.add_argument("--json", help="write the results to this JSON file")
    parser.add_argument("--plot", help="draw a PNG bar chart to this path")
    args = parser.parse_args()
    if not quant_isas_supported():
        sys.exit("the quantized kernels could not be built")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cpu_time:
        if torch.get_num_threads() != 1:
            sys.exit("--cpu-time measures one thread: run with --threads 1 (and OMP_NUM_THREADS=1)")
        global CLOCK
        CLOCK = time.thread_time
    rng = np.random.default_rng(0)
    steps: dict[str, dict[str, float]] = {}
    all_results: list[dict[str, Any]] = []
    print(f"{'shape':<9} {'format':<6} {'rows':>5} {'ours ms':>9} {'oneDNN ms':>10} {'ours GF/s':>10} {'oneDNN GF/s':>12} {'ratio':>6}")
    for rows in (int(r) for r in args.rows.split(",")):
        shapes = LAYER_SHAPES + ([LM_HEAD] if rows <= 64 else [])  # prefill runs the lm_head on last tokens only
        fmt_of = (lambda name: DEFAULT["lm_head"] if name == "lm_head" else DEFAULT["layers"])
        sets = [("default", shapes, fmt_of)]
        if args.formats:  # a K format's 256-value blocks fit only rows of a multiple of 256 (down's 1536)
            sets += [(f, [s for s in LAYER_SHAPES if s[2] % FORMATS[FORMAT_IDS[f]][1] == 0], (lambda name, f=f: f))
                     for f in OTHER_FORMATS]
        for label, chosen, fmt in sets:
            results = measure(chosen, rows, fmt, args.repeats, rng)
            for r in results:
                print(f"{r['name']:<9} {r['format']:<6} {rows:5d} {r['ours_ms']:9.3f} {r['onednn_ms']:10.3f} "
                      f"{r['ours_gflops']:10.1f} {r['onednn_gflops']:12.1f} {r['ratio']:5.2f}x")
            s = step(results)
            steps[f"{label}@{rows}"] = s
            print(f"  step {label} @ {rows} rows: ours {s['ours_ms']:.1f} ms, oneDNN fp32 {s['onednn_ms']:.1f} ms, "
                  f"{s['ratio']:.2f}x")
            all_results += [r | {"set": label} for r in results]
    for key, s in steps.items():
        if key.startswith("default@"):
            holds = s["ratio"] >= 1.0
            print(f"CHECK GEMMs of a {key.split('@')[1]}-row step on the default model's blocks vs oneDNN packed fp32: "
                  f"{s['ratio']:.2f}x (>= 1.0x) {'holds' if holds else 'FAILS'}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"isa": quant_isas_supported()[0], "threads": torch.get_num_threads(),
                                               "clock": "thread cpu time" if args.cpu_time else "wall",
                                               "repeats": args.repeats, "steps": steps, "shapes": all_results}, indent=2))
    if args.plot:
        plot(steps, args.plot)


def plot(steps: dict[str, dict[str, float]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(steps)
    xs = np.arange(len(labels))
    fig, ax = plt.subplots(figsize=(max(6, len(labels) * 0.9), 4))
    a = ax.bar(xs - 0.2, [steps[k]["ours_ms"] for k in labels], 0.4, label="shm_qgemm on blocks", color="tab:green")
    b = ax.bar(xs + 0.2, [steps[k]["onednn_ms"] for k in labels], 0.4, label="oneDNN packed fp32", color="tab:gray")
    ax.bar_label(a, fmt="%.0f", fontsize=7)
    ax.bar_label(b, fmt="%.0f", fontsize=7)
    ax.set_xticks(xs, labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("ms per step's GEMMs")
    ax.set_title("SmolLM2-135M GEMMs: GGML blocks vs fp32 (lower is better)")
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
