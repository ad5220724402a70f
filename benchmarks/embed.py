"""Embedding throughput: shmvllm against sentence-transformers, in the same run.

    flock /tmp/shmvllm-cpu.lock python benchmarks/embed.py --rounds 2 \
        --json benchmarks/results/embed.json --plot benchmarks/results/embed.png

10,000 deterministic generated sentences of 8-63 tokens (35 on average, [CLS] and [SEP]
included) for all-MiniLM-L6-v2. Both engines are timed end to end from text (tokenization
included) to float32 vectors, after a warm-up; with --rounds N they alternate N times and each
reports its best round (other processes on a shared machine then hit both alike).
sentence-transformers runs `encode` at its best batch size (32; it sorts by length and pads
per batch).

shmvllm (`--engine llm`, the default) is the whole engine as an application uses it:
`LLM(model=..., task="embed").embed(texts)`, the engine in its own process behind the
shared-memory rings, tokenization in the frontend overlapping the engine's compute. Each step
packs the tokens of many sentences with no padding, up to `--max-num-batched-tokens` (16384:
larger steps mean fewer, larger attention calls; ~3% faster than 8192 here) and
`--max-num-seqs`. `--engine runner` instead drives the PoolingModelRunner in this process
(row `shmvllm-runner`): the model alone, without the engine around it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
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


def embed_with_runner(
    model_dir: Path, max_num_batched_tokens: int, max_num_seqs: int
) -> Callable[[list[str]], np.ndarray]:
    """Tokenizer + PoolingModelRunner, steps packed greedily in arrival order up to the token
    budget and the sequence cap (what the scheduler will do for whole pooling prompts)."""
    from transformers import AutoTokenizer

    from shmvllm.config import EngineArgs
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


def timed(embed: Callable[[list[str]], np.ndarray], texts: list[str]) -> tuple[float, np.ndarray]:
    embed(texts[:64])  # warm-up
    started = time.perf_counter()
    vectors = embed(texts)
    return time.perf_counter() - started, vectors


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    names = [r["engine"] for r in rows]
    rates = [r["sentences_per_s"] for r in rows]
    bars = ax.barh(names, rates, color=["#4c72b0" if n.startswith("shmvllm") else "#999999" for n in names])
    ax.bar_label(bars, fmt="%.1f", padding=3)
    ax.set_xlim(0, max(rates) * 1.15)
    ax.set_xlabel("sentences / s (higher is better)")
    ax.set_title(f"all-MiniLM-L6-v2: {rows[0]['sentences']} sentences, {MIN_TOKENS}-{MAX_TOKENS} tokens", fontsize=10)
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
    parser.add_argument("--rounds", type=int, default=1, help="alternate the engines this often; report each one's best")
    parser.add_argument("--json", help="write the result rows to this JSON file")
    parser.add_argument("--plot", help="draw the rows into this PNG file")
    args = parser.parse_args()
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
    walls: list[list[float]] = [[] for _ in engines]
    results: list[np.ndarray] = []
    for round_ in range(args.rounds):  # alternating, so that a noisy neighbour hits both engines
        for i, (name, embed) in enumerate(engines):
            wall, vectors = timed(embed, texts)
            walls[i].append(wall)
            if round_ == 0:
                results.append(vectors)
            print(f"{name:>34}: {wall:7.2f} s  {n / wall:7.1f} sentences/s", flush=True)
    rows = []
    for (name, _), times in zip(engines, walls):
        best = min(times)
        rows.append({"engine": name, "sentences": n, "wall_s": round(best, 3), "sentences_per_s": round(n / best, 1)})
    cosine = np.sum(results[0] * results[1], axis=1) / (
        np.linalg.norm(results[0], axis=1) * np.linalg.norm(results[1], axis=1)
    )
    print(f"ratio {ours_name} / sentence-transformers: {rows[1]['sentences_per_s'] / rows[0]['sentences_per_s']:.3f}x"
          f"  (min cosine between them {cosine.min():.6f})")
    for path in (args.json, args.plot):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
