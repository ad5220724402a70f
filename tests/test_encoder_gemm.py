"""The encoders' AVX2 GEMM (model/encoder_gemm.py, kernels/encoder_gemm.c) against torch, and the
BERT encoder on it against transformers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig
from transformers import BertModel as HFBertModel

from shmvllm.model import encoder_gemm
from shmvllm.model.encoders import load_encoder
from shmvllm.model.kernels import encoder_gemm_kernels, quant_isas_supported

pytestmark = pytest.mark.skipif(
    "avx2" not in quant_isas_supported() or encoder_gemm_kernels() is None,
    reason="needs an x86 CPU with AVX2 + FMA and a C compiler",
)


@pytest.mark.parametrize(
    "rows, k, n, bias",
    [
        (13, 20, 40, True),  # fewer rows than a tile row block, columns not a whole panel
        (100, 800, 48, True),  # k in three passes, rows over two blocks plus an edge
        (1000, 64, 24, False),  # many row blocks, no bias
        (1, 384, 1152, True),  # one row: the panels split between threads
        (2047, 384, 384, True),  # rows shared out by threads in whole tiles, an edge tile last
    ],
)
def test_gemm_and_epilogues_match_torch(rows, k, n, bias):
    g = torch.Generator().manual_seed(rows + k + n)
    layer = torch.nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, k, generator=g) * k**-0.5)
    x, residual = torch.randn(rows, k, generator=g), torch.randn(rows, n, generator=g)
    packed = encoder_gemm.PackedLinear(layer.weight.detach(), None if layer.bias is None else layer.bias.detach())
    with torch.inference_mode():
        ref = F.linear(x.double(), layer.weight.double(), None if layer.bias is None else layer.bias.double()).float()
        torch.testing.assert_close(packed(x), ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(packed(x, residual=residual), ref + residual, atol=1e-5, rtol=1e-5)
        for approximate in ("none", "tanh"):
            torch.testing.assert_close(packed(x, gelu=approximate), F.gelu(ref, approximate=approximate), atol=1e-5, rtol=1e-5)
        strided = torch.randn(rows, 2 * k, generator=g)[:, ::2]  # not row-major: copied first
        torch.testing.assert_close(packed(strided), packed(strided.contiguous()))
        into = torch.full((rows, 2 * n), float("nan"))[:, n:]  # rows of a wider tensor: only those written
        got = packed(x, residual=residual, out=into)
        assert got.data_ptr() == into.data_ptr() and not into.isnan().any()
        torch.testing.assert_close(got, ref + residual, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 50, 2047])  # a short batch (three GEMMs), blocks shared out by threads
@pytest.mark.parametrize("in_place", [False, True])
def test_token_wise_matches_torch(rows, in_place):
    g = torch.Generator().manual_seed(rows)
    hidden, inter = 40, 96
    linears = [torch.nn.Linear(hidden, hidden), torch.nn.Linear(hidden, inter), torch.nn.Linear(inter, hidden)]
    norms = [torch.nn.LayerNorm(hidden, eps=1e-6) for _ in range(2)]
    with torch.inference_mode():
        for norm in norms:
            norm.weight.copy_(torch.randn(hidden, generator=g)), norm.bias.copy_(torch.randn(hidden, generator=g))
        attn = torch.randn(rows, 3 * hidden, generator=g)[:, hidden : 2 * hidden]  # rows at a stride
        x = torch.randn(rows, hidden, generator=g)
        d = lambda t: t.double()  # noqa: E731
        y = F.layer_norm(F.linear(d(attn), d(linears[0].weight), d(linears[0].bias)) + d(x), (hidden,), d(norms[0].weight), d(norms[0].bias), 1e-6)
        h = F.gelu(F.linear(y, d(linears[1].weight), d(linears[1].bias)))
        ref = F.layer_norm(F.linear(h, d(linears[2].weight), d(linears[2].bias)) + y, (hidden,), d(norms[1].weight), d(norms[1].bias), 1e-6)
        packed = [encoder_gemm.PackedLinear(lin.weight, lin.bias) for lin in linears]
        out = x if in_place else torch.empty_like(x)
        got = encoder_gemm.token_wise(attn, x, packed[0], norms[0], packed[1], "none", packed[2], norms[1], out)
        assert got.data_ptr() == out.data_ptr()
        torch.testing.assert_close(got, ref.float(), atol=2e-5, rtol=1e-5)
        with pytest.raises(ValueError, match="do not chain"):
            encoder_gemm.token_wise(attn, x, packed[0], norms[0], packed[2], "none", packed[1], norms[1], out)
        with pytest.raises(ValueError, match="norm2 must be a LayerNorm over 40"):
            encoder_gemm.token_wise(attn, x, packed[0], norms[0], packed[1], "none", packed[2], torch.nn.LayerNorm(8), out)


@pytest.mark.parametrize("rows", [385, 2047])  # the row deal: shares of whole tiles, an edge tile last
def test_every_row_once_whatever_the_team(rows):
    """Rows are dealt to the threads and taken over by those done first: with 1 to 5 threads
    (more than the cores, so that threads are preempted mid-share) every row is written, and
    bit-equal to one thread's."""
    g = torch.Generator().manual_seed(rows)
    hidden, inter = 40, 96
    linears = [torch.nn.Linear(hidden, hidden), torch.nn.Linear(hidden, inter), torch.nn.Linear(inter, hidden)]
    norms = [torch.nn.LayerNorm(hidden) for _ in range(2)]
    packed = [encoder_gemm.PackedLinear(lin.weight.detach(), lin.bias.detach()) for lin in linears]
    attn, x = torch.randn(rows, hidden, generator=g), torch.randn(rows, hidden, generator=g)
    threads = torch.get_num_threads()
    results = []
    try:
        with torch.inference_mode():
            for team in (1, 2, 3, 5):
                torch.set_num_threads(team)
                gemm = packed[1](attn, out=torch.full((rows, inter), float("nan")))
                wise = encoder_gemm.token_wise(attn, x, packed[0], norms[0], packed[1], "none", packed[2], norms[1],
                                               torch.full((rows, hidden), float("nan")))
                assert not gemm.isnan().any() and not wise.isnan().any()
                results.append((gemm, wise))
    finally:
        torch.set_num_threads(threads)
    for gemm, wise in results[1:]:
        assert torch.equal(gemm, results[0][0]) and torch.equal(wise, results[0][1])


