"""Batch generation (or embedding) over a Ray cluster: one shmvllm engine per replica.

Local (Ray starts a one-node cluster in this process):
    python examples/ray_batch_inference.py --num-prompts 200 --concurrency 2

On a cluster started with `ray start --head` / `ray start --address=HEAD:6379` (shmvllm and the
model installed on every node):
    python examples/ray_batch_inference.py --address auto --concurrency 4 --output out.jsonl

Embedding instead: --task embed --model all-minilm-l6-v2
"""

from __future__ import annotations

import argparse
import json
import os
import time

import ray

from shmvllm.ray import ProcessorConfig, build_processor

TOPICS = ["the moon", "shared memory", "Paris", "a river", "prime numbers", "the ocean", "trains", "tea"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", default=None, help="a running cluster ('auto' or HOST:PORT); default: a local one")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="shmvllm model name or a path present on every node")
    parser.add_argument("--task", choices=["generate", "embed"], default="generate")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=2, help="replicas (one engine each)")
    parser.add_argument("--num-cpus", type=int, default=1, help="CPUs (= engine threads) per replica")
    parser.add_argument("--batch-size", type=int, default=16, help="rows per call of a replica")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--output", default=None, help="write every row as JSON lines here")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    # The replicas import shmvllm; a checkout that is not pip-installed on the nodes travels with
    # the job as PYTHONPATH (the same path must exist on every node).
    env_vars = {"PYTHONPATH": os.environ["PYTHONPATH"]} if os.environ.get("PYTHONPATH") else {}
    ray.init(address=args.address, runtime_env={"env_vars": env_vars} if env_vars else None)
    ray.data.DataContext.get_current().execution_options.preserve_order = True  # rows back in input order

    rows = [{"id": i, "prompt": f"Write one sentence about {TOPICS[i % len(TOPICS)]}."} for i in range(args.num_prompts)]
    if args.task == "generate":
        for row in rows:  # per-row sampling: every third row samples, the others are greedy
            row["sampling_params"] = {"temperature": 0.8 if row["id"] % 3 == 0 else 0.0, "seed": row["id"]}
    config = ProcessorConfig(
        model=args.model,
        task=args.task,
        concurrency=args.concurrency,
        num_cpus=args.num_cpus,
        batch_size=args.batch_size,
        sampling_params={"max_tokens": args.max_tokens} if args.task == "generate" else None,
    )
    ds = build_processor(config)(ray.data.from_items(rows))

    started = time.perf_counter()
    results = ds.take_all()
    elapsed = time.perf_counter() - started
    for row in results[:3]:
        shown = row["generated_text"] if args.task == "generate" else f"embedding of {len(row['embeddings'])} floats"
        print(f"[{row['id']}] {row['prompt']!r} -> {shown!r}")
    extra = f", {sum(r['num_generated_tokens'] for r in results)} tokens generated" if args.task == "generate" else ""
    print(f"{len(results)} rows in {elapsed:.1f} s by {args.concurrency} replicas{extra}")
    if args.output:
        with open(args.output, "w") as f:
            for row in results:
                f.write(json.dumps({k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in row.items()}) + "\n")
    ray.shutdown()


if __name__ == "__main__":
    main()
