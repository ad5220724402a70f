"""Speculative decoding by n-gram (prompt) lookup, one request at a time: shmvllm with and without
`speculative_config={"method": "ngram", ...}`, and llama.cpp (llama-cpp-python) with and without
`LlamaPromptLookupDecoding` as its draft model, on the default model's GGUF file, in the same run.

Two workloads of chat-templated prompts, greedy, each request stopping at EOS (or MAX_TOKENS):

- grounded: prompts whose answers copy spans of the prompt (rewrite a paragraph with one change,
  fix the bug in a function and give it back whole, quote the sentences of a passage that say X):
  where prompt lookup pays;
- free: open questions whose answers quote nothing: what speculation costs when it rarely hits.

Each engine lives in a worker process of its own for the whole run; the parent asks the workers
for one repetition at a time (every prompt of both workloads once), in a rotating order, so that
the machine's noise falls on every engine alike. Reported per engine and workload, median and
spread over the repetitions, summed over the workload's prompts:

- decode tok/s: (tokens - 1) over (wall time - TTFT), as benchmarks/latency.py: what speculation
  changes (TTFT: a 1-token request's wall time for shmvllm, the first token's time for llama.cpp);
- request tok/s: tokens over the requests' whole wall time, prefill included;

and, for shmvllm with speculation, its acceptance counters (vllm:spec_decode_*).

    flock /tmp/shmvllm-cpu.lock python benchmarks/speculative.py --llama-python .venv-llamacpp/bin/python \\
        --repeats 5 --json benchmarks/results/speculative.json --plot benchmarks/results/speculative.png

`--k N` / `--lookup-min N` set shmvllm's num_speculative_tokens / prompt_lookup_min; `--lookup-tokens N`
llama.cpp's num_pred_tokens. `--engines shmvllm,shmvllm+draft` adds shmvllm with
`{"method": "draft_model", "model": --draft}` (default: the model itself, the only model of its
tokenizer shipped: every proposal is accepted, so the row is the draft mechanics' cost, not a speed-up).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from latency import Worker, shipped_gguf  # noqa: E402  (an engine's worker process; a shipped model's GGUF file)

MODEL = "smollm2-135m-instruct"
MAX_TOKENS = 256

_PARAGRAPH = (
    "The Riverside Community Library will open its new reading garden on Saturday, June 14, at 10 a.m. "
    "The garden has twelve shaded benches, a small fountain and a shelf of free books that anyone may take "
    "home. Children's story hour will move outside to the garden every Wednesday afternoon during the summer. "
    "Volunteers are still needed to water the plants on weekends; please sign up at the front desk."
)
_CODE = '''def average(values):
    """Return the arithmetic mean of a list of numbers."""
    total = 0
    for value in values:
        total += value
    return total / (len(values) - 1)


def median(values):
    """Return the middle value of a sorted copy of the list."""
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2 == 0:
        return (ordered[middle - 1] + ordered[middle]) / 2
    return ordered[middle]'''
_EMAIL = (
    "Hi Anna,\n\nThank you for sending the quarterly report on Tuesday. I read it carefully and I have two "
    "questions about the travel budget. First, why did the cost of train tickets rise by ten percent? Second, "
    "can we move the team meeting from Thursday to Friday morning? Please let me know by the end of the week.\n\n"
    "Best regards,\nTom"
)
_TYPOS = (
    "Honey bees live in colonys of up to sixty thousand workers. A worker bee lives about six weeks in sumer. "
    "The queen can lay two thousand eggs in a singel day. Bees communicate the direction of flowers with a "
    "waggle dance."
)

WORKLOADS: dict[str, list[str]] = {
    "grounded": [
        "Rewrite the following paragraph exactly as it is, changing only the day from Saturday to Sunday. "
        f"Output only the rewritten paragraph.\n\n{_PARAGRAPH}",
        f"Rewrite this email, replacing the name Anna with Maria. Output only the email.\n\n{_EMAIL}",
        f"Rename the function `average` to `mean` in this code. Output the whole code.\n\n```python\n{_CODE}\n```",
        f"Fix the spelling mistakes in this text and output the corrected text only.\n\n{_TYPOS}",
    ],
    "free": [
        "Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Explain why the sky is blue to a ten-year-old.",
    ],
}


# ---------------------------------------------------------------- workers (one engine each)

class _Shmvllm:
    def __init__(self, k: int, lookup_min: int, method: str | None, draft: str) -> None:
        from shmvllm import LLM, SamplingParams

        spec: dict[str, Any] | None = None
        if method == "ngram":
            spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": max(lookup_min, 4),
                    "prompt_lookup_min": lookup_min}
        elif method == "draft_model":
            spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": k}
        self.params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        self.first = SamplingParams(temperature=0.0, max_tokens=1)
        self.llm = LLM(model=MODEL, enable_prefix_caching=False, speculative_config=spec)

    def one(self, prompt: list[int]) -> tuple[list[int], float]:
        started = time.perf_counter()
        self.llm.generate([{"prompt_token_ids": prompt}], self.first, use_tqdm=False)
        ttft = time.perf_counter() - started
        out = self.llm.generate([{"prompt_token_ids": prompt}], self.params, use_tqdm=False)
        return list(out[0].outputs[0].token_ids), ttft

    def counters(self) -> dict[str, Any]:
        return {m.name: getattr(m, "value", getattr(m, "values", None))
                for m in self.llm.get_metrics() if m.name.startswith("vllm:spec_decode")}


class _LlamaCpp:
    def __init__(self, gguf: str, threads: int, lookup_tokens: int, speculate: bool) -> None:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup_tokens) if speculate else None
        self.llm = Llama(model_path=gguf, n_ctx=1024, n_threads=threads, n_threads_batch=threads, n_batch=512,
                         verbose=False, seed=0, draft_model=draft)
        self.eos = self.llm.token_eos()

    def one(self, prompt: list[int]) -> tuple[list[int], float]:
        self.llm.reset()
        tokens: list[int] = []
        started = time.perf_counter()
        ttft = 0.0
        for token in self.llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            if not ttft:
                ttft = time.perf_counter() - started
            if token == self.eos:
                break
            tokens.append(token)
            if len(tokens) == MAX_TOKENS:
                break
        return tokens, ttft

    def counters(self) -> dict[str, Any]:
        return {}


def _worker(kind: str, spec: dict[str, Any]) -> None:
    """Loads one engine, then answers each "rep" line on stdin with one JSON line: per workload,
    the wall seconds (the whole request, and to its first token) and the tokens of each prompt."""
    if kind.startswith("shmvllm"):
        os.environ.setdefault("OMP_NUM_THREADS", str(spec["threads"]))
        method = {"shmvllm+lookup": "ngram", "shmvllm+draft": "draft_model"}.get(kind)
        engine: Any = _Shmvllm(spec["k"], spec["lookup_min"], method, spec["draft"])
    else:
        engine = _LlamaCpp(spec["gguf"], spec["threads"], spec["lookup_tokens"], kind.endswith("+lookup"))
    prompts: dict[str, list[list[int]]] = spec["prompts"]
    engine.one(prompts["free"][0][:16])  # warm-up
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip() != "rep":
            break
        result: dict[str, Any] = {}
        for workload, items in prompts.items():
            walls, ttfts, outputs = [], [], []
            for prompt in items:
                started = time.perf_counter()
                tokens, ttft = engine.one(prompt)
                walls.append(time.perf_counter() - started - (ttft if kind.startswith("shmvllm") else 0.0))
                ttfts.append(ttft)
                outputs.append(tokens)
            result[workload] = {"wall_s": walls, "ttft_s": ttfts, "tokens": outputs}
        result["counters"] = engine.counters()
        print(json.dumps(result), flush=True)


# ---------------------------------------------------------------- the parent

def prompt_ids(gguf: str) -> dict[str, list[list[int]]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(Path(gguf).parent), gguf_file=Path(gguf).name)
    result = {}
    for workload, texts in WORKLOADS.items():
        result[workload] = []
        for text in texts:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True)
            result[workload].append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return result


def summarize(name: str, reps: list[dict[str, Any]]) -> dict[str, Any]:
    row: dict[str, Any] = {"engine": name, "repetitions": len(reps)}
    for workload in WORKLOADS:
        def rate(r: dict[str, Any], decode: bool) -> float:
            w = r[workload]
            if decode:
                return sum(len(t) - 1 for t in w["tokens"]) / sum(a - b for a, b in zip(w["wall_s"], w["ttft_s"]))
            return sum(map(len, w["tokens"])) / sum(w["wall_s"])

        row[workload] = {"tokens": reps[-1][workload]["tokens"], "num_tokens": sum(map(len, reps[-1][workload]["tokens"]))}
        for key, decode in (("tok_per_s", True), ("request_tok_per_s", False)):
            rates = [rate(r, decode) for r in reps]
            row[workload][key] = {"median": statistics.median(rates), "min": min(rates), "max": max(rates)}
            row[workload][key + "_each"] = rates
    row["counters"] = reps[-1]["counters"]
    return row


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    print(f"one request at a time, greedy, <= {MAX_TOKENS} tokens, {args.threads} threads; shmvllm k={args.k} "
          f"prompt_lookup_min={args.lookup_min}, "
          f"llama.cpp num_pred_tokens={args.lookup_tokens}; median [min, max] tok/s over {rows[0]['repetitions']} "
          "interleaved repetitions")
    print(f"{'engine':<18}" + "".join(f"{w + ' decode tok/s':>32}{'request tok/s':>15}" for w in WORKLOADS))
    for r in rows:
        cells = []
        for w in WORKLOADS:
            t = r[w]["tok_per_s"]
            cells.append(f"{t['median']:8.1f} [{t['min']:6.1f}, {t['max']:6.1f}] ({r[w]['num_tokens']:4d} tok)"
                         f"{r[w]['request_tok_per_s']['median']:15.1f}")
        print(f"{r['engine']:<18}" + "".join(f"{c:>47}" for c in cells))
    by = {r["engine"]: r for r in rows}
    spec = by.get("shmvllm+lookup")
    for name in ("shmvllm+lookup", "shmvllm+draft"):
        c = by[name]["counters"] if name in by else None
        if c:
            drafts = max(c.get("vllm:spec_decode_num_draft_tokens", 0), 1)
            print(f"{name} (warm-up and all repetitions, both workloads): {c.get('vllm:spec_decode_num_drafts')} verify steps, "
                  f"{c.get('vllm:spec_decode_num_accepted_tokens')} of {drafts} proposals accepted "
                  f"({c.get('vllm:spec_decode_num_accepted_tokens', 0) / drafts:.0%}), per position "
                  f"{c.get('vllm:spec_decode_num_accepted_tokens_per_pos')}")
    base, peer = by.get("shmvllm"), by.get("llama.cpp+lookup")
    for a, b in (("shmvllm+lookup", "shmvllm"), ("shmvllm+draft", "shmvllm"), ("llama.cpp+lookup", "llama.cpp"),
                 ("shmvllm+lookup", "llama.cpp+lookup"), ("shmvllm", "llama.cpp")):
        if a in by and b in by:
            print(f"{a}/{b}: " + ", ".join(
                f"{w} decode {by[a][w]['tok_per_s']['median'] / by[b][w]['tok_per_s']['median']:.2f}x "
                f"(request {by[a][w]['request_tok_per_s']['median'] / by[b][w]['request_tok_per_s']['median']:.2f}x)"
                for w in WORKLOADS))
    for w in WORKLOADS:
        for name in ("shmvllm+lookup", "shmvllm+draft"):
            if base and name in by:
                same = all(x == y for x, y in zip(base[w]["tokens"], by[name][w]["tokens"]))
                print(f"{w}: shmvllm's tokens with and without {name[8:]} speculation {'identical' if same else 'DIFFER'}")
    checks = []
    if spec and base:
        ratio = spec["grounded"]["tok_per_s"]["median"] / base["grounded"]["tok_per_s"]["median"]
        checks.append(f"CHECK grounded decode tok/s shmvllm+lookup/shmvllm = {ratio:.2f}x (>= 1.5x): "
                      f"{'holds' if ratio >= 1.5 else 'FAILS'}")
    if spec and peer:
        ratio = spec["grounded"]["tok_per_s"]["median"] / peer["grounded"]["tok_per_s"]["median"]
        checks.append(f"CHECK grounded decode tok/s shmvllm+lookup/llama.cpp+lookup = {ratio:.2f}x (>= 1.0x): "
                      f"{'holds' if ratio >= 1.0 else 'FAILS'}")
    if spec and base:
        ratio = spec["free"]["tok_per_s"]["median"] / base["free"]["tok_per_s"]["median"]
        checks.append(f"CHECK free-form decode tok/s shmvllm+lookup/shmvllm = {ratio:.2f}x (>= 0.95x, cost <= 5%): "
                      f"{'holds' if ratio >= 0.95 else 'FAILS'}")
    for line in checks:
        print(line)
    return checks


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(WORKLOADS), figsize=(12, 4.5))
    names = [r["engine"] for r in rows]
    colors = {"shmvllm": "tab:olive", "shmvllm+lookup": "tab:green", "shmvllm+draft": "tab:cyan", "llama.cpp": "navajowhite",
              "llama.cpp+lookup": "tab:orange"}
    for ax, workload in zip(axes, WORKLOADS):
        med = [r[workload]["tok_per_s"]["median"] for r in rows]
        low = [m - r[workload]["tok_per_s"]["min"] for m, r in zip(med, rows)]
        high = [r[workload]["tok_per_s"]["max"] - m for m, r in zip(med, rows)]
        bars = ax.bar(names, med, yerr=[low, high], capsize=4, color=[colors.get(n, "tab:blue") for n in names])
        ax.bar_label(bars, fmt="%.1f")
        ax.set_title(f"{workload}: decode tok/s of one request (higher is better)")
        ax.tick_params(axis="x", rotation=15)
    fig.suptitle("SmolLM2-135M-Instruct Q4_1 GGUF: " + ", ".join(names))
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-python", help="a Python with llama-cpp-python; llama.cpp is skipped without it")
    parser.add_argument("--engines", default="shmvllm,shmvllm+lookup,llama.cpp,llama.cpp+lookup")
    parser.add_argument("--k", type=int, default=3, help="shmvllm's num_speculative_tokens (<= 3: the native decode step verifies)")
    parser.add_argument("--lookup-min", type=int, default=3, help="shmvllm's prompt_lookup_min")
    parser.add_argument("--lookup-tokens", type=int, default=10, help="llama.cpp's num_pred_tokens (its default: 10)")
    parser.add_argument("--draft", default=MODEL, help="shmvllm+draft's draft model (default: the model itself)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json")
    parser.add_argument("--plot")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker, json.loads(args.spec))
        return
    gguf = shipped_gguf(MODEL)
    spec = {"gguf": gguf, "threads": args.threads, "k": args.k, "lookup_min": args.lookup_min, "lookup_tokens": args.lookup_tokens,
            "draft": args.draft, "prompts": prompt_ids(gguf)}
    names = [n for n in args.engines.split(",") if n]
    if not args.llama_python:
        names = [n for n in names if not n.startswith("llama.cpp")]
    workers = []
    try:
        for name in names:
            workers.append(Worker(name, name, args.llama_python if name.startswith("llama.cpp") else sys.executable, spec, __file__))
        reps: dict[str, list[dict[str, Any]]] = {w.name: [] for w in workers}
        for i in range(args.repeats):
            order = workers[i % len(workers):] + workers[: i % len(workers)]
            for worker in order:
                reps[worker.name].append(worker.rep())
            print(f"[speculative] repetition {i + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    finally:
        for worker in workers:
            worker.close()
    rows = [summarize(name, reps[name]) for name in names]
    checks = report(rows, args)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"threads": args.threads, "k": args.k, "lookup_min": args.lookup_min,
                                               "draft": args.draft if "shmvllm+draft" in names else None,
                                               "lookup_tokens": args.lookup_tokens,
                                               "max_tokens": MAX_TOKENS, "rows": rows, "checks": checks}, indent=1))
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
