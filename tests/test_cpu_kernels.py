"""The C kernels against the pure-torch code they replace: the cache write and decode attention
of PagedAttention on random caches (grouped queries, ragged lengths, shuffled blocks, decode
rows mixed with prefill rows), rms_norm, silu-and-mul and rotary; and the fallback to torch
where the kernels do not apply."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from shmvllm.model import attention, decoder, rotary
from shmvllm.model.attention import PagedAttention, build_attention_metadata
from shmvllm.model.kernels import cpu_kernels, quant_isas_supported


@pytest.fixture(scope="module")
def kernels():
    lib = cpu_kernels()
    assert lib is not None, "the C kernels did not build on this machine (is gcc installed?)"
    return lib


def _layer(num_heads: int, kv_heads: int, head_dim: int, num_blocks: int, block_size: int) -> PagedAttention:
    layer = PagedAttention(num_heads, kv_heads, head_dim, head_dim**-0.5)
    shape = (kv_heads, num_blocks, block_size, head_dim)
    generator = torch.Generator().manual_seed(1)
    layer.k_cache = torch.randn(shape, generator=generator)
    layer.v_cache = torch.randn(shape, generator=generator)
    return layer


def _step(query_lens: list[int], num_computed: list[int], block_size: int, num_blocks: int, seed: int):
    """A step's metadata with every request's blocks drawn at random (no block shared)."""
    rng = np.random.default_rng(seed)
    seq_lens = np.array(num_computed) + np.array(query_lens)
    width = int(-(-seq_lens.max() // block_size)) + 2
    order = rng.permutation(num_blocks).astype(np.int32)
    table = order[: len(query_lens) * width].reshape(len(query_lens), width)
    slots = []
    for i, (new, done) in enumerate(zip(query_lens, num_computed)):
        pos = np.arange(done, done + new)
        slots.append(table[i, pos // block_size].astype(np.int64) * block_size + pos % block_size)
    return build_attention_metadata(
        np.array(query_lens), np.array(num_computed), table, np.concatenate(slots), block_size, torch.device("cpu")
    )


def _run(layer: PagedAttention, meta, qkv: torch.Tensor, native: bool, monkeypatch) -> tuple[torch.Tensor, ...]:
    heads, kv = layer.num_heads, layer.num_kv_heads
    q, k, v = qkv.clone().split([heads, kv, kv], dim=1)
    k_cache, v_cache = layer.k_cache.clone(), layer.v_cache.clone()
    with monkeypatch.context() as patch:
        if not native:
            patch.setattr(attention, "kernels_for", lambda *tensors: None)
        out = layer(q, k, v, meta)
    written = (layer.k_cache.clone(), layer.v_cache.clone())
    layer.k_cache, layer.v_cache = k_cache, v_cache
    return (out, *written)


@pytest.mark.parametrize(
    "heads, kv_heads, head_dim, block_size",
    [(9, 3, 64, 16), (4, 4, 32, 4), (8, 2, 16, 8), (6, 1, 128, 16)],
)
def test_kernel_equals_torch(kernels, monkeypatch, heads, kv_heads, head_dim, block_size) -> None:
    num_blocks = 96
    layer = _layer(heads, kv_heads, head_dim, num_blocks, block_size)
    # decodes of ragged lengths (1 to several blocks, ending mid-block and on a boundary),
    # with prefill rows in between so that decode rows are not a prefix of the batch
    query_lens = [1, 7, 1, 1, 5, 1]
    num_computed = [0, 0, 3 * block_size - 1, 2 * block_size, 4, 37]
    meta = _step(query_lens, num_computed, block_size, num_blocks, seed=heads)
    qkv = torch.randn(sum(query_lens), heads + 2 * kv_heads, head_dim, generator=torch.Generator().manual_seed(2))
    native = _run(layer, meta, qkv, True, monkeypatch)
    reference = _run(layer, meta, qkv, False, monkeypatch)
    assert torch.equal(native[1], reference[1]) and torch.equal(native[2], reference[2])  # the cache write: copies
    torch.testing.assert_close(native[0], reference[0], rtol=1e-5, atol=1e-5)


def _with_sinks(layer: PagedAttention, seed: int) -> PagedAttention:
    """The layer with gpt-oss's sink logits: one per query head, some above every score."""
    layer.sinks = torch.nn.Parameter(torch.randn(layer.num_heads, generator=torch.Generator().manual_seed(seed)) * 3,
                                     requires_grad=False)
    return layer


