"""Throughput and single-request latency of SmolLM2-135M-Instruct: shmvllm vs HF transformers vs vLLM,
in fp32 and, on a CPU with native bf16 dot products (AVX512-BF16 / AMX-BF16), in bf16.

Workloads (the same tokens on every engine: greedy, ignore_eos, min_tokens = max_tokens):
- throughput: 64 varied chat prompts of 35-45 tokens x 128 output tokens;
- single: 1 prompt x 128 tokens: time to first token and decode tok/s.
Each row of VARIANTS (an engine, a dtype, its engine arguments) runs in a subprocess of its
own, one after the other, so that none disturbs another's measurement; every shmvllm row is
compared with HF and vLLM in its dtype (PEERS). A GEMM microbenchmark of the model's shapes
gives the roofline of each dtype.

    python benchmarks/throughput.py --json out/throughput.json --plot out/throughput.png \
        [--vllm-python .venv-vllm/bin/python] [--dtypes float32,bfloat16] \
        [--variant shmvllm-fp32='{"quantization": "none"}'] [--async-scheduling]

`--variant NAME=JSON` adds a shmvllm row with these engine arguments (its dtype: the JSON's
"dtype", default float32); a variant with `"quantization": "none"` (the dense fp32 weights)
gets a CHECK that the default (GGUF blocks) is at least as fast and holds less memory. shmvllm
rows carry the engine process's resident memory after the throughput run (`engine_rss_mib`).
`--async-scheduling` adds the row `shmvllm-async` (`async_scheduling=True`: step N+1 scheduled
while step N runs) beside `shmvllm`, with its ratios and CHECKs against it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

NUM_PROMPTS = 64
MAX_TOKENS = 128
MODEL = "smollm2-135m-instruct"
_RESULT_MARK = "THROUGHPUT-RESULT "
ASYNC_VARIANT = 'shmvllm-async={"async_scheduling": true}'

VARIANTS: dict[str, tuple[str, str, dict[str, Any]]] = {
    # row name: (engine, dtype, extra engine arguments)
    "shmvllm": ("shmvllm", "float32", {}),  # the default: the GGUF file's blocks, fp32 activations
    "shmvllm-bf16": ("shmvllm", "bfloat16", {}),  # the dequantized weights in bf16
    "hf": ("hf", "float32", {}),
    "hf-bf16": ("hf", "bfloat16", {}),
    "vllm": ("vllm", "float32", {}),
    "vllm-bf16": ("vllm", "bfloat16", {}),
}
_BUILTIN = frozenset(VARIANTS)
PEERS = {"shmvllm": ("hf", "vllm"), "shmvllm-bf16": ("hf-bf16", "vllm-bf16")}
"""Each shmvllm row against the peers in its dtype."""

_TOPICS = [
    "the water cycle", "black holes", "photosynthesis", "the French Revolution", "prime numbers",
    "how vaccines work", "the history of the bicycle", "plate tectonics", "the Roman aqueducts",
    "machine learning", "the Great Wall of China", "coral reefs", "the printing press",
    "quantum entanglement", "the human heart", "volcanoes", "the Silk Road", "honey bees",
    "the theory of relativity", "the Amazon rainforest", "jazz music", "the moon landing",
    "electric cars", "the immune system", "glaciers", "the Renaissance", "solar panels",
    "the stock market", "octopuses", "the internet", "earthquakes", "chess openings",
]
_ASKS = [
    "Explain {} to a curious twelve-year-old in a few friendly paragraphs.",
    "Write a short, vivid story for children that teaches something about {} along the way.",
]


def chat_prompt_token_ids(tokenizer: Any) -> list[list[int]]:
    """64 deterministic chat prompts, each 35-45 tokens after the chat template."""
    prompts = []
    for i in range(NUM_PROMPTS):
        text = _ASKS[i % 2].format(_TOPICS[i % len(_TOPICS)])
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # transformers v5 may return a BatchEncoding
            ids = ids["input_ids"]
        filler = tokenizer.encode(" Please keep it clear and simple", add_special_tokens=False)
        while len(ids) < 35:
            ids = ids[:-3] + filler[: 35 - len(ids)] + ids[-3:]
        prompts.append(list(ids[:45]))
    return prompts


def run_shmvllm(name: str, prompts: list[list[int]], repeats: int) -> list[dict[str, Any]]:
    from latency import _children, _rss_mib
    from shmvllm import LLM, SamplingParams
    from shmvllm.model.kernels import native_bf16

    _, dtype, extra = VARIANTS[name]
    started = time.perf_counter()
    llm = LLM(model=MODEL, dtype=dtype, **extra)
    load_s = time.perf_counter() - started
    path = f"dtype {llm.llm_engine.model_config.dtype}, CPU bf16: {native_bf16()[1]}"
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    wall, outputs = _best_of(repeats, lambda: llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    rows = [_row(name, "throughput", wall, tokens, load_s, [o.outputs[0].token_ids for o in outputs])]
    rows[0]["engine_rss_mib"] = sum(_rss_mib(pid) for pid in _children(os.getpid()))
    rows.append(_single(repeats, lambda n: llm.generate([{"prompt_token_ids": prompts[0]}], _exact(SamplingParams, n), use_tqdm=False),
                        name, load_s))
    llm.shutdown()
    for row in rows:
        row["path"] = path
    return rows


def run_vllm(name: str, prompts: list[list[int]], model_dir: str, repeats: int) -> list[dict[str, Any]]:
    from vllm import LLM, SamplingParams  # type: ignore[import-not-found]

    _, dtype, extra = VARIANTS[name]
    started = time.perf_counter()
    llm = LLM(model=model_dir, dtype=dtype, max_model_len=512, max_num_seqs=64, seed=0, **extra)
    load_s = time.perf_counter() - started
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    wall, outputs = _best_of(repeats, lambda: llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    rows = [_row(name, "throughput", wall, tokens, load_s, [list(o.outputs[0].token_ids) for o in outputs])]
    rows.append(_single(repeats, lambda n: llm.generate([{"prompt_token_ids": prompts[0]}], _exact(SamplingParams, n), use_tqdm=False),
                        name, load_s))
    return rows


def run_hf(name: str, prompts: list[list[int]], model_dir: str, repeats: int) -> list[dict[str, Any]]:
    import torch
    from transformers import AutoModelForCausalLM

    _, dtype, extra = VARIANTS[name]
    torch.set_num_threads(os.cpu_count() or 1)
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype), **extra).eval()
    load_s = time.perf_counter() - started
    pad = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0

    def generate(batch: list[list[int]], n: int) -> list[list[int]]:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=pad)
        return out[:, width:].tolist()

    generate(prompts[:2], 4)
    wall, outputs = _best_of(repeats, lambda: generate(prompts, MAX_TOKENS))
    rows = [_row(name, "throughput", wall, sum(len(o) for o in outputs), load_s, outputs)]
    rows.append(_single(repeats, lambda n: generate(prompts[:1], n), name, load_s))
    return rows


def _exact(params_cls: Any, n: int) -> Any:
    return params_cls(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True)


def _best_of(repeats: int, run: Any) -> tuple[float, Any]:
    """The fastest of `repeats` runs (seconds) and that run's result. Every engine gets the same
    number of runs: on a shared 2-core VM one run can be 10-20% slower than the next."""
    best: Optional[tuple[float, Any]] = None
    for _ in range(repeats):
        started = time.perf_counter()
        result = run()
        wall = time.perf_counter() - started
        if best is None or wall < best[0]:
            best = (wall, result)
    assert best is not None
    return best


def _single(repeats: int, generate_n: Any, engine: str, load_s: float) -> dict[str, Any]:
    """Time to first token = a 1-token request; decode rate from the 128-token one."""
    ttft, _ = _best_of(repeats, lambda: generate_n(1))
    wall, _ = _best_of(repeats, lambda: generate_n(MAX_TOKENS))
    row = _row(engine, "single", wall, MAX_TOKENS, load_s, None)
    row["ttft_s"] = ttft
    row["decode_tok_per_s"] = (MAX_TOKENS - 1) / max(wall - ttft, 1e-9)
    return row


def _row(engine: str, workload: str, wall: float, tokens: int, load_s: float, token_ids: Any) -> dict[str, Any]:
    return {"engine": engine, "workload": workload, "wall_s": wall, "output_tokens": tokens,
            "tok_per_s": tokens / wall, "load_s": load_s, "token_ids": token_ids}


def gemm_roofline(model_dir: str, dtype_name: str = "float32") -> dict[str, float]:
    """GEMM speed (`torch.mm` in `dtype_name`) on the model's shapes at batch 64; roofline tok/s
    = GFLOPS / FLOPs per token."""
    import torch
    from transformers import AutoConfig

    torch.set_num_threads(os.cpu_count() or 1)
    dtype = getattr(torch, dtype_name)
    cfg = AutoConfig.from_pretrained(model_dir)
    h, inter, v, layers = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    per_layer = [(h, h + 2 * kv), (h, h), (h, 2 * inter), (inter, h)]
    batch = 64
    x = {k: torch.randn(batch, k, dtype=dtype) for k in {h, inter}}
    weights = [(k, torch.randn(k, n, dtype=dtype)) for k, n in per_layer] + [(h, torch.randn(h, v, dtype=dtype))]

    def one_token_pass() -> None:
        for k, w in weights[:-1]:
            for _ in range(layers):
                torch.mm(x[k], w)
        torch.mm(x[h], weights[-1][1])

    one_token_pass()
    reps = 5
    started = time.perf_counter()
    for _ in range(reps):
        one_token_pass()
    seconds = (time.perf_counter() - started) / reps
    flops_per_token = 2 * (layers * sum(k * n for k, n in per_layer) + h * v)
    gflops = flops_per_token * batch / seconds / 1e9
    return {"dtype": dtype_name, "gemm_gflops": gflops, "flops_per_token": flops_per_token,
            "roofline_tok_per_s": gflops * 1e9 / flops_per_token}


def add_variant(spec: str) -> str:
    """`NAME=JSON` (--variant) -> a new shmvllm row of VARIANTS; returns NAME."""
    name, _, raw = spec.partition("=")
    extra = json.loads(raw or "{}")
    if not name or name in VARIANTS or not isinstance(extra, dict):
        raise SystemExit(f"--variant must be a new NAME=JSON-object, got {spec!r}")
    VARIANTS[name] = ("shmvllm", extra.pop("dtype", "float32"), extra)
    return name


def _child(name: str, model_dir: str, repeats: int) -> None:
    """Runs one variant (or the GEMM roofline "gemm:<dtype>") in this (fresh) process; prints its
    rows as JSON on the last line."""
    from transformers import AutoTokenizer

    if name.startswith("gemm:"):
        rows = [gemm_roofline(model_dir, name.partition(":")[2])]
    else:
        prompts = chat_prompt_token_ids(AutoTokenizer.from_pretrained(model_dir))
        engine = VARIANTS[name][0]
        if engine == "shmvllm":
            rows = run_shmvllm(name, prompts, repeats)
        elif engine == "hf":
            rows = run_hf(name, prompts, model_dir, repeats)
        else:
            rows = run_vllm(name, prompts, model_dir, repeats)
    print("\n" + _RESULT_MARK + json.dumps(rows), flush=True)


def _run_child(name: str, python: str, model_dir: str, repeats: int = 1) -> list[dict[str, Any]]:
    env = dict(os.environ)
    if VARIANTS.get(name, ("",))[0] == "vllm":
        env.update(VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND="0-1")
    print(f"[throughput] running {name} ...", file=sys.stderr, flush=True)
    command = [python, __file__, "--child", name, "--model-dir", model_dir, "--repeats", str(repeats)]
    if name in VARIANTS and name not in _BUILTIN:
        _, dtype, extra = VARIANTS[name]
        command += ["--variant", f"{name}={json.dumps({**extra, 'dtype': dtype})}"]
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{name} failed (exit {result.returncode}):\n{result.stderr[-4000:]}")
    marked = [line for line in result.stdout.splitlines() if line.startswith(_RESULT_MARK)]
    if not marked:
        raise RuntimeError(f"{name} printed no result:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    return json.loads(marked[-1][len(_RESULT_MARK):])


def select_variants(engines: list[str], dtypes: list[str], cpu_bf16: bool) -> list[str]:
    """The VARIANTS rows of these engines and dtypes, in table order; bf16 rows only on a CPU
    with native bf16."""
    return [name for name, (engine, dtype, _) in VARIANTS.items()
            if engine in engines and dtype in dtypes and (dtype != "bfloat16" or cpu_bf16)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", help="a Python with vllm-cpu installed; vLLM is skipped without it")
    parser.add_argument("--engines", default="shmvllm,hf", help="comma-separated engines to run (default: shmvllm,hf)")
    parser.add_argument("--dtypes", default="float32,bfloat16",
                        help="comma-separated dtypes to run (default: float32,bfloat16; bf16 only where the CPU has it)")
    parser.add_argument("--json", help="write the rows to this JSON file")
    parser.add_argument("--plot", help="draw a PNG bar chart to this path")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run each workload this many times per engine and keep the fastest (default: 1)")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                        help="an extra shmvllm row with these engine arguments (repeatable)")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="also run shmvllm with async_scheduling=True (row shmvllm-async) against it")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    variants = [add_variant(spec) for spec in args.variant + ([ASYNC_VARIANT] if args.async_scheduling else [])]
    if args.child:
        _child(args.child, args.model_dir, args.repeats)
        return
    from shmvllm.model.kernels import native_bf16
    from shmvllm.model.registry import resolve_model_dir

    model_dir = str(resolve_model_dir(MODEL))
    engines = [e for e in args.engines.split(",") if e]
    if args.vllm_python and "vllm" not in engines:
        engines.append("vllm")
    dtypes = [d for d in args.dtypes.split(",") if d]
    cpu_bf16, why = native_bf16()
    cpu_line = f"CPU bf16: {'yes' if cpu_bf16 else 'no'} ({why})"
    if not cpu_bf16 and "bfloat16" in dtypes:
        cpu_line += "; this CPU has no native bf16: the bf16 rows are skipped, the fp32 rows run"
    print(cpu_line, flush=True)
    rows: list[dict[str, Any]] = []
    for name in select_variants(engines, dtypes, cpu_bf16):
        python = args.vllm_python if VARIANTS[name][0] == "vllm" else sys.executable
        rows += _run_child(name, python, model_dir, args.repeats)
    dense = next((n for n in variants if VARIANTS[n][2].get("quantization") == "none"), None)
    ran = sorted({VARIANTS[r["engine"]][1] for r in rows})
    rooflines = [_run_child(f"gemm:{dtype}", sys.executable, model_dir)[0] for dtype in ran]
    report(rows, rooflines, cpu_line, dense)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        result = {"rows": [_without_ids(r) for r in rows], "rooflines": rooflines, "repeats": args.repeats,
                  "cpu_bf16": cpu_line, "checks": acceptance({(r["engine"], r["workload"]): r for r in rows}, cpu_bf16, dense)}
        Path(args.json).write_text(json.dumps(result, indent=2))
    if args.plot:
        plot(rows, rooflines, args.plot)


def _without_ids(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k != "token_ids"}


# (header, the row's key, its format); None for the text columns, which are left-aligned
_COLUMNS = [
    ("engine", "engine", None), ("workload", "workload", None), ("wall_s", "wall_s", ".2f"),
    ("tokens", "output_tokens", "d"), ("tok/s", "tok_per_s", ".1f"), ("ttft_ms", "ttft_ms", ".1f"),
    ("decode tok/s", "decode_tok_per_s", ".1f"), ("load_s", "load_s", ".1f"),
]


def table_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The results table, each column as wide as its longest cell (a --variant name can be
    longer than the built-in ones); a row without a column's value leaves it blank."""
    cells = [[header for header, _, _ in _COLUMNS]]
    for r in rows:
        r = {**r, "ttft_ms": r["ttft_s"] * 1e3} if "ttft_s" in r else r
        cells.append([str(r[key]) if fmt is None else format(r[key], fmt) if key in r else ""
                      for _, key, fmt in _COLUMNS])
    widths = [max(len(row[i]) for row in cells) for i in range(len(_COLUMNS))]
    return [
        " ".join(cell.ljust(width) if fmt is None else cell.rjust(width)
                 for cell, width, (_, _, fmt) in zip(row, widths, _COLUMNS)).rstrip()
        for row in cells
    ]


