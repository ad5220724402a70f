"""What the engine process costs: LLM.generate in-process vs multiprocess over shm vs over zmq.

The zmq peer and the timing of the engine's channel calls live in benchmarks/channels.py: both
implement the product's Endpoint interface and are swapped in from outside
(`channels.engine_channel`); the product itself only has the shared-memory rings.

A tiny random Llama (2 layers, hidden 64, SmolLM2's tokenizer; built in a temp dir) keeps the
model's share of a step small, so the frontend/engine channel shows. Two workloads, greedy with
ignore_eos: 1 prompt x 256 tokens and 64 prompts x 64 tokens. All LLMs live side by side and the
repetitions are interleaved (the modes' order rotates from one repetition to the next), so
machine noise hits every mode alike. Each wall time is the median of the repetitions (--stat
min: the fastest, the least disturbed by other programs). torch runs one thread in every mode
(--threads to change it): on a 2-core machine a second intra-op thread in the engine process
would compete with the frontend, and at hidden size 64 it buys nothing.

Each workload runs at two levels:
- generate: `LLM.generate`, the workload a user runs. The frontend detokenizes and builds
  RequestOutputs; in-process that work adds to every step, in multiprocess it overlaps the
  engine's next step, so multiprocess can beat in-process and the overhead come out negative:
  it then says nothing about the transport.
- client: the same requests (tokenized beforehand) straight through the EngineCoreClient, the
  frontend only receiving and decoding each step's outputs. Little is left to overlap, so the
  overhead is what splitting the engine off costs: the channel and the second process.

overhead_us_per_step = (wall - in-process wall of the same level) / engine steps, taken within
each repetition (the in-process run of the same repetition, a few seconds apart) and then the
median over the repetitions (--stat min: fastest wall minus fastest in-process wall);
overhead_iqr_us is the spread of those per-repetition figures (interquartile range); a check
whose margin is inside the medians' ~95% intervals (1.57 IQR / sqrt(repeats)) says so.
channel_us_per_step = the engine busy loop's own time in channel calls (send and try_send,
try_recv with its decoding, and the wake-ups and preemptions they cause) per step, timed inside
the engine process by the TimedEndpoint around its endpoint (the median over the repetitions):
the transport's cost on the engine's critical path. Encoding (the same codec for both) happens
before the send and is not in it. A step-sized sum of tens of µs, it is much steadier than a
difference of walls.

    python benchmarks/e2e_overhead.py [--repeats 30] [--threads 1]
                                      [--stat median|min] [--json out.json] [--plot out.png]

After the table it prints one CHECK line per target, "holds" or "FAILS"
with the figures: shm's overhead per step <= 1/3 of zmq's (engine channel time, client level,
and generate level where zmq's overhead is positive), and multiprocess-over-shm wall <= 1.05x
in-process on 64x64.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import channels  # noqa: E402  (benchmarks/channels.py, next to this file)

WORKLOADS = {"1x256": (1, 256), "64x64": (64, 64)}
_REQUEST_IDS = itertools.count()


def build_tiny_llama(target: Path) -> Path:
    """The same model as the tests' tiny_llama_dir fixture."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from shmvllm.model.registry import resolve_model_dir

    config = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model.eval().save_pretrained(target)
    AutoTokenizer.from_pretrained(resolve_model_dir("smollm2-135m-instruct")).save_pretrained(target)
    return target


def make_llm(model_dir: Path, mode: str, transport: str) -> Any:
    from shmvllm import LLM

    kwargs = dict(max_model_len=512, num_kv_blocks=1024, max_num_seqs=128)
    if mode == "inproc":
        return LLM(str(model_dir), multiprocess=False, **kwargs)
    with channels.engine_channel(channels.CHANNELS[transport]):
        return LLM(str(model_dir), **kwargs)


def _prompts(workload: str) -> tuple[list[str], Any]:
    from shmvllm import SamplingParams

    num_prompts, max_tokens = WORKLOADS[workload]
    prompts = [f"Request {i}: write a long story about the number {i * 7}." for i in range(num_prompts)]
    return prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _generate(llm: Any, workload: str) -> tuple[float, int]:
    prompts, params = _prompts(workload)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - started, sum(len(o.outputs[0].token_ids) for o in outputs)


