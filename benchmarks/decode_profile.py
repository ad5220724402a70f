"""Where a single-request decode step of the default model (SmolLM2-135M, Q4_1 layers, Q8_0 tied
lm_head) spends its time, in one process, on the quantized kernels' build for this CPU (or
``SHMVLLM_QUANT_ISA``).

Measured, each as the median over interleaved repetitions:
- the read-bandwidth probe (`shm_read_probe`, 256 MiB, 1 and 2 threads);
- the phases of one decode token as the model runner calls them: the embedding lookup, the
  native step (`DecodeStep.run`: all 30 layers and the final norm), the lm_head GEMV
  (`compute_logits`), the greedy pick (argmax); at a short context and at 4,096 tokens;
- each kernel alone, called from Python over all 30 layers' weights in turn (so that the weights
  stream from memory as in a step): the four GEMVs, the lm_head, attention, the small ops; and a
  GEMV too small to split, to price an OpenMP parallel region's entry and exit;
- GB/s of weights read by each GEMV and by the whole token.

    flock /tmp/shmvllm-cpu.lock python benchmarks/decode_profile.py [--json PATH]

`--step-stages` runs the profiling build of the step (decode_step.c compiled with
-DSHM_STEP_PROFILE: each thread's time in each stage of a layer, qkv GEMV, the wait at the barrier
after it, rotary + KV write, attention, o GEMV, ...) instead, and prints ms a token per thread: the
step alone at each context, then latency.py's decode as greedy bursts (row "burst": the step's
stages plus the embedding, the greedy lm_head and the pick).

`--engine` times a whole token instead, as `benchmarks/latency.py` decodes it (its prompt, 128
greedy tokens, prefix caching off): the engine in this process (`multiprocess=False`), with
timers on the pieces the model runner calls (ms per decoded token: the native burst, the native
step and lm_head of a token decoded outside a burst, the sampler, input preparation, the KV
blocks' zeroing, the rest of `execute_model`, the engine loop around it), then the same request
with the engine in its own process (the difference: the rings and the frontend).

`--layouts` times the native step (150-token context) on the layers' Q4_1 blocks as the file's
rows and as the loader repacks them (quant.Q4_1_R8, the 8-row GEMV pass's interleave), the two
alternating in rounds in this process, and checks that the two give the same bits.

`--prefill` times latency.py's time to first token instead (its 85-token prompt, a 1-token
request, prefix caching off), by piece: the engine in this process with timers on what the model
runner calls (each layer's four GEMMs by shape, attention, rotary, the norms, the rest of a layer's
Python, the embedding, the lm_head row, the sampler, input preparation, the KV blocks' zeroing, the
engine around execute_model, the frontend around the engine), then the same request with the
engine in its own process; each round's request follows `--gap` seconds of idle or of the read
probe (`--gap-probe`: what latency.py's other workers do between two of ours), and every round's
figure is printed so that modes show.

`--cpu-time` times with the calling thread's CPU time instead of the wall clock: with
OMP_NUM_THREADS=1 (the step's team is then the calling thread alone) that is the work a token
costs, whatever else the machine runs; the probe stays on the wall clock.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import statistics
import time
from typing import Any, Callable, Optional

import numpy as np
import torch

from shmvllm import envs
from shmvllm.engine.arg_utils import EngineArgs
from shmvllm.model.attention import build_attention_metadata
from shmvllm.model import kernels as kernel_builds
from shmvllm.model.kernels import cpu_kernels, quant_isas_supported, quant_kernels
from shmvllm.model.linear import Linear
from shmvllm.model.loader import get_model
from shmvllm.model.registry import resolve_model_dir
from shmvllm.worker.huge_pages import huge_page_buffer

BLOCK = 16
CONTEXTS = (150, 4096)
ENGINE_TOKENS = 128  # latency.py's request
CLOCK = time.perf_counter
WALL = time.perf_counter


def read_probe(threads: int, mib: int = 256, reps: int = 5) -> float:
    """GB/s of a streaming read of `mib` MiB by `threads` threads (best of `reps`)."""
    lib = quant_kernels()
    buf = torch.ones(mib << 20, dtype=torch.uint8)
    best = 0.0
    for _ in range(reps):
        started = WALL()
        lib.shm_read_probe(buf.data_ptr(), buf.numel(), threads)
        best = max(best, buf.numel() / (WALL() - started) / 1e9)
    return best


def _median_time(fn: Callable[[], Any], calls: int) -> float:
    times = []
    for _ in range(calls):
        started = CLOCK()
        fn()
        times.append(CLOCK() - started)
    return statistics.median(times)


def _bytes(linear: Any) -> int:
    return sum(part.data.numel() for _, part in linear.blocks)


class Setup:
    """The model with a KV cache of `max_context` tokens; decode steps at any context up to it."""

    def __init__(self, max_context: int) -> None:
        config = EngineArgs(model=str(resolve_model_dir("smollm2-135m-instruct")), max_model_len=max_context + 16)
        self.model = get_model(config.create_engine_config().model_config)
        layers = self.model.attention_layers()
        self.blocks = -(-(max_context + 1) // BLOCK)
        shape = (layers[0].num_kv_heads, self.blocks, BLOCK, layers[0].head_dim)
        gen = torch.Generator().manual_seed(0)
        # on huge pages, as the engine's cache (model_runner.py)
        caches = huge_page_buffer(2 * len(layers) * math.prod(shape) * 4).view(torch.float32).view(-1, *shape)
        for layer, k_cache, v_cache in zip(layers, caches[0::2], caches[1::2]):
            layer.k_cache = k_cache.copy_(torch.randn(shape, generator=gen) * 0.5)
            layer.v_cache = v_cache.copy_(torch.randn(shape, generator=gen) * 0.5)
        self.step = self.model.model.decode_step

    def inputs(self, context: int) -> tuple[torch.Tensor, torch.Tensor, Any]:
        pos = context - 1
        table = np.arange(self.blocks, dtype=np.int32)[None, :]
        meta = build_attention_metadata(np.array([1]), np.array([pos]), table, np.array([pos]), BLOCK, torch.device("cpu"))
        return torch.tensor([17]), torch.tensor([pos]), meta


def phases(setup: Setup, context: int, tokens: int) -> dict[str, float]:
    ids, positions, meta = setup.inputs(context)
    model = setup.model
    embed = model.model.embed_tokens
    times: dict[str, list[float]] = {"embed": [], "step": [], "lm_head": [], "argmax": []}
    with torch.inference_mode():
        for _ in range(tokens):
            t0 = CLOCK()
            hidden = embed(ids)
            t1 = CLOCK()
            out = setup.step.run(hidden, positions, meta)
            t2 = CLOCK()
            logits = model.compute_logits(out)
            t3 = CLOCK()
            logits.argmax(dim=-1)
            t4 = CLOCK()
            for key, value in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                times[key].append(value)
    return {key: statistics.median(values) for key, values in times.items()}


def layouts(setup: Setup, rounds: int, tokens: int) -> dict[str, list[float]]:
    """ms a step (median of `tokens` steps) per round on the file's rows and on the repacked
    blocks, alternating; the step's output must be the same bits on both."""
    model = setup.model
    linears = [m for m in model.modules() if isinstance(m, Linear) and m.blocks and m is not model.lm_head]
    tables = {"rows": {id(m): [(o, w.plain()) for o, w in m.blocks] for m in linears},
              "repacked": {id(m): m.blocks for m in linears}}
    ids, positions, meta = setup.inputs(CONTEXTS[0])
    times: dict[str, list[float]] = {name: [] for name in tables}
    with torch.inference_mode():
        hidden = model.model.embed_tokens(ids)
        outputs = {}
        for _ in range(rounds):
            for name, table in tables.items():
                for m in linears:
                    m.blocks = table[id(m)]
                setup.step._table = None  # laid out again on these blocks
                outputs[name] = setup.step.run(hidden.clone(), positions, meta)  # the step adds into its input
                times[name].append(_median_time(lambda: setup.step.run(hidden.clone(), positions, meta), tokens) * 1e3)
            if not torch.equal(outputs["rows"], outputs["repacked"]):
                raise AssertionError("the step's output differs between the rows and the repacked blocks")
    return times