def report(rows: list[dict[str, Any]], rooflines: list[dict[str, Any]], cpu_line: str, dense: Optional[str] = None) -> None:
    by = {(r["engine"], r["workload"]): r for r in rows}
    print(cpu_line)
    for line in table_lines(rows):
        print(line)
    for name in PEERS:
        row = by.get((name, "throughput"))
        if row and "path" in row:
            print(f"{name} ran with {row['path']}")
    for roofline in rooflines:
        print(f"GEMM roofline ({roofline['dtype']}): {roofline['gemm_gflops']:.1f} GFLOPS at batch 64 "
              f"-> {roofline['roofline_tok_per_s']:.0f} tok/s")
    for ours_name, peers in PEERS.items():
        ours = by.get((ours_name, "throughput"))
        for peer in peers:
            theirs = by.get((peer, "throughput"))
            if ours and theirs:
                same = sum(a == b for a, b in zip(ours["token_ids"], theirs["token_ids"]))
                print(f"throughput {ours_name}/{peer}: {ours['tok_per_s'] / theirs['tok_per_s']:.2f}x  "
                      f"(same tokens: {same}/{len(ours['token_ids'])} sequences)")
            single_ours, single_theirs = by.get((ours_name, "single")), by.get((peer, "single"))
            if single_ours and single_theirs:
                print(f"single-request decode {ours_name}/{peer}: "
                      f"{single_ours['decode_tok_per_s'] / single_theirs['decode_tok_per_s']:.2f}x")
    for top, bottom in (("shmvllm-bf16", "shmvllm"), ("shmvllm", dense), ("shmvllm-async", "shmvllm")):
        a, b = by.get((top, "throughput")), by.get((bottom, "throughput"))
        if a and b:
            same = sum(x == y for x, y in zip(a["token_ids"], b["token_ids"]))
            print(f"throughput {top}/{bottom}: {a['tok_per_s'] / b['tok_per_s']:.2f}x  "
                  f"(same tokens: {same}/{len(a['token_ids'])} sequences)")
    a, b = by.get(("shmvllm-async", "single")), by.get(("shmvllm", "single"))
    if a and b:
        print(f"single-request decode shmvllm-async/shmvllm: {a['decode_tok_per_s'] / b['decode_tok_per_s']:.2f}x, "
              f"TTFT {a['ttft_s'] / b['ttft_s']:.2f}x")
    for line in acceptance(by, "CPU bf16: yes" in cpu_line, dense):
        print(line)


