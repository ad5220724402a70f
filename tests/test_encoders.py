"""Encoder families (BERT, XLM-RoBERTa, ModernBERT), their classification heads and the
sentence-transformers configuration, through `LLM` against sentence-transformers / transformers.

Every model is a seeded tiny random one built with transformers (and saved with its
sentence-transformers modules where those apply)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from shmvllm import LLM, PoolingParams

# Mixed lengths (1 to ~60 tokens, an empty text, equal lengths side by side).
TEXTS = [
    "", "cat", "the river", "The cat and the river.", "quantum engine memory ring shared token",
    "the of cat river quantum engine memory ring shared token throughput latency paris " * 4,
    "Hello world, the cat.", "paris", "memory ring", "token throughput",
]
QUERIES = ["what is a cat", "river", "where is paris", "the engine"]
DOCS = ["a cat is an animal of the river", "paris is a city", "memory ring shared token", ""]


def _xlmr_tokenizer(target, minilm_dir):
    """A small sentencepiece-style (Unigram) XLM-R tokenizer: <s> A </s></s> B </s> pairs."""
    from transformers import XLMRobertaTokenizer

    vocab = json.loads((minilm_dir / "tokenizer.json").read_text())["model"]["vocab"]
    words = [w for w in vocab if w.isalpha() and w.isascii()][:3000]
    pieces = [("<s>", 0.0), ("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    pieces += [("\u2581" + w, -0.1 * len(w)) for w in words] + [(c, -5.0) for c in "abcdefghijklmnopqrstuvwxyz.,?!"]
    XLMRobertaTokenizer(vocab=pieces + [("<mask>", 0.0)]).save_pretrained(target)
    return len(pieces) + 1


def _config(model_type: str, vocab_size: int, **extra):
    from transformers import BertConfig, ModernBertConfig, XLMRobertaConfig

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    if model_type == "modernbert":
        # 3 layers: global, local, local; a window of 8 either side, so longer texts are banded.
        common.update(num_hidden_layers=3, max_position_embeddings=512, pad_token_id=0, bos_token_id=101,
                      eos_token_id=102, cls_token_id=101, sep_token_id=102, local_attention=16)
        return ModernBertConfig(**common, **extra)
    if model_type == "xlm-roberta":
        return XLMRobertaConfig(max_position_embeddings=130, pad_token_id=1, bos_token_id=0, eos_token_id=2, **common, **extra)
    return BertConfig(max_position_embeddings=128, **common, **extra)


def _save_hf(tmp_path_factory, minilm_dir, model_type: str, head: str = "", **extra):
    """A tiny random encoder (with a classification head when `head`) and its tokenizer."""
    from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

    target = tmp_path_factory.mktemp(f"{model_type}{head}")
    if model_type == "xlm-roberta":
        vocab_size = _xlmr_tokenizer(target, minilm_dir)
    else:
        AutoTokenizer.from_pretrained(minilm_dir).save_pretrained(target)
        vocab_size = 30522
    torch.manual_seed(0)
    config = _config(model_type, vocab_size, **extra)
    model_class = AutoModelForSequenceClassification if head else AutoModel
    model = model_class.from_config(config).eval()
    with torch.no_grad():  # wider weights than the init, so that heads' outputs spread
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.mul_(10.0 if "classifier" in name or "pooler" in name else 3.0)
            elif "classifier" in name and name.endswith("bias"):
                p.zero_()
    model.save_pretrained(target)
    return target


def _save_st(source, target, pooling: str, dense: int = 0, normalize: bool = True, **kwargs):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as models

    modules = [models.Transformer(str(source))]
    modules.append(models.Pooling(64, pooling_mode=pooling))
    if dense:
        torch.manual_seed(1)
        modules.append(models.Dense(64, dense, activation_function=torch.nn.Tanh()))
    if normalize:
        modules.append(models.Normalize())
    SentenceTransformer(modules=modules, device="cpu", **kwargs).save(str(target))
    return target


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def _embed(model_dir, texts, **kwargs) -> np.ndarray:
    with LLM(model=str(model_dir), multiprocess=False) as llm:
        return np.stack([o.outputs.numpy() for o in llm.embed(texts, use_tqdm=False, **kwargs)])


@pytest.fixture(scope="module")
def xlmr_embedder(tmp_path_factory, minilm_dir):
    source = _save_hf(tmp_path_factory, minilm_dir, "xlm-roberta")
    return _save_st(source, tmp_path_factory.mktemp("xlmr-st"), "mean")


@pytest.fixture(scope="module")
def modernbert_embedder(tmp_path_factory, minilm_dir):
    source = _save_hf(tmp_path_factory, minilm_dir, "modernbert")
    return _save_st(source, tmp_path_factory.mktemp("modernbert-st"), "mean")


@pytest.fixture(scope="module")
def bert_st_dense(tmp_path_factory, tiny_bert_dir):
    """BERT with CLS pooling, a Dense 64 -> 32 (tanh), Normalize, and prompts with a default."""
    return _save_st(
        tiny_bert_dir, tmp_path_factory.mktemp("bert-dense"), "cls", dense=32,
        prompts={"query": "query: ", "doc": "passage: "}, default_prompt_name="query",
    )


def test_xlm_roberta_embeddings_match_sentence_transformers(xlmr_embedder):
    from sentence_transformers import SentenceTransformer

    expected = SentenceTransformer(str(xlmr_embedder), device="cpu").encode(TEXTS, batch_size=4)
    got = _embed(xlmr_embedder, TEXTS)
    assert got.shape == expected.shape
    assert _cosines(got, expected).min() >= 0.99999


def test_modernbert_embeddings_match_sentence_transformers(modernbert_embedder):
    """Local layers band their attention: the long texts (~60 tokens) see only 8 positions either side."""
    from sentence_transformers import SentenceTransformer
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(modernbert_embedder)
    assert config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"] and config.sliding_window == 8
    expected = SentenceTransformer(str(modernbert_embedder), device="cpu").encode(TEXTS, batch_size=4)
    got = _embed(modernbert_embedder, TEXTS)
    assert _cosines(got, expected).min() >= 0.99999


def test_dense_layers_prompts_and_dimensions_as_sentence_transformers(bert_st_dense):
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(bert_st_dense), device="cpu")
    with LLM(model=str(bert_st_dense)) as llm:  # the engine process: token_embed's 2-D output over the rings
        outputs = llm.embed(TEXTS, use_tqdm=False)
        default = np.stack([o.outputs.numpy() for o in outputs])
        assert outputs[1].prompt_token_ids == llm.get_tokenizer()("query: cat")["input_ids"]
        assert default.shape == (len(TEXTS), 32)
        assert _cosines(default, reference.encode(TEXTS)).min() >= 0.99999  # the default prompt, "query: "
        doc = np.stack([o.outputs.numpy() for o in llm.embed(TEXTS, use_tqdm=False, prompt_name="doc")])
        assert _cosines(doc, reference.encode(TEXTS, prompt_name="doc")).min() >= 0.99999
        small = llm.embed(TEXTS, PoolingParams(dimensions=8), use_tqdm=False)
        truncated = SentenceTransformer(str(bert_st_dense), device="cpu", truncate_dim=8).encode(TEXTS, normalize_embeddings=True)
        got = np.stack([o.outputs.numpy() for o in small])
        assert got.shape == (len(TEXTS), 8)
        assert _cosines(got, truncated).min() >= 0.99999
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
        raw = llm.embed(TEXTS[:3], PoolingParams(normalize=False), use_tqdm=False)
        assert not np.allclose(np.linalg.norm(np.stack([o.outputs.numpy() for o in raw]), axis=1), 1.0)
        with pytest.raises(ValueError, match="dimensions"):
            llm.embed("x", PoolingParams(dimensions=33))  # beyond the Dense output, before anything is queued
        with pytest.raises(ValueError, match="prompt_name='passage'"):
            llm.embed("x", prompt_name="passage")
        with pytest.raises(ValueError, match="Classification"):
            llm.classify("x")
        # bound to "embed" (its first task), as vLLM binds a pooling model to one task
        with pytest.raises(ValueError, match=r'Try switching the model\'s pooling_task via `PoolerConfig\(task="token_embed"\)`'):
            llm.encode(TEXTS[3], pooling_task="token_embed")


def test_pooler_config_binds_the_task_and_sets_the_pooling(bert_st_dense):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as models

    from shmvllm.config import PoolerConfig

    reference = SentenceTransformer(str(bert_st_dense), device="cpu")
    # the engine process: the PoolerConfig travels in the engine's config, token_embed's 2-D output over the rings
    with LLM(model=str(bert_st_dense), pooler_config=PoolerConfig(task="token_embed", use_activation=False)) as llm:
        assert llm.pooling_task == "token_embed" and llm.model_config.pooler_config.task == "token_embed"
        tokens = llm.encode(TEXTS[3], use_tqdm=False)[0].outputs.data  # the bound task by default
        expected = reference.encode(TEXTS[3], output_value="token_embeddings", prompt_name="query")
        assert tokens.shape == expected.shape
        np.testing.assert_allclose(tokens.numpy(), expected, atol=1e-4)  # use_activation=False: not normalized
        assert not np.allclose(np.linalg.norm(expected, axis=1), 1.0)
        with pytest.raises(ValueError, match=r'PoolerConfig\(task="embed"\)'):
            llm.embed("x")
    # mean over the model's CLS pooling, 8 dimensions and no normalization by default; the older name
    texts = TEXTS[1:5]
    mean = SentenceTransformer(modules=[reference[0], models.Pooling(64, pooling_mode="mean"), reference[2]], device="cpu")
    expected = mean.encode(["query: " + t for t in texts])[:, :8]  # the model's default prompt
    with LLM(model=str(bert_st_dense), multiprocess=False,
             override_pooler_config={"pooling_type": "MEAN", "dimensions": 8, "use_activation": False}) as llm:
        assert llm.pooling_task == "embed"
        got = np.stack([o.outputs.numpy() for o in llm.embed(texts, use_tqdm=False)])
        np.testing.assert_allclose(got, expected, atol=1e-5)
        normalized = np.stack([o.outputs.numpy() for o in llm.embed(texts, PoolingParams(normalize=True), use_tqdm=False)])
        np.testing.assert_allclose(np.linalg.norm(normalized, axis=1), 1.0, atol=1e-5)  # a request's own choice wins
        assert normalized.shape == (len(texts), 8)


@pytest.mark.parametrize("pooler_config, error, match", [
    ({"task": "classify"}, ValueError, r"Unsupported task: 'classify' Supported tasks: \('embed', 'token_embed'\)"),
    ({"enable_chunked_processing": True}, ValueError, "pooler_config.enable_chunked_processing=True is not supported"),
    ({"returned_token_ids": [1, 2]}, ValueError, "pooler_config.returned_token_ids"),
    ({"pooling_type": "STEP"}, ValueError, "pooler_config.tok_pooling_type='STEP'"),
    ({"seq_pooling_type": "max"}, ValueError, "pooler_config.seq_pooling_type='max'"),
    ({"dimensions": 33}, ValueError, "pooler_config.dimensions must be at most the model's embedding size 32"),
    ({"normalize": True}, TypeError, r"unknown fields \['normalize'\]"),
    ("MEAN", TypeError, "pooler_config must be a PoolerConfig, a dict or None, got str"),
])
def test_pooler_config_refused_by_name_before_the_engine_starts(bert_st_dense, pooler_config, error, match):
    with pytest.raises(error, match=match):
        LLM(model=str(bert_st_dense), pooler_config=pooler_config)


def test_pooler_config_and_its_older_name_together_are_refused(bert_st_dense):
    with pytest.raises(ValueError, match="pooler_config and override_pooler_config"):
        LLM(model=str(bert_st_dense), pooler_config={"task": "embed"}, override_pooler_config={"task": "embed"})


@pytest.fixture(scope="module")
def bert_reranker(tmp_path_factory, minilm_dir):
    """A BertForSequenceClassification with one label, as transformers saves it (no modules.json)."""
    return _save_hf(tmp_path_factory, minilm_dir, "bert", head="-rerank", num_labels=1)


@pytest.fixture(scope="module")
def xlmr_reranker(tmp_path_factory, minilm_dir):
    """An XLM-RoBERTa cross-encoder saved by sentence-transformers' CrossEncoder."""
    from sentence_transformers import CrossEncoder

    source = _save_hf(tmp_path_factory, minilm_dir, "xlm-roberta", head="-rerank", num_labels=1)
    target = tmp_path_factory.mktemp("xlmr-ce")
    CrossEncoder(str(source), device="cpu").save(str(target))
    return target


