"""The native packed BERT encoder against transformers' BertModel (padded, with attention mask)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig
from transformers import BertModel as HFBertModel

from shmvllm.model.bert import AttentionPlan, BertModel
from shmvllm.model.encoders import load_encoder

LENGTHS = [1, 5, 17, 2, 33, 9]


@pytest.fixture(scope="module")
def hf_config(tiny_bert_dir):
    return AutoConfig.from_pretrained(tiny_bert_dir)


@pytest.fixture(scope="module")
def hf_model(tiny_bert_dir):
    return HFBertModel.from_pretrained(tiny_bert_dir, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def ours(tiny_bert_dir, hf_config):
    return load_encoder(tiny_bert_dir, hf_config, torch.float32, torch.device("cpu"))[0]


@pytest.fixture(scope="module")
def ours_torch(tiny_bert_dir, hf_config):
    """The encoder on torch's linears (oneDNN / F.linear), as where the C GEMM does not run."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SHMVLLM_QUANT_ISA", "portable")
        model = load_encoder(tiny_bert_dir, hf_config, torch.float32, torch.device("cpu"))[0]
    assert not model.layers[0].packed
    return model


def _batch(seed: int = 0, with_token_types: bool = False):
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(1000, 30000, (n,), generator=g) for n in LENGTHS]
    types = [torch.randint(0, 2, (n,), generator=g) if with_token_types else torch.zeros(n, dtype=torch.long) for n in LENGTHS]
    return seqs, types


def _hf_hidden(hf_model, seqs, types) -> list[torch.Tensor]:
    """Per-sequence last hidden states from the padded HF batch."""
    longest = max(LENGTHS)
    ids = torch.zeros(len(seqs), longest, dtype=torch.long)
    tt = torch.zeros_like(ids)
    mask = torch.zeros_like(ids)
    for i, (s, t) in enumerate(zip(seqs, types)):
        ids[i, : len(s)], tt[i, : len(s)], mask[i, : len(s)] = s, t, 1
    with torch.no_grad():
        out = hf_model(input_ids=ids, token_type_ids=tt, attention_mask=mask).last_hidden_state
    return [out[i, :n] for i, n in enumerate(LENGTHS)]


def _our_hidden(model, seqs, types, pass_types: bool) -> list[torch.Tensor]:
    cu = [0]
    for s in seqs:
        cu.append(cu[-1] + len(s))
    positions = torch.cat([torch.arange(len(s)) for s in seqs])
    with torch.inference_mode():
        out = model(torch.cat(seqs), positions, cu, torch.cat(types) if pass_types else None)
    assert out.shape == (cu[-1], model.hidden_size)
    return [out[a:b] for a, b in zip(cu[:-1], cu[1:])]


def test_packed_hidden_states_match_transformers(hf_model, ours):
    seqs, types = _batch()
    for ref, got in zip(_hf_hidden(hf_model, seqs, types), _our_hidden(ours, seqs, types, pass_types=False)):
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


def test_token_type_ids_match_transformers(hf_model, ours):
    seqs, types = _batch(seed=1, with_token_types=True)
    for ref, got in zip(_hf_hidden(hf_model, seqs, types), _our_hidden(ours, seqs, types, pass_types=True)):
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


def test_sequences_do_not_see_each_other(ours):
    """A sequence's states are the same alone and packed between others."""
    seqs, types = _batch(seed=2)
    packed = _our_hidden(ours, seqs, types, pass_types=False)
    for i in (0, 3, 5):
        alone = _our_hidden(ours, [seqs[i]], [types[i]], pass_types=False)[0]
        torch.testing.assert_close(packed[i], alone, atol=1e-5, rtol=1e-5)


def test_loads_prefixed_checkpoint_with_heads(tiny_bert_dir, hf_config, ours, tmp_path):
    """`BertFor*` checkpoints carry `bert.` names plus head weights: the encoder loads the same."""
    weights = load_file(tiny_bert_dir / "model.safetensors")
    prefixed = {f"bert.{k}": v.contiguous() for k, v in weights.items()}
    prefixed["cls.predictions.bias"] = torch.zeros(hf_config.vocab_size)
    save_file(prefixed, tmp_path / "model.safetensors")
    other = load_encoder(tmp_path, hf_config, torch.float32, torch.device("cpu"))[0]
    for (name, a), (_, b) in zip(ours.state_dict().items(), other.state_dict().items()):
        assert torch.equal(a, b), name


def test_unknown_weight_is_an_error(tiny_bert_dir, hf_config):
    weights = load_file(tiny_bert_dir / "model.safetensors")
    weights["encoder.layer.0.attention.self.rotary.weight"] = torch.zeros(3)
    model = BertModel(hf_config)
    with pytest.raises(ValueError, match="rotary"):
        model.load_weights(weights)


def test_missing_weights_dir_is_an_error(tmp_path, hf_config):
    with pytest.raises(ValueError, match="safetensors"):
        load_encoder(tmp_path, hf_config, torch.float32, torch.device("cpu"))[0]


