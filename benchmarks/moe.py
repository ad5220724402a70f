"""Mixture-of-experts decode: shmvllm vs llama.cpp on the same Qwen3-MoE GGUF file.

The model: a random Qwen3-MoE of a realistic shape that fits this machine (default 24 layers,
hidden 1024, 16 query / 4 KV heads of 64, 64 experts of intermediate 512, top-8, Q8_0 blocks
everywhere but the norms and the F32 router), with the SmolLM2 vocabulary and tokenizer copied
from the shipped GGUF file so that llama.cpp tokenizes it. Written once (random Q8_0 blocks,
drawn directly: no quantizer pass) to `--gguf-dir` and reused.

Two cases per engine, in the same run, repetitions interleaved (each engine in a worker process
of its own, `latency.Worker`), the same prompts and greedy tokens (EOS ignored) for both:
- one request: a 32-token prompt, then `--tokens` decoded tokens;
- a batch of 16 such requests (16 different prompts) decoded together.
Decode tok/s = generated tokens after the first over (wall of the N-token run - wall of the
1-token run), per case: the prefill and the first token are subtracted out. llama.cpp runs
through llama-cpp-python's low-level API (one context with 16 sequences, one llama_decode per
step for the whole batch, greedy argmax), the same thread count.

Weight bytes read per token: a token reads the attention, norms, router and lm_head weights and
only its top-k experts' (`active`); the dense equivalent reads all the experts. At a batch of 16 a
step reads each expert the batch chose once: the expected distinct experts under uniform routing,
E * (1 - (1 - k/E)^16), give the bytes per step.

    flock /tmp/shmvllm-cpu.lock python benchmarks/moe.py --llama-python .venv-llamacpp/bin/python \\
        --repeats 5 --json benchmarks/results/moe.json --plot benchmarks/results/moe.png
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from latency import Worker, _cpu_model, shipped_gguf  # noqa: E402

PROMPT_TOKENS = 32
BATCH = 16
_TEXT = ("The history of the printing press begins with movable type in East Asia and continues in Europe, where "
         "a goldsmith in Mainz combined a screw press, oil-based ink and metal type cast in a hand mould. ")


@dataclass(frozen=True)
class Shape:
    layers: int = 24
    hidden: int = 1024
    heads: int = 16
    kv_heads: int = 4
    head_dim: int = 64
    experts: int = 64
    top_k: int = 8
    expert_ff: int = 512

    @property
    def name(self) -> str:
        return (f"qwen3moe-L{self.layers}-h{self.hidden}-e{self.experts}x{self.expert_ff}-top{self.top_k}-q8_0")


Q8_0 = 8  # GGML type id
_Q8_BLOCK = 34  # bytes: an fp16 scale and 32 int8 values


def _q8_0(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
    """Random Q8_0 blocks of a weight `shape` (..., k) with values of about `std`: uint8 (..., k/32*34)."""
    *outer, k = shape
    blocks = int(np.prod(outer)) * (k // 32)
    out = np.empty((blocks, _Q8_BLOCK), dtype=np.uint8)
    out[:, :2] = np.full((blocks, 1), np.float16(std / 73.3)).view(np.uint8)  # uniform int8: std 73.3
    out[:, 2:] = rng.integers(-127, 128, size=(blocks, 32), dtype=np.int8).view(np.uint8)
    return out.reshape(*outer, k // 32 * _Q8_BLOCK)


def tensor_bytes(shape: Shape, vocab: int) -> dict[str, int]:
    """Bytes of the file's weights by role (Q8_0: 34 bytes per 32 values; norms and router F32)."""
    q8 = lambda n: n // 32 * _Q8_BLOCK  # noqa: E731
    h, L = shape.hidden, shape.layers
    attn = q8(h * (shape.heads + 2 * shape.kv_heads) * shape.head_dim) + q8(shape.heads * shape.head_dim * h)
    expert = 3 * q8(h * shape.expert_ff)
    norms = 4 * (2 * h + 2 * shape.head_dim)
    return {"attention": L * attn, "router": L * 4 * h * shape.experts, "expert": L * expert,
            "experts_all": L * expert * shape.experts, "lm_head": q8(vocab * h), "embedding_row": q8(h),
            "norms": L * norms + 4 * h}  # the layers' norms and the final one


