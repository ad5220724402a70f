"""Embedding throughput: shmvllm against sentence-transformers, in the same run.

    flock /tmp/shmvllm-cpu.lock python benchmarks/embed.py --rounds 2 \
        --json benchmarks/results/embed.json --plot benchmarks/results/embed.png

10,000 deterministic generated sentences of 8-63 tokens (35 on average, [CLS] and [SEP]
included) for all-MiniLM-L6-v2. Both engines are timed end to end from text (tokenization
included) to float32 vectors, after a warm-up and a full garbage collection (as timeit and
pyperf keep the collector out of the timed window: the peers' models and earlier rounds' outputs
live in this process, so a collection that falls inside one engine's call would bill it for
all of them); with --rounds N they alternate N times and each
reports its median round (other processes on a shared machine then hit both alike).
sentence-transformers runs `encode` at its best batch size (32; it sorts by length and pads
per batch), with its torch backend in this process and, with `--st-onnx-python PY`, its ONNX
backend (onnxruntime, the model exported at load) in a worker process run by PY: a virtual
environment holding `sentence-transformers[onnx]` (which pins its own transformers), e.g.

    python -m venv --system-site-packages .venv-st && .venv-st/bin/pip install "sentence-transformers[onnx]"

The worker is told when to run, so the three engines alternate round by round.
`--reranker-pairs N` adds a reranker row: a seeded random cross-encoder of MiniLM's shape
(BertForSequenceClassification, one label) scoring N (query, passage) pairs of the corpus,
`LLM.score` against sentence-transformers' `CrossEncoder.predict` (batch 32).

shmvllm (`--engine llm`, the default) is the whole engine as an application uses it:
`LLM(model=..., task="embed").embed(texts)`, the engine in its own process behind the
shared-memory rings, tokenization in the frontend overlapping the engine's compute. Each step
packs the tokens of many sentences with no padding, up to `--max-num-batched-tokens` (16384;
the runner takes each step through the model in pieces of at most 4,096 tokens) and
`--max-num-seqs`. `--engine runner` instead drives the PoolingModelRunner in this process
(row `shmvllm-runner`): the model alone, without the engine around it.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402

MODEL = "all-minilm-l6-v2"
MIN_TOKENS, MAX_TOKENS = 8, 63


def make_sentences(n: int, vocab: dict[str, int], seed: int = 0) -> list[str]:
    """Sentences of whole-word vocabulary entries ending in '.', each target-many tokens long
    (uniform in [MIN_TOKENS, MAX_TOKENS], counting [CLS], the period and [SEP])."""
    words = sorted(w for w in vocab if w.isascii() and w.isalpha() and len(w) >= 3)
    rng = random.Random(seed)
    sentences = []
    for _ in range(n):
        num_words = rng.randint(MIN_TOKENS, MAX_TOKENS) - 3
        text = " ".join(rng.choice(words) for _ in range(num_words))
        sentences.append(text[0].upper() + text[1:] + ".")
    return sentences


def embed_with_sentence_transformers(model_dir: Path, batch_size: int) -> Callable[[list[str]], np.ndarray]:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(model_dir), device="cpu")
    return lambda texts: model.encode(texts, batch_size=batch_size, convert_to_numpy=True)


def embed_with_onnx_worker(python: str, model_dir: Path, texts_file: Path, batch_size: int) -> Callable[[list[str]], np.ndarray]:
    """sentence-transformers' ONNX backend in a worker process (`python` has it installed): each
    call makes it embed the corpus once; it reports its own wall time, read back as the result."""
    import subprocess

    worker = subprocess.Popen(
        [python, __file__, "--onnx-worker", str(model_dir), str(texts_file), str(batch_size)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
    )
    import atexit

    atexit.register(worker.kill)
    if worker.stdout.readline().strip() != "ready":
        raise RuntimeError("the ONNX worker did not start")

    def embed(texts: list[str]) -> np.ndarray:
        worker.stdin.write(f"{len(texts)}\n")
        wall, path = worker.stdout.readline().split()
        embed.last_wall = float(wall)
        return np.load(path)

    return embed


def onnx_worker(model_dir: str, texts_file: str, batch_size: int) -> None:
    """The worker's loop: on "N" embed the first N texts, print "wall path-of-vectors"."""
    import sys
    import tempfile

    from sentence_transformers import SentenceTransformer

    texts = json.loads(Path(texts_file).read_text())
    model = SentenceTransformer(model_dir, backend="onnx", device="cpu")
    out = Path(tempfile.mkdtemp()) / "vectors.npy"
    print("ready", flush=True)
    for line in sys.stdin:
        chunk = texts[: int(line)]
        started = time.perf_counter()
        vectors = model.encode(chunk, batch_size=batch_size, convert_to_numpy=True)
        wall = time.perf_counter() - started
        np.save(out, vectors)
        print(f"{wall} {out}", flush=True)


