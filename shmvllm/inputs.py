"""The prompt shapes `LLM.generate` / `embed` take, with vLLM's names (`vllm.inputs`)."""

from __future__ import annotations

from typing import Any, Union

from typing_extensions import NotRequired, TypedDict


class TextPrompt(TypedDict):
    """A prompt as text, tokenized by the model's tokenizer."""

    prompt: str
    multi_modal_data: NotRequired[Any]  # refused: shmvllm serves text-only models
    mm_processor_kwargs: NotRequired[Any]
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    """A prompt as token ids, taken as they are."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]  # the text, if the caller has it (shown in RequestOutput.prompt)
    token_type_ids: NotRequired[list[int]]
    multi_modal_data: NotRequired[Any]
    mm_processor_kwargs: NotRequired[Any]
    cache_salt: NotRequired[str]


# One prompt: text, a TextPrompt, a TokensPrompt, or a bare list of token ids.
SingletonPrompt = Union[str, TextPrompt, TokensPrompt, list[int]]
PromptType = SingletonPrompt

__all__ = ["TextPrompt", "TokensPrompt", "SingletonPrompt", "PromptType"]
