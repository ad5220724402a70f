"""Tensor and pipeline parallelism on the default model: TP=1 against TP=2, PP=2 and PP=2 x TP=2,
single request and batch, one run.

The engines load SmolLM2-135M-Instruct on its GGUF blocks (Q4_1 layers, Q8_0 tied embedding;
under TP=2 each rank builds and loads only its share, see shmvllm/model/parallel/layers.py), and,
unless --no-fp32, dequantized to fp32 (quantization='none') as a second pair; each engine in its
own process for the whole run. TP=2 is rank 0 in the engine and rank 1 a worker program, each
with cpu_count // 2 torch threads, while TP=1 has all of them. SmolLM2-135M has 3 KV heads and 9
query heads: rank 0 holds 2 KV heads (6 query heads), rank 1 one (3); every row-parallel split
falls on a 32-value block boundary. The repetitions alternate the engines' order, so the
machine's noise falls on all alike. Per repetition:

- single: one request, 85 prompt tokens, 64 greedy tokens (EOS ignored): output tok/s;
- batch: 32 requests of 85 prompt tokens (distinct), 64 greedy tokens each: output tok/s.

PP=2 (pipeline_parallel_size=2) runs two stage programs of 15 layers each (the engine process
computes nothing), cpu_count // 2 threads each; PP=2 x TP=2 four programs, each stage a TP=2
group (shared-memory all-reduce), cpu_count // 4 threads each (at least one). Their
single-request cost per decode step over TP=1's is printed as the per-step cost of the
pipeline, and beside it the part that is the hand-offs, timed in the stages on the shared
monotonic clock (the engine's get_stats()['pipeline_handoff'], differenced around each run): the
command's way to stage 0, the hidden states' over the edge ring (the copy in, the receiver's
wake-up), the output's way back. The rest is the layer-by-layer path (TP=1 runs the native
all-layer decode step) and, with one request, stages that cannot overlap.

On the blocks, two TP=2 engines: the layers' all-reduces through gloo (the default) and through
the shared-memory arena (SHMVLLM_TP_ALLREDUCE=shm, engine "TP=2 shm").

Prefix caching is off, so every repetition pays its prefills. After the warm-up, each engine's
peak resident memory per rank (VmHWM of the engine process, rank 0, and of its worker children).
CHECKs: each TP=2's greedy tokens equal the TP=1's on the same weights (a divergence forgiven at
a top-2 logprob margin below 1e-3); the arena beats gloo (which would make it the default); every
TP=2 rank's peak memory is below its TP=1's (a rank loads its share, not the model).

    flock /tmp/shmvllm-cpu.lock python benchmarks/tensor_parallel.py --repeats 3 \\
        --json benchmarks/results/tensor_parallel.json --plot benchmarks/results/tensor_parallel.png
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

MODEL = "smollm2-135m-instruct"
PROMPT_TOKENS = 85
MAX_TOKENS = 64
BATCH = 32
MARGIN = 1e-3


def prompts(tokenizer: Any, batch: int) -> list[list[int]]:
    """`batch` distinct prompts of PROMPT_TOKENS ids (the first is the single request's)."""
    text = ("You are a careful assistant. Explain in plain words how a refrigerator keeps food cold, "
            "what the compressor and the refrigerant do, and why the back of the fridge feels warm. ") * 4
    ids = tokenizer(text)["input_ids"]
    return [[(i * 7 + 11) % 1000 + 100] + ids[: PROMPT_TOKENS - 1] for i in range(batch)]


def run(llm: Any, batch: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]], list[Any]]:
    from shmvllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    started = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    wall = time.perf_counter() - started
    return wall, [o.outputs[0].token_ids for o in outputs], [o.outputs[0].logprobs for o in outputs]


def same_greedy(ref_tokens: list[list[int]], ref_logprobs: list[Any], tokens: list[list[int]]) -> tuple[bool, int]:
    """(no unforgiven divergence, how many requests diverged at a forgiven margin)."""
    forgiven = 0
    for ref, ref_lp, got in zip(ref_tokens, ref_logprobs, tokens):
        for pos, (a, b) in enumerate(zip(ref, got)):
            if a != b:
                top = sorted(lp.logprob for lp in ref_lp[pos].values())[::-1]
                if top[0] - top[1] >= MARGIN:
                    return False, forgiven
                forgiven += 1
                break
    return True, forgiven


# (name, tensor_parallel_size, pipeline_parallel_size, all-reduce, quantization, the TP=1 engine it is checked against)
ENGINES = [
    ("TP=1", 1, 1, "gloo", None, None),
    ("TP=2", 2, 1, "gloo", None, "TP=1"),
    ("TP=2 shm", 2, 1, "shm", None, "TP=1"),
    ("PP=2", 1, 2, "gloo", None, "TP=1"),
    ("PP=2 x TP=2", 2, 2, "shm", None, "TP=1"),
    ("TP=1 fp32", 1, 1, "gloo", "none", None),
    ("TP=2 fp32", 2, 1, "gloo", "none", "TP=1 fp32"),
]