def write_model(path: Path, shape: Shape, seed: int = 0) -> Path:
    """The random Qwen3-MoE GGUF file, with SmolLM2's tokenizer (written once)."""
    import gguf

    from shmvllm.model.gguf_file import GGUFFile

    if path.exists():
        return path
    source = GGUFFile(shipped_gguf("smollm2-135m-instruct"))
    tokens = source.metadata("tokenizer.ggml.tokens")
    rng = np.random.default_rng(seed)
    h, ff, E = shape.hidden, shape.expert_ff, shape.experts
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    writer = gguf.GGUFWriter(str(tmp), "qwen3moe")
    writer.add_context_length(4096)
    writer.add_embedding_length(h)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(ff)
    writer.add_expert_feed_forward_length(ff)
    writer.add_expert_count(E)
    writer.add_expert_used_count(shape.top_k)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1e6)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model(source.metadata("tokenizer.ggml.model"))
    writer.add_tokenizer_pre(source.metadata("tokenizer.ggml.pre", "default"))
    writer.add_token_list(tokens)
    writer.add_token_types(np.asarray(source.metadata("tokenizer.ggml.token_type")).tolist())
    writer.add_token_merges(source.metadata("tokenizer.ggml.merges"))
    for key, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id), ("padding", writer.add_pad_token_id)):
        value = source.metadata(f"tokenizer.ggml.{key}_token_id")
        if value is not None:
            add(int(value))
    vocab = len(tokens)
    q_rows, kv_rows = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    # (name, shape, std or None for a norm); the matrices' std 1/sqrt(k) keeps activations bounded
    plan: list[tuple[str, tuple[int, ...], Any]] = [("token_embd.weight", (vocab, h), 1.0)]
    for i in range(shape.layers):
        b = f"blk.{i}."
        plan += [(b + "attn_norm.weight", (h,), None), (b + "attn_q.weight", (q_rows, h), h**-0.5),
                 (b + "attn_k.weight", (kv_rows, h), h**-0.5), (b + "attn_v.weight", (kv_rows, h), h**-0.5),
                 (b + "attn_q_norm.weight", (shape.head_dim,), None), (b + "attn_k_norm.weight", (shape.head_dim,), None),
                 (b + "attn_output.weight", (h, q_rows), q_rows**-0.5), (b + "ffn_norm.weight", (h,), None),
                 (b + "ffn_gate_inp.weight", (E, h), "router"), (b + "ffn_gate_exps.weight", (E, ff, h), h**-0.5),
                 (b + "ffn_up_exps.weight", (E, ff, h), h**-0.5), (b + "ffn_down_exps.weight", (E, h, ff), ff**-0.5)]
    plan += [("output_norm.weight", (h,), None), ("output.weight", (vocab, h), h**-0.5)]

    def make(shape_: tuple[int, ...], std: Any) -> np.ndarray:
        if std is None:
            return (1.0 + 0.1 * rng.standard_normal(shape_)).astype(np.float32)
        if std == "router":
            return (rng.standard_normal(shape_) * h**-0.5).astype(np.float32)
        return _q8_0(rng, shape_, std)

    for name, shape_, std in plan:
        nbytes = int(np.prod(shape_)) * 4 if std in (None, "router") else int(np.prod(shape_[:-1])) * shape_[-1] // 32 * _Q8_BLOCK
        if std in (None, "router"):
            writer.add_tensor_info(name, shape_, np.dtype(np.float32), nbytes)
        else:
            writer.add_tensor_info(name, (*shape_[:-1], shape_[-1] // 32 * _Q8_BLOCK), np.dtype(np.uint8), nbytes,
                                   raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, shape_, std in plan:
        writer.write_tensor_data(make(shape_, std))
    writer.close()
    tmp.rename(path)
    return path


def prompts(gguf_path: str) -> list[list[int]]:
    """BATCH prompts of PROMPT_TOKENS token ids: windows of a text tokenized by the file's tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(Path(gguf_path).parent), gguf_file=Path(gguf_path).name)
    ids = tokenizer(_TEXT * 8, add_special_tokens=False)["input_ids"]
    return [ids[i * 7 : i * 7 + PROMPT_TOKENS] for i in range(BATCH)]


# ---------------------------------------------------------------- workers (one engine each)

class _Shmvllm:
    def __init__(self, spec: dict[str, Any]) -> None:
        os.environ.setdefault("OMP_NUM_THREADS", str(spec["threads"]))
        from shmvllm import LLM, SamplingParams

        self.params = SamplingParams
        self.llm = LLM(model=spec["gguf"], enable_prefix_caching=False, max_model_len=512, skip_tokenizer_init=True)

    def run(self, batch: list[list[int]], n: int) -> list[list[int]]:
        params = self.params(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True)
        out = self.llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in out]


class _LlamaCpp:
    """llama.cpp's batched greedy decoding: one context of BATCH sequences, one llama_decode a step."""

    def __init__(self, spec: dict[str, Any]) -> None:
        import llama_cpp as ll

        self.ll = ll
        self._quiet = ll.llama_log_callback(lambda level, text, data: None)  # kept: llama.cpp holds the pointer
        ll.llama_log_set(self._quiet, ctypes.c_void_p())
        ll.llama_backend_init()
        model_params = ll.llama_model_default_params()
        self.model = ll.llama_model_load_from_file(spec["gguf"].encode(), model_params)
        ctx_params = ll.llama_context_default_params()
        ctx_params.n_ctx = 4096
        ctx_params.n_batch = 1024
        ctx_params.n_ubatch = 512
        ctx_params.n_seq_max = BATCH
        ctx_params.n_threads = ctx_params.n_threads_batch = spec["threads"]
        self.ctx = ll.llama_init_from_model(self.model, ctx_params)
        self.vocab = ll.llama_n_vocab(ll.llama_model_get_vocab(self.model))
        self.batch = ll.llama_batch_init(1024, 0, 1)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        batch = self.batch
        for i, (token, pos, seq, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, logits
        batch.n_tokens = len(entries)
        if self.ll.llama_decode(self.ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def _argmax(self, index: int) -> int:
        logits = np.ctypeslib.as_array(self.ll.llama_get_logits_ith(self.ctx, index), shape=(self.vocab,))
        return int(logits.argmax())

    def run(self, batch: list[list[int]], n: int) -> list[list[int]]:
        self.ll.llama_memory_clear(self.ll.llama_get_memory(self.ctx), True)
        entries, last = [], []
        for seq, prompt in enumerate(batch):
            entries += [(t, pos, seq, pos == len(prompt) - 1) for pos, t in enumerate(prompt)]
            last.append(len(entries) - 1)
        self._decode(entries)
        out = [[self._argmax(i)] for i in last]
        for step in range(1, n):
            self._decode([(tokens[-1], len(p) + step - 1, seq, True) for seq, (p, tokens) in enumerate(zip(batch, out))])
            for seq, tokens in enumerate(out):
                tokens.append(self._argmax(seq))
        return out


def _worker(kind: str, spec: dict[str, Any]) -> None:
    """Loads one engine, then answers each "rep" line on stdin with one JSON line on stdout."""
    started = time.perf_counter()
    engine = _Shmvllm(spec) if kind == "shmvllm" else _LlamaCpp(spec)
    load_s = time.perf_counter() - started
    batch, n = spec["prompts"], spec["tokens"]
    engine.run(batch[:1], 2)  # warm-up
    engine.run(batch, 2)
    sys.stdout.write(json.dumps({"load_s": load_s}) + "\n")
    sys.stdout.flush()
    for line in sys.stdin:
        if line.strip() != "rep":
            break
        result = {}
        for case, prompts_ in (("one", batch[:1]), ("batch16", batch)):
            t0 = time.perf_counter()
            engine.run(prompts_, 1)
            t1 = time.perf_counter()
            tokens = engine.run(prompts_, n)
            t2 = time.perf_counter()
            first = t1 - t0
            result[case] = {"decode_tok_per_s": len(prompts_) * (n - 1) / max((t2 - t1) - first, 1e-9),
                            "first_token_s": first, "tokens": tokens}
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()


# ---------------------------------------------------------------- the parent

def _stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _same_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-python", help="a Python with llama-cpp-python (required: llama.cpp is the peer)")
    parser.add_argument("--gguf-dir", default=str(Path.home() / ".cache" / "shmvllm" / "bench"),
                        help="where the random model's GGUF file is written once and reused")
    parser.add_argument("--layers", type=int, default=Shape.layers)
    parser.add_argument("--experts", type=int, default=Shape.experts)
    parser.add_argument("--expert-ff", type=int, default=Shape.expert_ff)
    parser.add_argument("--tokens", type=int, default=32, help="tokens decoded per request (default 32)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repetitions per engine (default 3)")
    parser.add_argument("--json", help="write the results to this JSON file")
    parser.add_argument("--plot", help="draw a PNG to this path")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker, json.loads(args.spec))
        return
    if not args.llama_python:
        parser.error("--llama-python is required (llama.cpp is the peer every CHECK compares with)")
    shape = Shape(layers=args.layers, experts=args.experts, expert_ff=args.expert_ff)
    started = time.perf_counter()
    gguf = str(write_model(Path(args.gguf_dir) / f"{shape.name}.gguf", shape))
    print(f"[moe] model {gguf} ({Path(gguf).stat().st_size / 2**30:.2f} GiB, {time.perf_counter() - started:.0f} s)",
          file=sys.stderr)
    spec = {"gguf": gguf, "threads": args.threads, "prompts": prompts(gguf), "tokens": args.tokens}
    workers = [Worker("shmvllm", "shmvllm", sys.executable, spec, __file__),
               Worker("llama.cpp", "llama.cpp", args.llama_python, spec, __file__)]
    reps: dict[str, list[dict[str, Any]]] = {w.name: [] for w in workers}
    try:
        for i in range(args.repeats):
            for w in workers[i % 2:] + workers[: i % 2]:
                reps[w.name].append(w.rep())
            print(f"[moe] repetition {i + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    finally:
        for w in workers:
            w.close()

    vocab = _vocab_size(gguf)
    parts = tensor_bytes(shape, vocab)
    shared = parts["attention"] + parts["router"] + parts["lm_head"] + parts["embedding_row"] + parts["norms"]
    active = shared + parts["expert"] * shape.top_k
    dense = shared + parts["experts_all"]
    distinct16 = shape.experts * (1 - (1 - shape.top_k / shape.experts) ** BATCH)
    per_step16 = shared + parts["expert"] * distinct16
    rows, checks = {}, []
    for case in ("one", "batch16"):
        rows[case] = {w.name: _stats([r[case]["decode_tok_per_s"] for r in reps[w.name]]) for w in workers}
        ours, peer = rows[case]["shmvllm"]["median"], rows[case]["llama.cpp"]["median"]
        same = [_same_prefix(a, b) for a, b in zip(reps["shmvllm"][-1][case]["tokens"], reps["llama.cpp"][-1][case]["tokens"])]
        rows[case]["same_greedy_prefix"] = same
        ratio = ours / peer
        checks.append(f"CHECK decode tok/s shmvllm/llama.cpp, {case} = {ratio:.2f}x (>= 1.0x): {'PASS' if ratio >= 1.0 else 'FAIL'}")
        print(f"[moe] {case}: shmvllm {ours:.1f} tok/s [{rows[case]['shmvllm']['min']:.1f}, {rows[case]['shmvllm']['max']:.1f}], "
              f"llama.cpp {peer:.1f} tok/s [{rows[case]['llama.cpp']['min']:.1f}, {rows[case]['llama.cpp']['max']:.1f}], "
              f"ratio {ratio:.2f}x; greedy tokens equal for the first {same} of {args.tokens}")
    weights = {"active_bytes_per_token": active, "dense_equivalent_bytes_per_token": dense,
               "active_share": active / dense, "batch16_expected_distinct_experts": distinct16,
               "batch16_bytes_per_step": per_step16, "batch16_bytes_per_token": per_step16 / BATCH}
    print(f"[moe] weight bytes read per token, one request: {active / 2**20:.0f} MiB (top-{shape.top_k} of {shape.experts} "
          f"experts) vs {dense / 2**20:.0f} MiB dense equivalent = {active / dense:.1%}; batch of 16: "
          f"~{distinct16:.1f} distinct experts a layer, {per_step16 / BATCH / 2**20:.0f} MiB a token")
    for line in checks:
        print(line)
    result = {"model": asdict(shape), "gguf": gguf, "file_bytes": Path(gguf).stat().st_size, "threads": args.threads,
              "cpu": _cpu_model(), "tokens": args.tokens, "prompt_tokens": PROMPT_TOKENS, "repeats": args.repeats,
              "decode_tok_per_s": rows, "weights": weights, "checks": checks,
              "load_s": {w.name: w.ready["load_s"] for w in workers}}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    if args.plot:
        plot(result, args.plot)


def _vocab_size(gguf_path: str) -> int:
    from shmvllm.model.gguf_file import GGUFFile

    return len(GGUFFile(gguf_path).metadata("tokenizer.ggml.tokens"))


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    colors = ["tab:green", "tab:orange"]
    for ax, case, title in ((axes[0], "one", "one request"), (axes[1], "batch16", "batch of 16")):
        row = result["decode_tok_per_s"][case]
        names = ["shmvllm", "llama.cpp"]
        med = [row[n]["median"] for n in names]
        err = [[m - row[n]["min"] for m, n in zip(med, names)], [row[n]["max"] - m for m, n in zip(med, names)]]
        ax.bar_label(ax.bar(names, med, yerr=err, capsize=4, color=colors), fmt="%.1f")
        ax.set_title(f"decode tok/s, {title}")
    w = result["weights"]
    labels = ["active (top-k)", "batch 16 / token", "dense equivalent"]
    values = [w["active_bytes_per_token"] / 2**20, w["batch16_bytes_per_token"] / 2**20, w["dense_equivalent_bytes_per_token"] / 2**20]
    axes[2].bar_label(axes[2].bar(labels, values, color=["tab:green", "tab:olive", "tab:gray"]), fmt="%.0f")
    axes[2].set_title("weight MiB read per token")
    axes[2].tick_params(axis="x", rotation=15)
    m = result["model"]
    fig.suptitle(f"Qwen3-MoE {m['layers']} layers, hidden {m['hidden']}, {m['experts']} experts x {m['expert_ff']}, "
                 f"top-{m['top_k']}, Q8_0; {result['threads']} threads")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