STAGES = ("fork", "qkv", "qkv_wait", "rope_kv", "rope_kv_wait", "attention", "attention_wait", "o", "o_wait",
          "gate_up", "gate_up_wait", "glu", "down", "down_wait", "final", "final_wait", "head", "head_wait", "pick")
BURST = 8  # the engine's default SHMVLLM_DECODE_BURST
PROMPT = 85  # latency.py's prompt


def step_stages(setup: Setup, isa: str, context: Optional[int], tokens: int) -> list[dict[str, float]]:
    """Each thread's ms a token in each stage of the native step (the profiling build), and the
    step's wall time a token as the caller sees it ("call"). context None: latency.py's decode
    instead, greedy bursts of BURST tokens from position PROMPT on (fork: the embedding and the
    team's start; head: the greedy lm_head; pick: the argmax over its chunks)."""
    flags = next(f for name, _, f in kernel_builds.QUANT_ISAS if name == isa)
    signatures = {**kernel_builds._QUANT_SIGNATURES, "shm_step_profile": (ctypes.c_int, [ctypes.c_void_p])}
    lib = kernel_builds._build(f"quant_kernels-{isa}-profile", kernel_builds.STEP_SOURCE,
                               kernel_builds._QUANT_BASE_FLAGS + flags + ["-DSHM_STEP_PROFILE"], signatures,
                               (kernel_builds.QUANT_SOURCE, kernel_builds.QUANT_FORMATS_SOURCE,
                                kernel_builds.QUANT_INT8_SOURCE, kernel_builds.QUANT_GEMM_INT8_SOURCE,
                                kernel_builds.ATTENTION_HEADER, kernel_builds.MOE_SOURCE,
                                kernel_builds.GREEDY_HEAD_SOURCE))
    step = setup.step
    shipped, step.quant, step._table, step._burst = step.quant, lib, None, None
    sums = np.zeros((8, len(STAGES)), dtype=np.int64)
    calls = []
    try:
        with torch.inference_mode():
            if context is None:
                table = np.arange(setup.blocks, dtype=np.int32)
                tokens = tokens // BURST * BURST
                for warm in (True, False):
                    lib.shm_step_profile(sums.ctypes.data)
                    token = 17
                    for position in range(PROMPT, PROMPT + tokens, BURST):
                        started = WALL()
                        token = setup.model.decode_burst(token, position, table, BURST, [], [], 0, None)[-1]
                        calls.append((WALL() - started) / BURST)
                    if warm:
                        calls.clear()
            else:
                ids, positions, meta = setup.inputs(context)
                hidden = setup.model.model.embed_tokens(ids)
                for warm in (True, False):
                    lib.shm_step_profile(sums.ctypes.data)
                    for _ in range(tokens):
                        started = WALL()
                        step.run(hidden.clone(), positions, meta)
                        calls.append(WALL() - started)
                    if warm:
                        calls.clear()
            lib.shm_step_profile(sums.ctypes.data)
    finally:
        step.quant, step._table, step._burst = shipped, None, None
    threads = torch.get_num_threads()
    rows = [dict(zip(STAGES, (sums[t] / tokens / 1e6).tolist())) for t in range(threads)]
    for row in rows:
        row["call"] = statistics.median(calls) * 1e3
    return rows


