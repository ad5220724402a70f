"""The frontend's `tokenizers`-only tokenizer equals transformers' tokenizer of the same files:
ids (special tokens, pairs, truncation), decodes, incremental detokenization, special ids and
chat templates; directories it does not reproduce get transformers' tokenizer by name."""

import json
import random
import shutil

import pytest

from shmvllm.engine.chat_template import render_chat_template
from shmvllm.engine.detokenizer import IncrementalDetokenizer, added_token_ids, byte_fallback_token_ids, special_token_ids
from shmvllm.engine.fast_tokenizer import FastTokenizer, unsupported_reason
from shmvllm.engine.renderer import Renderer, load_frontend_tokenizer, load_tokenizer

TEXTS = [
    "Hello world!", "  leading and trailing spaces  ", "Ünïcödé — 日本語 😀 text, naïve café",
    "don't you're I'm it's . , ? ! ' 've", "<|im_start|>user\nhi<|im_end|>", "[CLS] a [SEP] b [MASK] [PAD]",
    "", "a\n\n\tb  \r\n c", "x" * 300, "code: def f(x):\n    return x ** 2  # ✓", "<s> </s> <unk> <0x41>",
]
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello", "tool_calls": None},
    {"role": "user", "content": "And now?"},
]


@pytest.fixture(scope="module")
def byte_fallback_dir(tmp_path_factory, byte_fallback_tokenizer):
    """The conftest's byte-fallback tokenizer saved by transformers, with add_bos_token /
    add_eos_token in its config (which transformers ignores beside a tokenizer.json) and no
    post-processor in its tokenizer.json."""
    target = tmp_path_factory.mktemp("byte_fallback")
    byte_fallback_tokenizer.save_pretrained(target)
    config = json.loads((target / "tokenizer_config.json").read_text())
    (target / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True, "add_eos_token": True}))
    tokenizer_json = json.loads((target / "tokenizer.json").read_text())
    (target / "tokenizer.json").write_text(json.dumps({**tokenizer_json, "post_processor": None}))
    return target


@pytest.fixture(scope="module")
def extra_specials_dir(tmp_path_factory, smollm2_dir):
    """SmolLM2's files with a special token the tokenizer.json lacks, extra special tokens, and a
    dict of named chat templates in tokenizer_config.json."""
    target = tmp_path_factory.mktemp("extra_specials")
    shutil.copy(smollm2_dir / "tokenizer.json", target / "tokenizer.json")
    config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    template = (smollm2_dir / "chat_template.jinja").read_text()
    config.update(mask_token="<|mask|>", extra_special_tokens=["<|tool|>", "<|im_start|>"], chat_template=[
        {"name": "default", "template": template},
        {"name": "tool_use", "template": "{% for t in tools %}{{ t | tojson }}{% endfor %}" + template},
    ])
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    return target


@pytest.fixture(scope="module", params=["smollm2", "minilm", "tiny_llama", "tiny_bert", "byte_fallback", "extra_specials"])
def pair(request):
    """(FastTokenizer, transformers' tokenizer) of one directory."""
    directory = request.getfixturevalue(request.param + "_dir")
    assert unsupported_reason(directory) is None
    return FastTokenizer(directory), load_tokenizer(directory)


def test_ids_equal(pair):
    fast, hf = pair
    for text in TEXTS:
        for add_special_tokens in (True, False):
            assert fast(text, add_special_tokens=add_special_tokens) == dict(hf(text, add_special_tokens=add_special_tokens))
            assert fast.encode(text, add_special_tokens=add_special_tokens) == hf.encode(text, add_special_tokens=add_special_tokens)
    assert fast(TEXTS, add_special_tokens=True) == dict(hf(TEXTS, add_special_tokens=True))


def test_pairs_and_truncation_equal(pair):
    """Cross-encoder pairs (token types where the class returns them) and truncation to max_length."""
    fast, hf = pair
    for max_length in (8, 20, 512):
        for add_special_tokens in (True, False):
            ours = fast(TEXTS[:5], TEXTS[5:10], truncation=True, max_length=max_length, add_special_tokens=add_special_tokens)
            theirs = hf(TEXTS[:5], TEXTS[5:10], truncation=True, max_length=max_length, add_special_tokens=add_special_tokens)
            assert ours == dict(theirs)
        assert fast(TEXTS, truncation=True, max_length=max_length) == dict(hf(TEXTS, truncation=True, max_length=max_length))
    # a later call without truncation is not truncated
    assert fast("x" * 300)["input_ids"] == hf("x" * 300)["input_ids"]