@pytest.mark.parametrize("which", ["bert_reranker", "xlmr_reranker"])
def test_reranker_scores_match_cross_encoder(request, which):
    from sentence_transformers import CrossEncoder

    model_dir = request.getfixturevalue(which)
    reference = CrossEncoder(str(model_dir), device="cpu")
    pairs = [(q, d) for q in QUERIES for d in DOCS]
    expected = reference.predict(pairs, batch_size=5)
    with LLM(model=str(model_dir)) as llm:  # the engine process: pair token types over the rings
        assert llm.supported_tasks == ("classify", "score")
        scores = llm.score([q for q, _ in pairs], [d for _, d in pairs], use_tqdm=False)
        got = np.array([s.outputs.score for s in scores])
        np.testing.assert_allclose(got, expected, atol=1e-4)
        one_to_many = llm.score(QUERIES[0], DOCS, use_tqdm=False)
        np.testing.assert_allclose([s.outputs.score for s in one_to_many], expected[: len(DOCS)], atol=1e-4)
        logits = llm.score(QUERIES[0], DOCS, pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
        raw = reference.predict([(QUERIES[0], d) for d in DOCS], activation_fn=torch.nn.Identity())
        np.testing.assert_allclose([s.outputs.score for s in logits], raw, atol=1e-4)
        assert np.std(raw) > 0.02  # the pairs score apart (hundreds of times the tolerance)
        with pytest.raises(ValueError, match="Embedding"):
            llm.embed("x")


@pytest.mark.parametrize("model_type, extra", [
    ("bert", {}), ("xlm-roberta", {}), ("modernbert", {"classifier_pooling": "mean"}), ("modernbert", {"classifier_pooling": "cls"}),
])
def test_classify_probabilities_match_transformers(tmp_path_factory, minilm_dir, model_type, extra):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model_dir = _save_hf(tmp_path_factory, minilm_dir, model_type, head="-classify", num_labels=3, **extra)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    texts = TEXTS[1:]
    with torch.no_grad():
        expected = [torch.softmax(hf(**tokenizer(t, return_tensors="pt")).logits[0], -1).numpy() for t in texts]
    with LLM(model=str(model_dir), multiprocess=False) as llm:
        assert llm.supported_tasks == ("classify",)
        got = llm.classify(texts, use_tqdm=False)
        np.testing.assert_allclose(np.array([o.outputs.probs for o in got]), np.stack(expected), atol=1e-5)
        assert got[0].outputs.num_classes == 3
        encoded = llm.encode(texts[:2], pooling_task="classify", use_tqdm=False)
        np.testing.assert_allclose(encoded[1].outputs.data.numpy(), expected[1], atol=1e-5)
        with pytest.raises(ValueError, match="Score"):
            llm.score("a", "b")


def _tiny_qwen3(tmp_path_factory, smollm2_dir):
    from transformers import Qwen3Config

    from conftest import _save_tiny_causal_lm

    config = Qwen3Config(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=True,
    )
    return _save_tiny_causal_lm(config, smollm2_dir, tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.mark.parametrize("family, pooling", [("qwen2", "lasttoken"), ("qwen2", "mean"), ("qwen3", "lasttoken")])
def test_decoder_embedder_matches_sentence_transformers(tmp_path_factory, tiny_qwen2_dir, smollm2_dir, family, pooling):
    """A generation architecture as an embedder (Qwen3-Embedding's recipe: last-token pooling,
    normalized, an instruction prompt), causal attention within each packed sequence."""
    import shutil

    from sentence_transformers import SentenceTransformer
    from transformers import AutoTokenizer

    checkpoint = tiny_qwen2_dir if family == "qwen2" else _tiny_qwen3(tmp_path_factory, smollm2_dir)
    source = tmp_path_factory.mktemp(f"{family}-{pooling}")
    for item in checkpoint.iterdir():
        if item.is_file() and item.name != "chat_template.jinja":  # else sentence-transformers 6 wraps texts in it
            shutil.copy(item, source / item.name)
    tokenizer = AutoTokenizer.from_pretrained(source)
    tokenizer.pad_token = tokenizer.eos_token  # sentence-transformers pads its batches
    tokenizer.save_pretrained(source)
    target = _save_st(source, tmp_path_factory.mktemp(f"{family}-st-{pooling}"), pooling,
                      prompts={"query": "Instruct: find the text\nQuery: "})
    for name in ("config.json", "model.safetensors"):  # the *ForCausalLM checkpoint, as Qwen3-Embedding ships
        shutil.copy(source / name, target / name)
    reference = SentenceTransformer(str(target), device="cpu")
    texts = [t for t in TEXTS if t]  # an empty text has no last token
    expected = reference.encode(texts, batch_size=4, prompt_name="query")
    with LLM(model=str(target), task="embed", multiprocess=False) as llm:
        got = np.stack([o.outputs.numpy() for o in llm.embed(texts, use_tqdm=False, prompt_name="query")])
    assert _cosines(got, expected).min() >= 0.99999


@pytest.fixture(scope="module")
def embedding_gemma(tmp_path_factory, smollm2_dir):
    """EmbeddingGemma's recipe at a tiny size: a Gemma3TextModel checkpoint (tensors without "model.")
    with bidirectional attention, sliding layers of window 8 (transformers: 4 positions either side)
    around a global one, mean pooling, two bias-free Dense layers, Normalize, and its prompts."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as models
    from transformers import AutoModel, AutoTokenizer, Gemma3TextConfig

    source = tmp_path_factory.mktemp("gemma3-text")
    config = Gemma3TextConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, max_position_embeddings=512, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], use_bidirectional_attention=True,
        architectures=["Gemma3TextModel"], pad_token_id=2, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    model = AutoModel.from_config(config).float().eval()
    with torch.no_grad():  # wider than the init, so that the window and the direction of attention show
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model.save_pretrained(source)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    tokenizer.chat_template = None  # else sentence-transformers 6 wraps texts in it
    tokenizer.save_pretrained(source)
    torch.manual_seed(1)
    modules = [
        models.Transformer(str(source)), models.Pooling(64, pooling_mode="mean"),
        models.Dense(64, 128, bias=False, activation_function=torch.nn.Identity()),
        models.Dense(128, 64, bias=False, activation_function=torch.nn.Identity()), models.Normalize(),
    ]
    target = tmp_path_factory.mktemp("embeddinggemma-st")
    prompts = {"query": "task: search result | query: ", "document": "title: none | text: "}
    SentenceTransformer(modules=modules, device="cpu", prompts=prompts).save(str(target))
    return target


def test_embedding_gemma_matches_sentence_transformers(embedding_gemma):
    """Bidirectional, banded attention over the packed sequences; prompts and Matryoshka dimensions."""
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(embedding_gemma), device="cpu")
    assert type(reference[0].auto_model).__name__ == "Gemma3TextModel"
    texts = [t for t in TEXTS if t]
    with LLM(model=str(embedding_gemma), multiprocess=False) as llm:
        assert llm.pooling_task == "embed"
        for prompt_name in ("query", "document"):
            got = np.stack([o.outputs.numpy() for o in llm.embed(texts, use_tqdm=False, prompt_name=prompt_name)])
            expected = reference.encode(texts, batch_size=4, prompt_name=prompt_name)
            assert got.shape == expected.shape == (len(texts), 64)
            assert _cosines(got, expected).min() >= 0.99999
        small = llm.embed(texts, PoolingParams(dimensions=16), use_tqdm=False, prompt_name="query")
        truncated = SentenceTransformer(str(embedding_gemma), device="cpu", truncate_dim=16).encode(
            texts, prompt_name="query", normalize_embeddings=True)
        got = np.stack([o.outputs.numpy() for o in small])
        assert got.shape == (len(texts), 16)
        assert _cosines(got, truncated).min() >= 0.99999
    with pytest.raises(ValueError, match="use_bidirectional_attention=True: it embeds"):
        LLM(model=str(embedding_gemma), task="generate")


def test_bidirectional_flag_of_another_family_is_refused(tmp_path):
    """Only Gemma 3 reads use_bidirectional_attention: another family's model is refused, not run causally."""
    from shmvllm.config import ModelConfig
    from shmvllm.model.hf_config import HFConfig, config_values
    from shmvllm.worker.pooling_runner import PoolingModelRunner
    from transformers import Qwen3Config

    values = config_values(Qwen3Config(architectures=["Qwen3ForCausalLM"]))
    hf_config = HFConfig({**values, "use_bidirectional_attention": True})
    config = ModelConfig(model="q", model_dir=tmp_path, hf_config=hf_config, task="embed", dtype="float32",
                         device="cpu", max_model_len=128)
    with pytest.raises(ValueError, match="use_bidirectional_attention=True .* Gemma 3 only"):
        PoolingModelRunner(config)


@pytest.mark.parametrize("model_type, head, pooling, shortcut", [
    ("bert", "-rerank", None, True), ("xlm-roberta", "-rerank", None, True), ("modernbert", "-classify", "cls", True),
    ("modernbert", "-classify", "mean", False), ("bert", "", "cls", True), ("xlm-roberta", "", "lasttoken", True),
    ("modernbert", "", "cls", True), ("bert", "", "mean", False),
])
def test_one_token_poolers_compute_the_last_layer_for_that_token(
    tmp_path_factory, minilm_dir, monkeypatch, model_type, head, pooling, shortcut
):
    """A pooler or head that reads one token per sequence (CLS, last token) makes the encoder
    compute its last layer's queries, attention output and MLP for that token only, with the
    outputs of the full last layer; mean pooling (and token_embed) gets every token."""
    from transformers import AutoTokenizer

    from shmvllm.engine.arg_utils import EngineArgs
    from shmvllm.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
    from shmvllm.worker.pooling_runner import PoolingModelRunner

    if head:
        extra = {"classifier_pooling": pooling} if model_type == "modernbert" else {}
        model_dir = _save_hf(tmp_path_factory, minilm_dir, model_type, head=head, num_labels=1 if head == "-rerank" else 3, **extra)
    else:
        source = _save_hf(tmp_path_factory, minilm_dir, model_type)
        model_dir = _save_st(source, tmp_path_factory.mktemp(f"{model_type}-{pooling}"), pooling)
    runner = PoolingModelRunner(EngineArgs(model=str(model_dir)).create_engine_config().model_config)
    runner.load_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tokenizer(t)["input_ids"] for t in TEXTS]
    reqs = [NewRequestData(f"r{i}", p, [], None, PoolingParams(), [], 0) for i, p in enumerate(prompts)]
    step = SchedulerOutput(reqs, CachedRequestData(), {r.req_id: len(r.prompt_token_ids) for r in reqs}, sum(map(len, prompts)))
    seen = []
    forward = runner.model.forward
    monkeypatch.setattr(runner.model, "forward", lambda *args: seen.append(args[-1]) or forward(*args))
    got = runner.execute_model(step).pooler_output
    assert (seen[-1] is not None) == shortcut
    if shortcut:
        lengths = sorted(map(len, prompts))  # the runner packs by length
        expected_at = [0] * len(prompts) if pooling in (None, "cls") else [n - 1 for n in lengths]
        assert seen[-1].tolist() == expected_at
        assert runner._query_at(["embed", "token_embed"], np.array(lengths)) is None
    monkeypatch.setattr(runner, "_query_at", lambda tasks, lengths: None)
    full = runner.execute_model(step).pooler_output
    assert seen[-1] is None
    for req in reqs:
        np.testing.assert_allclose(got[req.req_id], full[req.req_id], rtol=1e-5, atol=1e-6)
