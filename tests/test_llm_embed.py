"""LLM.embed / LLM.encode end to end: the engine in its own process, vectors over the shm rings,
against sentence-transformers itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from shmvllm.entrypoints.llm import LLM
from shmvllm.outputs import EmbeddingRequestOutput, PoolingRequestOutput
from shmvllm.pooling_params import PoolingParams
from shmvllm.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[1]


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@pytest.fixture(scope="module")
def reference(minilm_dir):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_dir), device="cpu")


@pytest.fixture(scope="module")
def embed_llm():
    llm = LLM(model="all-minilm-l6-v2")  # detected as an embedding model; multiprocess by default
    yield llm
    llm.shutdown()


def test_embed_matches_sentence_transformers(embed_llm, reference, embedding_texts):
    texts = embedding_texts
    outputs = embed_llm.embed(texts, use_tqdm=False)
    assert all(isinstance(o, EmbeddingRequestOutput) and o.finished and o.error is None for o in outputs)
    assert [o.prompt for o in outputs] == texts
    got = np.stack([o.outputs.numpy() for o in outputs])
    expected = reference.encode(texts, batch_size=32, convert_to_numpy=True)
    assert got.shape == expected.shape == (100, 384) and got.dtype == np.float32
    sims = cosine(got, expected)
    assert sims.min() >= 0.9999, (int(sims.argmin()), float(sims.min()))
    tokenizer = reference.tokenizer
    assert outputs[0].prompt_token_ids == [tokenizer.cls_token_id, tokenizer.sep_token_id]  # "" as the reference does
    assert max(len(o.prompt_token_ids) for o in outputs) == 256  # long texts truncated at the model's max length
    assert outputs[0].outputs.hidden_size == 384


def test_encode_returns_tensors(embed_llm):
    texts = ["a ring of shared memory", "Привет"]
    encoded = embed_llm.encode(texts, use_tqdm=False)
    embedded = embed_llm.embed(texts, use_tqdm=False)
    for enc, emb in zip(encoded, embedded):
        assert isinstance(enc, PoolingRequestOutput) and isinstance(enc.outputs.data, torch.Tensor)
        assert enc.outputs.data.dtype == torch.float32 and enc.outputs.data.shape == (384,)
        np.testing.assert_array_equal(enc.outputs.data.numpy(), emb.outputs.numpy())
    single = embed_llm.encode("one text", use_tqdm=False)
    assert len(single) == 1 and single[0].prompt == "one text"


def test_pooling_params_per_request(embed_llm):
    texts = ["matryoshka dolls nest", "token ids given", "raw"]
    full = embed_llm.embed(texts[0], PoolingParams(normalize=False), use_tqdm=False)[0].outputs.numpy()
    ids = embed_llm.get_tokenizer()(texts[1])["input_ids"]
    prompts = [texts[0], {"prompt_token_ids": ids}, {"prompt": texts[2]}]
    params = [PoolingParams(dimensions=16), PoolingParams(), PoolingParams(normalize=False)]
    cut, given, raw = embed_llm.embed(prompts, params, use_tqdm=False)
    np.testing.assert_allclose(cut.outputs.numpy(), full[:16] / np.linalg.norm(full[:16]), atol=1e-6)
    assert given.prompt is None and given.prompt_token_ids == ids
    np.testing.assert_allclose(np.linalg.norm(given.outputs.numpy()), 1.0, atol=1e-5)
    assert np.linalg.norm(raw.outputs.numpy()) > 1.5  # MiniLM's mean-pooled vectors are not unit length


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: PoolingParams(dimensions=0), "dimensions"),
        (lambda: PoolingParams(dimensions=2.5), "dimensions"),
        (lambda: PoolingParams(normalize="yes"), "normalize"),
    ],
)
def test_invalid_pooling_params_name_the_field(make, field):
    with pytest.raises(ValueError, match=field):
        make()


def test_dimensions_beyond_the_model_are_refused_before_queueing(embed_llm):
    params = PoolingParams(dimensions=385)  # valid on its own; larger than the model's 384
    with pytest.raises(ValueError, match="dimensions"):
        embed_llm.embed(["x", "y"], params, use_tqdm=False)
    assert not embed_llm.llm_engine.has_unfinished_requests()  # nothing was queued


def test_invalid_embed_inputs_queue_nothing(embed_llm):
    with pytest.raises(ValueError, match="pooling_params has 1 entries for 2 prompts"):
        embed_llm.embed(["a", "b"], [PoolingParams()], use_tqdm=False)
    with pytest.raises(TypeError, match="pooling_params must be a PoolingParams or a list of them, got int"):
        embed_llm.embed(["a", "b"], 5, use_tqdm=False)
    with pytest.raises(ValueError, match="vocabulary"):
        embed_llm.embed(["fine", {"prompt_token_ids": [101, 10**9, 102]}], use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len=256"):
        embed_llm.embed([{"prompt_token_ids": [101] * 257}], use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        embed_llm.embed([], use_tqdm=False)
    with pytest.raises(TypeError, match="PoolingParams"):
        embed_llm.embed(["a"], SamplingParams(), use_tqdm=False)
    assert not embed_llm.llm_engine.has_unfinished_requests()
    assert embed_llm.embed("still serving", use_tqdm=False)[0].error is None


def test_generate_on_an_embedding_model_is_a_clear_error(embed_llm):
    with pytest.raises(ValueError, match="cannot generate"):
        embed_llm.generate("Hello")
    with pytest.raises(ValueError, match="cannot generate"):
        embed_llm.chat([{"role": "user", "content": "Hello"}])


def test_requests_in_flight_stay_capped(tiny_bert_dir, embedding_texts):
    """max_num_seqs=2: at most 4 requests in flight, so embed interleaves sending and receiving."""
    from sentence_transformers import SentenceTransformer

    texts = embedding_texts[:40]
    with LLM(model=str(tiny_bert_dir), max_num_seqs=2) as llm:
        seen = []
        process = llm.llm_engine.process_engine_outputs

        def step(outputs):
            seen.append(llm.llm_engine.get_num_unfinished_requests())
            return process(outputs)

        llm.llm_engine.process_engine_outputs = step
        got = np.stack([o.outputs.numpy() for o in llm.embed(texts, use_tqdm=False)])
    assert max(seen) <= 4 and len(seen) >= 10
    expected = SentenceTransformer(str(tiny_bert_dir), device="cpu").encode(texts, convert_to_numpy=True)
    np.testing.assert_allclose(got, expected, atol=2e-5)


def test_generation_and_embedding_llms_in_one_process(tiny_llama_dir, embed_llm, reference):
    """Two multiprocess engines side by side, each over its own rings, interleaved."""
    params = SamplingParams(temperature=0.0, max_tokens=8)
    prompts = ["The capital of France is", "Shared memory rings"]
    with LLM(model=str(tiny_llama_dir), max_model_len=256, num_kv_blocks=64) as gen_llm:
        before = [o.outputs[0].token_ids for o in gen_llm.generate(prompts, params, use_tqdm=False)]
        texts = ["between two generate calls", "Ελληνικά"]
        vectors = np.stack([o.outputs.numpy() for o in embed_llm.embed(texts, use_tqdm=False)])
        after = [o.outputs[0].token_ids for o in gen_llm.generate(prompts, params, use_tqdm=False)]
        with pytest.raises(ValueError, match="cannot embed"):
            gen_llm.embed("text")
        with pytest.raises(ValueError, match="cannot embed"):
            gen_llm.encode("text")
        gen_pid = gen_llm.llm_engine.engine_core.engine_pid
    assert before == after and all(len(t) == 8 for t in before)
    assert gen_pid != embed_llm.llm_engine.engine_core.engine_pid
    assert cosine(vectors, reference.encode(texts, convert_to_numpy=True)).min() >= 0.9999


def test_cli_embed_prints_json_lines(tmp_path, reference):
    texts = ["first line", "zweite Zeile — ünïcode", ""]
    input_file = tmp_path / "texts.txt"
    input_file.write_text("\n".join(texts[1:]) + "\n", encoding="utf-8")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(
        [sys.executable, "-m", "shmvllm", "embed", texts[0], "--input", str(input_file)],
        capture_output=True, text=True, timeout=300, env=env, cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["index"] for r in records] == [0, 1, 2] and [r["text"] for r in records] == texts
    got = np.array([r["embedding"] for r in records], dtype=np.float32)
    assert cosine(got, reference.encode(texts, convert_to_numpy=True)).min() >= 0.9999


@pytest.mark.parametrize("bad", ["priority", "prompt"])
def test_a_bad_fifth_of_eight_embeds_queues_nothing(embed_llm, monkeypatch, bad):
    """The whole pooling call is checked before the first chunk is tokenized and queued."""
    prompts: list = [f"sentence {i}" for i in range(8)]
    priority = [0] * 8
    if bad == "priority":
        priority[4] = "high"
    else:
        prompts[4] = {"prompt_token_ids": [1, 10**6]}
    queued = []
    monkeypatch.setattr(embed_llm.llm_engine.engine_core, "add_request", lambda *a, **k: queued.append(a))
    with pytest.raises((ValueError, TypeError)):
        embed_llm.embed(prompts, priority=priority, use_tqdm=False)
    assert queued == []
    monkeypatch.undo()
    assert len(embed_llm.embed(["still serving"], use_tqdm=False)[0].outputs.embedding) == 384
