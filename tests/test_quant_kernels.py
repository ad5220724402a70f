"""The block-quantized kernels (kernels/quant_kernels.c) against gguf.quants.dequantize + torch.

Every GGML format the kernels run, on every instruction-set build this CPU can run plus the
portable one: dequantized rows must equal the reference bit for bit (the values the arithmetic
sees), and the GEMM must equal dequantize-then-matmul (float64) within fp32 accumulation error,
with bias and residual, odd shapes, 1/2/3/4 rows (the GEMV) and 5/17/33/64/200 rows (the blocked
GEMM: full and partial row tiles, a last column panel of one to five columns) and strided outputs
(fused parts).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shmvllm.model.kernels import QUANT_ISAS, quant_isas_supported, quant_kernels
from shmvllm.model.linear import VocabEmbedding, block_linear, merge_parts
from shmvllm.model.quant import FORMAT_IDS, FORMATS, QuantizedWeight, quantize

ISAS = quant_isas_supported()
pytestmark = pytest.mark.skipif(not ISAS, reason="the quantized kernels could not be built")

# Where each format keeps its fp16 scales (byte offsets in a block): random bytes there would be
# NaN or huge; the rest of a block is any bits. MXFP4's scale is a power-of-two exponent byte.
_FP16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
                "Q5_0": [0], "Q5_1": [0, 2], "Q2_K": [80, 82], "Q3_K": [108], "IQ4_NL": [0], "IQ4_XS": [0],
                "MXFP4": []}
# fp16 scales at the ends of the range (largest, smallest normal, subnormals, signed zero) that
# every eighth block takes
_EXTREME_FP16 = np.array([65504.0, -65504.0, 6.104e-05, 5.96e-08, -5.96e-08, 3.0e-07, 0.0, -0.0], dtype=np.float16)


def random_weight(name: str, n: int, k: int, rng: np.random.Generator) -> QuantizedWeight:
    qtype = FORMAT_IDS[name]
    _, values, nbytes = FORMATS[qtype]
    if name == "F32":
        data = rng.standard_normal((n, k)).astype(np.float32).view(np.uint8)
    elif name == "F16":
        data = rng.standard_normal((n, k)).astype(np.float16).view(np.uint8)
    elif name == "BF16":
        bits = rng.standard_normal((n, k)).astype(np.float32).view(np.uint32) >> 16
        data = bits.astype(np.uint16).view(np.uint8)
    else:
        blocks = rng.integers(0, 256, size=(n * (k // values), nbytes), dtype=np.uint8)
        extreme = rng.random(len(blocks)) < 0.125
        for offset in _FP16_FIELDS[name]:
            scale = (rng.standard_normal(len(blocks)) * 0.05).astype(np.float16)
            scale[extreme] = rng.choice(_EXTREME_FP16, int(extreme.sum()))
            blocks[:, offset : offset + 2] = scale.view(np.uint8).reshape(-1, 2)
        if name == "MXFP4":  # exponents 2^-128 .. 2^72: sums of products stay finite
            blocks[:, 0] = np.where(extreme, rng.integers(0, 200, len(blocks)), rng.integers(118, 132, len(blocks)))
        data = blocks.reshape(n, -1)
    return QuantizedWeight(torch.from_numpy(np.ascontiguousarray(data).reshape(n, -1)), qtype, k)


def block_width(name: str) -> int:
    return FORMATS[FORMAT_IDS[name]][1]


def reference(x: torch.Tensor, w: torch.Tensor, bias, residual) -> torch.Tensor:
    out = x.double() @ w.double().T
    if bias is not None:
        out += bias.double()
    if residual is not None:
        out += residual.double()
    return out


def check_close(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    # fp32 accumulation error bound: ~k * eps * sum |x||w|, with margin
    scale = (x.double().abs() @ w.double().abs().T) + 1.0
    err = (got.double() - want).abs() / scale
    assert float(err.max()) < 1e-5, float(err.max())


# The formats whose blocked GEMM (more than 4 rows) the VNNI build runs with x in two int8 pieces per block of 32
INT8_GEMM_FORMATS = {"Q5_0", "Q5_1", "Q4_K"}


def int8_gemm_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What x in two int8 pieces per block of 32 (within max |x| / 127 / 256 of x) may cost each
    output: sum |w| times that, plus fp32 rounding."""
    rows, k = x.shape
    step = x.double().abs().view(rows, k // 32, 32).amax(-1) / 127 / 256
    return 1.01 * step.repeat_interleave(32, -1) @ w.double().abs().T + 2e-6 * (x.double().abs() @ w.double().abs().T + 1.0)


def check_gemm(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, w: torch.Tensor, isa: str, names: set[str]) -> None:
    """check_close, or the int8 bound where the VNNI build's int8 GEMM runs one of `names`."""
    rows = x.numel() // x.shape[-1]
    if isa == "avx512vnni" and rows > 4 and names & INT8_GEMM_FORMATS:
        x2 = x.reshape(rows, -1)
        err = (got.double().reshape(rows, -1) - want.reshape(rows, -1)).abs()
        bound = int8_gemm_bound(x2, w)
        assert bool((err <= bound).all()), float((err / bound).max())
    else:
        check_close(got, want, x, w)


@pytest.fixture(params=ISAS)
def isa(request, monkeypatch):
    monkeypatch.setenv("SHMVLLM_QUANT_ISA", request.param)
    quant_kernels.cache_clear()
    yield request.param
    quant_kernels.cache_clear()


@pytest.mark.parametrize("name", sorted(FORMAT_IDS))
def test_dequantized_rows_equal_gguf_reference(isa, name):
    rng = np.random.default_rng(1)
    k = 512 if block_width(name) == 256 else 96
    weight = random_weight(name, 13, k, rng)
    if name == "MXFP4":  # every exponent byte, up to values that overflow to inf
        weight.data.view(-1, 17)[:, 0] = torch.arange(weight.data.numel() // 17) * 7 % 256
    want = weight.dequantize()
    table = VocabEmbedding(13, k)
    table.set_blocks(weight)
    ids = torch.tensor([[3, 0], [12, 3]])
    got = table(ids)
    assert got.shape == (2, 2, k)
    assert torch.equal(got.view(-1, k), want[ids.view(-1)])  # bit for bit


def test_mxfp4_every_exponent_byte(isa):
    """All 256 e8m0 scales (2^-128 .. 2^127, the largest overflowing to inf as in gguf-py)."""
    rng = np.random.default_rng(2)
    weight = random_weight("MXFP4", 256, 32, rng)
    weight.data[:, 0] = torch.arange(256, dtype=torch.uint8)
    table = VocabEmbedding(256, 32)
    table.set_blocks(weight)
    with np.errstate(over="ignore"):
        want = weight.dequantize()
    assert torch.equal(table(torch.arange(256)), want)


@pytest.mark.parametrize("name", sorted(FORMAT_IDS))
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 17, 33, 64, 200])
def test_gemm_matches_dequantize_then_matmul(isa, name, rows):
    rng = np.random.default_rng(rows)
    n, k = 37, (512 if block_width(name) == 256 else 160)
    weight = random_weight(name, n, k, rng)
    w = weight.dequantize()
    x = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32))
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    residual = torch.from_numpy(rng.standard_normal((rows, n)).astype(np.float32))
    for b, r in [(None, None), (bias, None), (None, residual), (bias, residual)]:
        got = block_linear(x, [(0, weight)], n, b, r)
        check_gemm(got, reference(x, w, b, r), x, w, isa, {name})


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0"])
def test_gemv_row_is_the_same_alone_or_among_rows(isa, name):
    # speculative verification runs a request's rows together: each must equal its one-row decode bit for bit
    rng = np.random.default_rng(7)
    n, k = 37, 160
    weight = random_weight(name, n, k, rng)
    x = torch.from_numpy(rng.standard_normal((4, k)).astype(np.float32))
    together = {rows: block_linear(x[:rows], [(0, weight)], n, None, None) for rows in (2, 3, 4)}
    for i in range(4):
        alone = block_linear(x[i : i + 1], [(0, weight)], n, None, None)
        for rows, out in together.items():
            if i < rows:
                assert torch.equal(out[i : i + 1], alone), (name, i, rows)


