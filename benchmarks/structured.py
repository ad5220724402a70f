"""Structured outputs: what the grammar masks cost. The same 64 requests free vs JSON-schema-
constrained vs regex-constrained, on the default model (SmolLM2-135M-Instruct).

Every mode generates exactly --max-tokens tokens per request, so that the batch has the same
shape in every mode and only the masks differ: free runs with ignore_eos; the JSON schema asks
for at least 12 objects (and the regex for 20 phone numbers), more than the token budget holds,
so no grammar ends early. Greedy. The modes run interleaved (their order rotating from one
repetition to the next) after a small warm-up run each (which also compiles the grammars, then
cached); tokens/s is the median over the repetitions, and the ratio is to the free batch's.
Beside wall-clock tokens/s, tokens per CPU-second of this process (all its threads: the engine
runs here) is printed: on a machine shared with other work the wall clock mostly measures the
neighbours, CPU time mostly the work (and a thread that spins shows in it).

Per step (engine steps of the constrained runs): the scheduler's batch fill of the 64 bitmask
rows (xgrammar's BatchGrammarMatcher), the runner's apply of the rows to the logits, and the
matchers' accept of the sampled tokens, from the engine's own counters. The engine runs in this
process (multiprocess=False) so that the runner's counter is at hand; the ratio compares like
with like, and the transport is not what is measured here (see e2e_overhead.py).

    flock /tmp/shmvllm-cpu.lock python benchmarks/structured.py [--repeats 3] [--max-tokens 48]
        [--json benchmarks/results/structured.json] [--plot benchmarks/results/structured.png]

After the table it prints one CHECK line: JSON-constrained tokens/s >= 85% of free.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

NUM_REQUESTS = 64
ITEMS_SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "minItems": 12,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "category": {"type": "string", "enum": ["tool", "food", "toy", "book"]},
                    "price": {"type": "number", "minimum": 0, "maximum": 1000},
                    "in_stock": {"type": "boolean"},
                },
                "required": ["name", "category", "price", "in_stock"],
            },
        }
    },
    "required": ["items"],
}
PHONES_REGEX = r"(\(\d{3}\) \d{3}-\d{4}\n){20}"
TOPICS = ["a hardware store", "a bakery", "a toy shop", "a bookshop", "a market stall", "a pharmacy", "a florist",
          "a garden centre"]
MODES = ("free", "json", "regex")


def make_params(mode: str, max_tokens: int) -> Any:
    from shmvllm import SamplingParams
    from shmvllm.sampling_params import StructuredOutputsParams

    if mode == "free":
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    constraint = StructuredOutputsParams(json=ITEMS_SCHEMA) if mode == "json" else StructuredOutputsParams(regex=PHONES_REGEX)
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=constraint)


def prompts_for(llm: Any, mode: str) -> list[str]:
    tokenizer = llm.get_tokenizer()
    ask = {"free": "Describe what {} sells.", "json": "List what {} sells, as JSON.", "regex": "List phone numbers of {}."}[mode]
    return [tokenizer.apply_chat_template([{"role": "user", "content": ask.format(TOPICS[i % len(TOPICS)]) + f" ({i})"}],
                                          tokenize=False, add_generation_prompt=True) for i in range(NUM_REQUESTS)]


def counters(llm: Any) -> dict[str, float]:
    """The engine's step count and structured-output time counters (in-process engine)."""
    client = llm.llm_engine.engine_core
    stats = client.get_stats()
    applier = client.engine_core.executor.worker.model_runner.bitmask_applier
    so = stats.get("structured_output", {})
    return {"steps": stats["num_steps"], "fill_s": so.get("fill_s", 0.0), "accept_s": so.get("accept_s", 0.0),
            "apply_s": applier.apply_s, "num_fills": so.get("num_fills", 0), "num_compiles": so.get("num_compiles", 0)}