def test_attention_runs_for_sorted_lengths(ours):
    """Length-sorted packing attends runs of equal length together, and each sequence still
    attends only to itself."""
    lengths = [3, 3, 3, 8, 9, 10, 40]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    assert AttentionPlan(cu).runs == [(0, 0, 3, 3), (9, 3, 1, 8), (17, 4, 1, 9), (26, 5, 1, 10), (36, 6, 1, 40)]
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(1000, 30000, (n,), generator=g) for n in lengths]
    zeros = [torch.zeros(n, dtype=torch.long) for n in lengths]
    packed = _our_hidden(ours, seqs, zeros, pass_types=False)
    for i in range(len(lengths)):
        alone = _our_hidden(ours, [seqs[i]], [zeros[i]], pass_types=False)[0]
        torch.testing.assert_close(packed[i], alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [32, 40, 64, 12])  # 40: a last slice of 8 columns; 12: SDPA only
@pytest.mark.parametrize("window", [None, 0, 5])
def test_attention_kernel_matches_sdpa(monkeypatch, head_dim, window):
    """kernels/encoder_attention.c (CPU, fp32) against the SDPA runs, over mixed lengths (one
    token, runs of equal length, longer than a window) and a QKV with a wider row stride."""
    from shmvllm.model import bert
    from shmvllm.model.kernels import encoder_attention_kernels

    if encoder_attention_kernels() is None:
        pytest.skip("needs an x86 CPU with AVX2 + FMA and a C compiler")
    lengths = [1, 2, 7, 7, 7, 9, 16, 33, 70]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    heads, g = 3, torch.Generator().manual_seed(7)
    qkv = torch.randn(cu[-1], 3 * heads * head_dim + 5, generator=g)[:, : 3 * heads * head_dim]
    plan = AttentionPlan(cu)
    assert (bert._attention_kernels(qkv, qkv, head_dim) is not None) == (head_dim % 8 == 0)
    got = plan.attend(qkv, heads, head_dim, window)
    monkeypatch.setattr(bert, "_attention_kernels", lambda q, kv, head_dim: None)
    torch.testing.assert_close(got, plan.attend(qkv, heads, head_dim, window), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("window", [None, 3])
def test_one_query_per_sequence_equals_its_rows_of_full_attention(monkeypatch, kernel, window):
    """attend_one: the first, the last or any one token of each sequence queries all of its
    keys, and gets its row of the full attention (the C kernel and the SDPA runs)."""
    from shmvllm.model import bert
    from shmvllm.model.kernels import encoder_attention_kernels

    if kernel and encoder_attention_kernels() is None:
        pytest.skip("needs an x86 CPU with AVX2 + FMA and a C compiler")
    if not kernel:
        monkeypatch.setattr(bert, "_attention_kernels", lambda q, kv, head_dim: None)
    lengths = [1, 2, 7, 7, 7, 9, 16, 33, 70]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    heads, head_dim, g = 3, 32, torch.Generator().manual_seed(11)
    qkv = torch.randn(cu[-1], 3 * heads * head_dim, generator=g)
    plan = AttentionPlan(cu)
    full = plan.attend(qkv, heads, head_dim, window)
    tensor_lengths = torch.tensor(lengths)
    for query_at in (torch.zeros(len(lengths), dtype=torch.int64), tensor_lengths - 1,
                     (torch.rand(len(lengths), generator=g) * tensor_lengths).long()):
        q = qkv[plan.token_rows(query_at), : heads * head_dim]
        got = plan.attend_one(q, qkv[:, heads * head_dim :], heads, head_dim, query_at, window)
        assert got.shape == (len(lengths), heads * head_dim)
        # the kernel's per-query arithmetic is the same either way; SDPA picks its own kernel per shape
        tolerance = dict(atol=0, rtol=0) if kernel else dict(atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(got, full[plan.token_rows(query_at)], **tolerance)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_linear_epilogues(monkeypatch, fused, approximate):
    """The oneDNN-fused GEMM epilogues (CPU) and the plain path (other devices) agree with torch."""
    from shmvllm.model import bert

    monkeypatch.setattr(bert, "_ONEDNN_FUSION", fused)
    g = torch.Generator().manual_seed(4)
    layer = torch.nn.Linear(24, 40)
    x, residual = torch.randn(7, 24, generator=g), torch.randn(7, 40, generator=g)
    ref = torch.nn.functional.linear(x, layer.weight, layer.bias)
    with torch.inference_mode():
        torch.testing.assert_close(bert._linear(x, layer), ref)
        torch.testing.assert_close(bert._linear(x, layer, residual=residual), ref + residual)
        torch.testing.assert_close(
            bert._linear(x, layer, gelu=approximate), torch.nn.functional.gelu(ref, approximate=approximate)
        )


@pytest.mark.parametrize("onednn", [True, False])
def test_torch_linears_match_transformers(monkeypatch, hf_model, ours_torch, onednn):
    from shmvllm.model import bert

    monkeypatch.setattr(bert, "_ONEDNN_FUSION", onednn and bert._ONEDNN_FUSION)
    seqs, types = _batch(seed=5)
    for ref, got in zip(_hf_hidden(hf_model, seqs, types), _our_hidden(ours_torch, seqs, types, pass_types=False)):
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


def test_token_chunks_do_not_change_the_result(monkeypatch, ours_torch):
    from shmvllm.model import bert

    seqs, types = _batch(seed=6)
    whole = _our_hidden(ours_torch, seqs, types, pass_types=False)
    monkeypatch.setattr(bert, "TOKEN_CHUNK", 7)
    for a, b in zip(whole, _our_hidden(ours_torch, seqs, types, pass_types=False)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