def acceptance(by: dict[tuple[str, str], dict[str, Any]], cpu_bf16: bool = True, dense: Optional[str] = None) -> list[str]:
    """The targets, each with its figure and whether it holds in this run."""
    lines = []

    def check(what: str, value: float, target: float, unit: str, at_most: bool = False) -> None:
        holds = value <= target if at_most else value >= target
        lines.append(f"CHECK {what}: {value:.2f}{unit} ({'<=' if at_most else '>='} {target}{unit}) "
                     f"{'holds' if holds else 'FAILS'}")

    def ratio(ours: str, theirs: str, key: str = "tok_per_s", workload: str = "throughput") -> Optional[float]:
        a, b = by.get((ours, workload)), by.get((theirs, workload))
        return a[key] / b[key] if a and b else None

    for what, ours, theirs, target in (
        ("throughput shmvllm fp32 vs vllm fp32", "shmvllm", "vllm", 1.0),
        ("throughput shmvllm fp32 vs hf fp32", "shmvllm", "hf", 1.6),
        ("throughput shmvllm bf16 vs vllm bf16", "shmvllm-bf16", "vllm-bf16", 1.0),
    ):
        value = ratio(ours, theirs)
        if value is not None:
            check(what, value, target, "x")
    if not cpu_bf16:
        lines.append("CHECK throughput shmvllm bf16 vs vllm bf16: not run (this CPU has no native bf16)")
    value = ratio("shmvllm", "hf", "decode_tok_per_s", "single")
    if value is not None:
        check("single-request decode vs hf", value, 2.0, "x")
    ours = by.get(("shmvllm", "throughput"))
    dense_row = by.get((dense, "throughput")) if dense else None
    if ours and dense_row:
        check(f"throughput on GGUF blocks vs the dense fp32 path ({dense})", ours["tok_per_s"] / dense_row["tok_per_s"], 1.0, "x")
        check(f"engine RSS on GGUF blocks vs {dense}", ours["engine_rss_mib"] / dense_row["engine_rss_mib"], 1.0, "x",
              at_most=True)
    if ours:
        check("LLM() ready", ours["load_s"], 15, " s", at_most=True)
    # async scheduling is on by default only where it gains: these say whether it does here
    for workload, key in (("throughput", "tok_per_s"), ("single", "decode_tok_per_s")):
        value = ratio("shmvllm-async", "shmvllm", key, workload)
        if value is not None:
            check(f"{workload} async_scheduling on vs off", value, 1.0, "x")
    return lines