@pytest.mark.parametrize("int8_isa", [pytest.param(isa, marks=pytest.mark.skipif(isa not in ISAS, reason=f"the CPU lacks {isa}"))
                                      for isa in ("avx512vnni", "avx2")])
@pytest.mark.parametrize("name", ["Q2_K", "Q3_K", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 4])
def test_int8_rows_error_is_the_split_of_x(int8_isa, name, rows):
    """The VNNI and AVX2 builds' Q2_K / Q3_K / Q4_1 GEMV (AVX2's Q5_0 / Q5_1, VNNI's Q8_0) holds x per block
    (256 / 32 values) in three int8 pieces, to within max |x| / 127 / 32768: with outliers 1000x the
    rest, the error stays within sum |w| times that (plus fp32 rounding; the fp32 rows are within it too)."""
    rng = np.random.default_rng(11)
    n, k = 37, 1024
    weight = random_weight(name, n, k, rng)
    w = weight.dequantize().double()
    x = rng.standard_normal((rows, k)) * np.where(rng.random((rows, k)) < 0.01, 1000.0, 1.0)
    x = torch.from_numpy(x.astype(np.float32))
    out = torch.empty(rows, n)
    lib = quant_kernels(int8_isa)
    assert lib.shm_qgemm(out.data_ptr(), n, x.data_ptr(), k, weight.data.data_ptr(), weight.data.shape[1],
                         weight.qtype, None, None, 0, rows, n, k) == 0
    err = (out.double() - x.double() @ w.T).abs()
    split = block_width(name)
    step = x.double().abs().view(rows, k // split, split).amax(-1) / 127 / 32768
    bound = 1.01 * step.repeat_interleave(split, -1) @ w.abs().T + 2e-6 * (x.double().abs() @ w.abs().T + 1.0)
    assert bool((err <= bound).all()), float((err / bound).max())


@pytest.mark.parametrize("rows", [1, 4, 5, 64, 200])
def test_mixed_format_parts_fill_their_columns(isa, rows):
    """A fused projection with shards in different formats: each part writes its own columns."""
    rng = np.random.default_rng(7)
    k = 256
    q, kk, v = random_weight("Q4_K", 24, k, rng), random_weight("Q4_K", 8, k, rng), random_weight("Q6_K", 8, k, rng)
    parts = merge_parts([(32, v), (0, q), (24, kk)], 40, k)
    assert [(offset, part.name, part.n) for offset, part in parts] == [(0, "Q4_K", 32), (32, "Q6_K", 8)]
    w = torch.cat([q.dequantize(), kk.dequantize(), v.dequantize()])
    x = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32))
    bias = torch.from_numpy(rng.standard_normal(40).astype(np.float32))
    residual = torch.from_numpy(rng.standard_normal((rows, 40)).astype(np.float32))
    got = block_linear(x, parts, 40, bias, residual)
    check_gemm(got, reference(x, w, bias, residual), x, w, isa, {"Q4_K"})


