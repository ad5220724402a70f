"""The frontend's tokenizer from a model directory's files, with the `tokenizers` library alone.

transformers' tokenizer classes take 0.7-1 s to import and build; the same `tokenizers.Tokenizer`
from tokenizer.json takes ~0.25 s. This class sets it up as transformers' TokenizersBackend does
(the special tokens tokenizer_config.json / special_tokens_map.json name, added as special
tokens when the file lacks them; BOS / EOS from the file's post-processor, as transformers
ignores add_bos_token / add_eos_token beside a tokenizer.json; truncation and padding off unless
a call asks) and
offers the part of its interface the frontend uses: encoding (pairs included), decoding with
skip_special_tokens and clean_up_tokenization_spaces, the vocabulary and special ids, and the
chat template (`chat_template.render_chat_template`).

Only the tokenizer classes whose set-up this reproduces are taken (`FAST_CLASSES`, checked
against transformers' by tests); anything else is transformers' own tokenizer, loaded by name
(`unsupported_reason` says why).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, Optional, Union

from shmvllm.engine.chat_template import render_chat_template

# tokenizer_config.json's tokenizer_class values whose transformers set-up equals tokenizer.json's
# with the steps above (tests/test_fast_tokenizer.py compares each against transformers).
# Qwen2Tokenizer, GPT2Tokenizer, GemmaTokenizer, LlamaTokenizer rebuild their pre-tokenizers and are not.
FAST_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast", "BertTokenizer", "BertTokenizerFast"})
_NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Classes whose encodings carry token_type_ids (transformers' model_input_names).
_TOKEN_TYPE_CLASSES = frozenset({"BertTokenizer", "BertTokenizerFast"})
# tokenizer_config.json keys that change encoding or decoding in ways not reproduced here.
_UNSUPPORTED_KEYS = ("split_special_tokens", "add_prefix_space", "fix_mistral_regex")


def _token_text(value: Any) -> Optional[str]:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    value = json.loads(path.read_text(encoding="utf-8"))
    return value if isinstance(value, dict) else {}


def unsupported_reason(tokenizer_dir: Path, mode: str = "auto") -> Optional[str]:
    """Why the directory's tokenizer needs transformers (None: `FastTokenizer` reproduces it)."""
    if mode == "slow":
        return "tokenizer_mode='slow' asks for transformers' Python tokenizer"
    if not (tokenizer_dir / "tokenizer.json").exists():
        return "there is no tokenizer.json"
    try:
        config = _read_json(tokenizer_dir / "tokenizer_config.json")
    except (OSError, ValueError) as exc:
        return f"tokenizer_config.json cannot be read ({exc})"
    name = config.get("tokenizer_class", "TokenizersBackend")
    if name not in FAST_CLASSES:
        return f"tokenizer_class {name!r} is not one whose set-up shmvllm reproduces"
    for key in _UNSUPPORTED_KEYS:
        if config.get(key):
            return f"tokenizer_config.json sets {key}={config[key]!r}"
    if name in _TOKEN_TYPE_CLASSES and (reason := _bert_set_up_differs(tokenizer_dir, config)) is not None:
        return reason
    if (tokenizer_dir / "additional_chat_templates").is_dir():
        return "the directory has additional_chat_templates/"
    if isinstance(config.get("extra_special_tokens"), dict):
        return "tokenizer_config.json names model-specific special tokens (extra_special_tokens is a dict)"
    model_type = str(_read_json(tokenizer_dir / "config.json").get("model_type", "")) if (tokenizer_dir / "config.json").exists() else ""
    if "mistral" in model_type or "mixtral" in model_type:
        return "transformers patches Mistral tokenizers' pre-tokenizer"
    return None