def _through_client(llm: Any, workload: str) -> tuple[float, int]:
    """The workload's requests, tokenized beforehand, added to the engine client and run until
    all finished; each step's outputs are received and decoded, nothing more."""
    prompts, params = _prompts(workload)
    processor, client = llm.llm_engine.input_processor, llm.llm_engine.engine_core
    requests = [processor.process_inputs(f"client-{next(_REQUEST_IDS)}", p, params)[0] for p in prompts]
    started = time.perf_counter()
    for request in requests:
        client.add_request(request)
    unfinished, tokens = {r.request_id for r in requests}, 0
    while unfinished:
        outputs = client.get_output()
        tokens += len(outputs.token_ids)
        for output in outputs.outputs:
            tokens += len(output.new_token_ids)
            if output.finished:
                unfinished.discard(output.request_id)
    return time.perf_counter() - started, tokens


LEVELS = {"generate": _generate, "client": _through_client}


def _channel_seconds(llm: Any, cfg: tuple[str, str]) -> float:
    """The engine busy loop's time in channel calls so far (0 in-process)."""
    if cfg[0] == "inproc":
        return 0.0
    return channels.engine_channel_seconds(llm.llm_engine.engine_core.addresses)


def run_workload(llm: Any, cfg: tuple[str, str], level: str, workload: str) -> tuple[float, int, int, float]:
    """(wall seconds, output tokens, engine steps, channel seconds) of one run."""
    client = llm.llm_engine.engine_core
    steps_before, channel_before = client.get_stats()["num_steps"], _channel_seconds(llm, cfg)
    wall, tokens = LEVELS[level](llm, workload)
    steps = client.get_stats()["num_steps"] - steps_before
    return wall, tokens, steps, _channel_seconds(llm, cfg) - channel_before


def measure(model_dir: Path, configs: list[tuple[str, str]], repeats: int, stat_name: str) -> list[dict[str, Any]]:
    llms = {cfg: make_llm(model_dir, *cfg) for cfg in configs}
    runs: dict[tuple, list[tuple[float, int, int, float]]] = {}
    try:
        for llm in llms.values():  # warm-up: first-call costs of torch and the tokenizer
            for run_level in LEVELS.values():
                for workload in WORKLOADS:
                    run_level(llm, workload)
        # Every frontend (and the in-process engine) shares this process's heap: keep the
        # collector from walking all of it again and again, which only in-process would pay.
        gc.collect()
        gc.freeze()
        for rep in range(repeats):
            order = configs[rep % len(configs):] + configs[: rep % len(configs)]
            for level in LEVELS:
                for workload in WORKLOADS:
                    for cfg in order:
                        runs.setdefault((level, workload, cfg), []).append(run_workload(llms[cfg], cfg, level, workload))
    finally:
        for cfg, llm in llms.items():
            if cfg[0] != "inproc":
                channels.remove_timing_file(llm.llm_engine.engine_core.addresses)
            llm.shutdown()
    return [
        _row(level, workload, cfg, runs[(level, workload, cfg)], runs[(level, workload, configs[0])], stat_name)
        for level in LEVELS for workload in WORKLOADS for cfg in configs
    ]


def _row(level: str, workload: str, cfg: tuple[str, str], results: list, base: list, stat_name: str) -> dict[str, Any]:
    """One table row from the repetitions of one config and of in-process (`base`), in step."""
    mode, transport = cfg
    walls = [r[0] for r in results]
    steps = results[-1][2]
    paired = [(r[0] - b[0]) / r[2] * 1e6 for r, b in zip(results, base)]
    if stat_name == "min":
        wall, overhead = min(walls), (min(walls) - min(b[0] for b in base)) / steps * 1e6
    else:
        wall, overhead = statistics.median(walls), statistics.median(paired)
    channels = [r[3] / r[2] * 1e6 for r in results]
    channel = statistics.median(channels)
    return {
        "level": level, "mode": mode, "transport": transport, "workload": workload,
        "wall_s": round(wall, 4), "tokens": results[-1][1], "steps": steps, "repeats": len(results),
        "overhead_us_per_step": round(overhead, 1), "overhead_iqr_us": round(_iqr(paired), 1),
        "channel_us_per_step": None if channel != channel else round(channel, 1),
        "channel_iqr_us": None if channel != channel else round(_iqr(channels), 1),
        "walls_s": [round(w, 4) for w in walls],  # per repetition, in order
    }


def _iqr(values: list[float]) -> float:
    if len(values) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(values, n=4)
    return q3 - q1


