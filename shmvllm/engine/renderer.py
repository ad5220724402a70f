"""The renderer: user inputs (text, token ids, chat conversations) -> prompt token ids.

It owns the tokenizer. A chat conversation goes through the tokenizer's chat template; the
rendered text already carries the template's special tokens, so it is tokenized without adding
more.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Optional, Union

logger = logging.getLogger(__name__)

ChatMessage = dict[str, Any]
Conversation = list[ChatMessage]


def load_tokenizer(tokenizer_dir: Union[str, Path], mode: str = "auto", **kwargs: Any) -> Any:
    """The Hugging Face tokenizer of a local directory; mode "slow": the Python implementation.

    A directory with a tokenizer.json gets the class its tokenizer_config.json names, taken from
    transformers directly: AutoTokenizer would import transformers' config machinery, and torch
    with it (seconds); the class and the files are what AutoTokenizer would use."""
    cls = _named_tokenizer_class(Path(tokenizer_dir)) if mode != "slow" else None
    if cls is not None:
        return cls.from_pretrained(str(tokenizer_dir), **kwargs)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir), use_fast=mode != "slow", **kwargs)


def load_frontend_tokenizer(tokenizer_dir: Union[str, Path], mode: str = "auto") -> Any:
    """The tokenizer the frontend encodes, decodes and renders chats with: a `FastTokenizer`
    (the `tokenizers` library, no transformers import) where it reproduces the directory's
    transformers tokenizer, else transformers' own (`load_tokenizer`), with the reason logged."""
    from shmvllm.engine.fast_tokenizer import FastTokenizer, unsupported_reason

    reason = unsupported_reason(Path(tokenizer_dir), mode)
    if reason is None:
        return FastTokenizer(tokenizer_dir)
    logger.info("Tokenizer of %s: transformers' (%s)", tokenizer_dir, reason)
    return load_tokenizer(tokenizer_dir, mode)