def kernels(setup: Setup, calls: int) -> dict[str, dict[str, float]]:
    """Each GEMV over all layers' weights in turn (s per layer and GB/s), the lm_head, attention
    at each context, the small ops, and the price of a parallel region."""
    lib = quant_kernels()
    cpu = cpu_kernels()
    model = setup.model
    layers = model.model.layers
    hidden = layers[0].input_layernorm.weight.shape[0]
    x = torch.randn(1, 1536)
    out = torch.empty(1, 49152)
    result: dict[str, dict[str, float]] = {}

    def gemv(linear: Any) -> None:
        k = linear.in_features
        for offset, part in linear.blocks:
            lib.shm_qgemm(out.data_ptr() + 4 * offset, linear.out_features, x.data_ptr(), k, part.data.data_ptr(),
                          part.data.shape[1], part.qtype, None, None, 0, 1, part.n, k)

    kinds = {
        "qkv": [l.self_attn.qkv_proj for l in layers], "o": [l.self_attn.o_proj for l in layers],
        "gate_up": [l.mlp.gate_up_proj for l in layers], "down": [l.mlp.down_proj for l in layers],
        "lm_head": [model.lm_head],
    }
    for name, linears in kinds.items():
        per_pass = _median_time(lambda: [gemv(lin) for lin in linears], calls)
        nbytes = sum(_bytes(lin) for lin in linears)
        result[name] = {"s_per_call": per_pass / len(linears), "calls_per_token": len(linears),
                        "s_per_token": per_pass, "gb_per_s": nbytes / per_pass / 1e9, "bytes_per_token": nbytes}
    # a 64 x 1024 Q8_0 GEMV (65,536 weights: just at the parallel threshold) against one just
    # below it (one thread, no region): the difference is a region's entry + exit + split
    small = torch.randint(0, 255, (64, 32 * 34), dtype=torch.uint8)
    small[:, ::34] = 0
    small[:, 1::34] = 0x20  # fp16 scale 2^-7 in each block
    for name, rows in (("region_gemv_64x1024", 64), ("serial_gemv_63x1024", 63)):
        result[name] = {"s_per_call": _median_time(
            lambda: lib.shm_qgemm(out.data_ptr(), 64, x.data_ptr(), 1024, small.data_ptr(), 34, 8, None, None, 0, 1, rows, 1024),
            calls * 20)}
    attn = layers[0].self_attn
    q = torch.randn(1, attn.q_size + 2 * attn.kv_size)
    o = torch.empty(1, attn.q_size)
    table = torch.arange(setup.blocks, dtype=torch.int32)
    rows = torch.zeros(1, dtype=torch.int64)
    for context in CONTEXTS:
        lens = torch.tensor([context], dtype=torch.int32)

        def attention() -> None:
            for l in layers:
                a = l.self_attn.attn
                cpu.shm_paged_decode_attention(o.data_ptr(), attn.q_size, q.data_ptr(), q.shape[1], rows.data_ptr(), 1,
                                               a.k_cache.data_ptr(), a.v_cache.data_ptr(), setup.blocks * BLOCK,
                                               table.data_ptr(), setup.blocks, lens.data_ptr(), BLOCK, a.num_heads,
                                               a.num_kv_heads, a.head_dim, a.scale)

        per_pass = _median_time(attention, calls)
        result[f"attention_{context}"] = {"s_per_call": per_pass / len(layers), "calls_per_token": len(layers), "s_per_token": per_pass}
    h = torch.randn(1, hidden)
    w = layers[0].input_layernorm.weight
    gu = torch.randn(1, 3072)
    act = torch.empty(1, 1536)
    small_ops = {
        "rms_norm": lambda: cpu.shm_rms_norm(o.data_ptr(), h.data_ptr(), w.data_ptr(), 1, hidden, 1e-5),
        "silu_mul": lambda: cpu.shm_silu_and_mul(act.data_ptr(), gu.data_ptr(), 1, 1536),
    }
    for name, fn in small_ops.items():
        result[name] = {"s_per_call": _median_time(fn, calls * 20)}
    result["ctypes_call"] = {"s_per_call": _median_time(lambda: lib.shm_qvector_width(), calls * 20)}
    return result