def test_decodes_and_special_tokens_equal(pair):
    fast, hf = pair
    rng = random.Random(0)
    sequences = [hf(text)["input_ids"] for text in TEXTS]
    sequences += [[rng.randrange(len(hf)) for _ in range(rng.randrange(1, 40))] for _ in range(100)]
    sequences += [sorted(hf.all_special_ids) + [5, 6, 7]]
    for ids in sequences:
        for skip in (True, False):
            assert fast.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    for name in ("all_special_ids", "all_special_tokens", "special_tokens_map", "bos_token_id", "eos_token_id",
                 "pad_token_id", "unk_token_id", "bos_token", "eos_token", "vocab_size", "chat_template"):
        assert getattr(fast, name) == getattr(hf, name), name
    assert len(fast) == len(hf)
    assert fast.get_vocab() == hf.get_vocab()
    assert {i: (t.content, t.special) for i, t in fast.added_tokens_decoder.items()} == {
        i: (t.content, t.special) for i, t in hf.added_tokens_decoder.items()}
    assert byte_fallback_token_ids(fast) == byte_fallback_token_ids(hf)
    assert special_token_ids(fast) == special_token_ids(hf)
    assert added_token_ids(fast) == added_token_ids(hf)


def test_incremental_detokenization_equal(pair):
    """The detokenizer over the fast tokenizer streams what it streams over transformers'
    (skip_special_tokens, spaces_between_special_tokens)."""
    fast, hf = pair
    rng = random.Random(1)
    for _ in range(30):
        ids = [rng.randrange(len(hf)) for _ in range(rng.randrange(1, 30))]
        for skip in (True, False):
            for spaced in (True, False):
                pieces = []
                for tok in (fast, hf):
                    special = special_token_ids(tok)
                    detok = IncrementalDetokenizer(tok, skip, byte_fallback_token_ids(tok), special,
                                                   added_token_ids(tok) if spaced else frozenset())
                    pieces.append([detok.update([i]) for i in ids] + [detok.flush()])
                assert pieces[0] == pieces[1]


def _chat_cases(tokenizer):
    yield CONVERSATION[:2], {"add_generation_prompt": True}
    yield CONVERSATION, {"add_generation_prompt": False}
    yield CONVERSATION[:3], {"continue_final_message": True}
    yield CONVERSATION[:2], {"add_generation_prompt": True, "enable_thinking": False, "custom": {"a": [1, 2]}}
    tools = [{"type": "function", "function": {"name": "f", "description": "<b>x</b> é", "parameters": {}}}]
    yield CONVERSATION[:2], {"add_generation_prompt": True, "tools": tools}


def test_chat_templates_equal(pair):
    fast, hf = pair
    if fast.chat_template is None:
        with pytest.raises(ValueError):
            fast.apply_chat_template(CONVERSATION, tokenize=False)
        return
    for conversation, kwargs in _chat_cases(fast):
        assert fast.apply_chat_template(conversation, tokenize=False, **kwargs) == hf.apply_chat_template(
            conversation, tokenize=False, **kwargs)
        assert fast.apply_chat_template(conversation, tokenize=True, **kwargs) == hf.apply_chat_template(
            conversation, tokenize=True, return_dict=False, **kwargs)


TEMPLATE_FEATURES = """{%- set ns = namespace(n=0) -%}
{%- for m in messages -%}
{%- if m.role not in ['user', 'assistant', 'system'] -%}{{ raise_exception('bad role ' + m.role) }}{%- endif -%}
{%- set ns.n = ns.n + 1 -%}
  {{ bos_token }}{{ m.role }}: {{ m.content | trim }}{% if m.reasoning_content is defined %} [{{ m.reasoning_content }}]{% endif %}
{% if loop.index > 5 %}{% break %}{% endif %}
{%- endfor -%}
{{ dict(a=1) | tojson }} {{ {'k': '<&>'} | tojson(indent=2) }} {{ ns.n }} {{ strftime_now('%Y') | length }}
{%- if tools %}{% for t in tools %}{{ t | tojson }}{% endfor %}{% endif %}
{%- if add_generation_prompt %}assistant:{% endif %}"""


@pytest.mark.parametrize("kwargs", [
    {"add_generation_prompt": True},
    {"continue_final_message": True},
    {"add_generation_prompt": False, "tools": [{"name": "t", "x": [1, 2.5, None, True]}], "bos_token": "<over>"},
])
def test_template_features_equal(smollm2_dir, kwargs):
    """namespace, raise_exception, tojson (no HTML escaping, indent), strftime_now, dict, loop
    controls, trim/lstrip of blocks, reasoning aliases, kwargs over special tokens."""
    fast, hf = FastTokenizer(smollm2_dir), load_tokenizer(smollm2_dir)
    conversation = [{"role": "user", "content": " hi "}, {"role": "assistant", "content": "ok", "thinking": "hmm"}]
    theirs = hf.apply_chat_template(conversation, chat_template=TEMPLATE_FEATURES, tokenize=False, **kwargs)
    assert fast.apply_chat_template(conversation, chat_template=TEMPLATE_FEATURES, tokenize=False, **kwargs) == theirs


