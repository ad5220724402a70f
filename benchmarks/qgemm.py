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

from shmvllm.model.kernels import quant_isas_supported, quant_kernels
from shmvllm.model.linear import block_linear
from shmvllm.model.quant import FORMAT_IDS, FORMATS, QuantizedWeight

HIDDEN, INTERMEDIATE, KV, VOCAB, LAYERS = 576, 1536, 192, 49152, 30
# (name, out features n, in features k, calls per step)
LAYER_SHAPES = [("qkv", HIDDEN + 2 * KV, HIDDEN, LAYERS), ("o", HIDDEN, HIDDEN, LAYERS),
                ("gate_up", 2 * INTERMEDIATE, HIDDEN, LAYERS), ("down", HIDDEN, INTERMEDIATE, LAYERS)]
LM_HEAD = ("lm_head", VOCAB, HIDDEN, 1)
# the default model's formats: Q4_1 layers, Q8_0 embedding / lm_head; the rest on the layer shapes
DEFAULT = {"layers": "Q4_1", "lm_head": "Q8_0"}
OTHER_FORMATS = ["Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS", "MXFP4"]
# the formats the GEMV's weight-read rate is checked for, against Q4_1's
NEW_FORMATS = ["Q5_0", "Q5_1", "Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS", "MXFP4"]
_FP16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
                "Q5_0": [0], "Q5_1": [0, 2], "Q2_K": [80, 82], "Q3_K": [108], "IQ4_NL": [0], "IQ4_XS": [0], "MXFP4": []}