def _named_tokenizer_class(tokenizer_dir: Path) -> Any:
    """The tokenizers-backed class tokenizer_config.json names, or None (AutoTokenizer decides)."""
    config_file = tokenizer_dir / "tokenizer_config.json"
    if not (tokenizer_dir / "tokenizer.json").exists() or not config_file.exists():
        return None
    try:
        name = json.loads(config_file.read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        return None
    if not isinstance(name, str) or not name.isidentifier():
        return None
    import transformers

    cls = getattr(transformers, name, None) or getattr(transformers, name + "Fast", None)
    backend = getattr(transformers, "TokenizersBackend", None)
    return cls if isinstance(cls, type) and backend is not None and issubclass(cls, backend) else None


def get_tokenizer(
    tokenizer_name: Union[str, Path],
    *args: Any,
    tokenizer_mode: str = "auto",
    trust_remote_code: bool = False,
    revision: Optional[str] = None,
    download_dir: Optional[str] = None,
    **kwargs: Any,
) -> Any:
    """vLLM's `get_tokenizer`: a model's tokenizer by the name LLM(model=...) takes (a shipped
    short name, a local directory or a .gguf file). trust_remote_code and download_dir change
    nothing (no remote code runs, nothing is downloaded); other kwargs go to the tokenizer."""
    from shmvllm.model.registry import resolve_model_dir

    if revision is not None:
        raise ValueError(f"revision={revision!r} is not supported: shmvllm loads local models only.")
    if tokenizer_mode not in ("auto", "hf", "slow"):
        raise ValueError(f"tokenizer_mode={tokenizer_mode!r} is not supported: 'auto', 'hf' or 'slow'.")
    return load_tokenizer(resolve_model_dir(str(tokenizer_name)), tokenizer_mode, **kwargs)


def resolve_hf_chat_template(
    tokenizer: Any, chat_template: Optional[str], tools: Optional[list[dict[str, Any]]], **_: Any
) -> Optional[str]:
    """vLLM's choice of chat template: the one given, else the tokenizer's (its tool-use variant
    when tools are given and it has one), else None. The model_config / trust_remote_code that
    vLLM's version takes change nothing here."""
    if chat_template is not None:
        return chat_template
    try:
        return tokenizer.get_chat_template(None, tools=tools)
    except (ValueError, AttributeError, TypeError):
        return getattr(tokenizer, "chat_template", None) or None


class Renderer:
    def __init__(self, tokenizer: Any):
        """tokenizer None: the engine has none (skip_tokenizer_init); only token ids go in."""
        self.tokenizer = tokenizer

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"prompt must be a str, got {type(text).__name__}.")
        if self.tokenizer is None:
            raise ValueError("Tokenizer not available when `skip_tokenizer_init=True`: give prompt_token_ids instead of text prompts.")
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def render_chat_text(
        self,
        conversation: Conversation,
        chat_template: Optional[str] = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Optional[list[dict[str, Any]]] = None,
        chat_template_kwargs: Optional[dict[str, Any]] = None,
        chat_template_content_format: str = "auto",
    ) -> str:
        """The conversation rendered by the chat template, as text.

        chat_template_kwargs: extra variables for the template (e.g. enable_thinking).
        chat_template_content_format: "auto" / "string" join a message's OpenAI-style text parts
        ([{"type": "text", "text": ...}]) into one string (with newlines, as vLLM); "openai"
        passes the parts to the template as they are."""
        _check_conversation(conversation)
        if self.tokenizer is None:
            raise ValueError("Tokenizer not available when `skip_tokenizer_init=True`: chat needs one.")
        if chat_template is None and not self.has_chat_template:
            raise ValueError("this model's tokenizer has no chat template; pass chat_template=... or use generate().")
        if add_generation_prompt and continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be True.")
        if chat_template_content_format not in ("auto", "string", "openai"):
            raise ValueError(
                f"chat_template_content_format must be 'auto', 'string' or 'openai', got {chat_template_content_format!r}."
            )
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise ValueError(f"chat_template_kwargs must be a dict, got {chat_template_kwargs!r}.")
        reserved = sorted(set(chat_template_kwargs or ()) & {"conversation", "tokenize", "chat_template"})
        if reserved:
            raise ValueError(f"chat_template_kwargs cannot set {reserved}: they are chat()'s own arguments.")
        if chat_template_content_format != "openai":
            conversation = [_flatten_content(message) for message in conversation]
        kwargs = {
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
            **(chat_template_kwargs or {}),
        }
        if tools is not None:
            kwargs["tools"] = tools
        if chat_template is not None and not isinstance(chat_template, str):
            raise TypeError(f"chat_template must be a str, got {type(chat_template).__name__}.")
        try:
            return self.tokenizer.apply_chat_template(conversation, chat_template=chat_template, tokenize=False, **kwargs)
        except Exception as exc:  # the template refused the conversation (raise_exception), or choked on it
            raise ValueError(f"the chat template cannot render these messages: {type(exc).__name__}: {exc}") from exc

    def render_chat(self, conversation: Conversation, **kwargs: Any) -> tuple[str, list[int]]:
        """(rendered text, its token ids) for one conversation."""
        text = self.render_chat_text(conversation, **kwargs)
        return text, self.tokenize(text, add_special_tokens=False)


def _flatten_content(message: ChatMessage) -> ChatMessage:
    """A message whose content is a list of OpenAI parts, with the text parts joined into one string."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"message content part {part!r} is not supported: shmvllm serves text-only models.")
        texts.append(part["text"])
    return {**message, "content": "\n".join(texts)}


def _check_conversation(conversation: Any) -> None:
    """ValueError / TypeError naming the message and the field a chat template would choke on."""
    if not isinstance(conversation, list) or not conversation:
        raise ValueError(f"messages must be a non-empty list of {{'role', 'content'}} dicts, got {conversation!r}.")
    for i, message in enumerate(conversation):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ValueError(f"each chat message must be a dict with 'role' and 'content', got {message!r}.")
        if not isinstance(message["role"], str) or not message["role"]:
            raise TypeError(f"messages[{i}]['role'] must be a non-empty str, got {message['role']!r}.")
        content = message["content"]
        if content is None or isinstance(content, str):  # None: an assistant message with tool_calls
            continue
        if isinstance(content, list) and all(isinstance(part, dict) for part in content):
            continue  # which parts are supported: _flatten_content (or the template) says
        raise TypeError(
            f"messages[{i}]['content'] must be a str, None or a list of content part dicts, got {content!r}."
        )
