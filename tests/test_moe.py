"""Mixture-of-experts decoders (Qwen3-MoE with a dense layer, Mixtral; 8 experts, top-2) against
transformers' eager fp32 greedy tokens: alone, in a mixed batch, under preemption, with chunked
prefill and prefix-cache hits, at tensor_parallel_size 2, and from GGUF files of the same weights
(F32, and Q8_0 experts run as GGML blocks): Qwen3-MoE against transformers on that file, Mixtral
(llama.cpp's "llama" with experts, which transformers cannot read) against transformers on the
weights the file holds; the MoE layer itself: transformers' routing and sums, the C kernel of all
the experts against the experts one by one, and an expert no token chose is never read."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

# the families' shared engine tests, run here on this module's family_dir
from test_architectures import (  # noqa: F401
    assert_engine_matches,
    assert_native_step_ran,
    prompts_of,
    test_alone_and_in_a_mixed_batch,
    test_chunked_prefill_and_prefix_cache_hits,
    test_under_preemption,
)
from test_engine_core import make_engine
from tiny_models import assert_same_greedy, build_tiny, hf_greedy, hf_model, quantized_copy, write_gguf

FAMILIES = ["qwen3_moe", "mixtral"]


@pytest.fixture(scope="module", params=FAMILIES)
def family_dir(request, tmp_path_factory) -> Path:
    return build_tiny(request.param, tmp_path_factory.mktemp(request.param))


def test_moe_layer_routes_and_sums_as_transformers(family_dir):
    """Our MoE layer on transformers' layer-0 weights and inputs: the same top-k, the same sums
    (to float rounding: the GEMMs differ), and the router's choices are transformers' exactly."""
    engine = make_engine(family_dir, num_kv_blocks=16)
    try:
        ours = engine.executor.worker.model_runner.model.model.layers[0].mlp
    finally:
        engine.shutdown()
    reference = hf_model(family_dir)
    block = reference.model.layers[0].mlp
    x = torch.randn(37, reference.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, expected_weights, expected_ids = block.gate(x)
        weights, ids = ours.route(x)
        assert torch.equal(ids, expected_ids)
        torch.testing.assert_close(weights, expected_weights, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(ours(x), block(x.unsqueeze(0))[0], rtol=1e-5, atol=1e-6)


def test_native_decode_step_equals_the_layer_path(family_dir):
    """One and three requests (rows sharing an expert run it once on both rows): the native step's
    routing (C's expf softmax, top-k, the experts' GEMVs, the weighted sum) gives the layer path's
    hidden states."""
    from test_model_llama import PagedModel, native_and_layered
    from tiny_models import VOCAB

    paged = PagedModel(family_dir, num_blocks=64, max_model_len=256)
    for lengths in ([5], [9, 70, 21]):
        for a, b in native_and_layered(paged, lengths, VOCAB):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_one_kernel_for_all_experts_equals_the_experts_one_by_one(family_dir, gguf_model_dir, tmp_path):
    """kernels/moe.c (slots sorted by expert, the experts' GEMVs FEW_ROWS rows at a time, the
    weighted sum + residual) against the experts run one by one from Python, on fp32 weights and
    on Q8_0 blocks, for 1 to 300 rows (experts with many rows)."""
    blocks_dir = family_dir if family_dir.name.startswith("mixtral") else gguf_model_dir  # every layer sparse
    for model in (family_dir, write_gguf(blocks_dir, tmp_path / "q8_0.gguf", qtype="Q8_0")):
        engine = make_engine(model, num_kv_blocks=16)
        try:
            moe = engine.executor.worker.model_runner.model.model.layers[0].mlp
        finally:
            engine.shutdown()
        generator = torch.Generator().manual_seed(2)
        for rows in (1, 3, 16, 300):
            x = torch.randn(rows, moe.gate.in_features, generator=generator)
            residual = torch.randn(rows, moe.gate.in_features, generator=generator)
            with torch.no_grad():
                weights, ids = moe.route(x)
                native = moe._native(x, weights, ids, residual)
                assert native is not None
                layered = moe._layered(x, weights, ids, residual.clone())
            torch.testing.assert_close(native, layered, rtol=1e-5, atol=1e-5, msg=f"{model.name}, {rows} rows")


def test_experts_no_token_chose_are_not_read(family_dir):
    """Every expert no token chose gets NaN weights: the output stays finite (it never read them),
    and poisoning a chosen one shows."""
    engine = make_engine(family_dir, num_kv_blocks=16)
    try:
        moe = engine.executor.worker.model_runner.model.model.layers[0].mlp
    finally:
        engine.shutdown()
    x = torch.randn(3, moe.gate.in_features, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, ids = moe.route(x)
        chosen = set(ids.reshape(-1).tolist())
        assert len(chosen) < moe.num_experts
        expected = moe(x)
        for index, expert in enumerate(moe.experts):
            if index not in chosen:
                _poison(expert)
        torch.testing.assert_close(moe(x), expected, rtol=0, atol=0)
        _poison(moe.experts[min(chosen)])
        assert torch.isnan(moe(x)).any()


def _poison(expert) -> None:
    for linear in (expert.gate_up_proj, expert.down_proj):
        linear.weight.data.fill_(float("nan"))
        linear.pack()


def test_tensor_parallel_2_gives_transformers_tokens(family_dir):
    """tensor_parallel_size=2, every expert's intermediate rows split over the ranks, one
    all-reduce per MoE layer: a mixed batch under preemption, greedy tokens equal to transformers'."""
    _assert_tp2_preempted_gives(family_dir, family_dir, seed=7, stop_token_ids=[])