def test_template_errors(smollm2_dir):
    import jinja2

    fast = FastTokenizer(smollm2_dir)
    with pytest.raises(jinja2.exceptions.TemplateError, match="bad role tool"):
        fast.apply_chat_template([{"role": "tool", "content": "x"}], chat_template=TEMPLATE_FEATURES, tokenize=False)
    with pytest.raises(jinja2.exceptions.SecurityError):
        fast.apply_chat_template(CONVERSATION, chat_template="{% set ns = namespace(_x=1) %}", tokenize=False)
    with pytest.raises(jinja2.exceptions.SecurityError):
        render_chat_template("{{ messages.__class__.__mro__ }}", CONVERSATION, {})
    with pytest.raises(ValueError, match="not compatible"):
        fast.apply_chat_template(CONVERSATION, add_generation_prompt=True, continue_final_message=True, tokenize=False)
    with pytest.raises(ValueError, match="empty conversation"):
        fast.apply_chat_template([], tokenize=False)
    # through the renderer: the template's refusal is a ValueError naming it
    with pytest.raises(ValueError, match="bad role tool"):
        Renderer(fast).render_chat_text([{"role": "tool", "content": "x"}], chat_template=TEMPLATE_FEATURES)


def test_named_templates_choose_as_transformers(extra_specials_dir):
    fast, hf = FastTokenizer(extra_specials_dir), load_tokenizer(extra_specials_dir)
    tools = [{"name": "t"}]
    for args in ((None, None), (None, tools), ("tool_use", None), ("default", tools)):
        assert fast.get_chat_template(*args) == hf.get_chat_template(*args)
    assert fast.apply_chat_template(CONVERSATION[:2], tools=tools, tokenize=False) == hf.apply_chat_template(
        CONVERSATION[:2], tools=tools, tokenize=False)


def test_unsupported_directories_get_transformers_by_name(tmp_path, smollm2_dir, caplog):
    """No tokenizer.json, a class whose set-up is not reproduced, tokenizer_mode='slow',
    split_special_tokens: transformers' tokenizer, the reason logged."""
    from transformers import PreTrainedTokenizerBase

    assert "slow" in unsupported_reason(smollm2_dir, "slow")
    qwen = tmp_path / "qwen"
    qwen.mkdir()
    shutil.copy(smollm2_dir / "tokenizer.json", qwen / "tokenizer.json")
    config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    (qwen / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "Qwen2Tokenizer"}))
    assert "Qwen2Tokenizer" in unsupported_reason(qwen)
    split = tmp_path / "split"
    shutil.copytree(qwen, split)
    (split / "tokenizer_config.json").write_text(json.dumps({**config, "split_special_tokens": True}))
    assert "split_special_tokens" in unsupported_reason(split)
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    assert "tokenizer.json" in unsupported_reason(bare)
    with caplog.at_level("INFO", logger="shmvllm.engine.renderer"):
        tok = load_frontend_tokenizer(qwen)
    assert isinstance(tok, PreTrainedTokenizerBase) and "Qwen2Tokenizer" in caplog.text
    assert tok("Hello world!")["input_ids"] == load_tokenizer(qwen)("Hello world!")["input_ids"]
    assert isinstance(load_frontend_tokenizer(smollm2_dir), FastTokenizer)



@pytest.mark.parametrize("update", [{"do_lower_case": False}, {"strip_accents": True}, {"tokenize_chinese_chars": False}])
def test_bert_config_unlike_its_tokenizer_json_gets_transformers(tmp_path, minilm_dir, update):
    """transformers' BertTokenizer rebuilds its normalizer from tokenizer_config.json: where that
    differs from tokenizer.json's, the frontend takes transformers' tokenizer, with its ids."""
    from transformers import PreTrainedTokenizerBase

    target = tmp_path / "bert"
    target.mkdir()
    for name in ("tokenizer.json", "special_tokens_map.json"):
        shutil.copy(minilm_dir / name, target / name)
    config = json.loads((minilm_dir / "tokenizer_config.json").read_text())
    (target / "tokenizer_config.json").write_text(json.dumps({**config, **update}))
    key = next(iter(update))
    assert {"do_lower_case": "lowercase", "strip_accents": "strip_accents",
            "tokenize_chinese_chars": "handle_chinese_chars"}[key] in unsupported_reason(target)
    tok = load_frontend_tokenizer(target)
    assert isinstance(tok, PreTrainedTokenizerBase)
    text = "Hello World Ünïcode 東京"
    assert tok(text)["input_ids"] == load_tokenizer(target)(text)["input_ids"]

def test_bad_input_named(smollm2_dir):
    fast = FastTokenizer(smollm2_dir)
    with pytest.raises(TypeError, match="text must be"):
        fast([b"bytes"])
    with pytest.raises(ValueError, match="text_pair has 1 items for 2 texts"):
        fast(["a", "b"], ["c"])