def _bert_set_up_differs(tokenizer_dir: Path, config: dict[str, Any]) -> Optional[str]:
    """transformers' BertTokenizer rebuilds its normalizer, pre-tokenizer, decoder and
    post-processor from tokenizer_config.json (do_lower_case, strip_accents,
    tokenize_chinese_chars, cls / sep) and its WordPiece model with the defaults; where
    tokenizer.json's differ, the reason (this class uses the file's as they are), else None."""
    spec = _read_json(tokenizer_dir / "tokenizer.json")
    cls, sep = (_token_text(config.get(key)) or default for key, default in (("cls_token", "[CLS]"), ("sep_token", "[SEP]")))
    expected = {
        "normalizer": {"type": "BertNormalizer", "clean_text": True, "handle_chinese_chars": config.get("tokenize_chinese_chars", True),
                       "strip_accents": config.get("strip_accents"), "lowercase": config.get("do_lower_case", True)},
        "pre_tokenizer": {"type": "BertPreTokenizer"},
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": True},
        "model": {"type": "WordPiece", "unk_token": _token_text(config.get("unk_token")) or "[UNK]",
                  "continuing_subword_prefix": "##", "max_input_chars_per_word": 100},
    }
    for part, values in expected.items():
        found = spec.get(part) or {}
        for key, value in values.items():
            if found.get(key) != value:
                return f"tokenizer.json's {part} has {key}={found.get(key)!r} where transformers' BertTokenizer sets {value!r}"
    processor = spec.get("post_processor") or {}
    single = [{"SpecialToken": {"id": cls, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
              {"SpecialToken": {"id": sep, "type_id": 0}}]
    pair = single + [{"Sequence": {"id": "B", "type_id": 1}}, {"SpecialToken": {"id": sep, "type_id": 1}}]
    if processor.get("type") != "TemplateProcessing" or processor.get("single") != single or processor.get("pair") != pair:
        return f"tokenizer.json's post_processor is not the {cls} ... {sep} template transformers' BertTokenizer sets"
    return None


class FastTokenizer:
    """A `tokenizers.Tokenizer` set up and used as transformers' fast tokenizer of the same files."""

    is_fast = True

    def __init__(self, tokenizer_dir: Union[str, Path]):
        """tokenizer_dir: a directory `unsupported_reason` accepts."""
        from tokenizers import AddedToken, Tokenizer, processors

        directory = Path(tokenizer_dir)
        self.name_or_path = str(directory)
        config = {**_read_json(directory / "special_tokens_map.json"), **_read_json(directory / "tokenizer_config.json")}
        self._class_name = config.get("tokenizer_class", "TokenizersBackend")
        backend = Tokenizer.from_file(str(directory / "tokenizer.json"))
        backend.no_truncation()
        backend.no_padding()
        backend.encode_special_tokens = False
        self._backend = backend
        # a call's truncation is the backend's state: one encode at a time sees its own
        self._encoding = threading.Lock()
        self.truncation_side = config.get("truncation_side", "right")
        self.model_max_length = config.get("model_max_length")
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        # transformers skips the clean-up for BPE models unless told to corrupt their output
        if type(backend.model).__name__ == "BPE" and not config.get(
            "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"
        ):
            self.clean_up_tokenization_spaces = False
        self._named = {key: text for key in _NAMED_SPECIAL if (text := _token_text(config.get(key))) is not None}
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
        self._extra = [text for text in map(_token_text, extra) if text is not None]
        # special tokens the file's added tokens lack become added special tokens, as transformers adds them
        known = {token.content for token in backend.get_added_tokens_decoder().values()}
        for index, entry in sorted(((int(k), v) for k, v in (config.get("added_tokens_decoder") or {}).items())):
            if entry.get("content") not in known:
                backend.add_tokens([AddedToken(entry["content"], single_word=entry.get("single_word", False),
                                               lstrip=entry.get("lstrip", False), rstrip=entry.get("rstrip", False),
                                               normalized=entry.get("normalized", True), special=entry.get("special", False))])
                known.add(entry["content"])
        missing = [text for text in [*self._named.values(), *self._extra] if text not in known]
        if missing:
            backend.add_tokens([AddedToken(text, special=True) for text in dict.fromkeys(missing)])
        # with a tokenizer.json, transformers drops add_bos_token / add_eos_token: BOS and EOS are the
        # post-processor's; a file without one gets the plain template
        if backend.post_processor is None:
            backend.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])
        self.chat_template = self._read_chat_template(directory, config)
        self._added = backend.get_added_tokens_decoder()
        self._vocab = backend.get_vocab(with_added_tokens=True)  # built here, on the loading thread

    @staticmethod
    def _read_chat_template(directory: Path, config: dict[str, Any]) -> Union[str, dict[str, str], None]:
        jinja = directory / "chat_template.jinja"
        if jinja.exists():
            return jinja.read_text(encoding="utf-8")
        value = config.get("chat_template")
        if isinstance(value, list):  # named templates: [{"name": ..., "template": ...}]
            return {entry["name"]: entry["template"] for entry in value}
        return value if isinstance(value, str) else None

    # -- special tokens --------------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        """bos_token / eos_token / ... and their *_id: None where the tokenizer has none."""
        if name in _NAMED_SPECIAL:
            return self._named.get(name)
        if name.endswith("_id") and name[:-3] in _NAMED_SPECIAL:
            text = self._named.get(name[:-3])
            return None if text is None else self._backend.token_to_id(text)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return dict(self._named)

    @property
    def all_special_tokens(self) -> list[str]:
        return list(dict.fromkeys([*self._named.values(), *self._extra]))

    @property
    def all_special_ids(self) -> list[int]:
        return self.convert_tokens_to_ids(self.all_special_tokens)

    @property
    def added_tokens_decoder(self) -> dict[int, Any]:
        """id -> `tokenizers.AddedToken` (content, special)."""
        return dict(self._added)

    # -- vocabulary --------------------------------------------------------------------------

    def get_vocab(self) -> dict[str, int]:
        return dict(self._vocab)

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def convert_tokens_to_ids(self, tokens: Union[str, list[str]]) -> Union[Optional[int], list[Optional[int]]]:
        unk = self.unk_token_id
        if isinstance(tokens, str):
            found = self._backend.token_to_id(tokens)
            return unk if found is None else found
        return [self.convert_tokens_to_ids(token) for token in tokens]

    def convert_ids_to_tokens(self, ids: Union[int, list[int]], skip_special_tokens: bool = False) -> Any:
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        special = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._backend.id_to_token(i) for i in ids if i not in special]

    # -- encoding ----------------------------------------------------------------------------

    def __call__(
        self,
        text: Union[str, list[str]],
        text_pair: Union[str, list[str], None] = None,
        add_special_tokens: bool = True,
        truncation: bool = False,
        max_length: Optional[int] = None,
    ) -> dict[str, Any]:
        """{"input_ids", "attention_mask"(, "token_type_ids")}: lists for one text, lists of lists for a batch."""
        batched = isinstance(text, (list, tuple))
        texts = list(text) if batched else [text]
        for item in texts:
            if not isinstance(item, str):
                raise TypeError(f"text must be a str or a list of str, got an item {item!r}.")
        if text_pair is not None:
            pairs = list(text_pair) if batched else [text_pair]
            if len(pairs) != len(texts):
                raise ValueError(f"text_pair has {len(pairs)} items for {len(texts)} texts.")
            inputs: list[Any] = list(zip(texts, pairs))
        else:
            inputs = texts
        with self._encoding:
            if truncation and max_length is not None:
                self._backend.enable_truncation(max_length, strategy="longest_first", direction=self.truncation_side)
            try:
                encodings = self._backend.encode_batch(inputs, add_special_tokens=add_special_tokens)
            finally:
                if truncation and max_length is not None:
                    self._backend.no_truncation()
        out: dict[str, Any] = {"input_ids": [e.ids for e in encodings]}
        if self._class_name in _TOKEN_TYPE_CLASSES:
            out["token_type_ids"] = [e.type_ids for e in encodings]
        out["attention_mask"] = [e.attention_mask for e in encodings]
        return out if batched else {key: value[0] for key, value in out.items()}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self(text, add_special_tokens=add_special_tokens)["input_ids"]

    # -- decoding ----------------------------------------------------------------------------

    def decode(self, token_ids: Union[int, list[int]], skip_special_tokens: bool = False) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        text = self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return _clean_up(text) if self.clean_up_tokenization_spaces else text

    def batch_decode(self, sequences: list[list[int]], skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(ids, skip_special_tokens=skip_special_tokens) for ids in sequences]

    # -- chat templates ------------------------------------------------------------------------

    def get_chat_template(self, chat_template: Optional[str] = None, tools: Optional[list[dict[str, Any]]] = None) -> str:
        """transformers' choice: the one given (or named), else the tokenizer's (its tool_use variant
        when tools are given)."""
        own = self.chat_template
        if isinstance(own, dict):
            if chat_template is not None and chat_template in own:
                return own[chat_template]
            if chat_template is None:
                if tools is not None and "tool_use" in own:
                    return own["tool_use"]
                if "default" in own:
                    return own["default"]
                raise ValueError(f"This model has multiple chat templates with no default: pass one of {sorted(own)}.")
        if chat_template is not None:
            return chat_template
        if own is None:
            raise ValueError("Cannot use chat template functions because tokenizer.chat_template is not set.")
        return own

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        tools: Optional[list[dict[str, Any]]] = None,
        documents: Optional[list[dict[str, Any]]] = None,
        chat_template: Optional[str] = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        tokenize: bool = True,
        **kwargs: Any,
    ) -> Union[str, list[int]]:
        """The conversation rendered (tokenize=False), or its token ids (no special tokens added)."""
        text = render_chat_template(
            self.get_chat_template(chat_template, tools), conversation, self.special_tokens_map, tools=tools,
            documents=documents, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, **kwargs,
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _clean_up(text: str) -> str:
    """transformers' clean_up_tokenization: no space before punctuation and English contractions."""
    for spaced, joined in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                           (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(spaced, joined)
    return text