def run_once(llm: Any, mode: str, prompts: list[str], params: Any) -> dict[str, Any]:
    before = counters(llm)
    started, cpu_started = time.perf_counter(), time.process_time()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    after = counters(llm)
    delta = {k: after[k] - before[k] for k in after}
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    reasons = sorted({o.outputs[0].finish_reason for o in outputs})
    return {"mode": mode, "wall_s": wall, "cpu_s": cpu, "tokens": tokens, "tok_per_s": tokens / wall,
            "tok_per_cpu_s": tokens / cpu, "finish_reasons": reasons,
            "text0": outputs[0].outputs[0].text, **delta}


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    free = statistics.median(r["tok_per_s"] for r in runs if r["mode"] == "free")
    free_cpu = statistics.median(r["tok_per_cpu_s"] for r in runs if r["mode"] == "free")
    for mode in MODES:
        chosen = [r for r in runs if r["mode"] == mode]
        steps = sum(r["steps"] for r in chosen)
        per_step = {k: 1e6 * sum(r[k] for r in chosen) / max(steps, 1) for k in ("fill_s", "apply_s", "accept_s")}
        wall_per_step = 1e6 * sum(r["wall_s"] for r in chosen) / max(steps, 1)
        tok_per_s = statistics.median(r["tok_per_s"] for r in chosen)
        tok_per_cpu_s = statistics.median(r["tok_per_cpu_s"] for r in chosen)
        rows.append({
            "mode": mode,
            "repeats": len(chosen),
            "tokens": chosen[0]["tokens"],
            "wall_s": statistics.median(r["wall_s"] for r in chosen),
            "tok_per_s": tok_per_s,
            "ratio_to_free": tok_per_s / free,
            "tok_per_cpu_s": tok_per_cpu_s,
            "cpu_ratio_to_free": tok_per_cpu_s / free_cpu,
            "steps_per_run": steps / len(chosen),
            "step_us": wall_per_step,
            "fill_us_per_step": per_step["fill_s"],
            "apply_us_per_step": per_step["apply_s"],
            "accept_us_per_step": per_step["accept_s"],
            "mask_us_per_step": sum(per_step.values()),
            "finish_reasons": sorted({f for r in chosen for f in r["finish_reasons"]}),
            "tok_per_s_all": [round(r["tok_per_s"], 2) for r in chosen],
        })
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print("| mode | tokens | wall_s | tok/s | vs free | tok/cpu-s | vs free | step ms | fill µs/step | apply µs/step "
          "| accept µs/step | mask share | finish |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        share = r["mask_us_per_step"] / r["step_us"] if r["step_us"] else 0.0
        print(f"| {r['mode']} | {r['tokens']} | {r['wall_s']:.2f} | {r['tok_per_s']:.1f} | {r['ratio_to_free']:.3f} | "
              f"{r['tok_per_cpu_s']:.1f} | {r['cpu_ratio_to_free']:.3f} | "
              f"{r['step_us'] / 1e3:.1f} | {r['fill_us_per_step']:.0f} | {r['apply_us_per_step']:.0f} | "
              f"{r['accept_us_per_step']:.0f} | {100 * share:.1f}% | {','.join(r['finish_reasons'])} |")


def checks(rows: list[dict[str, Any]]) -> list[str]:
    by_mode = {r["mode"]: r for r in rows}
    ratio = by_mode["json"]["ratio_to_free"]
    return [f"CHECK JSON-constrained tok/s >= 0.85x free: {'holds' if ratio >= 0.85 else 'FAILS'} "
            f"(json {by_mode['json']['tok_per_s']:.1f} tok/s, free {by_mode['free']['tok_per_s']:.1f} tok/s, {ratio:.3f}x; "
            f"regex {by_mode['regex']['ratio_to_free']:.3f}x; per CPU-second json {by_mode['json']['cpu_ratio_to_free']:.3f}x, "
            f"regex {by_mode['regex']['cpu_ratio_to_free']:.3f}x)"]


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    bars = left.bar([r["mode"] for r in rows], [r["tok_per_s"] for r in rows], color=["tab:gray", "tab:blue", "tab:green"])
    left.bar_label(bars, labels=[f"{r['tok_per_s']:.0f} ({r['ratio_to_free']:.2f}x)" for r in rows])
    left.axhline(0.85 * rows[0]["tok_per_s"], color="red", linestyle="--", label="85% of free")
    left.set_ylabel("output tokens / s")
    left.set_title(f"{NUM_REQUESTS} requests x {rows[0]['tokens'] // NUM_REQUESTS} tokens, greedy")
    left.legend(loc="lower right")
    constrained = [r for r in rows if r["mode"] != "free"]
    names = [r["mode"] for r in constrained]
    bottom = [0.0] * len(constrained)
    for key, label in (("fill_us_per_step", "batch fill"), ("apply_us_per_step", "apply"), ("accept_us_per_step", "accept")):
        values = [r[key] / 1e3 for r in constrained]
        right.bar(names, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    for i, r in enumerate(constrained):
        right.annotate(f"step {r['step_us'] / 1e3:.0f} ms", (i, bottom[i]), ha="center", va="bottom")
    right.set_ylabel("ms per engine step")
    right.set_title("grammar mask cost per step")
    right.legend()
    fig.suptitle("Structured outputs (xgrammar), SmolLM2-135M-Instruct, CPU")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--plot", metavar="PATH.png")
    args = parser.parse_args(argv)

    from shmvllm import LLM

    llm = LLM(multiprocess=False, max_model_len=1024, max_num_seqs=NUM_REQUESTS)
    try:
        work = {mode: (prompts_for(llm, mode), make_params(mode, args.max_tokens)) for mode in MODES}
        warm = {}
        for mode in MODES:
            prompts = work[mode][0]
            started = time.perf_counter()
            run_once(llm, mode, prompts[:4], make_params(mode, 4))
            warm[mode] = time.perf_counter() - started
        runs = []
        for rep in range(args.repeats):
            for mode in MODES[rep % len(MODES):] + MODES[: rep % len(MODES)]:
                runs.append(run_once(llm, mode, *work[mode]))
        compiles = counters(llm)["num_compiles"]
    finally:
        llm.shutdown()
    rows = summarize(runs)
    print_table(rows)
    print(f"warm-up runs (4 requests x 4 tokens, first compile included): " + ", ".join(f"{m} {s:.2f} s" for m, s in warm.items())
          + f"; grammars compiled: {compiles:.0f}")
    for mode in MODES:
        sample = next(r["text0"] for r in runs if r["mode"] == mode)
        print(f"{mode} output 0: {sample[:100]!r}")
    for line in checks(rows):
        print(line)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"rows": rows, "runs": runs, "warmup_s": warm,
                                               "max_tokens": args.max_tokens}, indent=1))
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