@pytest.mark.parametrize("window, softcap, sinks", [(5, None, False), (None, 2.0, False), (9, 1.5, False), (1, None, False),
                                                    (None, None, True), (5, None, True)])
def test_sliding_window_and_softcap_against_a_naive_reference(kernels, monkeypatch, window, softcap, sinks) -> None:
    """Decode rows (the C kernel and the torch path) and prefill rows (fresh and after a cached
    prefix) of a sliding-window / soft-capped / sink layer against attention written out per
    query: keys at positions (p - window, p], scores cap * tanh(score * scale / cap), the head's
    sink logit joining the softmax and dropped after it."""
    block_size, num_blocks, heads, kv_heads, head_dim = 4, 96, 6, 2, 16
    layer = _layer(heads, kv_heads, head_dim, num_blocks, block_size)
    layer.sliding_window, layer.softcap = window, softcap
    if sinks:
        _with_sinks(layer, seed=9)
    query_lens, num_computed = [1, 11, 1, 6, 1], [0, 0, 13, 9, 3]
    rng = np.random.default_rng(7)
    width = 8
    table = rng.permutation(num_blocks)[: len(query_lens) * width].astype(np.int32).reshape(len(query_lens), width)
    positions = [np.arange(done, done + new) for new, done in zip(query_lens, num_computed)]
    slots = np.concatenate([table[i, pos // block_size].astype(np.int64) * block_size + pos % block_size
                            for i, pos in enumerate(positions)])
    meta = build_attention_metadata(np.array(query_lens), np.array(num_computed), table, slots, block_size, torch.device("cpu"))
    qkv = torch.randn(sum(query_lens), heads + 2 * kv_heads, head_dim, generator=torch.Generator().manual_seed(8))
    native = _run(layer, meta, qkv, True, monkeypatch)
    reference = _run(layer, meta, qkv, False, monkeypatch)
    torch.testing.assert_close(native[0], reference[0], rtol=1e-5, atol=1e-5)
    keys = reference[1].reshape(kv_heads, -1, head_dim)
    values = reference[2].reshape(kv_heads, -1, head_dim)
    q = qkv[:, :heads]
    expected, row = [], 0
    for i, pos in enumerate(positions):
        context = np.arange(pos[-1] + 1)
        context_slots = torch.from_numpy(table[i, context // block_size].astype(np.int64) * block_size + context % block_size)
        for p in pos:
            visible = [c for c in range(p + 1) if window is None or c > p - window]
            out = torch.empty(heads, head_dim)
            for h in range(heads):
                k = keys[h // (heads // kv_heads), context_slots[visible]]
                v = values[h // (heads // kv_heads), context_slots[visible]]
                scores = (k @ q[row, h]) * head_dim**-0.5
                if softcap is not None:
                    scores = torch.tanh(scores / softcap) * softcap
                if sinks:
                    out[h] = torch.softmax(torch.cat([scores, layer.sinks[h : h + 1]]), dim=0)[:-1] @ v
                else:
                    out[h] = torch.softmax(scores, dim=0) @ v
            expected.append(out.reshape(-1))
            row += 1
    torch.testing.assert_close(reference[0], torch.stack(expected), rtol=1e-5, atol=1e-5)


def test_sinks_over_contexts_of_many_runs(kernels, monkeypatch) -> None:
    """Contexts of 1-3 runs of the kernel's task length (the runs joined by its combine step,
    the sink in the joined denominator): the C kernel equals the torch path."""
    block_size, num_blocks = 16, 256
    layer = _with_sinks(_layer(8, 2, 64, num_blocks, block_size), seed=3)
    meta = _step([1, 1, 1], [1300, 700, 40], block_size, num_blocks, seed=6)
    qkv = torch.randn(3, 12, 64, generator=torch.Generator().manual_seed(5))
    native = _run(layer, meta, qkv, True, monkeypatch)
    reference = _run(layer, meta, qkv, False, monkeypatch)
    torch.testing.assert_close(native[0], reference[0], rtol=1e-5, atol=1e-5)


def test_kernel_on_a_large_decode_batch(kernels, monkeypatch) -> None:
    """64 decodes with contexts of 35-170 tokens: the shape of the throughput benchmark."""
    block_size, num_blocks = 16, 1024
    layer = _layer(9, 3, 64, num_blocks, block_size)
    lengths = np.random.default_rng(3).integers(35, 170, size=64)
    meta = _step([1] * 64, lengths.tolist(), block_size, num_blocks, seed=4)
    qkv = torch.randn(64, 15, 64, generator=torch.Generator().manual_seed(5))
    native = _run(layer, meta, qkv, True, monkeypatch)
    reference = _run(layer, meta, qkv, False, monkeypatch)
    torch.testing.assert_close(native[0], reference[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(native[1], reference[1])


def test_kernel_on_long_contexts(kernels, monkeypatch) -> None:
    """Contexts of one to several runs of positions (the kernel cuts attention into runs of 512
    and joins their softmax pieces): one short, one just past a run, one ending on a run's
    boundary, one of 2.3 runs, beside a prefill row."""
    block_size, num_blocks = 16, 400
    layer = _layer(9, 3, 64, num_blocks, block_size)
    lengths = [40, 512, 1023, 1200]
    meta = _step([1, 6, 1, 1, 1], [lengths[0], 3, *lengths[1:]], block_size, num_blocks, seed=6)
    qkv = torch.randn(10, 15, 64, generator=torch.Generator().manual_seed(7))
    native = _run(layer, meta, qkv, True, monkeypatch)
    reference = _run(layer, meta, qkv, False, monkeypatch)
    torch.testing.assert_close(native[0], reference[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(native[1], reference[1])


@pytest.mark.parametrize("heads, kv_heads, context", [(8, 1, 700), (6, 2, 300), (9, 3, 200)])
def test_attention_cut_by_query_head_equals_uncut(kernels, monkeypatch, heads, kv_heads, context) -> None:
    """A lone decode whose (kv head, run) tasks are fewer than two a thread is cut by query head
    (one slice a thread): the output is the one thread's, uncut, bit for bit, with sinks, over one
    run and over several."""
    block_size, num_blocks = 16, 128
    layer = _with_sinks(_layer(heads, kv_heads, 128, num_blocks, block_size), seed=4)
    meta = _step([1], [context], block_size, num_blocks, seed=8)
    qkv = torch.randn(1, heads + 2 * kv_heads, 128, generator=torch.Generator().manual_seed(9))
    threads = torch.get_num_threads()
    try:
        outputs = []
        for team in (1, 2, 3):
            torch.set_num_threads(team)
            outputs.append(_run(layer, meta, qkv, True, monkeypatch)[0])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], outputs[2])
    torch.testing.assert_close(outputs[0], _run(layer, meta, qkv, False, monkeypatch)[0], rtol=1e-5, atol=1e-5)


def test_kernels_stay_off_where_they_do_not_apply(kernels) -> None:
    layer = _layer(4, 2, 16, 8, 4)
    q = torch.zeros(3, 8, 16)
    k = v = torch.zeros(3, 2, 16)
    assert layer._kernels(q[:, :4], k, v) is kernels
    assert layer._kernels(q[:, :4].to(torch.float64), k, v) is None  # another dtype
    assert layer._kernels(q[:, :4, ::2], k, v) is None  # head_dim not contiguous
    layer.k_cache = layer.k_cache.to(torch.bfloat16)
    assert layer._kernels(q[:, :4], k, v) is None  # a bf16 cache


def test_loading_the_kernels_keeps_denormals(kernels) -> None:
    """Built with -ffast-math, the library must not switch the process to flush-to-zero."""
    tiny = torch.tensor(1e-38, dtype=torch.float32)
    assert (tiny * 1e-3).item() != 0.0
    assert np.float32(1e-38) * np.float32(1e-3) != 0.0


def _without_kernels(monkeypatch, module, call):
    with monkeypatch.context() as patch:
        patch.setattr(module, "kernels_for", lambda *tensors: None)
        return call()


@pytest.mark.parametrize("rows, hidden", [(1, 576), (64, 576), (300, 1024), (3, 7)])
def test_rms_norm_kernel(kernels, monkeypatch, rows, hidden) -> None:
    norm = decoder.RMSNorm(hidden, 1e-5)
    generator = torch.Generator().manual_seed(rows)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=generator))
        x = torch.randn(rows, hidden, generator=generator) * 3
        native = norm(x)
        reference = _without_kernels(monkeypatch, decoder, lambda: norm(x))
        transformers_formula = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(native, reference, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(native, transformers_formula, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows, width", [(1, 1536), (64, 1536), (200, 4096), (5, 3)])
def test_silu_and_mul_kernel(kernels, rows, width) -> None:
    x = torch.randn(rows, 2 * width, generator=torch.Generator().manual_seed(width)) * 4
    out = torch.empty(rows, width)
    kernels.shm_silu_and_mul(out.data_ptr(), x.data_ptr(), rows, width)
    gate, up = x.split(width, dim=-1)
    torch.testing.assert_close(out, torch.nn.functional.silu(gate) * up, rtol=1e-5, atol=1e-6)


class _RopeConfig:
    rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    max_position_embeddings = 512


@pytest.mark.parametrize("rows, heads, head_dim", [(1, 12, 64), (64, 12, 64), (700, 6, 128)])
def test_rotary_kernel(kernels, monkeypatch, rows, heads, head_dim) -> None:
    embedding = rotary.RotaryEmbedding(_RopeConfig(), head_dim, 1024)
    generator = torch.Generator().manual_seed(heads)
    positions = torch.randint(0, 1024, (rows,), generator=generator)
    qkv = torch.randn(rows, heads + 4, head_dim, generator=generator)  # rotate the first `heads`, as q and k
    native, reference = qkv.clone(), qkv.clone()
    embedding(positions, torch.float32).apply_(native[:, :heads])
    _without_kernels(monkeypatch, rotary, lambda: embedding(positions, torch.float32).apply_(reference[:, :heads]))
    torch.testing.assert_close(native, reference, rtol=1e-5, atol=1e-5)
    assert torch.equal(native[:, heads:], qkv[:, heads:])  # the v part is left alone


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("bias, with_residual", [(False, False), (True, False), (True, True), (False, True)])
def test_linear_few_rows_kernel(kernels, rows, bias, with_residual) -> None:
    from shmvllm.model.linear import Linear

    torch.manual_seed(rows)
    layer = Linear(576, 960, bias=bias)
    layer.pack()
    x = torch.randn(rows, 576)
    residual = torch.randn(rows, 960) if with_residual else None
    with torch.no_grad():
        out = layer(x, residual)
        reference = torch.nn.functional.linear(x, layer.weight, layer.bias)
        if residual is not None:
            reference = reference + residual
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=2e-5)


@pytest.mark.skipif("avx512" not in quant_isas_supported() or shutil.which("objdump") is None, reason="needs an AVX-512 CPU and objdump")
def test_the_avx2_build_holds_no_avx512_instructions() -> None:
    """SHMVLLM_QUANT_ISA=avx2 on an AVX-512 CPU: every kernel library a decoder runs is AVX2 code
    (no zmm register anywhere), while the default fp32 build does use AVX-512 here."""
    script = ("from shmvllm.model.kernels import cpu_kernels, logprob_kernels, quant_kernels; import torch; "
              "print('\\n'.join(k._name for k in (cpu_kernels(), cpu_kernels(torch.bfloat16), logprob_kernels(), quant_kernels())))")

    def zmm_lines(isa: str | None) -> dict[str, int]:
        env = {k: v for k, v in os.environ.items() if k != "SHMVLLM_QUANT_ISA"} | ({"SHMVLLM_QUANT_ISA": isa} if isa else {})
        paths = subprocess.run([sys.executable, "-c", script], env=env, check=True, capture_output=True, text=True,
                               timeout=900).stdout.split()
        assert len(paths) == 4
        return {path: subprocess.run(["objdump", "-d", path], check=True, capture_output=True, text=True).stdout.count("zmm")
                for path in paths}

    capped = zmm_lines("avx2")
    assert all(count == 0 for count in capped.values()), capped
    assert next(iter(zmm_lines(None).values())) > 0  # the default fp32 build: AVX-512 on this CPU