def make_reranker(model_dir: Path, target: Path) -> Path:
    """A seeded random cross-encoder of all-MiniLM-L6-v2's shape (one label) with its tokenizer."""
    from transformers import AutoConfig, AutoTokenizer, BertForSequenceClassification

    config = AutoConfig.from_pretrained(model_dir)
    config.num_labels, config.architectures = 1, ["BertForSequenceClassification"]
    torch.manual_seed(0)
    BertForSequenceClassification(config).eval().save_pretrained(target)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(target)
    return target


def rerank_pairs(texts: list[str], n: int) -> list[tuple[str, str]]:
    """n (query, passage) pairs: a short query (a sentence's first words) against a corpus sentence."""
    rng = random.Random(1)
    return [(" ".join(rng.choice(texts).split()[:6]), rng.choice(texts)) for _ in range(n)]


def embed_with_runner(
    model_dir: Path, max_num_batched_tokens: int, max_num_seqs: int
) -> Callable[[list[str]], np.ndarray]:
    """Tokenizer + PoolingModelRunner, steps packed greedily in arrival order up to the token
    budget and the sequence cap (what the scheduler will do for whole pooling prompts)."""
    from transformers import AutoTokenizer

    from shmvllm.engine.arg_utils import EngineArgs
    from shmvllm.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
    from shmvllm.pooling_params import PoolingParams
    from shmvllm.worker.pooling_runner import PoolingModelRunner

    model_config = EngineArgs(model=str(model_dir), task="embed").create_engine_config().model_config
    runner = PoolingModelRunner(model_config)
    runner.load_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    params = PoolingParams()

    def run_step(reqs: list[NewRequestData]) -> dict[str, np.ndarray]:
        num_tokens = {r.req_id: len(r.prompt_token_ids) for r in reqs}
        step = SchedulerOutput(reqs, CachedRequestData(), num_tokens, sum(num_tokens.values()))
        return runner.execute_model(step).pooler_output

    def embed(texts: list[str]) -> np.ndarray:
        encoded = tokenizer(texts, truncation=True, max_length=model_config.max_model_len)["input_ids"]
        outputs: dict[str, np.ndarray] = {}
        step: list[NewRequestData] = []
        budget = max_num_batched_tokens
        for i, ids in enumerate(encoded):
            if step and (len(ids) > budget or len(step) == max_num_seqs):
                outputs.update(run_step(step))
                step, budget = [], max_num_batched_tokens
            step.append(NewRequestData(str(i), ids, [], None, params, [], 0))
            budget -= len(ids)
        if step:
            outputs.update(run_step(step))
        return np.stack([outputs[str(i)] for i in range(len(texts))])

    return embed


def embed_with_llm(model_dir: Path, max_num_batched_tokens: int, max_num_seqs: int) -> Callable[[list[str]], np.ndarray]:
    """LLM.embed: the multiprocess engine over the shm rings (shut down at interpreter exit)."""
    from shmvllm.entrypoints.llm import LLM

    llm = LLM(model=str(model_dir), task="embed", max_num_batched_tokens=max_num_batched_tokens,
              max_num_seqs=max_num_seqs)
    return lambda texts: np.stack([o.outputs.numpy() for o in llm.embed(texts, use_tqdm=False)])