def piece_timer(spent: dict[str, float], nested_apart: bool) -> Callable[..., Callable[[], None]]:
    """`timed(owner, name, key)`: wraps owner.name so that each call adds its wall time to
    spent[key] (key a string, or a function of the call's arguments) and returns the undo; with
    `nested_apart` a piece's time leaves out the timed pieces it calls. A tree without that
    attribute (a baseline run) is left as it is."""
    stack: list[float] = []  # per open call: the time its timed callees took

    def timed(owner: Any, name: str, key: Callable[..., str] | str) -> Callable[[], None]:
        original = getattr(owner, name, None)
        if original is None:
            return lambda: None

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            stack.append(0.0)
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                took = time.perf_counter() - started
                inner = stack.pop()
                label = key(*args) if callable(key) else key
                spent[label] = spent.get(label, 0.0) + took - (inner if nested_apart else 0.0)
                if stack:
                    stack[-1] += took

        setattr(owner, name, wrapper)
        return lambda: setattr(owner, name, original)

    return timed


def engine_token(rounds: int) -> dict[str, dict[str, float]]:
    """ms per decoded token of latency.py's request, by piece (in-process), and end to end with
    the engine in-process and in its own process; medians over `rounds` (1-token and 128-token
    requests alternating, a 128-token request's time less its 1-token one's, over 127 tokens)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    import latency
    from shmvllm import LLM, SamplingParams
    from shmvllm.model import decode_step, decoder, sampler
    from shmvllm.worker import model_runner

    spent: dict[str, float] = {}
    timed = piece_timer(spent, nested_apart=False)

    prompt = latency.prompt_token_ids(latency.shipped_gguf("smollm2-135m-instruct"), True)
    result: dict[str, dict[str, float]] = {}
    for mode in ("in-process", "two processes"):
        undo = [] if mode == "two processes" else [
            timed(decoder.DecoderForCausalLM, "decode_burst", "native burst (step + lm_head + argmax a token)"),
            timed(decode_step.DecodeStep, "run", "native step outside a burst"),
            timed(decoder.DecoderForCausalLM, "compute_logits", "lm_head outside a burst"),
            timed(sampler.Sampler, "__call__", "sampler"),
            timed(model_runner.ModelRunner, "_prepare_inputs", "input preparation"),
            timed(model_runner.ModelRunner, "_zero_new_blocks", "KV blocks' zeroing"),
            timed(model_runner.ModelRunner, "execute_model", "execute_model"),
        ]
        samples: dict[str, list[float]] = {}
        with LLM(model="smollm2-135m-instruct", multiprocess=mode != "in-process", enable_prefix_caching=False) as llm:

            def one(n: int) -> float:
                params = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True)
                started = time.perf_counter()
                llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
                return time.perf_counter() - started

            one(4)
            for _ in range(rounds):
                spent.clear()
                short = one(1)
                before = dict(spent)
                long = one(ENGINE_TOKENS)
                per = {k: (v - 2 * before.get(k, 0.0)) / (ENGINE_TOKENS - 1) for k, v in spent.items()}
                per["token"] = (long - short) / (ENGINE_TOKENS - 1)
                for k, v in per.items():
                    samples.setdefault(k, []).append(v * 1e3)
        for restore in undo:
            restore()
        medians = {k: statistics.median(v) for k, v in samples.items()}
        if "execute_model" in medians:
            inside = sum(v for k, v in medians.items() if k not in ("token", "execute_model"))
            medians["rest of execute_model"] = medians["execute_model"] - inside
            medians["engine loop around execute_model"] = medians["token"] - medians.pop("execute_model")
        result[mode] = medians
    return result


GEMM_SHAPES = {(960, 576): "qkv GEMM", (576, 576): "o GEMM", (3072, 576): "gate-up GEMM", (576, 1536): "down GEMM"}


def prefill_pieces(rounds: int, gap: float, gap_probe: bool) -> dict[str, Any]:
    """ms of latency.py's 1-token request by piece (in-process, each piece's own time, nested
    pieces taken out of their callers), then its wall time with the engine in its own process;
    medians over `rounds`, and each round's request time."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    import latency
    from shmvllm import LLM, SamplingParams
    from shmvllm.model import attention, decoder, linear, rotary, sampler
    from shmvllm.worker import model_runner

    spent: dict[str, float] = {}
    timed = piece_timer(spent, nested_apart=True)

    def gemm_name(x: torch.Tensor, parts: Any, n: int, *rest: Any) -> str:
        return GEMM_SHAPES.get((n, x.shape[-1]), "lm_head" if n > 10000 else f"GEMM {n}x{x.shape[-1]}")

    prompt = latency.prompt_token_ids(latency.shipped_gguf("smollm2-135m-instruct"), True)
    probe = torch.ones(256 << 20, dtype=torch.uint8) if gap_probe else None
    result: dict[str, Any] = {}
    for mode in ("in-process", "two processes"):
        undo = [] if mode == "two processes" else [
            timed(linear, "block_linear", gemm_name),
            timed(attention.PagedAttention, "forward", "attention (KV write + prefill attention)"),
            timed(rotary.RotaryStep, "apply_", "rotary"),
            timed(decoder.RMSNorm, "forward", "rms norms"),
            timed(decoder.MLP, "forward", "silu-mul and MLP glue"),
            timed(decoder.Attention, "forward", "attention block glue"),
            timed(decoder.DecoderLayer, "forward", "layer glue"),
            timed(decoder.DecoderModel, "forward", "embedding, rotary tables, model glue"),
            timed(decoder.DecoderForCausalLM, "compute_logits", "compute_logits glue"),
            timed(sampler.Sampler, "__call__", "sampler"),
            timed(model_runner.ModelRunner, "_prepare_inputs", "input preparation"),
            timed(model_runner.ModelRunner, "_zero_new_blocks", "KV blocks' zeroing"),
            timed(model_runner.ModelRunner, "execute_model", "rest of execute_model"),
        ]
        samples: dict[str, list[float]] = {}
        with LLM(model="smollm2-135m-instruct", multiprocess=mode != "in-process", enable_prefix_caching=False) as llm:
            params = SamplingParams(temperature=0.0, max_tokens=1, min_tokens=1, ignore_eos=True)

            def one() -> float:
                started = time.perf_counter()
                llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
                return time.perf_counter() - started

            one()
            one()
            for _ in range(rounds):
                if probe is not None:
                    for _ in range(3):
                        quant_kernels().shm_read_probe(probe.data_ptr(), probe.numel(), torch.get_num_threads())
                time.sleep(gap)
                spent.clear()
                total = one()
                pieces = dict(spent)
                pieces["engine loop and frontend"] = total - sum(pieces.values())
                pieces["TTFT"] = total
                for k, v in pieces.items():
                    samples.setdefault(k, []).append(v * 1e3)
        for restore in undo:
            restore()
        gemms = [sum(samples[k][i] for k in samples if k.endswith("GEMM")) for i in range(rounds)] if undo else []
        result[mode] = {"median_ms": {k: statistics.median(v) for k, v in samples.items()},
                        "ttft_ms_each": samples["TTFT"], "gemms_ms_each": gemms}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=200, help="decode steps per context (default 200)")
    parser.add_argument("--calls", type=int, default=30, help="repetitions of each kernel pass (default 30)")
    parser.add_argument("--cpu-time", action="store_true", help="time with the calling thread's CPU time")
    parser.add_argument("--step-stages", action="store_true", help="only the step's stages per thread (profiling build)")
    parser.add_argument("--engine", action="store_true", help="only a whole token in the engine, by piece")
    parser.add_argument("--layouts", action="store_true", help="only the step on the Q4_1 rows against the repacked blocks")
    parser.add_argument("--prefill", action="store_true", help="only latency.py's time to first token, by piece")
    parser.add_argument("--gap", type=float, default=0.5, help="--prefill: idle seconds before each request (default 0.5)")
    parser.add_argument("--gap-probe", action="store_true", help="--prefill: the read probe runs before each request")
    parser.add_argument("--rounds", type=int, default=5, help="--engine / --layouts / --prefill: rounds (default 5)")
    parser.add_argument("--json", help="write the figures to this JSON file")
    args = parser.parse_args()
    if args.cpu_time:
        global CLOCK
        CLOCK = time.thread_time
    isa = envs.SHMVLLM_QUANT_ISA() or quant_isas_supported()[0]
    threads = torch.get_num_threads()
    report: dict[str, Any] = {"isa": isa, "threads": threads, "cpu": _cpu_model(), "clock": "cpu" if args.cpu_time else "wall"}
    if args.prefill:
        report["prefill"] = prefill_pieces(args.rounds, args.gap, args.gap_probe)
        print(f"{report['cpu']}, quantized kernels: {isa}, {threads} threads; TTFT of latency.py's request, ms, "
              f"median of {args.rounds}, each after {args.gap} s{' and the read probe' if args.gap_probe else ''}")
        for mode, r in report["prefill"].items():
            print(f"{mode}: " + ", ".join(f"{k} {v:.2f}" for k, v in r["median_ms"].items()))
            print(f"{mode}: each TTFT " + " ".join(f"{v:.1f}" for v in r["ttft_ms_each"]))
            if r["gemms_ms_each"]:
                print(f"{mode}: each round's layer GEMMs " + " ".join(f"{v:.1f}" for v in r["gemms_ms_each"]))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)
        return
    if args.engine:
        report["engine_ms_per_token"] = engine_token(args.rounds)
        print(f"{report['cpu']}, quantized kernels: {isa}, {threads} threads; ms per decoded token, median of {args.rounds}")
        for mode, pieces in report["engine_ms_per_token"].items():
            print(f"{mode}: " + ", ".join(f"{k} {v:.3f}" for k, v in pieces.items()))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)
        return
    setup = Setup(max(CONTEXTS))
    if args.layouts:
        report["layouts_step_ms"] = layouts(setup, args.rounds, args.tokens)
        print(f"{report['cpu']}, quantized kernels: {isa}, {threads} threads; the step at {CONTEXTS[0]} positions, "
              f"ms (median of {args.tokens} steps) per round, same bits on both")
        for name, values in report["layouts_step_ms"].items():
            print(f"{name:>9}: " + " ".join(f"{v:.3f}" for v in values) + f"  median {statistics.median(values):.3f}")
        rows, repacked = (statistics.median(report["layouts_step_ms"][n]) for n in ("rows", "repacked"))
        print(f"rows / repacked: {rows / repacked:.2f}x")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)
        return
    if args.step_stages:
        report["step_stages"] = {str(c): step_stages(setup, isa, c, args.tokens) for c in CONTEXTS}
        report["step_stages"]["burst"] = step_stages(setup, isa, None, args.tokens)
        print(f"{report['cpu']}, quantized kernels: {isa}, {threads} threads; ms a token per stage, per thread")
        print("context thread " + " ".join(f"{name:>8.8}" for name in STAGES) + "  sum  call")
        for context, rows in report["step_stages"].items():
            for t, row in enumerate(rows):
                total = sum(row[name] for name in STAGES)
                print(f"{context:>7} {t:>6} " + " ".join(f"{row[name]:8.3f}" for name in STAGES)
                      + f" {total:5.2f} {row['call']:5.2f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)
        return
    report["read_gb_per_s"] = {str(t): read_probe(t) for t in (1, 2)}
    report["phases"] = {str(c): phases(setup, c, args.tokens) for c in CONTEXTS}
    report["kernels"] = kernels(setup, args.calls)
    weights = sum(v["bytes_per_token"] for v in report["kernels"].values() if "bytes_per_token" in v)
    report["weight_bytes_per_token"] = weights
    print(f"{report['cpu']}, quantized kernels: {isa}, {threads} threads, {report['clock']} time")
    print("read probe GB/s: " + ", ".join(f"{t} thread(s) {v:.1f}" for t, v in report["read_gb_per_s"].items()))
    for context, ph in report["phases"].items():
        total = sum(ph.values())
        print(f"context {context}: token {total * 1e3:.2f} ms ({weights / total / 1e9:.1f} GB/s of weights): "
              + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in ph.items()))
    for name, k in report["kernels"].items():
        extra = f", {k['s_per_token'] * 1e3:.3f} ms/token, {k['gb_per_s']:.1f} GB/s" if "gb_per_s" in k else (
            f", {k['s_per_token'] * 1e3:.3f} ms/token" if "s_per_token" in k else "")
        print(f"  {name:<22} {k['s_per_call'] * 1e6:8.1f} us/call{extra}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


if __name__ == "__main__":
    main()
