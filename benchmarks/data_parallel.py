"""Data parallel: one engine on all cores vs N engines on cores / N each, in the same run.

    flock /tmp/shmvllm-cpu.lock python benchmarks/data_parallel.py --rounds 2 \
        --json benchmarks/results/data_parallel.json --plot benchmarks/results/data_parallel.png

Workloads (as benchmarks/throughput.py and benchmarks/embed.py run them):
- generate: SmolLM2-135M-Instruct (the default model), the 64 chat prompts of throughput.py
  (35-45 tokens) x 128 greedy tokens (ignore_eos, min_tokens = max_tokens);
- embed: all-MiniLM-L6-v2, the 10,000 generated sentences of embed.py, text to vectors.

For each workload both LLMs are alive at once: `data_parallel_size=1` (one engine process,
unpinned, one torch thread per core) and `data_parallel_size=N` (N engine processes, each
pinned to its cores / N share with as many threads); the rounds alternate between them, so a
noisy neighbour hits both alike, and each reports its best round. Per run: the rate, each
engine's steps, and where the CPU went (the frontend process's CPU seconds, each engine's),
which is what says why N engines are or are not faster than one on this machine. CHECK lines:
N engines give the same greedy tokens (the same embeddings within 1e-5) as one, every engine
served, and whether N engines are faster.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

from embed import make_sentences  # noqa: E402
from throughput import MAX_TOKENS, chat_prompt_token_ids  # noqa: E402

GEN_MODEL = "smollm2-135m-instruct"
EMBED_MODEL = "all-minilm-l6-v2"
_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def engine_pids(llm: Any) -> list[int]:
    client = llm.llm_engine.engine_core
    return list(getattr(client, "engine_pids", None) or [client.engine_pid])


def engine_steps(llm: Any) -> list[int]:
    stats = llm.llm_engine.engine_core.get_stats()
    return [e["num_steps"] for e in stats.get("engines", [stats])]


def measure(llm: Any, run: Callable[[], Any]) -> dict[str, Any]:
    """One timed run: wall seconds, each engine's steps and CPU seconds, the frontend's CPU seconds."""
    pids = engine_pids(llm)
    steps0, cpu0, front0 = engine_steps(llm), [cpu_seconds(p) for p in pids], os.times()
    started = time.perf_counter()
    result = run()
    wall = time.perf_counter() - started
    front1 = os.times()
    steps = [b - a for a, b in zip(steps0, engine_steps(llm))]
    engine_cpu = [cpu_seconds(p) - c for p, c in zip(pids, cpu0)]
    frontend_cpu = (front1.user - front0.user) + (front1.system - front0.system)
    return {"wall_s": wall, "steps": steps, "engine_cpu_s": engine_cpu, "frontend_cpu_s": frontend_cpu, "result": result}


def alternate(name: str, llms: dict[int, Any], run: Callable[[Any], Any], rounds: int) -> dict[int, list[dict[str, Any]]]:
    runs: dict[int, list[dict[str, Any]]] = {dp: [] for dp in llms}
    for round_ in range(rounds):
        for dp, llm in llms.items():
            m = measure(llm, lambda: run(llm))
            runs[dp].append(m)
            print(f"[{name}] round {round_ + 1} dp={dp}: {m['wall_s']:7.2f} s, steps {m['steps']}, engine CPU "
                  f"{[round(c, 1) for c in m['engine_cpu_s']]} s, frontend CPU {m['frontend_cpu_s']:.1f} s", flush=True)
    return runs


def summarize(workload: str, unit: str, amount: int, runs: dict[int, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    rows = []
    for dp, ms in runs.items():
        best = min(ms, key=lambda m: m["wall_s"])
        rows.append({
            "workload": workload, "data_parallel_size": dp, unit: amount, "wall_s": round(best["wall_s"], 3),
            "rate": round(amount / best["wall_s"], 1), "rate_unit": f"{unit}/s",
            "steps_per_engine": best["steps"], "engine_cpu_s": [round(c, 2) for c in best["engine_cpu_s"]],
            "frontend_cpu_s": round(best["frontend_cpu_s"], 2),
            "all_walls_s": [round(m["wall_s"], 3) for m in ms],
        })
    return rows


def generate_workload(
    dp_n: int, rounds: int, kv_cache_memory: int, num_prompts: int, max_tokens: int
) -> tuple[list[dict[str, Any]], list[str]]:
    from transformers import AutoTokenizer

    from shmvllm import LLM, SamplingParams
    from shmvllm.model.registry import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(GEN_MODEL))
    prompts = [{"prompt_token_ids": p} for p in chat_prompt_token_ids(tokenizer)[:num_prompts]]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True)
    llms = {dp: LLM(model=GEN_MODEL, data_parallel_size=dp, kv_cache_memory=kv_cache_memory // dp) for dp in (1, dp_n)}
    try:
        for llm in llms.values():  # warm-up
            llm.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
        runs = alternate("generate", llms, lambda llm: llm.generate(prompts, params, use_tqdm=False), rounds)
    finally:
        for llm in llms.values():
            llm.shutdown()
    tokens = [[list(o.outputs[0].token_ids) for o in runs[dp][0]["result"]] for dp in (1, dp_n)]
    amount = sum(len(t) for t in tokens[0])
    rows = summarize("generate", "tokens", amount, runs)
    checks = [
        _check(f"dp={dp_n} greedy tokens equal dp=1's ({num_prompts} x {max_tokens})", tokens[1] == tokens[0]),
        _check(f"generate: every one of the {dp_n} engines stepped", min(rows[1]["steps_per_engine"]) > 0),
    ]
    return rows, checks


def embed_workload(dp_n: int, rounds: int, sentences: int) -> tuple[list[dict[str, Any]], list[str]]:
    from transformers import AutoTokenizer

    from shmvllm import LLM
    from shmvllm.model.registry import resolve_model_dir

    texts = make_sentences(sentences, AutoTokenizer.from_pretrained(resolve_model_dir(EMBED_MODEL)).get_vocab())
    llms = {dp: LLM(model=EMBED_MODEL, task="embed", data_parallel_size=dp) for dp in (1, dp_n)}
    try:
        for llm in llms.values():
            llm.embed(texts[:64], use_tqdm=False)
        runs = alternate(
            "embed", llms, lambda llm: np.stack([o.outputs.numpy() for o in llm.embed(texts, use_tqdm=False)]), rounds
        )
    finally:
        for llm in llms.values():
            llm.shutdown()
    vectors = [runs[dp][0]["result"] for dp in (1, dp_n)]
    rows = summarize("embed", "sentences", sentences, runs)
    diff = float(np.abs(vectors[1] - vectors[0]).max())
    checks = [
        _check(f"dp={dp_n} embeddings equal dp=1's within 1e-5 (max difference {diff:.2e})", diff <= 1e-5),
        _check(f"embed: every one of the {dp_n} engines stepped", min(rows[1]["steps_per_engine"]) > 0),
    ]
    return rows, checks


def _check(what: str, ok: bool) -> str:
    line = f"CHECK {what}: {'PASS' if ok else 'FAIL'}"
    print(line, flush=True)
    return line


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.2 * len(workloads), 3.2))
    for ax, workload in zip(np.atleast_1d(axes), workloads):
        mine = [r for r in rows if r["workload"] == workload]
        names = [f"dp={r['data_parallel_size']}" for r in mine]
        bars = ax.bar(names, [r["rate"] for r in mine], color=["#999999", "#4c72b0"][: len(mine)])
        ax.bar_label(bars, fmt="%.1f", padding=2)
        ax.set_ylim(0, max(r["rate"] for r in mine) * 1.2)
        ax.set_ylabel(mine[0]["rate_unit"] + " (higher is better)")
        ax.set_title(f"{workload}: {os.cpu_count()} cores", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-parallel-size", type=int, default=2, help="N, against one engine")
    parser.add_argument("--rounds", type=int, default=2, help="alternate dp=1 and dp=N this often; each reports its best")
    parser.add_argument("--sentences", type=int, default=10_000)
    parser.add_argument("--kv-cache-memory", type=int, default=1 << 30, help="bytes of KV cache in all (dp=N: 1/N each)")
    parser.add_argument("--workloads", default="generate,embed")
    parser.add_argument("--quick", action="store_true", help="a check that the script runs: 16 x 16 tokens, 300 sentences")
    parser.add_argument("--json", help="write the rows and the CHECK lines to this JSON file")
    parser.add_argument("--plot", help="draw the rates into this PNG file")
    args = parser.parse_args()
    dp_n = args.data_parallel_size
    num_prompts, max_tokens = (16, 16) if args.quick else (64, MAX_TOKENS)
    sentences = 300 if args.quick else args.sentences
    print(f"{os.cpu_count()} cores (this process may use {len(os.sched_getaffinity(0))}); dp=1 vs dp={dp_n}", flush=True)
    rows: list[dict[str, Any]] = []
    checks: list[str] = []
    for workload in args.workloads.split(","):
        if workload == "generate":
            new_rows, new_checks = generate_workload(dp_n, args.rounds, args.kv_cache_memory, num_prompts, max_tokens)
        elif workload == "embed":
            new_rows, new_checks = embed_workload(dp_n, args.rounds, sentences)
        else:
            raise SystemExit(f"unknown workload {workload!r}: generate, embed")
        rows += new_rows
        checks += new_checks
        one, many = new_rows
        ratio = many["rate"] / one["rate"]
        print(f"{workload}: dp=1 {one['rate']} {one['rate_unit']}, dp={dp_n} {many['rate']} {many['rate_unit']}: "
              f"ratio {ratio:.3f}x", flush=True)
        checks.append(_check(f"{workload}: dp={dp_n} faster than dp=1 ({ratio:.3f}x)", ratio > 1.0))
    print(f"{'workload':>9} {'dp':>3} {'wall_s':>8} {'rate':>9} {'unit':>13} {'steps/engine':>16} {'engine CPU s':>16} {'frontend CPU s':>15}")
    for r in rows:
        print(f"{r['workload']:>9} {r['data_parallel_size']:>3} {r['wall_s']:>8.2f} {r['rate']:>9.1f} {r['rate_unit']:>13} "
              f"{str(r['steps_per_engine']):>16} {str(r['engine_cpu_s']):>16} {r['frontend_cpu_s']:>15.2f}")
    for path in (args.json, args.plot):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"cores": os.cpu_count(), "rows": rows, "checks": checks}, indent=2) + "\n")
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
