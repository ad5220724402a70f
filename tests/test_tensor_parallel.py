"""Tensor parallelism end to end: TP=2 (rank 0 in the engine, rank 1 a worker program; the
all-reduces through the shared-memory arena, or gloo) against TP=1 on tiny random Llama and
Qwen2 models with 2 KV heads (and one with 3, split unevenly); a worker killed mid-generate; an
idle TP=2 engine's CPU; the split itself; knobs refused by name. On GGML blocks: TP=2 against
TP=1 on the shipped SmolLM2 GGUF, on tiny GGUF files in Q4_0 / Q8_0, in Q4_K / Q6_K and in the
later formats (Q5_0 ... MXFP4, a Q3_K o_proj; the 256-value ones' o_proj split falls inside a
block), and on quantization='q8_0'; what each rank builds and holds; a rank's peak memory against a
whole load's; a row-parallel layer's shards summed against the full product."""

from __future__ import annotations

import json
import logging
import os
import random
import re
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from shmvllm import LLM, SamplingParams
from shmvllm.engine.arg_utils import EngineArgs
from shmvllm.engine.exceptions import EngineDeadError
from shmvllm.model.kernels import quant_isa, quant_isas_supported
from shmvllm.model.linear import Linear, VocabEmbedding
from shmvllm.model.loader import get_model
from shmvllm.model.parallel.group import TPGroup
from shmvllm.model.checkpoint import CheckpointTensor
from shmvllm.model.parallel.layers import RowParallelLinear
from shmvllm.model.parallel.split import split_range, split_sizes
from shmvllm.model.quant import FORMAT_IDS, FORMATS, QuantizedWeight
from test_quant_kernels import INT8_GEMM_FORMATS

MAX_MODEL_LEN = 256
MARGIN = 1e-3  # a greedy divergence is forgiven only where TP=1's top-2 logits are this close
LOGPROB_TOL = 1e-4
INT8_GEMM_LOGPROB_TOL = 1e-3

needs_blocks = pytest.mark.skipif(not quant_isas_supported(), reason="the quantized kernels could not be built")


def mixed_prompts(n: int = 32) -> list[dict]:
    """Token-id prompts of 3..90 tokens; half share a 40-token prefix (prefix-cache hits)."""
    rng = random.Random(0)
    shared = [rng.randrange(3, 49000) for _ in range(40)]
    prompts = []
    for i in range(n):
        tail = [rng.randrange(3, 49000) for _ in range(rng.randint(3, 50))]
        prompts.append({"prompt_token_ids": (shared + tail) if i % 2 else tail})
    return prompts


def params_for(n: int = 32) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=8 + (i * 7) % 25, ignore_eos=True, logprobs=2) for i in range(n)]


def run(model_dir: Path, tp: int, multiprocess: bool) -> tuple[list, dict]:
    # 40 blocks of 16 tokens for 32 requests of up to ~120 tokens: the scheduler preempts
    with LLM(model=str(model_dir), multiprocess=multiprocess, max_model_len=MAX_MODEL_LEN, num_kv_blocks=40,
             tensor_parallel_size=tp) as llm:
        outputs = llm.generate(mixed_prompts(), params_for(), use_tqdm=False)
        stats = llm.llm_engine.engine_core.get_stats()
    return outputs, stats


def assert_same_greedy(reference: list, candidate: list, logprob_tol: float = LOGPROB_TOL) -> None:
    """Same tokens up to a divergence at a top-2 margin < MARGIN, logprobs within logprob_tol."""
    forgiven = 0
    for ref, got in zip(reference, candidate):
        ref_c, got_c = ref.outputs[0], got.outputs[0]
        for pos, (a, b) in enumerate(zip(ref_c.token_ids, got_c.token_ids)):
            top = sorted(ref_c.logprobs[pos].values(), key=lambda lp: -lp.logprob)
            if a != b:
                margin = top[0].logprob - top[1].logprob
                assert margin < MARGIN, f"request {ref.request_id}: token {pos} differs ({a} vs {b}) at margin {margin}"
                forgiven += 1
                break
            ref_lp, got_lp = ref_c.logprobs[pos][a].logprob, got_c.logprobs[pos][b].logprob
            assert abs(ref_lp - got_lp) < logprob_tol, f"request {ref.request_id}: logprob {pos}: {ref_lp} vs {got_lp}"
        else:
            assert len(ref_c.token_ids) == len(got_c.token_ids)
    assert forgiven <= 2, f"{forgiven} forgiven divergences"


