"""Many concurrent callers, one short request at a time each: what an application sees.

For 1, 4, 16 and 64 callers, each caller sends one request, waits for its answer, sends the
next, for --seconds (default 10). Embedding (all-MiniLM-L6-v2, one short sentence a request):

- shmvllm threads: one shared `LLM`, each caller a thread calling `LLM.embed([text])`;
- shmvllm async: one shared `AsyncLLM`, each caller a coroutine awaiting `AsyncLLM.embed(text)`;
- shmvllm serial: the same LLM behind a lock (one request at a time);
- sentence-transformers behind a lock: `SentenceTransformer.encode([text])` per request, one at
  a time (what an application does with it today).

Generation (the shipped SmolLM2-135M-Instruct GGUF, 16 greedy tokens a request, EOS ignored): shmvllm
threads (`LLM.generate`), shmvllm async (`AsyncLLM.generate`, streaming: it also gives TTFT),
shmvllm serial, and llama-cpp-python behind a lock (streaming, in its own venv's python, given
by --llama-python; left out without it). Reported: requests/s (and tokens/s), latency p50/p99,
TTFT p50/p99 where the API streams.

    flock /tmp/shmvllm-cpu.lock python benchmarks/concurrent_callers.py --llama-python .venv-llamacpp/bin/python \\
        --json benchmarks/results/concurrent.json --plot benchmarks/results/concurrent.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional

CALLERS = (1, 4, 16, 64)
GEN_TOKENS = 16
GEN_PROMPT = "Write one sentence about the sea, number {}."
_WORDS = "the quick brown fox jumps over a lazy dog near shared memory rings in the engine".split()


def sentence(i: int) -> str:
    """A short sentence (8-14 words), different for each request."""
    return " ".join(_WORDS[(i * 7 + j) % len(_WORDS)] for j in range(8 + i % 7)) + f" {i}."


# ---------------------------------------------------------------- harnesses

# A caller's request: returns (seconds to the first token or None, tokens produced).
Call = Callable[[int], tuple[Optional[float], int]]
AsyncCall = Callable[[int], Awaitable[tuple[Optional[float], int]]]


def _summary(records: list[tuple[float, Optional[float], int]], elapsed: float) -> dict[str, Any]:
    latencies = sorted(r[0] for r in records)
    ttfts = sorted(r[1] for r in records if r[1] is not None)

    def pct(values: list[float], q: float) -> Optional[float]:
        return values[min(int(q * len(values)), len(values) - 1)] if values else None

    return {"requests": len(records), "seconds": elapsed, "requests_per_s": len(records) / elapsed,
            "tokens_per_s": sum(r[2] for r in records) / elapsed,
            "latency_p50_s": pct(latencies, 0.5), "latency_p99_s": pct(latencies, 0.99),
            "ttft_p50_s": pct(ttfts, 0.5), "ttft_p99_s": pct(ttfts, 0.99)}


def run_threads(call: Call, callers: int, seconds: float) -> dict[str, Any]:
    records: list[tuple[float, Optional[float], int]] = []
    counter = iter(range(1 << 40))
    barrier = threading.Barrier(callers + 1)
    stop_at = [0.0]
    errors: list[BaseException] = []

    def caller() -> None:
        barrier.wait()
        try:
            while time.perf_counter() < stop_at[0]:
                started = time.perf_counter()
                ttft, tokens = call(next(counter))
                records.append((time.perf_counter() - started, ttft, tokens))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=caller, daemon=True) for _ in range(callers)]
    for t in threads:
        t.start()
    started = time.perf_counter()
    stop_at[0] = started + seconds
    barrier.wait()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return _summary(records, time.perf_counter() - started)


def run_coroutines(make_call: Callable[[], Awaitable[Any]], callers: int, seconds: float) -> dict[str, Any]:
    """make_call: a coroutine giving (AsyncCall, close) in the running loop."""

    async def main() -> dict[str, Any]:
        call, close = await make_call()
        records: list[tuple[float, Optional[float], int]] = []
        counter = iter(range(1 << 40))
        stop_at = time.perf_counter() + seconds

        async def caller() -> None:
            while time.perf_counter() < stop_at:
                started = time.perf_counter()
                ttft, tokens = await call(next(counter))
                records.append((time.perf_counter() - started, ttft, tokens))

        try:
            started = time.perf_counter()
            await asyncio.gather(*(caller() for _ in range(callers)))
            return _summary(records, time.perf_counter() - started)
        finally:
            close()

    return asyncio.run(main())


def locked(call: Call) -> Call:
    lock = threading.Lock()

    def one(i: int) -> tuple[Optional[float], int]:
        with lock:
            return call(i)

    return one


# ---------------------------------------------------------------- llama.cpp worker (its own venv)

def llama_worker(gguf: str, callers: list[int], seconds: float) -> None:
    from llama_cpp import Llama

    llm = Llama(model_path=gguf, n_ctx=512, verbose=False, seed=0)

    def call(i: int) -> tuple[Optional[float], int]:
        started = time.perf_counter()
        first, count = None, 0
        prompt = llm.tokenize(GEN_PROMPT.format(i).encode())
        for _ in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            if first is None:
                first = time.perf_counter() - started
            count += 1
            if count == GEN_TOKENS:  # EOS ignored, as shmvllm's ignore_eos=True
                break
        return first, count

    call(0)
    rows = [{"callers": n, **run_threads(locked(call), n, seconds)} for n in callers]
    print(json.dumps(rows))


def run_llama(python: str, gguf: str, callers: list[int], seconds: float) -> list[dict[str, Any]]:
    out = subprocess.run([python, __file__, "--llama-worker", gguf, "--callers", ",".join(map(str, callers)),
                          "--seconds", str(seconds)], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- the runs

def embedding_rows(callers: list[int], seconds: float) -> list[dict[str, Any]]:
    from sentence_transformers import SentenceTransformer

    from shmvllm import LLM, AsyncLLM, EngineArgs
    from shmvllm.model.registry import resolve_model_dir

    rows: list[dict[str, Any]] = []

    def add(engine: str, mode: str, n: int, result: dict[str, Any]) -> None:
        rows.append({"task": "embed", "engine": engine, "mode": mode, "callers": n, **result})
        print(f"[concurrent] embed {engine:<22} {mode:<10} callers={n:<3} {result['requests_per_s']:8.1f} req/s "
              f"p50={result['latency_p50_s'] * 1e3:7.1f} ms p99={result['latency_p99_s'] * 1e3:7.1f} ms",
              file=sys.stderr, flush=True)

    model_dir = str(resolve_model_dir("all-minilm-l6-v2"))
    st = SentenceTransformer(model_dir, device="cpu")
    st.encode(["warm up"])
    st_call = locked(lambda i: (None, len(st.encode([sentence(i)]))))
    for n in callers:
        add("sentence-transformers", "lock", n, run_threads(st_call, n, seconds))
    del st

    with LLM(model_dir) as llm:
        llm.embed(["warm up"], use_tqdm=False)

        def call(i: int) -> tuple[Optional[float], int]:
            return None, len(llm.embed([sentence(i)], use_tqdm=False))

        for n in callers:
            add("shmvllm", "threads", n, run_threads(call, n, seconds))
            add("shmvllm", "serial", n, run_threads(locked(call), n, seconds))

    async def make_async() -> Any:
        engine = AsyncLLM.from_engine_args(EngineArgs(model=model_dir))

        async def one(i: int) -> tuple[Optional[float], int]:
            await engine.embed(sentence(i))
            return None, 1

        return one, engine.shutdown

    for n in callers:
        add("shmvllm", "coroutines", n, run_coroutines(make_async, n, seconds))
    return rows


def generation_rows(callers: list[int], seconds: float, llama_python: Optional[str]) -> list[dict[str, Any]]:
    from shmvllm import LLM, AsyncLLM, EngineArgs, RequestOutputKind, SamplingParams
    from shmvllm.model.registry import resolve_model_dir

    rows: list[dict[str, Any]] = []

    def add(engine: str, mode: str, n: int, result: dict[str, Any]) -> None:
        rows.append({"task": "generate", "engine": engine, "mode": mode, "callers": n, **result})
        ttft = f"ttft p50={result['ttft_p50_s'] * 1e3:7.1f} ms" if result["ttft_p50_s"] is not None else ""
        print(f"[concurrent] generate {engine:<12} {mode:<10} callers={n:<3} {result['tokens_per_s']:8.1f} tok/s "
              f"p50={result['latency_p50_s'] * 1e3:7.1f} ms p99={result['latency_p99_s'] * 1e3:7.1f} ms {ttft}",
              file=sys.stderr, flush=True)

    model = "smollm2-135m-instruct"
    params = SamplingParams(temperature=0, max_tokens=GEN_TOKENS, ignore_eos=True)
    with LLM(model) as llm:
        llm.generate("warm up", params, use_tqdm=False)

        def call(i: int) -> tuple[Optional[float], int]:
            return None, len(llm.generate(GEN_PROMPT.format(i), params, use_tqdm=False)[0].outputs[0].token_ids)

        for n in callers:
            add("shmvllm", "threads", n, run_threads(call, n, seconds))
            add("shmvllm", "serial", n, run_threads(locked(call), n, seconds))

    stream_params = SamplingParams(temperature=0, max_tokens=GEN_TOKENS, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def make_async() -> Any:
        engine = AsyncLLM.from_engine_args(EngineArgs(model=model))
        ids = iter(range(1 << 40))

        async def one(i: int) -> tuple[Optional[float], int]:
            started, first, count = time.perf_counter(), None, 0
            async for out in engine.generate(GEN_PROMPT.format(i), stream_params, f"g{next(ids)}"):
                if first is None:
                    first = time.perf_counter() - started
                count += len(out.outputs[0].token_ids)
            return first, count

        return one, engine.shutdown

    for n in callers:
        add("shmvllm", "coroutines", n, run_coroutines(make_async, n, seconds))
    if llama_python:
        gguf = shipped_gguf(model)
        for row in run_llama(llama_python, gguf, callers, seconds):
            add("llama.cpp", "lock", row.pop("callers"), row)
    return rows


def shipped_gguf(model: str) -> str:
    import importlib.util

    from shmvllm.model.registry import SHIPPED_MODELS

    shipped = SHIPPED_MODELS[model]
    spec = importlib.util.find_spec(shipped.package)
    if spec is None or spec.origin is None:
        raise SystemExit(f"the generation model needs {shipped.pip_name}")
    return str(Path(spec.origin).parent / shipped.relative_path)


# ---------------------------------------------------------------- report

def _find(rows: list[dict[str, Any]], task: str, engine: str, mode: str, n: int) -> Optional[dict[str, Any]]:
    return next((r for r in rows if (r["task"], r["engine"], r["mode"], r["callers"]) == (task, engine, mode, n)), None)


def report(rows: list[dict[str, Any]], callers: list[int]) -> list[str]:
    print(f"{'task':<9} {'engine':<22} {'mode':<11} {'callers':>7} {'req/s':>9} {'tok/s':>9} "
          f"{'p50 ms':>8} {'p99 ms':>8} {'TTFT p50':>9} {'TTFT p99':>9}")
    for r in rows:
        ttft50 = f"{r['ttft_p50_s'] * 1e3:9.1f}" if r["ttft_p50_s"] is not None else f"{'-':>9}"
        ttft99 = f"{r['ttft_p99_s'] * 1e3:9.1f}" if r["ttft_p99_s"] is not None else f"{'-':>9}"
        print(f"{r['task']:<9} {r['engine']:<22} {r['mode']:<11} {r['callers']:>7} {r['requests_per_s']:9.1f} "
              f"{r['tokens_per_s']:9.1f} {r['latency_p50_s'] * 1e3:8.1f} {r['latency_p99_s'] * 1e3:8.1f} {ttft50} {ttft99}")
    checks = []
    n = 16 if 16 in callers else max(callers)
    st = _find(rows, "embed", "sentence-transformers", "lock", n)
    for mode in ("threads", "coroutines"):
        ours = _find(rows, "embed", "shmvllm", mode, n)
        if st and ours:
            ratio = ours["requests_per_s"] / st["requests_per_s"]
            checks.append(f"CHECK embed {n} callers ({mode}): shmvllm/sentence-transformers-behind-a-lock throughput = "
                          f"{ratio:.2f}x (>= 2.0x): {'holds' if ratio >= 2.0 else 'FAILS'}")
            p99 = ours["latency_p99_s"] / st["latency_p99_s"]
            checks.append(f"CHECK embed {n} callers ({mode}): p99 latency shmvllm/sentence-transformers = {p99:.2f}x "
                          f"(< 1.0x): {'holds' if p99 < 1.0 else 'FAILS'}")
    for task, key in (("embed", "requests_per_s"), ("generate", "tokens_per_s")):
        ours, serial = _find(rows, task, "shmvllm", "threads", n), _find(rows, task, "shmvllm", "serial", n)
        if ours and serial:
            print(f"{task} {n} callers: shmvllm threads / shmvllm serial = {ours[key] / serial[key]:.2f}x")
    llama, ours = _find(rows, "generate", "llama.cpp", "lock", n), _find(rows, "generate", "shmvllm", "coroutines", n)
    if llama and ours:
        print(f"generate {n} callers: shmvllm coroutines / llama.cpp behind a lock tok/s = "
              f"{ours['tokens_per_s'] / llama['tokens_per_s']:.2f}x")
    for line in checks:
        print(line)
    return checks


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, task, key, label in ((axes[0], "embed", "requests_per_s", "sentences/s"),
                                 (axes[1], "generate", "tokens_per_s", "tokens/s")):
        series = sorted({(r["engine"], r["mode"]) for r in rows if r["task"] == task})
        for engine, mode in series:
            points = sorted((r["callers"], r[key]) for r in rows if (r["task"], r["engine"], r["mode"]) == (task, engine, mode))
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=f"{engine} ({mode})")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent callers")
        ax.set_ylabel(label)
        ax.set_title(task)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="how long each configuration runs (default: %(default)s)")
    parser.add_argument("--callers", default=",".join(map(str, CALLERS)), help="caller counts (default: %(default)s)")
    parser.add_argument("--tasks", default="embed,generate", help="embed, generate or both (default: %(default)s)")
    parser.add_argument("--llama-python", help="python of a venv with llama-cpp-python (the generation peer)")
    parser.add_argument("--json", help="write the rows to this JSON file")
    parser.add_argument("--plot", help="draw a PNG to this path")
    parser.add_argument("--llama-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    callers = [int(c) for c in args.callers.split(",")]
    if args.llama_worker:
        llama_worker(args.llama_worker, callers, args.seconds)
        return
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    tasks = args.tasks.split(",")
    rows = []
    if "embed" in tasks:
        rows += embedding_rows(callers, args.seconds)
    if "generate" in tasks:
        rows += generation_rows(callers, args.seconds, args.llama_python)
    checks = report(rows, callers)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"seconds": args.seconds, "rows": rows, "checks": checks}, indent=1))
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
