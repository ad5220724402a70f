"""Q4_1 repacked at load in groups of 8 rows (quant.Q4_1_R8, quant_kernels.c's T_Q4_1_R8).

The builds with the 8-row GEMV pass (AVX2, AVX-512 VNNI) repack a Linear's Q4_1 parts; every
build runs a repacked weight. Its GEMV, few-row GEMV (2-4 rows: speculative verification) and
blocked GEMM must give the plain rows' bits on the same build: for row ranges that start and end
inside a group (threads splitting the rows unevenly), with bias and residual, in a fused weight
beside a part of another format.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shmvllm.model.kernels import quant_isas_supported, quant_kernels
from shmvllm.model.linear import Linear, block_linear, repacked
from shmvllm.model.quant import FORMAT_IDS, Q4_1_R8, QuantizedWeight
from test_quant_kernels import isa, random_weight  # noqa: F401 (isa: the fixture running a test on each build)

ISAS = quant_isas_supported()
REPACKING = [isa for isa in ("avx512vnni", "avx2") if isa in ISAS]
pytestmark = pytest.mark.skipif(not REPACKING, reason="no kernel build with the 8-row pass runs on this CPU")
Q4_1 = FORMAT_IDS["Q4_1"]


def pair(n: int, k: int, seed: int) -> tuple[QuantizedWeight, QuantizedWeight]:
    """A random Q4_1 weight and its repacked copy (made by a build with the pass)."""
    plain = random_weight("Q4_1", n, k, np.random.default_rng(seed))
    packed = repacked(plain, quant_kernels(REPACKING[0]))
    assert packed.qtype == Q4_1_R8 and packed.data.data_ptr() != plain.data.data_ptr()
    return plain, packed


def test_layout_round_trips_and_dequantizes_as_the_rows():
    plain, packed = pair(48, 160, 1)
    assert not torch.equal(packed.data, plain.data)
    assert torch.equal(packed.plain().data, plain.data)
    assert torch.equal(packed.dequantize(), plain.dequantize())
    assert packed.name == "Q4_1 in groups of 8" and packed.shape == (48, 160)


def test_rows_are_cut_on_group_boundaries():
    plain, packed = pair(48, 96, 2)
    part = packed.rows(16, 24)
    assert part.qtype == Q4_1_R8 and torch.equal(part.plain().data, plain.rows(16, 24).data)
    with pytest.raises(ValueError, match="groups of 8 rows"):
        packed.rows(3, 8)
    with pytest.raises(ValueError, match="groups of 8 rows"):
        packed.rows(8, 12)
    with pytest.raises(ValueError, match="groups of 8 rows"):
        QuantizedWeight(packed.data[:12], Q4_1_R8, 96)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 17])
def test_repacked_gemv_and_gemm_give_the_rows_bits(isa, threads, rows):
    plain, packed = pair(40, 576, 3)
    rng = np.random.default_rng(rows)
    x = torch.from_numpy(rng.standard_normal((rows, 576)).astype(np.float32))
    bias = torch.from_numpy(rng.standard_normal(40).astype(np.float32))
    residual = torch.from_numpy(rng.standard_normal((rows, 40)).astype(np.float32))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # 40 rows over 3 threads: ranges [0, 13), [13, 26), [26, 40)
    try:
        for b, r in ((None, None), (bias, residual)):
            want = block_linear(x, [(0, plain)], 40, b, r)
            got = block_linear(x, [(0, packed)], 40, b, r)
            assert torch.equal(got, want), (isa, threads, rows)
    finally:
        torch.set_num_threads(before)


def test_each_row_is_its_own_among_rows(isa):
    # speculative verification: each of 2-4 rows of x equals its one-row GEMV bit for bit
    plain, packed = pair(64, 160, 4)
    x = torch.from_numpy(np.random.default_rng(5).standard_normal((4, 160)).astype(np.float32))
    for rows in (2, 3, 4):
        together = block_linear(x[:rows], [(0, packed)], 64, None, None)
        for i in range(rows):
            assert torch.equal(together[i], block_linear(x[i : i + 1], [(0, plain)], 64, None, None)[0])


def test_linear_repacks_q4_1_parts_of_whole_groups(isa):
    q8 = random_weight("Q8_0", 5, 96, np.random.default_rng(6))
    q4 = random_weight("Q4_1", 40, 96, np.random.default_rng(7))
    odd = random_weight("Q4_1", 44, 96, np.random.default_rng(8))
    fused, ragged = Linear(96, 45, bias=False), Linear(96, 44, bias=False)
    fused.set_blocks([(0, q8), (5, q4)])
    ragged.set_blocks([(0, odd)])
    x = torch.from_numpy(np.random.default_rng(9).standard_normal((3, 96)).astype(np.float32))
    want = fused(x)
    fused.repack()
    ragged.repack()
    types = [w.qtype for _, w in fused.blocks]
    assert types == [FORMAT_IDS["Q8_0"], Q4_1_R8 if isa in REPACKING else Q4_1]
    assert ragged.blocks[0][1].qtype == Q4_1  # 44 rows: not whole groups, the rows stay
    assert torch.equal(fused(x), want)


def test_repacked_rows_have_no_row_lookup(isa):
    _, packed = pair(8, 32, 10)
    out = torch.empty(1, 32)
    ids = torch.zeros(1, dtype=torch.int64)
    rc = quant_kernels().shm_qdequant_rows(out.data_ptr(), packed.data.data_ptr(), 20, Q4_1_R8, ids.data_ptr(), 1, 8, 32)
    assert rc == -1