def random_blocks(name: str, n: int, k: int, rng: np.random.Generator) -> QuantizedWeight:
    qtype = FORMAT_IDS[name]
    _, values, nbytes = FORMATS[qtype]
    blocks = rng.integers(0, 256, size=(n * (k // values), nbytes), dtype=np.uint8)
    for offset in _FP16_FIELDS[name]:
        blocks[:, offset : offset + 2] = (rng.standard_normal(len(blocks)) * 0.05).astype(np.float16).view(np.uint8).reshape(-1, 2)
    if name == "MXFP4":  # e8m0 exponents near 2^0
        blocks[:, 0] = rng.integers(118, 132, len(blocks))
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


GEMV_K = 4096  # a multiple of every format's block width


def gemv_rates(isas: list[str], names: list[str], repeats: int, weight_mib: float,
               rng: np.random.Generator) -> dict[str, Any]:
    """The one-row GEMV (shm_qgemm at one row, as a decode step calls it) of each format on each ISA
    build, over a weight of ~`weight_mib` MiB of blocks (past the last-level cache, as a model's
    weights are during decoding): bytes of weights read per second. Its peer: the machine's read
    rate, torch.sum over an fp32 buffer of the same size. Samples are interleaved (the order of
    the formats rotated every round); medians and spread kept."""
    weights, outs = {}, {}
    for name in names:
        _, values, nbytes = FORMATS[FORMAT_IDS[name]]
        n = max(1, int(weight_mib * 2**20) // (GEMV_K // values * nbytes))
        weights[name] = random_blocks(name, n, GEMV_K, rng)
        outs[name] = torch.empty(1, n)
    x = torch.randn(1, GEMV_K)
    buffer = torch.ones(int(weight_mib * 2**20) // 4)
    libs = {isa: quant_kernels(isa) for isa in isas}
    samples: dict[str, list[float]] = {"read": []} | {f"{isa}/{name}": [] for isa in isas for name in names}

    def gemv(lib: Any, w: QuantizedWeight, out: torch.Tensor) -> None:
        rc = lib.shm_qgemm(out.data_ptr(), w.n, x.data_ptr(), GEMV_K, w.data.data_ptr(), w.data.shape[1], w.qtype,
                           None, None, 0, 1, w.n, GEMV_K)
        assert rc == 0, rc

    for isa in isas:  # warm: pages touched, kernels loaded
        for name in names:
            gemv(libs[isa], weights[name], outs[name])
    buffer.sum()
    calls = 3
    for rep in range(repeats):
        started = CLOCK()
        for _ in range(calls):
            buffer.sum()
        samples["read"].append(buffer.numel() * 4 * calls / (CLOCK() - started))
        order = names[rep % len(names):] + names[:rep % len(names)]
        for isa in isas:
            for name in order:
                w = weights[name]
                started = CLOCK()
                for _ in range(calls):
                    gemv(libs[isa], w, outs[name])
                samples[f"{isa}/{name}"].append(w.data.numel() * calls / (CLOCK() - started))
    rates = {key: {"median_gbs": statistics.median(v) / 1e9, "min_gbs": min(v) / 1e9, "max_gbs": max(v) / 1e9}
             for key, v in samples.items()}
    for isa in isas:
        for name in names:
            rate = rates[f"{isa}/{name}"]
            rate["vs_q4_1"] = rate["median_gbs"] / rates[f"{isa}/Q4_1"]["median_gbs"]
            rate["vs_read"] = rate["median_gbs"] / rates["read"]["median_gbs"]
            rate["mib"] = weights[name].data.numel() / 2**20
    return rates


def print_gemv(rates: dict[str, Any], isas: list[str], names: list[str]) -> None:
    read = rates["read"]
    print(f"\nGEMV, one row, weights past the cache: machine read rate (torch.sum) {read['median_gbs']:.1f} GB/s "
          f"[{read['min_gbs']:.1f}-{read['max_gbs']:.1f}]")
    print(f"{'isa':<9} {'format':<7} {'GB/s':>6} {'spread':>13} {'vs Q4_1':>8} {'vs read':>8}")
    for isa in isas:
        for name in names:
            r = rates[f"{isa}/{name}"]
            print(f"{isa:<9} {name:<7} {r['median_gbs']:6.1f} {r['min_gbs']:6.1f}-{r['max_gbs']:<6.1f} "
                  f"{r['vs_q4_1']:7.2f}x {r['vs_read']:7.2f}x")
    for isa in isas:
        for name in (name for name in NEW_FORMATS if name in names):
            ratio = rates[f"{isa}/{name}"]["vs_q4_1"]
            print(f"CHECK GEMV weight read rate {name} vs Q4_1 ({isa}): {ratio:.2f}x (>= 0.8x) "
                  f"{'holds' if ratio >= 0.8 else 'FAILS'}")


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
    parser.add_argument("--gemm", action=argparse.BooleanOptionalAction, default=True,
                        help="time the GEMMs at --rows against oneDNN")
    parser.add_argument("--gemv", action=argparse.BooleanOptionalAction, default=True,
                        help="time each format's one-row GEMV in weight bytes/s against Q4_1's and the read rate")
    parser.add_argument("--gemv-mib", type=float, default=64.0, help="MiB of blocks per GEMV weight (default 64)")
    parser.add_argument("--gemv-isas", default="best,avx2",
                        help="ISA builds the GEMV runs on ('best': this CPU's best; default best,avx2)")
    parser.add_argument("--gemv-formats", default="",
                        help="comma-separated formats for the GEMV (Q4_1, the yardstick, always runs; default all)")
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
    for rows in (int(r) for r in args.rows.split(",") if args.gemm):
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
    gemv = None
    if args.gemv:
        supported = quant_isas_supported()
        isas = list(dict.fromkeys(supported[0] if isa == "best" else isa for isa in args.gemv_isas.split(",")))
        for isa in isas:
            if isa not in supported:
                sys.exit(f"--gemv-isas: this CPU does not run the {isa!r} build (it runs {supported})")
        names = ["Q4_1", "Q4_0", "Q8_0", "Q4_K", "Q6_K", *NEW_FORMATS]
        if args.gemv_formats:
            wanted = args.gemv_formats.split(",")
            unknown = sorted(set(wanted) - set(names))
            if unknown:
                sys.exit(f"--gemv-formats: no GEMV for {unknown} (the formats: {names})")
            names = ["Q4_1", *(name for name in names if name in wanted and name != "Q4_1")]
        gemv = gemv_rates(isas, names, args.repeats, args.gemv_mib, rng)
        print_gemv(gemv, isas, names)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"isa": quant_isas_supported()[0], "threads": torch.get_num_threads(),
                                               "clock": "thread cpu time" if args.cpu_time else "wall",
                                               "repeats": args.repeats, "steps": steps, "shapes": all_results,
                                               "gemv": gemv, "gemv_mib": args.gemv_mib}, indent=2))
    if args.plot:
        plot(steps, gemv, args.plot)


def plot(steps: dict[str, dict[str, float]], gemv: dict[str, Any] | None, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in (("steps", steps), ("gemv", gemv)) if p[1]]
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4.2), squeeze=False)
    for ax, (kind, data) in zip(axes[0], panels):
        if kind == "steps":
            labels = list(data)
            xs = np.arange(len(labels))
            a = ax.bar(xs - 0.2, [data[k]["ours_ms"] for k in labels], 0.4, label="shm_qgemm on blocks", color="tab:green")
            b = ax.bar(xs + 0.2, [data[k]["onednn_ms"] for k in labels], 0.4, label="oneDNN packed fp32", color="tab:gray")
            ax.bar_label(a, fmt="%.0f", fontsize=7)
            ax.bar_label(b, fmt="%.0f", fontsize=7)
            ax.set_xticks(xs, labels, rotation=30, ha="right", fontsize=8)
            ax.set_ylabel("ms per step's GEMMs")
            ax.set_title("SmolLM2-135M GEMMs: GGML blocks vs fp32 (lower is better)", fontsize=9)
        else:
            isas = sorted({key.split("/")[0] for key in data if "/" in key})
            names = list(dict.fromkeys(key.split("/")[1] for key in data if "/" in key))
            xs = np.arange(len(names))
            width = 0.8 / len(isas)
            for i, isa in enumerate(isas):
                bars = ax.bar(xs + (i - (len(isas) - 1) / 2) * width, [data[f"{isa}/{n}"]["median_gbs"] for n in names],
                              width, label=isa)
                ax.bar_label(bars, fmt="%.1f", fontsize=6)
            ax.axhline(data["read"]["median_gbs"], color="black", linestyle="--", label="read rate (torch.sum)")
            ax.set_xticks(xs, names, rotation=30, ha="right", fontsize=8)
            ax.set_ylabel("GB/s of weights (one-row GEMV)")
            ax.set_title("GEMV weight read rate per format (higher is better)", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