def _assert_tp2_preempted_gives(model, reference, seed: int, stop_token_ids: list[int]) -> None:
    """A mixed batch at tensor_parallel_size=2 in 10 blocks of 4 (preempted): transformers' greedy
    tokens of `reference`."""
    from shmvllm import LLM, SamplingParams

    prompts = prompts_of([1, 5, 17, 8, 3, 24], seed=seed)
    params = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=stop_token_ids)
    with LLM(model=str(model), multiprocess=False, tensor_parallel_size=2, num_kv_blocks=10, block_size=4,
             skip_tokenizer_init=True) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        stats = llm.llm_engine.engine_core.get_stats()
    assert stats["num_preemptions"] > 0, stats
    for prompt, output in zip(prompts, outputs):
        assert_same_greedy(list(output.outputs[0].token_ids), hf_greedy(reference, tuple(prompt), 8),
                           f"prompt of {len(prompt)} tokens")


# ---- GGUF: llama.cpp's stacked expert tensors ----------------------------------------------------

# transformers' qwen3moe GGUF config reads neither the experts' width nor dense layers
GGUF_OVERRIDES = (("moe_intermediate_size", 64),)


@pytest.fixture(scope="module")
def gguf_model_dir(tmp_path_factory) -> Path:
    """A Qwen3-MoE as llama.cpp runs it: every layer sparse, top-k weights renormalized."""
    return build_tiny("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe_gguf"), mlp_only_layers=[], norm_topk_prob=True,
                      moe_intermediate_size=64)


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_gguf_stacked_experts_against_transformers_on_the_file(gguf_model_dir, tmp_path, qtype):
    """ffn_{gate,up,down}_exps [n_expert, rows, k] and ffn_gate_inp: F32 gives the HF directory's
    tokens; Q8_0 experts stay GGML blocks (views of the mapped file) and give transformers' tokens
    on the file."""
    path = write_gguf(gguf_model_dir, tmp_path / f"tiny-{qtype}.gguf", qtype=qtype)
    engine = make_engine(path, num_kv_blocks=64)
    try:
        moe = engine.executor.worker.model_runner.model.model.layers[1].mlp
        assert (moe.experts[7].down_proj.blocks is not None) == (qtype != "F32")
        prompts = prompts_of([1, 17, 33, 5], seed=6)
        if qtype == "F32":
            assert_engine_matches(gguf_model_dir, engine, prompts)
        for prompt, tokens in zip(prompts, _generate(engine, prompts)):
            expected = hf_greedy(tmp_path, tuple(prompt), 8, path.name, GGUF_OVERRIDES)
            assert_same_greedy(tokens, expected, f"{qtype}, prompt of {len(prompt)} tokens")
    finally:
        engine.shutdown()


def test_tensor_parallel_2_on_q8_0_expert_blocks_equals_size_1(gguf_model_dir, tmp_path):
    """Each rank keeps one 32-value block column of every expert's down_proj (and the matching
    gate/up rows): the tokens of size 2 equal size 1's."""
    from shmvllm import LLM, SamplingParams

    path = write_gguf(gguf_model_dir, tmp_path / "tiny-q8_0.gguf", qtype="Q8_0")
    prompts = prompts_of([1, 5, 17, 8], seed=8)
    tokens = {}
    for size in (1, 2):
        with LLM(model=str(path), multiprocess=False, tensor_parallel_size=size, num_kv_blocks=32,
                 skip_tokenizer_init=True) as llm:
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=8),
                                   use_tqdm=False)
        tokens[size] = [list(o.outputs[0].token_ids) for o in outputs]
    assert tokens[2] == tokens[1]


def _generate(engine, prompts: list[list[int]]) -> list[list[int]]:
    from shmvllm.sampling_params import SamplingParams
    from test_engine_core import make_request, run, tokens_of

    requests = [make_request(p, SamplingParams(temperature=0.0, max_tokens=8, eos_token_id=1)) for p in prompts]
    outputs = run(engine, requests)
    return [tokens_of(outputs[r.request_id]) for r in requests]


def test_gguf_config_reads_the_experts_width(gguf_model_dir, tmp_path):
    from shmvllm.model.registry import locate_model

    path = write_gguf(gguf_model_dir, tmp_path / "tiny.gguf")
    config = locate_model(str(path)).hf_config()
    assert (config.moe_intermediate_size, config.num_local_experts, config.num_experts_per_tok) == (64, 8, 2)
    assert config.norm_topk_prob is True


