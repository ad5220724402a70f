"""The bf16 build of the C kernels against fp32 references on the same (bf16-valued) inputs:
decode attention and the cache write, rms_norm, silu-and-mul, rotary and the few-rows GEMV,
and the packed oneDNN bf16 GEMM of Linear.

Tolerance: each kernel accumulates in fp32 and rounds every stored value to bf16 once (twice
where transformers' bf16 module rounds an intermediate, see cpu_kernels.c), so an output may
be off the fp32 reference by about one or two bf16 ulps of its magnitude (2^-8 relative each)
plus the fp32 summation-order noise; BF16_RTOL = 2^-7 covers two roundings."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shmvllm.model import decoder, rotary
from shmvllm.model.attention import PagedAttention, build_attention_metadata
from shmvllm.model.kernels import cpu_kernels, kernels_for
from shmvllm.model.linear import Linear

BF16 = torch.bfloat16
BF16_RTOL = 2.0**-7


@pytest.fixture(scope="module")
def kernels():
    lib = cpu_kernels(BF16)
    assert lib is not None, "the bf16 C kernels did not build on this machine (is gcc installed?)"
    return lib


def _bf16_values(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    """Random values exactly representable in bf16 (as fp32), so both sides see the same inputs."""
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(BF16).float()


def _close(out: torch.Tensor, reference: torch.Tensor, atol: float) -> None:
    assert out.dtype == BF16
    torch.testing.assert_close(out.float(), reference, rtol=BF16_RTOL, atol=atol)


def test_kernels_for_picks_the_build_by_dtype(kernels) -> None:
    x32, x16 = torch.zeros(2, 4), torch.zeros(2, 4, dtype=BF16)
    assert kernels_for(x16, x16) is kernels
    assert kernels_for(x32, x32) is cpu_kernels(torch.float32) is not kernels
    assert kernels_for(x16, x32) is None  # mixed dtypes
    assert kernels_for(x16.half()) is None


@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", [(9, 3, 64, 16), (4, 4, 32, 4), (6, 1, 128, 16)])
def test_decode_attention_and_cache_write(kernels, heads, kv_heads, head_dim, block_size) -> None:
    num_blocks = 64
    rng = np.random.default_rng(heads)
    query_lens = [1, 6, 1, 1, 1]
    num_computed = [0, 0, 3 * block_size - 1, 2 * block_size, 37]
    seq_lens = np.array(num_computed) + np.array(query_lens)
    width = int(-(-seq_lens.max() // block_size)) + 1
    table = rng.permutation(num_blocks).astype(np.int32)[: len(query_lens) * width].reshape(len(query_lens), width)
    slots = np.concatenate([
        table[i, np.arange(c, c + n) // block_size].astype(np.int64) * block_size + np.arange(c, c + n) % block_size
        for i, (n, c) in enumerate(zip(query_lens, num_computed))
    ])
    meta = build_attention_metadata(np.array(query_lens), np.array(num_computed), table, slots, block_size,
                                    torch.device("cpu"))
    cache_shape = (kv_heads, num_blocks, block_size, head_dim)
    k_cache, v_cache = _bf16_values(*cache_shape, seed=1), _bf16_values(*cache_shape, seed=2)
    qkv = _bf16_values(sum(query_lens), heads + 2 * kv_heads, head_dim, seed=3)

    def run(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        layer = PagedAttention(heads, kv_heads, head_dim, head_dim**-0.5)
        layer.k_cache, layer.v_cache = k_cache.to(dtype), v_cache.to(dtype)
        q, k, v = qkv.to(dtype).split([heads, kv_heads, kv_heads], dim=1)
        if dtype == BF16:
            assert layer._kernels(q, k, v) is kernels
        return layer(q, k, v, meta), layer.k_cache, layer.v_cache

    out, k_written, v_written = run(BF16)
    ref_out, ref_k, ref_v = run(torch.float32)
    assert torch.equal(k_written.float(), ref_k) and torch.equal(v_written.float(), ref_v)  # copies, exact
    decode_rows = meta.decodes.rows
    # the decode rows come from the bf16 kernel; the prefill row from torch's bf16 SDPA
    _close(out[decode_rows], ref_out[decode_rows], atol=2e-3)
    torch.testing.assert_close(out.float(), ref_out, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("rows, hidden", [(1, 576), (64, 576), (300, 1024), (3, 7)])
def test_rms_norm(kernels, rows, hidden) -> None:
    norm = decoder.RMSNorm(hidden, 1e-5).to(BF16)
    x, weight = _bf16_values(rows, hidden, seed=rows, scale=3.0), _bf16_values(hidden, seed=hidden)
    with torch.no_grad():
        norm.weight.copy_(weight)
        out = norm(x.to(BF16))
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    _close(out, weight * normed, atol=1e-3)
    # transformers' bf16 arithmetic: normalize in fp32, round, scale in bf16 (bit for bit here)
    assert torch.equal(out, weight.to(BF16) * normed.to(BF16))


@pytest.mark.parametrize("rows, width", [(1, 1536), (64, 1536), (5, 3)])
def test_silu_and_mul(kernels, rows, width) -> None:
    x = _bf16_values(rows, 2 * width, seed=width, scale=4.0)
    out, x16 = torch.empty(rows, width, dtype=BF16), x.to(BF16)
    kernels.shm_silu_and_mul(out.data_ptr(), x16.data_ptr(), rows, width)
    gate, up = x.split(width, dim=-1)
    _close(out, torch.nn.functional.silu(gate) * up, atol=1e-3)


class _RopeConfig:
    rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    max_position_embeddings = 512


@pytest.mark.parametrize("rows, heads, head_dim", [(1, 12, 64), (64, 12, 64), (300, 6, 128)])
def test_rotary(kernels, rows, heads, head_dim) -> None:
    embedding = rotary.RotaryEmbedding(_RopeConfig(), head_dim, 1024)
    positions = torch.randint(0, 1024, (rows,), generator=torch.Generator().manual_seed(heads))
    qkv = _bf16_values(rows, heads + 4, head_dim, seed=heads)
    native, reference = qkv.to(BF16), qkv.clone()
    assert kernels_for(native) is kernels
    embedding(positions, BF16).apply_(native[:, :heads])
    # transformers casts cos / sin to the activation dtype before rotating; so does the kernel
    cos = embedding.cos_cache[positions].unsqueeze(1).to(BF16).float()
    sin = embedding.sin_cache[positions].unsqueeze(1).to(BF16).float()
    rotary.apply_rotary_(reference[:, :heads], cos, sin)
    _close(native, reference, atol=2e-3)
    assert torch.equal(native[:, heads:].float(), qkv[:, heads:])  # the v part is left alone


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 64])
@pytest.mark.parametrize("bias, with_residual", [(False, False), (True, True)])
def test_linear(rows, bias, with_residual) -> None:
    """Few rows run the C kernel (vdpbf16ps where the CPU has it), more the packed oneDNN bf16
    GEMM; both within one rounding of the fp32 product of the same bf16 values. k = 580: a tail
    of 4 after the kernel's 32-wide steps."""
    layer = Linear(580, 960, bias=bias).to(BF16)
    weight = _bf16_values(960, 580, seed=rows, scale=0.05)
    bias_values = _bf16_values(960, seed=rows + 1) if bias else None
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias:
            layer.bias.copy_(bias_values)
    assert layer.pack(), "oneDNN should pack a bf16 weight on the CPU"
    x = _bf16_values(rows, 580, seed=rows + 2)
    residual = _bf16_values(rows, 960, seed=rows + 3) if with_residual else None
    with torch.no_grad():
        out = layer(x.to(BF16), None if residual is None else residual.to(BF16))
    reference = torch.nn.functional.linear(x, weight, bias_values)
    if residual is not None:
        reference = reference + residual
    _close(out, reference, atol=1e-2)
