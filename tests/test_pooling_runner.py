"""Poolers and the PoolingModelRunner against sentence-transformers and transformers."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModel, AutoTokenizer

from shmvllm.engine.arg_utils import EngineArgs
from shmvllm.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from shmvllm.model.pooler import PoolerConfig, PoolingType, finalize, load_pooler_config, pool
from shmvllm.pooling_params import PoolingParams
from shmvllm.worker.pooling_runner import PoolingModelRunner


def _runner(model_dir) -> PoolingModelRunner:
    model_config = EngineArgs(model=str(model_dir), task="embed").create_engine_config().model_config
    runner = PoolingModelRunner(model_config)
    runner.load_model()
    return runner


def _step(prompts: list[list[int]], params=None, computed: int = 0, scheduled=None) -> SchedulerOutput:
    reqs = [
        NewRequestData(f"r{i}", p, [], None, params or PoolingParams(), [], computed) for i, p in enumerate(prompts)
    ]
    num = {r.req_id: len(r.prompt_token_ids) if scheduled is None else scheduled for r in reqs}
    return SchedulerOutput(reqs, CachedRequestData(), num, sum(num.values()))


def _embed(runner, prompts, params=None) -> np.ndarray:
    out = runner.execute_model(_step(prompts, params))
    assert out.req_ids == [f"r{i}" for i in range(len(prompts))]
    assert out.sampled_token_ids == [[] for _ in prompts]
    vectors = [out.pooler_output[f"r{i}"] for i in range(len(prompts))]
    assert all(v.dtype == np.float32 and v.ndim == 1 for v in vectors)
    return np.stack(vectors)


@pytest.fixture(scope="module")
def minilm_runner(minilm_dir):
    return _runner(minilm_dir)


@pytest.fixture(scope="module")
def tiny_runner(tiny_bert_dir):
    return _runner(tiny_bert_dir)


def test_minilm_matches_sentence_transformers(minilm_dir, minilm_runner, embedding_texts):
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(minilm_dir), device="cpu")
    texts = embedding_texts
    expected = reference.encode(texts, batch_size=32, convert_to_numpy=True)
    encoded = reference.tokenizer(texts, truncation=True, max_length=reference.max_seq_length)["input_ids"]
    assert max(len(ids) for ids in encoded) == 256  # the long ones are truncated
    assert encoded[0] == [reference.tokenizer.cls_token_id, reference.tokenizer.sep_token_id]  # empty text
    got = _embed(minilm_runner, encoded)
    cosine = (got * expected).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(expected, axis=1))
    assert cosine.min() >= 0.9999, (cosine.argmin(), cosine.min())
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


def test_tiny_bert_matches_transformers_mean_pooling(tiny_bert_dir, tiny_runner, embedding_texts):
    tokenizer = AutoTokenizer.from_pretrained(tiny_bert_dir)
    texts = embedding_texts[:40]
    batch = tokenizer(texts, truncation=True, max_length=256, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = AutoModel.from_pretrained(tiny_bert_dir).eval()(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    expected = F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1).numpy()
    got = _embed(tiny_runner, tokenizer(texts, truncation=True, max_length=256)["input_ids"])
    np.testing.assert_allclose(got, expected, atol=2e-5)


def test_dimensions_truncate_then_renormalize(tiny_runner):
    prompts = [[101, 2023, 2003, 102], [101, 7592, 102]]
    full = _embed(tiny_runner, prompts, PoolingParams(normalize=False))
    cut = _embed(tiny_runner, prompts, PoolingParams(dimensions=16))
    raw_cut = _embed(tiny_runner, prompts, PoolingParams(dimensions=16, normalize=False))
    expected = full[:, :16] / np.linalg.norm(full[:, :16], axis=1, keepdims=True)
    np.testing.assert_allclose(cut, expected, atol=1e-6)
    np.testing.assert_allclose(raw_cut, full[:, :16], atol=1e-6)


def test_step_with_mixed_params(tiny_runner):
    prompts = [[101, 2023, 102], [101, 2023, 102]]
    step = _step(prompts)
    step.scheduled_new_reqs[1].pooling_params = PoolingParams(dimensions=8)
    out = tiny_runner.execute_model(step).pooler_output
    assert out["r0"].shape == (64,) and out["r1"].shape == (8,)
    np.testing.assert_allclose(out["r1"], out["r0"][:8] / np.linalg.norm(out["r0"][:8]), atol=1e-6)


def test_step_past_the_sub_batch_runs_in_pieces_with_the_same_outputs(tiny_runner):
    from shmvllm.worker import pooling_runner

    rng = np.random.default_rng(0)
    lengths = [int(n) for n in rng.integers(3, 200, size=80)]  # ~8,000 tokens: two or three pieces
    prompts = [[101] + [int(t) for t in rng.integers(1000, 5000, size=n - 2)] + [102] for n in lengths]
    assert sum(lengths) > pooling_runner.SUB_BATCH_TOKENS
    together = _embed(tiny_runner, prompts)
    alone = np.concatenate([_embed(tiny_runner, [p]) for p in prompts[:6]])
    np.testing.assert_allclose(together[:6], alone, atol=1e-6)
    cosine = (together * np.stack([_embed(tiny_runner, [p])[0] for p in prompts])).sum(1)
    assert cosine.min() >= 0.999999


def test_sub_batches_cut_at_whole_sequences():
    from shmvllm.worker.pooling_runner import _sub_batches

    reqs = _step([[1] * n for n in (3, 4, 2, 9, 1, 1)]).scheduled_new_reqs
    parts = _sub_batches(reqs, 8)
    assert [[len(r.prompt_token_ids) for r in part] for part in parts] == [[3, 4], [2], [9], [1, 1]]


def test_empty_step(tiny_runner):
    out = tiny_runner.execute_model(_step([]))
    assert out.req_ids == [] and out.pooler_output == {}


@pytest.mark.parametrize(
    "step, field",
    [
        (_step([[101, 102, 103]], scheduled=2), "num_scheduled_tokens"),
        (_step([[101, 102, 103]], computed=1), "num_computed_tokens"),
        (_step([[101] * 300]), "max_model_len"),
        (_step([[101, 102]], PoolingParams(dimensions=65)), "dimensions"),
        (_step([[]]), "prompt_token_ids"),
    ],
)
def test_invalid_steps_name_the_field(tiny_runner, step, field):
    with pytest.raises(ValueError, match=field):
        tiny_runner.execute_model(step)


def test_cached_requests_are_refused(tiny_runner):
    step = _step([])
    step.scheduled_cached_reqs = CachedRequestData(req_ids=["r9"], new_block_ids=[[]], num_computed_tokens=[3])
    with pytest.raises(ValueError, match="whole"):
        tiny_runner.execute_model(step)


def test_pool_modes_on_packed_states():
    hidden = torch.arange(12, dtype=torch.float32).view(6, 2)
    cu = torch.tensor([0, 1, 4, 6])
    torch.testing.assert_close(pool(hidden, cu, PoolingType.CLS), hidden[[0, 1, 4]])
    torch.testing.assert_close(pool(hidden, cu, PoolingType.LAST), hidden[[0, 3, 5]])
    expected = torch.stack([hidden[0:1].mean(0), hidden[1:4].mean(0), hidden[4:6].mean(0)])
    torch.testing.assert_close(pool(hidden, cu, PoolingType.MEAN), expected)


def test_finalize_defaults():
    pooled = torch.tensor([[3.0, 4.0], [0.0, 2.0]])
    normalized = finalize(pooled, [None, PoolingParams()], default_normalize=True)
    torch.testing.assert_close(torch.stack(normalized), torch.tensor([[0.6, 0.8], [0.0, 1.0]]))
    raw = finalize(pooled, [None, None], default_normalize=False)
    torch.testing.assert_close(torch.stack(raw), pooled)
    with pytest.raises(ValueError, match="params"):
        finalize(pooled, [None], default_normalize=True)


def test_pooler_config_from_sentence_transformers(minilm_dir):
    config = load_pooler_config(minilm_dir, AutoConfig.from_pretrained(minilm_dir))
    assert config == PoolerConfig(PoolingType.MEAN, normalize=True)


def _st_dir(tmp_path, pooling: dict, normalize: bool):
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return tmp_path


@pytest.mark.parametrize(
    "pooling, normalize, expected",
    [
        ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}, False, PoolingType.CLS),
        ({"pooling_mode_lasttoken": True}, True, PoolingType.LAST),
        ({"pooling_mode": "lasttoken"}, True, PoolingType.LAST),
        ({"pooling_mode": "mean"}, False, PoolingType.MEAN),
    ],
)
def test_pooler_config_modes(tmp_path, pooling, normalize, expected):
    config = load_pooler_config(_st_dir(tmp_path, pooling, normalize), None)
    assert config == PoolerConfig(expected, normalize=normalize)


@pytest.mark.parametrize("pooling", [{"pooling_mode_max_tokens": True}, {"pooling_mode": "max"}, {}])
def test_unsupported_pooling_is_an_error(tmp_path, pooling):
    with pytest.raises(ValueError, match="pooling"):
        load_pooler_config(_st_dir(tmp_path, pooling, True), None)


def test_default_pooler_config_without_sentence_transformers_files(tmp_path, tiny_bert_dir):
    from transformers import LlamaConfig

    bert = AutoConfig.from_pretrained(tiny_bert_dir)
    assert load_pooler_config(tmp_path, bert) == PoolerConfig(PoolingType.CLS, normalize=True)
    llama = LlamaConfig(architectures=["LlamaForCausalLM"])
    assert load_pooler_config(tmp_path, llama) == PoolerConfig(PoolingType.LAST, normalize=True)


def test_llama_last_token_pooling_matches_transformers(tiny_llama_dir):
    """A decoder embeds by causal attention within each packed sequence and its last token."""
    config = EngineArgs(model=str(tiny_llama_dir), task="embed", max_model_len=128).create_engine_config()
    runner = PoolingModelRunner(config.model_config)
    assert runner.pooler_config == PoolerConfig(PoolingType.LAST, normalize=True)
    runner.load_model()
    prompts = [[1, 4093, 314, 253], [1, 9], [7], list(range(100, 140))]
    got = _embed(runner, prompts)
    hf = AutoModel.from_pretrained(tiny_llama_dir).eval()
    with torch.no_grad():
        expected = [F.normalize(hf(torch.tensor([p])).last_hidden_state[0, -1], dim=-1).numpy() for p in prompts]
    np.testing.assert_allclose(got, np.stack(expected), atol=2e-5)


def test_embed_token_budget_covers_the_longest_prompt():
    """A pooling prompt is never split: the default budget grows with max_model_len."""
    from shmvllm.engine.arg_utils import _scheduler_limits

    assert _scheduler_limits(None, None, "embed", 512, False) == (16384, 1024)
    assert _scheduler_limits(None, None, "embed", 32768, False) == (32768, 1024)
    assert _scheduler_limits(100, 3, "embed", 32768, False) == (100, 3)  # what the user set stays
    assert _scheduler_limits(None, None, "generate", 4096, True) == (2048, 128)
    assert _scheduler_limits(None, None, "generate", 4096, False) == (4096, 128)


def test_warm_up_keeps_the_outputs(tiny_bert_dir):
    """The engine's warm-up (glibc's heap kept and faulted in) leaves every output as it was."""
    texts = [[1, 5, 6, 2], [1, 7, 8, 9, 10, 2]]
    cold = _embed(_runner(tiny_bert_dir), texts)
    warm = _runner(tiny_bert_dir)
    warm.warm_up(max_num_batched_tokens=512)
    np.testing.assert_array_equal(_embed(warm, texts), cold)


_FIRST_CALL_FAULTS = """
import resource, sys, torch
from shmvllm.engine.arg_utils import EngineArgs
from shmvllm.worker.pooling_runner import PoolingModelRunner
runner = PoolingModelRunner(EngineArgs(model=sys.argv[1], task="embed").create_engine_config().model_config)
runner.load_model()
if sys.argv[2] == "warm":
    runner.warm_up(max_num_batched_tokens=512)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
activation = torch.ones(4 << 20, dtype=torch.uint8)  # a step's activations: 4 MB
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_warm_up_maps_the_first_calls_activations(tiny_bert_dir):
    """After warm_up a fresh engine process's first activations land on pages already mapped
    (glibc's heap kept, not trimmed, and faulted in); without it they fault page by page."""
    faults = {
        mode: int(subprocess.run([sys.executable, "-c", _FIRST_CALL_FAULTS, str(tiny_bert_dir), mode],
                                 capture_output=True, text=True, check=True, timeout=120).stdout.split()[-1])
        for mode in ("cold", "warm")
    }
    pages = (4 << 20) // 4096
    assert faults["cold"] > pages // 2 and faults["warm"] < pages // 8, faults