def test_benchmark_model_bytes_add_up(tmp_path):
    """benchmarks/moe.py's random Q8_0 Qwen3-MoE file: its tensors are the bytes the benchmark
    counts (the active-expert and dense-equivalent figures rest on them)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import moe as bench

    from shmvllm.model.quant import gguf_tensor_infos

    shape = bench.Shape(layers=2, hidden=64, heads=2, kv_heads=1, head_dim=32, experts=4, top_k=2, expert_ff=32)
    path = bench.write_model(tmp_path / "tiny-moe.gguf", shape)
    infos = {info.name: info.nbytes for info in gguf_tensor_infos(path)}
    parts = bench.tensor_bytes(shape, bench._vocab_size(str(path)))
    assert infos["blk.1.ffn_down_exps.weight"] * 3 * shape.layers == parts["experts_all"]
    embedding = infos.pop("token_embd.weight")
    assert sum(infos.values()) == parts["attention"] + parts["router"] + parts["experts_all"] + parts["lm_head"] + parts["norms"]
    assert embedding == parts["embedding_row"] * bench._vocab_size(str(path))


# ---- Mixtral from a GGUF file: a "llama" with expert_count and stacked ffn_*_exps ----------------

@pytest.fixture(scope="module")
def mixtral_gguf(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(the HF directory, its Q8_0 GGUF file, an HF directory of the weights that file holds)."""
    base = tmp_path_factory.mktemp("mixtral_gguf")
    model_dir = build_tiny("mixtral", base / "hf")
    path = write_gguf(model_dir, base / "tiny-mixtral-q8_0.gguf", qtype="Q8_0")
    return model_dir, path, quantized_copy(model_dir, base / "q8_0-weights", "Q8_0")


def test_mixtral_gguf_f32_gives_the_hf_directory_tokens(mixtral_gguf, tmp_path):
    """The config the file implies is Mixtral's (experts, top-k, the experts' width), and its F32
    weights (q/k rows interleaved by the converter, experts stacked) give the directory's tokens."""
    from shmvllm.model.registry import locate_model

    model_dir = mixtral_gguf[0]
    path = write_gguf(model_dir, tmp_path / "tiny-mixtral.gguf")
    config = locate_model(str(path)).hf_config()
    assert config.architectures == ["MixtralForCausalLM"]
    assert (config.num_local_experts, config.num_experts_per_tok, config.intermediate_size) == (8, 2, 128)
    engine = make_engine(path, num_kv_blocks=64)
    try:
        assert_engine_matches(model_dir, engine, prompts_of([1, 17, 33, 5], seed=9))
    finally:
        engine.shutdown()


def assert_gguf_case(path, reference, case: str, check_alone) -> None:
    """One of GGUF_CASES on the file `path`, against transformers' greedy tokens of `reference`:
    alone then in a mixed batch (`check_alone(engine)` after the lone request), under preemption,
    or with chunked prefill and prefix-cache hits."""
    if case == "alone_and_batched":
        engine = make_engine(path, num_kv_blocks=64)
        try:
            prompts = prompts_of([1, 5, 17, 33, 8, 40, 3, 24], seed=10)
            assert_engine_matches(reference, engine, prompts[:1])
            check_alone(engine)
            assert_engine_matches(reference, engine, prompts)
        finally:
            engine.shutdown()
    elif case == "preemption":
        engine = make_engine(path, num_kv_blocks=24, block_size=4)
        try:
            assert_engine_matches(reference, engine, prompts_of([1, 5, 17, 33, 8, 40, 3, 24], seed=11))
            assert engine.get_stats()["num_preemptions"] > 0
        finally:
            engine.shutdown()
    else:
        engine = make_engine(path, num_kv_blocks=128, max_num_batched_tokens=16)
        try:
            system = prompts_of([40], seed=12)[0]
            prompts = [system + suffix for suffix in prompts_of([3, 9, 1, 20], seed=13)]
            assert_engine_matches(reference, engine, prompts[:1])
            outputs = assert_engine_matches(reference, engine, prompts[1:])
            assert all(outs[-1].num_cached_tokens == 32 for outs in outputs.values())
        finally:
            engine.shutdown()


GGUF_CASES = ["alone_and_batched", "preemption", "prefix_hits"]


@pytest.mark.parametrize("case", GGUF_CASES)
def test_mixtral_q8_0_gguf_against_transformers(mixtral_gguf, case):
    """Q8_0 experts as GGML blocks: alone (the native decode step), in a mixed batch (the C kernel
    of all the experts), under preemption, and with chunked prefill and prefix-cache hits."""
    _, path, reference = mixtral_gguf

    def check_alone(engine) -> None:
        moe = engine.executor.worker.model_runner.model.model.layers[0].mlp
        assert moe.experts[5].gate_up_proj.blocks is not None
        assert_native_step_ran(engine, "mixtral")

    assert_gguf_case(path, reference, case, check_alone)


def test_mixtral_q8_0_gguf_tensor_parallel_2_against_transformers(mixtral_gguf):
    """Every expert's rows split over the two ranks, under preemption (the file names no EOS: 1 stops)."""
    _, path, reference = mixtral_gguf
    _assert_tp2_preempted_gives(path, reference, seed=14, stop_token_ids=[1])