_COLORS = {"shmvllm": "tab:green", "hf": "tab:gray", "vllm": "tab:blue"}


def plot(rows: list[dict[str, Any]], rooflines: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for ax, workload, key, title in ((axes[0], "throughput", "tok_per_s", "64 prompts x 128 tokens: output tok/s"),
                                     (axes[1], "single", "decode_tok_per_s", "1 prompt: decode tok/s")):
        chosen = [r for r in rows if r["workload"] == workload]
        colors = [_COLORS[VARIANTS[r["engine"]][0]] for r in chosen]
        bars = ax.bar([r["engine"] for r in chosen], [r[key] for r in chosen], color=colors)
        for bar, r in zip(bars, chosen):
            bar.set_hatch("//" if VARIANTS[r["engine"]][1] == "bfloat16" else "")
        ax.bar_label(bars, fmt="%.0f")
        ax.set_title(title)
        ax.set_ylabel("tokens / s")
        ax.tick_params(axis="x", labelrotation=20)
        if workload == "throughput":
            for roofline, style in zip(rooflines, ("--", ":")):
                ax.axhline(roofline["roofline_tok_per_s"], color="red", linestyle=style,
                           label=f"GEMM roofline {roofline['dtype']}")
            ax.legend()
    fig.suptitle("SmolLM2-135M-Instruct, fp32 and bf16 (hatched), 2 CPU cores")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