def test_bad_input_is_a_value_error():
    packed = encoder_gemm.PackedLinear(torch.randn(16, 8), torch.randn(16))
    with pytest.raises(ValueError, match=r"x must be a float32 \[tokens, 8\]"):
        packed(torch.randn(3, 9))
    with pytest.raises(ValueError, match="residual must be"):
        packed(torch.randn(3, 8), residual=torch.randn(3, 15))
    with pytest.raises(ValueError, match="out must be"):
        packed(torch.randn(3, 8), out=torch.empty(3, 15))


def test_chosen_by_isa(monkeypatch):
    weight = torch.randn(16, 8)
    monkeypatch.setenv("SHMVLLM_QUANT_ISA", "avx2")
    assert isinstance(encoder_gemm.pack_for_cpu(weight, None), encoder_gemm.PackedLinear)
    assert encoder_gemm.pack_for_cpu(weight.bfloat16(), None) is None  # fp32 only
    monkeypatch.setenv("SHMVLLM_QUANT_ISA", "portable")
    assert encoder_gemm.pack_for_cpu(weight, None) is None  # held off the vector kernels: oneDNN / torch
    monkeypatch.delenv("SHMVLLM_QUANT_ISA")
    assert isinstance(encoder_gemm.pack_for_cpu(weight, None), encoder_gemm.PackedLinear)  # AVX-512 CPUs too


def test_bert_on_the_avx2_gemm_matches_transformers(monkeypatch, tiny_bert_dir):
    monkeypatch.setenv("SHMVLLM_QUANT_ISA", "avx2")
    config = AutoConfig.from_pretrained(tiny_bert_dir)
    ours = load_encoder(tiny_bert_dir, config, torch.float32, torch.device("cpu"))[0]
    assert set(ours.layers[0].packed) == {"qkv", "attn_out", "intermediate", "out"}
    hf = HFBertModel.from_pretrained(tiny_bert_dir, attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(0)
    lengths = [1, 5, 17, 2, 33, 9]
    seqs = [torch.randint(1000, 30000, (n,), generator=g) for n in lengths]
    ids = torch.zeros(len(seqs), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = s, 1
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    with torch.inference_mode():
        ref = hf(input_ids=ids, attention_mask=mask).last_hidden_state
        got = ours(torch.cat(seqs), torch.cat([torch.arange(n) for n in lengths]), cu)
    for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        torch.testing.assert_close(got[a:b], ref[i, : lengths[i]], atol=2e-5, rtol=1e-4)