@pytest.fixture(scope="module")
def tiny_uneven_llama_dir(tmp_path_factory, smollm2_dir) -> Path:
    """3 KV heads (6 query heads) and an intermediate size of 130: over 2 ranks every split is uneven,
    as SmolLM2-135M's 3 KV heads are."""
    from transformers import LlamaConfig

    from conftest import _save_tiny_causal_lm

    config = LlamaConfig(
        vocab_size=49152, hidden_size=96, intermediate_size=130, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=1024,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )
    return _save_tiny_causal_lm(config, smollm2_dir, tmp_path_factory.mktemp("tiny-uneven-llama"))


@pytest.mark.parametrize(
    "model, allreduce",
    [("tiny_llama_dir", "shm"), ("tiny_qwen2_dir", "shm"), ("tiny_qwen2_dir", "gloo"), ("tiny_uneven_llama_dir", "shm")],
)
def test_tp2_greedy_equals_tp1_with_preemption_and_prefix_hits(model, allreduce, request, monkeypatch):
    monkeypatch.setenv("SHMVLLM_TP_ALLREDUCE", allreduce)
    model_dir = request.getfixturevalue(model)
    reference, _ = run(model_dir, 1, multiprocess=False)
    outputs, stats = run(model_dir, 2, multiprocess=model == "tiny_llama_dir")  # the others in-process
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0, stats
    assert_same_greedy(reference, outputs)


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except (OSError, IndexError):
                pass
    return found


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


def _segments_of(pids: list[int]) -> list[str]:
    return [p.name for p in Path("/dev/shm").iterdir() if any(f"ipcring-{pid}-" in p.name for pid in pids)]


def test_idle_tp2_engine_sleeps_and_a_killed_worker_ends_the_engine(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), multiprocess=True, max_model_len=MAX_MODEL_LEN, num_kv_blocks=64,
              tensor_parallel_size=2)
    client = llm.llm_engine.engine_core
    engine = client.engine_pid
    workers = _children(engine)
    try:
        assert len(workers) == 1, workers
        llm.generate(["warm up"], SamplingParams(max_tokens=4), use_tqdm=False)
        time.sleep(0.5)
        pids = [engine, *workers]
        before = sum(map(_cpu_seconds, pids))
        time.sleep(5.0)
        used = sum(map(_cpu_seconds, pids)) - before
        assert used < 0.05 * 5.0, f"an idle TP=2 engine used {used:.3f} CPU-s in 5 s"

        killed_at: list[float] = []

        def kill_worker() -> None:
            time.sleep(1.0)
            killed_at.append(time.monotonic())
            os.kill(workers[0], signal.SIGKILL)

        threading.Thread(target=kill_worker, daemon=True).start()
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        with pytest.raises(EngineDeadError):
            llm.generate([f"request {i}" for i in range(16)] * 4, params, use_tqdm=False)
        raised_at = time.monotonic()
        assert killed_at, "generate ended before the worker was killed"
        assert raised_at - killed_at[0] < 2.0, f"EngineDeadError {raised_at - killed_at[0]:.2f} s after the kill"
    finally:
        llm.shutdown() if hasattr(llm, "shutdown") else llm.__exit__(None, None, None)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and not all(_gone(p) for p in [engine, *workers]):
        time.sleep(0.05)
    assert all(_gone(p) for p in [engine, *workers])
    assert _segments_of([engine, *workers]) == []


