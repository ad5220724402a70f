"""The renderer: user inputs (text, token ids, chat conversations) -> prompt token ids.

It owns the tokenizer. A chat conversation goes through the tokenizer's chat template; the
rendered text already carries the template's special tokens, so it is tokenized without adding
more.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Union

ChatMessage = dict[str, Any]
Conversation = list[ChatMessage]


def load_tokenizer(tokenizer_dir: Union[str, Path]) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


class Renderer:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"prompt must be a str, got {type(text).__name__}.")
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def render_chat_text(
        self,
        conversation: Conversation,
        chat_template: Optional[str] = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> str:
        """The conversation rendered by the chat template, as text."""
        _check_conversation(conversation)
        if chat_template is None and not self.has_chat_template:
            raise ValueError("this model's tokenizer has no chat template; pass chat_template=... or use generate().")
        if add_generation_prompt and continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be True.")
        return self.tokenizer.apply_chat_template(
            conversation,
            chat_template=chat_template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )

    def render_chat(self, conversation: Conversation, **kwargs: Any) -> tuple[str, list[int]]:
        """(rendered text, its token ids) for one conversation."""
        text = self.render_chat_text(conversation, **kwargs)
        return text, self.tokenize(text, add_special_tokens=False)


def _check_conversation(conversation: Any) -> None:
    if not isinstance(conversation, list) or not conversation:
        raise ValueError(f"messages must be a non-empty list of {{'role', 'content'}} dicts, got {conversation!r}.")
    for message in conversation:
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ValueError(f"each chat message must be a dict with 'role' and 'content', got {message!r}.")