def print_report(rows: list[dict[str, Any]]) -> None:
    print(f"{'level':<10}{'mode':<13}{'transport':<10}{'workload':<9}{'wall_s':>9}{'tokens':>8}{'steps':>7}"
          f"{'overhead us/step':>18}{'(IQR)':>8}{'channel us/step':>17}")
    for r in rows:
        channel = "-" if r["channel_us_per_step"] is None else f"{r['channel_us_per_step']:.1f}"
        print(f"{r['level']:<10}{r['mode']:<13}{r['transport']:<10}{r['workload']:<9}{r['wall_s']:>9.3f}"
              f"{r['tokens']:>8}{r['steps']:>7}{r['overhead_us_per_step']:>18.1f}{r['overhead_iqr_us']:>8.1f}{channel:>17}")
    print()
    for line in checks(rows):
        print(line)


def _third(what: str, shm: dict[str, Any], zmq: dict[str, Any], key: str) -> str:
    """The check "shm <= zmq / 3" on one measure (`key`, with its `*_iqr_us` spread); not
    applicable when zmq costs nothing; flagged when the margin is inside the noise: the two
    medians' ~95% intervals (1.57 IQR / sqrt(n), as a notched box plot's notch) added in quadrature."""
    iqr_key = key.replace("us_per_step", "iqr_us")
    a, b = shm[key], zmq[key]
    noise = 1.57 * math.hypot(shm[iqr_key], zmq[iqr_key] / 3) / math.sqrt(shm["repeats"])
    figures = f"shm {a:.1f} us, zmq {b:.1f} us (IQR {shm[iqr_key]:.1f} / {zmq[iqr_key]:.1f})"
    if b <= 0:
        return f"CHECK shm <= zmq/3, {what}: not applicable, zmq's overhead is not positive: {figures}"
    verdict = "holds" if a <= b / 3 else "FAILS"
    within = ", margin within the noise" if abs(b / 3 - a) < noise else ""
    return f"CHECK shm <= zmq/3, {what}: {verdict}{within}: {figures}, shm/zmq = {a / b:.2f}"


def checks(rows: list[dict[str, Any]]) -> list[str]:
    """One line per acceptance item and measure."""
    by = {(r["level"], r["workload"], r["transport"]): r for r in rows}
    lines = []
    for workload in WORKLOADS:
        for level in LEVELS:
            shm, zmq = by.get((level, workload, "shm")), by.get((level, workload, "zmq"))
            if shm is None or zmq is None:
                continue
            lines.append(_third(f"{workload} {level}, engine channel time/step", shm, zmq, "channel_us_per_step"))
            lines.append(_third(f"{workload} {level}, overhead/step vs in-process", shm, zmq, "overhead_us_per_step"))
    for level in LEVELS:
        shm, inproc = by.get((level, "64x64", "shm")), by[(level, "64x64", "none")]
        if shm is not None:
            ratio = shm["wall_s"] / inproc["wall_s"]
            lines.append(f"CHECK shm wall <= 1.05x in-process, 64x64 {level}: {'holds' if ratio <= 1.05 else 'FAILS'} "
                         f"(shm {shm['wall_s']:.3f} s, in-process {inproc['wall_s']:.3f} s, {ratio:.3f}x)")
    return lines


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measures = [("generate", "overhead_us_per_step", "generate: overhead"), ("client", "overhead_us_per_step", "client: overhead"),
                ("client", "channel_us_per_step", "engine: channel time")]
    fig, axes = plt.subplots(1, len(WORKLOADS), figsize=(6 * len(WORKLOADS), 4.5))
    for ax, workload in zip(axes, WORKLOADS):
        sel = [r for r in rows if r["workload"] == workload and r["mode"] == "multiprocess"]
        series = sorted({r["transport"] for r in sel})
        width = 0.8 / len(series)
        for k, transport in enumerate(series):
            values = []
            for level, key, _ in measures:
                row = next(r for r in sel if (r["level"], r["transport"]) == (level, transport))
                values.append(row[key] or 0.0)
            xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(measures))]
            ax.bar(xs, values, width, label=transport, color=("tab:green" if transport == "shm" else "tab:red"))
        ax.set_xticks(range(len(measures)), [label for _, _, label in measures])
        ax.axhline(0, color="black", linewidth=0.8)
        ax.set_title(f"{workload}: µs per engine step (vs in-process)")
        ax.set_ylabel("µs / step")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1, help="torch threads in every process")
    parser.add_argument("--stat", choices=("median", "min"), default="median")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--plot", metavar="PATH.png")
    args = parser.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before torch loads; the engine inherits it
    configs = [("inproc", "none")] + [("multiprocess", t) for t in ("shm", "zmq")]
    with tempfile.TemporaryDirectory(prefix="e2e-overhead-") as tmp:
        model_dir = build_tiny_llama(Path(tmp) / "tiny-llama")
        rows = measure(model_dir, configs, args.repeats, args.stat)
    print_report(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