def test_split_covers_everything_once():
    for n in (1, 2, 3, 9, 130, 49152):
        for world in range(1, min(n, 5) + 1):
            ranges = [split_range(n, world, r) for r in range(world)]
            assert ranges[0][0] == 0 and ranges[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            assert max(split_sizes(n, world)) - min(split_sizes(n, world)) <= 1


def test_knobs_refused_by_name(tiny_llama_dir, tiny_bert_dir):
    with pytest.raises(ValueError, match="tensor_parallel_size=3 is more than the model's num_key_value_heads=2"):
        LLM(model=str(tiny_llama_dir), tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive int, got 0"):
        LLM(model=str(tiny_llama_dir), tensor_parallel_size=0)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 is not supported for task 'embed'"):
        LLM(model=str(tiny_bert_dir), tensor_parallel_size=2)


# ---- GGML blocks: sharded as blocks ---------------------------------------------------------

# The fp16 scale fields of the K formats (byte offsets in a block) and a scale that gives the
# dequantized weights a spread like the tiny models' (std ~0.05-0.1).
_K_SCALES = {"Q4_K": ([0, 2], 3e-4), "Q5_K": ([0, 2], 1.5e-4), "Q6_K": ([208], 1e-4),
             "Q2_K": ([80, 82], 3e-3), "Q3_K": ([108], 1.5e-3), "IQ4_NL": ([0], 8e-4), "IQ4_XS": ([0], 3e-5)}


def _blocks(name: str, weight: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """[n, k] -> [n, row_bytes] uint8 GGML blocks of `name`: the reference quantizer where
    gguf-py has one, else random blocks (gguf-py cannot quantize the K and IQ4 formats)."""
    from gguf.quants import quantize

    qtype = FORMAT_IDS[name]
    if name not in _K_SCALES:
        return np.ascontiguousarray(quantize(weight, qtype)).view(np.uint8).reshape(weight.shape[0], -1)
    _, values, nbytes = FORMATS[qtype]
    n, k = weight.shape
    blocks = rng.integers(0, 256, size=(n * (k // values), nbytes), dtype=np.uint8)
    offsets, scale = _K_SCALES[name]
    for offset in offsets:
        blocks[:, offset : offset + 2] = (rng.standard_normal(len(blocks)) * scale).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n, -1)


def write_tiny_gguf(target: Path, tokenizer_dir: Path, formats: dict[str, str]) -> Path:
    """A 2-layer random Llama as a GGUF file (hidden 256 = 4 heads of 64, 2 KV heads,
    intermediate 512, tied Q8_0 embedding) and the HF directory that names it as its source;
    `formats`: GGUF tensor kind (attn_q, attn_k, attn_v, attn_output, ffn_gate, ffn_up,
    ffn_down) -> GGML format. Over 2 ranks o_proj's input splits at 128 and down_proj's at 256."""
    import gguf
    from transformers import AutoTokenizer, LlamaConfig

    config = LlamaConfig(
        vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
        architectures=["LlamaForCausalLM"],
    )
    config.save_pretrained(target)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(target)
    rng = np.random.default_rng(0)
    hidden, inter, kv = config.hidden_size, config.intermediate_size, 2 * 64
    shapes = {"attn_q": (hidden, hidden), "attn_k": (kv, hidden), "attn_v": (kv, hidden), "attn_output": (hidden, hidden),
              "ffn_gate": (inter, hidden), "ffn_up": (inter, hidden), "ffn_down": (hidden, inter)}
    writer = gguf.GGUFWriter(str(target / "tiny.gguf"), "llama")
    embedding = (rng.standard_normal((config.vocab_size, hidden)) * 0.08).astype(np.float32)
    writer.add_tensor("token_embd.weight", _blocks("Q8_0", embedding, rng), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    for layer in range(config.num_hidden_layers):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{layer}.{norm}.weight", (1.0 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
        for kind, shape in shapes.items():
            weight = (rng.standard_normal(shape) * 0.08).astype(np.float32)
            name = formats[kind]
            writer.add_tensor(f"blk.{layer}.{kind}.weight", _blocks(name, weight, rng),
                              raw_dtype=gguf.GGMLQuantizationType(FORMAT_IDS[name]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (target / "gguf_source.json").write_text(json.dumps({"gguf_file": str(target / "tiny.gguf")}))
    return target


# Q4_0 / Q8_0 (32-value blocks): every split on a block boundary. Q4_K with Q6_K v and down (the
# mix of llama.cpp's Q4_K_M): o_proj's split at 128 falls inside a 256-value block.
TINY_GGUF_FORMATS = {
    "q4_0": {"attn_q": "Q4_0", "attn_k": "Q4_0", "attn_v": "Q8_0", "attn_output": "Q4_0",
             "ffn_gate": "Q4_0", "ffn_up": "Q4_0", "ffn_down": "Q8_0"},
    "q4_k": {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K",
             "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K"},
    # the later formats, 32- and 256-value blocks; Q3_K o_proj straddles as Q4_K's does
    "low_bit": {"attn_q": "Q5_0", "attn_k": "Q5_1", "attn_v": "IQ4_NL", "attn_output": "Q3_K",
                "ffn_gate": "Q2_K", "ffn_up": "MXFP4", "ffn_down": "IQ4_XS"},
}


@pytest.fixture(scope="module", params=sorted(TINY_GGUF_FORMATS))
def tiny_gguf(request, tmp_path_factory, smollm2_dir) -> tuple[str, Path]:
    """(which of TINY_GGUF_FORMATS, its model directory)."""
    target = tmp_path_factory.mktemp(f"tiny-gguf-{request.param}")
    return request.param, write_tiny_gguf(target, smollm2_dir, TINY_GGUF_FORMATS[request.param])


def _generate(model_dir: Path, tp: int, prompts: list, params: list, **kwargs) -> list:
    with LLM(model=str(model_dir), multiprocess=False, max_model_len=MAX_MODEL_LEN, num_kv_blocks=48,
             tensor_parallel_size=tp, **kwargs) as llm:
        return llm.generate(prompts, params, use_tqdm=False)


@needs_blocks
def test_tp2_on_gguf_blocks_equals_tp1(tiny_gguf):
    kind, model_dir = tiny_gguf
    prompts, params = mixed_prompts(8), params_for(8)
    # the prefill GEMM's int8 split of x (VNNI build) turns the ulps by which the all-reduce's order
    # moves x into a different rounding of a piece, up to 2^-15 of a block's largest value
    int8 = quant_isa() == "avx512vnni" and INT8_GEMM_FORMATS & set(TINY_GGUF_FORMATS[kind].values())
    tol = INT8_GEMM_LOGPROB_TOL if int8 else LOGPROB_TOL
    assert_same_greedy(_generate(model_dir, 1, prompts, params), _generate(model_dir, 2, prompts, params), tol)


@needs_blocks
def test_tp2_on_q8_0_at_load_equals_tp1(tiny_qwen2_dir):
    """quantization='q8_0' (untied Q8_0 lm_head, qkv bias) shards its blocks too."""
    prompts, params = mixed_prompts(8), params_for(8)
    reference = _generate(tiny_qwen2_dir, 1, prompts, params, quantization="q8_0")
    assert_same_greedy(reference, _generate(tiny_qwen2_dir, 2, prompts, params, quantization="q8_0"))


@needs_blocks
def test_tp2_on_the_shipped_smollm2_gguf_equals_tp1(smollm2_dir, caplog):
    """The default model on its Q4_1 / Q8_0 blocks (3 KV heads: 2 + 1, every split on a block
    boundary); the startup log says what each rank's KV cache holds."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Three colours of the rainbow are"]
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)] * len(prompts)
    reference = _generate(smollm2_dir, 1, prompts, params)
    with caplog.at_level(logging.INFO, logger="shmvllm"):
        assert_same_greedy(reference, _generate(smollm2_dir, 2, prompts, params))
    lines = [r.getMessage() for r in caplog.records]
    assert any(re.search(r"KV cache 48 blocks .*per rank ([\d.]+) \+ ([\d.]+) MiB for 2 \+ 1 of 3 KV heads", m) for m in lines), lines
    assert any("this rank's 2 of 3 KV heads" in m for m in lines), lines  # rank 0's own line (rank 1 logs in its process)


def _block_tensors(model) -> list:
    return [part.data for m in model.modules() if isinstance(m, (Linear, VocabEmbedding)) and m.blocks is not None
            for part in ([m.blocks] if isinstance(m.blocks, QuantizedWeight) else [p for _, p in m.blocks])]


@needs_blocks
def test_each_rank_holds_only_its_blocks(tiny_gguf, caplog):
    """Every layer of every rank is built at its share's shape and runs on blocks (no fp32
    weight); row shares are views of the mapped file, input-column shares copies of their own
    (no view keeping the full tensor's pages) unless they hold every column, and the ranks' blocks add up to the full model's,
    plus the straddled block column of a split that falls inside a block, warned about by name."""
    kind, model_dir = tiny_gguf
    config = EngineArgs(model=str(model_dir), max_model_len=64).create_engine_config().model_config
    full_bytes = sum(t.numel() for t in {id(t): t for t in _block_tensors(get_model(config))}.values())
    o_format = TINY_GGUF_FORMATS[kind]["attn_output"]
    _, o_values, o_block_bytes = FORMATS[FORMAT_IDS[o_format]]
    straddles = o_values == 256
    held = 0
    for rank in range(2):
        with caplog.at_level(logging.WARNING, logger="shmvllm.model.parallel.layers"):
            caplog.clear()
            model = get_model(config, TPGroup(rank, 2))
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                assert linear.blocks is not None and linear.weight.numel() == 0
            for linear, width in ((attn.o_proj, 256), (mlp.down_proj, 512)):
                # a share of some input columns is a copy of its own; all of them (a straddled block) the file's view
                assert all((p.data.untyped_storage().nbytes() == p.data.numel()) != (p.k == width) for _, p in linear.blocks)
            assert attn.num_kv_heads == 1 and attn.qkv_proj.out_features == 128 + 64 + 64  # 2 query heads, 1 KV head
            assert mlp.down_proj.pad is None and mlp.down_proj.in_features == 256
            if straddles:  # rank 0 holds input columns [0, 256) of o_proj for its [0, 128), rank 1 too for [128, 256)
                assert attn.o_proj.pad == ((0, 128) if rank == 0 else (128, 0))
                assert attn.o_proj.in_features == 256
            else:
                assert attn.o_proj.pad is None and attn.o_proj.in_features == 128
        embedding = model.model.embed_tokens
        assert embedding.blocks.n == 49152 // 2
        assert embedding.blocks.data.untyped_storage().nbytes() > embedding.blocks.data.numel()  # a view of the file
        assert model.lm_head.blocks[0][1] is embedding.blocks  # tied: one copy
        held += sum(t.numel() for t in {id(t): t for t in _block_tensors(model)}.values())
        warned = [r.getMessage() for r in caplog.records if "split inside a GGML block" in r.getMessage()]
        if straddles and rank == 0:
            assert len(warned) == 1 and f"model.layers.0.self_attn.o_proj ({o_format}, 256-value blocks" in warned[0]
            assert "down_proj" not in warned[0]
        else:
            assert not warned
    # a straddled o_proj (256 rows of one 256-value block) is held whole by both ranks, once more per layer
    assert held == full_bytes + (2 * 256 * o_block_bytes if straddles else 0)


class _SumLater:
    """A group of one rank whose all-reduce leaves the partial sum alone (the test adds them)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def all_reduce_(self, tensor):
        return tensor


class _InMemory(CheckpointTensor):
    """A checkpoint tensor held in memory (blocks or values)."""

    def __init__(self, name: str, value) -> None:
        self.name, self.value = name, value
        self.shape = tuple(value.shape)

    def rows(self, start, stop, out=None):
        return self.value[start:stop]

    def columns(self, start, stop):
        if isinstance(self.value, torch.Tensor):
            return self.value[:, start:stop]
        _, values, nbytes = FORMATS[self.value.qtype]
        return QuantizedWeight(self.value.data[:, start // values * nbytes : stop // values * nbytes].clone(),
                               self.value.qtype, stop - start)


@needs_blocks
@pytest.mark.parametrize("name, k, cuts", [
    ("Q4_1", 96, [(0, 64), (64, 96)]),            # on 32-value boundaries
    ("Q4_0", 96, [(0, 40), (40, 96)]),            # inside a block: both ranks hold block [32, 64)
    ("Q6_K", 512, [(0, 256), (256, 512)]),
    ("Q4_K", 512, [(0, 128), (128, 384), (384, 512)]),  # three ranks, every cut inside a block
])
def test_row_parallel_blocks_sum_to_the_full_product(name, k, cuts):
    from test_quant_kernels import random_weight

    torch.manual_seed(0)
    unit = 256 if name.endswith("_K") else 32
    blocks = random_weight(name, 24, k, np.random.default_rng(0))
    bias = torch.randn(24)
    full = Linear(k, 24, bias=True, device="meta")
    full.bias = torch.nn.Parameter(bias, requires_grad=False)
    full.set_blocks([(0, blocks)])
    for rows in (1, 7):
        x, residual = torch.randn(rows, k), torch.randn(rows, 24)
        want = full(x, residual)
        got = torch.zeros_like(want)
        for rank, (a, b) in enumerate(cuts):
            shard = RowParallelLinear(k, 24, a, b, unit, True, _SumLater(rank, len(cuts)))
            shard.weight.weight_loader(shard.weight, _InMemory("w", blocks))
            shard.bias.weight_loader(shard.bias, _InMemory("b", bias))
            shard.set_blocks(shard.pending_blocks)
            assert shard.blocks is not None and shard.in_features % unit == 0
            got += shard(x[:, a:b].contiguous(), residual)
        scale = (x.abs() @ blocks.dequantize().abs().T).max()
        assert torch.allclose(got, want, atol=float(scale) * 1e-6, rtol=0), float((got - want).abs().max())


# ---- a rank's memory is its share -----------------------------------------------------------

_LOAD_AND_MEASURE = r"""
import json, sys
from pathlib import Path
from shmvllm.engine.arg_utils import EngineArgs
from shmvllm.model.loader import get_model
from shmvllm.model.parallel.group import TPGroup
from shmvllm.model.parallel.layers import shard_bytes

def status(key):
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(key + ":"))
    return int(line.split()[1]) * 1024

config = EngineArgs(model=sys.argv[1], max_model_len=64, skip_tokenizer_init=True).create_engine_config().model_config
Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) restarts from the current RSS
before = status("VmRSS")
model = get_model(config, TPGroup(int(sys.argv[2]), int(sys.argv[3])))
print(json.dumps({"peak_growth": status("VmHWM") - before, "held": sum(shard_bytes(model))}))
"""


@pytest.fixture(scope="module")
def llama_84mb_dir(tmp_path_factory) -> Path:
    """A random 4-layer Llama of 84 MB of fp32 weights (untied 8192-token vocabulary), written
    straight as safetensors: big enough that a rank's share shows in its resident memory."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    target = tmp_path_factory.mktemp("llama-84mb")
    config = LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
                         tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    config.save_pretrained(target)
    generator = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (8192, 512), "lm_head.weight": (8192, 512), "model.norm.weight": (512,)}
    for i in range(4):
        prefix = f"model.layers.{i}"
        shapes.update({f"{prefix}.self_attn.q_proj.weight": (512, 512), f"{prefix}.self_attn.k_proj.weight": (256, 512),
                       f"{prefix}.self_attn.v_proj.weight": (256, 512), f"{prefix}.self_attn.o_proj.weight": (512, 512),
                       f"{prefix}.mlp.gate_proj.weight": (1536, 512), f"{prefix}.mlp.up_proj.weight": (1536, 512),
                       f"{prefix}.mlp.down_proj.weight": (512, 1536), f"{prefix}.input_layernorm.weight": (512,),
                       f"{prefix}.post_attention_layernorm.weight": (512,)})
    save_file({name: torch.randn(shape, generator=generator) * 0.05 for name, shape in shapes.items()},
              str(target / "model.safetensors"))
    return target


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's resettable peak RSS")
def test_a_ranks_peak_memory_is_its_share(llama_84mb_dir):
    """Rank 0 of 2 loaded in a process of its own: the parameters it holds are half the model's
    (plus the replicated norms), and the growth of its peak resident memory while loading is
    about half a whole load's: it reads its share of each tensor, never the whole."""
    import subprocess
    import sys

    def load(rank: int, world: int) -> dict:
        out = subprocess.run([sys.executable, "-c", _LOAD_AND_MEASURE, str(llama_84mb_dir), str(rank), str(world)],
                             capture_output=True, text=True, timeout=300, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    whole, share = load(0, 1), load(0, 2)
    assert 0.49 < share["held"] / whole["held"] < 0.51, (share, whole)
    assert whole["peak_growth"] > whole["held"], whole  # the measure sees a whole load
    assert share["peak_growth"] < 0.6 * whole["peak_growth"], (share, whole)