HANDOFF_PARTS = ("steps", "command_ms", "edges_ms", "output_ms")


def handoff_totals(llm: Any) -> dict[str, float]:
    """The pipeline's hand-off milliseconds summed over every step so far, and the steps."""
    stats = llm.llm_engine.engine_core.get_stats()["pipeline_handoff"]
    return {part: stats["steps"] * (1 if part == "steps" else stats[part]) for part in HANDOFF_PARTS}


def _proc_field(pid: int, index: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[index]


def rank_peaks_mib(llm: Any) -> list[float]:
    """Peak resident memory (VmHWM, MiB) of the engine process (rank 0) and of its children (the other ranks)."""
    engine = llm.llm_engine.engine_core.engine_pid
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int(_proc_field(int(entry.name), 1)) == engine:
                    children.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                pass
    peaks = []
    for pid in [engine, *sorted(children)]:
        status = Path(f"/proc/{pid}/status").read_text()
        peaks.append(int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1]) / 1024)
    return peaks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repetitions per engine (default 3)")
    parser.add_argument("--no-fp32", action="store_true", help="leave out the fp32 (quantization='none') engines")
    parser.add_argument("--batch", type=int, default=BATCH, help=f"requests of the batch workload (default {BATCH})")
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help=f"greedy tokens per request (default {MAX_TOKENS})")
    parser.add_argument("--json", help="write the results to this JSON file")
    parser.add_argument("--plot", help="draw a PNG to this path")
    args = parser.parse_args()

    from shmvllm import LLM

    cores = os.cpu_count() or 1
    specs = {name: (tp, pp, allreduce, quantization, reference) for name, tp, pp, allreduce, quantization, reference
             in ENGINES if not (args.no_fp32 and quantization == "none")}
    engines: dict[str, Any] = {}
    load_s: dict[str, float] = {}
    try:
        for name, (tp, pp, allreduce, quantization, _) in specs.items():
            started = time.perf_counter()
            os.environ["SHMVLLM_TP_ALLREDUCE"] = allreduce  # read when the engine process builds its executor
            engines[name] = LLM(model=MODEL, quantization=quantization, tensor_parallel_size=tp,
                                pipeline_parallel_size=pp, max_model_len=512, enable_prefix_caching=False,
                                kv_cache_memory=256 << 20)
            load_s[name] = time.perf_counter() - started
        os.environ.pop("SHMVLLM_TP_ALLREDUCE")
        batch = prompts(engines["TP=1"].get_tokenizer(), args.batch)
        walls: dict[tuple[str, str], list[float]] = {(n, w): [] for n in engines for w in ("single", "batch")}
        tokens: dict[tuple[str, str], Any] = {}
        for name in engines:  # warm-up: first-call costs (oneDNN, allocations) out of the timings
            run(engines[name], batch[:2], args.max_tokens)
        peaks = {name: rank_peaks_mib(llm) for name, llm in engines.items()}
        pipelined = [name for name, (_, pp, *_) in specs.items() if pp > 1]
        handoffs = {(n, w): dict.fromkeys(HANDOFF_PARTS, 0.0) for n in pipelined for w in ("single", "batch")}
        for rep in range(args.repeats):
            order = list(engines)[rep % len(engines):] + list(engines)[: rep % len(engines)]
            for workload, requests in (("single", batch[:1]), ("batch", batch)):
                for name in order:
                    before = handoff_totals(engines[name]) if name in pipelined else None
                    wall, toks, lps = run(engines[name], requests, args.max_tokens)
                    walls[name, workload].append(wall)
                    tokens[name, workload] = (toks, lps)
                    if before is not None:
                        for part, value in handoff_totals(engines[name]).items():
                            handoffs[name, workload][part] += value - before[part]
    finally:
        for llm in engines.values():
            llm.shutdown()

    rows = []
    for (name, workload), values in walls.items():
        n = args.max_tokens * (1 if workload == "single" else args.batch)
        rates = [n / w for w in values]
        tp, pp, _, quantization, _ = specs[name]
        rows.append({"engine": name, "workload": workload, "weights": "fp32" if quantization == "none" else "GGUF blocks",
                     "threads_per_rank": max(1, cores // (tp * pp)), "tok_per_s": statistics.median(rates),
                     "min": min(rates), "max": max(rates), "load_s": load_s[name], "peak_rss_mib_per_rank": peaks[name]})
    print(f"{cores} cores; SmolLM2-135M (GGUF Q4_1 blocks{'' if args.no_fp32 else '; fp32'}); {PROMPT_TOKENS} prompt "
          f"tokens, {args.max_tokens} greedy tokens, batch {args.batch}; median of {args.repeats} (min..max)")
    print(f"{'engine':10} {'workload':8} {'threads/rank':>12} {'output tok/s':>22} {'load s':>7}")
    for r in rows:
        print(f"{r['engine']:10} {r['workload']:8} {r['threads_per_rank']:>12} "
              f"{r['tok_per_s']:8.1f} ({r['min']:.1f}..{r['max']:.1f}) {r['load_s']:7.1f}")
    by = {(r["engine"], r["workload"]): r for r in rows}
    checks = []
    for name, (tp, pp, _, _, reference) in specs.items():
        print(f"{name}: peak RSS per rank (MiB) {' + '.join(f'{p:.0f}' for p in peaks[name])}")
        if reference is not None and tp * pp > 1:
            worst, whole = max(peaks[name]), max(peaks[reference])
            checks.append(f"CHECK {name} every rank's peak RSS below {reference}'s = {worst:.0f} / {whole:.0f} MiB = "
                          f"{worst / whole:.2f}x (< 1.0x): {'holds' if worst < whole else 'FAILS'}")
    step_cost_ms = {name: 1000 * (1 / by[name, "single"]["tok_per_s"] - 1 / by["TP=1", "single"]["tok_per_s"])
                    for name in pipelined}
    handoff_ms: dict[str, dict[str, float]] = {}
    for (name, workload), totals in handoffs.items():
        steps = max(totals["steps"], 1)
        per_step = {part: totals[part] / steps for part in HANDOFF_PARTS[1:]}
        per_step["total_ms"] = sum(per_step.values())
        handoff_ms[f"{name} {workload}"] = {"steps": totals["steps"], **per_step}
        print(f"{name} hand-offs per step ({workload}, {totals['steps']:.0f} steps): command {per_step['command_ms']:.3f} "
              f"+ edges {per_step['edges_ms']:.3f} + output {per_step['output_ms']:.3f} = {per_step['total_ms']:.3f} ms")
    for name in pipelined:
        print(f"{name} per-step cost over TP=1 (single request, per decode step): {step_cost_ms[name]:.2f} ms, of which "
              f"hand-offs {handoff_ms[f'{name} single']['total_ms']:.2f} ms")
    for workload in ("single", "batch"):
        pp_vs_tp = by["PP=2", workload]["tok_per_s"] / by["TP=2", workload]["tok_per_s"]
        print(f"PP=2 / TP=2 {workload}: {pp_vs_tp:.2f}x")
        for name, (_, _, _, _, reference) in specs.items():
            if reference is not None:
                ratio = by[name, workload]["tok_per_s"] / by[reference, workload]["tok_per_s"]
                print(f"{name}/{reference} {workload}: {ratio:.2f}x")
        shm_vs_gloo = by["TP=2 shm", workload]["tok_per_s"] / by["TP=2", workload]["tok_per_s"]
        print(f"TP=2 shm all-reduce / gloo all-reduce {workload}: {shm_vs_gloo:.2f}x")
        checks.append(f"CHECK TP=2 shared-memory all-reduce faster than gloo ({workload}) = {shm_vs_gloo:.2f}x (> 1.0x): "
                      f"{'holds' if shm_vs_gloo > 1.0 else 'FAILS'}")
        for name, (_, _, _, _, reference) in specs.items():
            if reference is not None:
                ok, forgiven = same_greedy(*tokens[reference, workload], tokens[name, workload][0])
                checks.append(f"CHECK {name} greedy tokens equal {reference}'s ({workload}, {forgiven} forgiven at "
                              f"margin < {MARGIN}): {'holds' if ok else 'FAILS'}")
    for line in checks:
        print(line)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"cores": cores, "prompt_tokens": PROMPT_TOKENS, "max_tokens": args.max_tokens,
                                               "batch": args.batch, "step_cost_over_tp1_ms": step_cost_ms,
                                               "handoff_ms_per_step": handoff_ms, "rows": rows,
                                               "checks": checks}, indent=2) + "\n")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        names = list(engines)
        colors = ["tab:blue", "tab:orange", "tab:gray", "tab:green", "tab:olive", "tab:cyan", "tab:red"]
        fig, axes = plt.subplots(1, 2, figsize=(12, 4))
        for ax, workload in zip(axes, ("single", "batch")):
            values = [by[n, workload]["tok_per_s"] for n in names]
            errs = [[v - by[n, workload]["min"] for n, v in zip(names, values)],
                    [by[n, workload]["max"] - v for n, v in zip(names, values)]]
            ax.bar(names, values, yerr=errs, color=colors[: len(names)], capsize=4)
            ax.tick_params(axis="x", labelsize=8)
            ax.set_title(f"{workload} ({1 if workload == 'single' else args.batch} x {args.max_tokens} tokens)")
            ax.set_ylabel("output tok/s")
        fig.suptitle(f"SmolLM2-135M on {cores} cores: tensor and pipeline parallel (GGUF blocks{'' if args.no_fp32 else '; fp32'})")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=100)


if __name__ == "__main__":
    main()