def timed(embed: Callable[[list], np.ndarray], items: list) -> tuple[float, np.ndarray]:
    embed(items[:64])  # warm-up
    gc.collect()
    started = time.perf_counter()
    vectors = embed(items)
    wall = time.perf_counter() - started
    return getattr(embed, "last_wall", wall), vectors  # a worker reports its own time


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.5 * len(rows)))
    names = [f"{r['task']}: {r['engine']}" for r in rows]
    rates = [r["sentences_per_s"] for r in rows]
    bars = ax.barh(names, rates, color=["#4c72b0" if r["engine"].startswith("shmvllm") else "#999999" for r in rows])
    ax.bar_label(bars, fmt="%.1f", padding=3)
    ax.set_xlim(0, max(rates) * 1.15)
    ax.set_xlabel("sentences (embed) or pairs (rerank) / s, higher is better")
    ax.set_title(f"all-MiniLM-L6-v2 [{rows[0]['isa']}]: {rows[0]['sentences']} sentences, {MIN_TOKENS}-{MAX_TOKENS} tokens", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sentences", type=int, default=10_000)
    parser.add_argument("--quick", action="store_true", help="2,000 sentences")
    parser.add_argument("--st-batch-size", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--max-num-seqs", type=int, default=1024)
    parser.add_argument("--engine", choices=["llm", "runner"], default="llm",
                        help="llm: LLM.embed through the engine process; runner: the model runner in this process")
    parser.add_argument("--rounds", type=int, default=1, help="alternate the engines this often; report each one's median")
    parser.add_argument("--st-onnx-python", help="a python with sentence-transformers[onnx]: adds its ONNX backend's row")
    parser.add_argument("--reranker-pairs", type=int, default=0, help="add the reranker rows over this many pairs")
    parser.add_argument("--onnx-worker", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--json", help="write the result rows to this JSON file")
    parser.add_argument("--plot", help="draw the rows into this PNG file")
    args = parser.parse_args()
    if args.onnx_worker:
        model_dir, texts_file, batch_size = args.onnx_worker
        onnx_worker(model_dir, texts_file, int(batch_size))
        return
    n = 2_000 if args.quick else args.sentences

    from transformers import AutoTokenizer

    from shmvllm.model.registry import resolve_model_dir

    model_dir = resolve_model_dir(MODEL)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = make_sentences(n, tokenizer.get_vocab())
    lengths = [len(ids) for ids in tokenizer(texts)["input_ids"]]
    print(f"{n} sentences, {min(lengths)}-{max(lengths)} tokens, {np.mean(lengths):.1f} on average; "
          f"torch threads {torch.get_num_threads()}")

    if args.engine == "llm":
        ours_name, ours = "shmvllm", embed_with_llm(model_dir, args.max_num_batched_tokens, args.max_num_seqs)
    else:
        ours_name, ours = "shmvllm-runner", embed_with_runner(model_dir, args.max_num_batched_tokens, args.max_num_seqs)
    engines = [
        (f"sentence-transformers (batch {args.st_batch_size})", embed_with_sentence_transformers(model_dir, args.st_batch_size)),
        (ours_name, ours),
    ]
    if args.st_onnx_python:
        texts_file = Path(tempfile.mkdtemp()) / "texts.json"
        texts_file.write_text(json.dumps(texts))
        engines.append((f"sentence-transformers ONNX (batch {args.st_batch_size})",
                        embed_with_onnx_worker(args.st_onnx_python, model_dir, texts_file, args.st_batch_size)))
    tasks: list[tuple[str, str, Callable, list]] = [("embed", name, fn, texts) for name, fn in engines]
    if args.reranker_pairs:
        from sentence_transformers import CrossEncoder

        from shmvllm.entrypoints.llm import LLM

        reranker_dir = make_reranker(model_dir, Path(tempfile.mkdtemp()) / "reranker")
        pairs = rerank_pairs(texts, args.reranker_pairs)
        cross_encoder = CrossEncoder(str(reranker_dir), device="cpu")
        llm = LLM(model=str(reranker_dir), max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs)
        tasks.append(("rerank", f"CrossEncoder.predict (batch {args.st_batch_size})",
                      lambda p: np.asarray(cross_encoder.predict(p, batch_size=args.st_batch_size)), pairs))
        tasks.append(("rerank", "shmvllm LLM.score",
                      lambda p: np.array([o.outputs.score for o in llm.score([q for q, _ in p], [d for _, d in p], use_tqdm=False)]), pairs))
    walls: list[list[float]] = [[] for _ in tasks]
    results: list[np.ndarray] = []
    for round_ in range(args.rounds):  # alternating, so that a noisy neighbour hits every engine
        for i, (kind, name, fn, items) in enumerate(tasks):
            wall, vectors = timed(fn, items)
            walls[i].append(wall)
            if round_ == 0:
                results.append(vectors)
            print(f"{kind} {name:>42}: {wall:7.2f} s  {len(items) / wall:7.1f} items/s", flush=True)
    rows = []
    for (kind, name, _, items), times in zip(tasks, walls):
        median = float(np.median(times))
        rows.append({"task": kind, "engine": name, "sentences": len(items), "wall_s": round(median, 3),
                     "walls_s": [round(t, 3) for t in times],
                     "sentences_per_s": round(len(items) / median, 1), "isa": isa_label()})
    rate = {r["engine"]: r["sentences_per_s"] for r in rows}
    st_name = engines[0][0]
    cosine = _cosines(results[0], results[1])
    print(f"min cosine between shmvllm and sentence-transformers: {cosine.min():.6f}")
    checks = [(f"{ours_name} / {st_name}", rate[ours_name] / rate[st_name], 1.3)]
    if args.st_onnx_python:
        checks.append((f"{ours_name} / {engines[2][0]}", rate[ours_name] / rate[engines[2][0]], 1.0))
    if args.reranker_pairs:
        rerank = [r for r in rows if r["task"] == "rerank"]
        checks.append(("shmvllm LLM.score / CrossEncoder.predict", rerank[1]["sentences_per_s"] / rerank[0]["sentences_per_s"], 1.2))
        print(f"max |score difference| shmvllm vs CrossEncoder: {np.abs(results[-1] - results[-2]).max():.2e}")
    for label, ratio, target in checks:
        print(f"ratio {label}: {ratio:.3f}x")
        print(f"CHECK {label} >= {target}x [{isa_label()}]: {'PASS' if ratio >= target else 'FAIL'} ({ratio:.3f}x)")
    for path in (args.json, args.plot):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    if args.plot:
        plot(rows, args.plot)


def isa_label() -> str:
    """Which vector ISA torch, oneDNN and MKL (the torch peer's GEMMs) were held to."""
    capped = [f"{k}={os.environ[k]}" for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
              if os.environ.get(k)]
    return ", ".join(capped) or f"native ({torch.backends.cpu.get_cpu_capability()})"


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


if __name__ == "__main__":
    main()