@pytest.mark.skipif("avx512vnni" not in ISAS, reason="the CPU lacks avx512vnni")
@pytest.mark.parametrize("name", sorted(INT8_GEMM_FORMATS))
@pytest.mark.parametrize("rows", [5, 85])
def test_int8_gemm_error_is_the_split_of_x(name, rows):
    """The VNNI build's blocked GEMM holds x per block of 32 in two int8 pieces, to within max |x| / 127 / 256:
    with outliers 1000x the rest, the error stays within sum |w| times that; x that is not finite
    gives NaN in its row's outputs, zeros give zeros."""
    rng = np.random.default_rng(13)
    n, k = 37, 1024
    weight = random_weight(name, n, k, rng)
    w = weight.dequantize().double()
    x = rng.standard_normal((rows, k)) * np.where(rng.random((rows, k)) < 0.01, 1000.0, 1.0)
    x[1] = 0.0
    x[2, 7] = np.inf
    x = torch.from_numpy(x.astype(np.float32))
    got = torch.empty(rows, n)
    assert quant_kernels("avx512vnni").shm_qgemm(got.data_ptr(), n, x.data_ptr(), k, weight.data.data_ptr(),
                                                 weight.data.shape[1], weight.qtype, None, None, 0, rows, n, k) == 0
    assert bool(got[2].isnan().all()) and bool((got[1] == 0).all())
    keep = [r for r in range(rows) if r != 2]
    err = (got[keep].double() - x[keep].double() @ w.T).abs()
    bound = int8_gemm_bound(x[keep], w)
    assert bool((err <= bound).all()), float((err / bound).max())


@pytest.mark.parametrize("rows", [5, 64, 131])
@pytest.mark.parametrize("n", [1, 7, 131])
def test_blocked_gemm_odd_shapes(isa, rows, n):
    """Ragged column panels and row tiles, a long row of inputs (the down projection's), the
    3-D input of a layer."""
    rng = np.random.default_rng(n * rows)
    k = 1536
    weight = random_weight("Q4_1", n, k, rng)
    w = weight.dequantize()
    x = torch.from_numpy(rng.standard_normal((1, rows, k)).astype(np.float32))
    residual = torch.from_numpy(rng.standard_normal((1, rows, n)).astype(np.float32))
    got = block_linear(x, [(0, weight)], n, None, residual)
    assert got.shape == (1, rows, n)
    check_gemm(got.view(rows, n), reference(x.view(rows, k), w, None, residual.view(rows, n)), x.view(rows, k), w, isa, {"Q4_1"})


def test_parts_must_tile_the_weight():
    rng = np.random.default_rng(0)
    a = random_weight("Q8_0", 4, 64, rng)
    with pytest.raises(ValueError, match="tile"):
        merge_parts([(0, a), (5, a)], 9, 64)
    with pytest.raises(ValueError, match="cover 4"):
        merge_parts([(0, a)], 9, 64)


def test_quantize_q8_0_roundtrip_and_gemm(isa):
    rng = np.random.default_rng(3)
    w = torch.from_numpy(rng.standard_normal((19, 96)).astype(np.float32))
    weight = quantize(w, FORMAT_IDS["Q8_0"])
    assert weight.shape == (19, 96)
    deq = weight.dequantize()
    assert float((deq - w).abs().max()) <= float(w.abs().max()) / 127
    x = torch.from_numpy(rng.standard_normal((2, 96)).astype(np.float32))
    check_close(block_linear(x, [(0, weight)], 19), reference(x, deq, None, None), x, deq)


def test_bad_inputs_are_refused(isa):
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="Q4_1 rows of 96 values take 60 bytes"):
        QuantizedWeight(torch.zeros(2, 61, dtype=torch.uint8), FORMAT_IDS["Q4_1"], 96)
    with pytest.raises(ValueError, match="not supported"):
        QuantizedWeight(torch.zeros(2, 66, dtype=torch.uint8), 16, 256)  # IQ2_XXS
    table = VocabEmbedding(4, 64)
    table.set_blocks(random_weight("Q8_0", 4, 64, rng))
    with pytest.raises(IndexError, match=r"\[0, 4\)"):
        table(torch.tensor([1, 4]))
    weight = random_weight("Q8_0", 4, 64, rng)
    with pytest.raises(ValueError, match="fp32 input"):
        block_linear(torch.zeros(1, 64, dtype=torch.float64), [(0, weight)], 4)


def test_isa_override_is_checked(monkeypatch):
    monkeypatch.setenv("SHMVLLM_QUANT_ISA", "sse9")
    quant_kernels.cache_clear()
    try:
        with pytest.raises(ValueError, match="sse9"):
            quant_kernels()
    finally:
        quant_kernels.cache_clear()
    assert ISAS[-1] == "portable" and set(ISAS) <= {name for name, _, _ in QUANT_ISAS}


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_read_probe_reads_every_byte(isa, threads):
    """The bandwidth probe sums the whole buffer whatever the thread count (each thread's share
    is a whole number of its vector steps; 65,536 float ones sum exactly)."""
    lib = quant_kernels()
    ones = torch.ones(1 << 16, dtype=torch.float32)
    assert lib.shm_read_probe(ones.data_ptr(), ones.numel() * 4, threads) == float(ones.numel())
