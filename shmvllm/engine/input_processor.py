"""Prompt + SamplingParams -> EngineCoreRequest: tokenize, validate, fill in what the model knows.

Everything that can be wrong with a request is found here, as a ValueError, before anything is
queued in the engine: an empty prompt, token ids outside the vocabulary, a prompt that leaves no
room to generate within max_model_len.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Optional, Union

import msgspec

from shmvllm.engine.messages import EngineCoreRequest, now
from shmvllm.engine.renderer import Renderer
from shmvllm.pooling_params import PoolingParams
from shmvllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# What `generate` accepts per prompt: text, {"prompt": text}, or {"prompt_token_ids": [...]}.
PromptType = Union[str, dict[str, Any]]


class InputProcessor:
    def __init__(
        self,
        renderer: Renderer,
        max_model_len: int,
        vocab_size: int,
        model_dir: Optional[Path] = None,
        hidden_size: Optional[int] = None,
        generates: bool = True,
    ):
        """hidden_size: the pooled vector's size, for PoolingParams.verify. generates: False for an
        embedding model, which has no EOS tokens to look up."""
        self.renderer = renderer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.eos_token_id: Optional[int] = None
        self.extra_eos_token_ids: list[int] = []
        if generates:
            self.eos_token_id, self.extra_eos_token_ids = _eos_token_ids(renderer.tokenizer, model_dir)

    def process_inputs(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: Optional[float] = None,
        priority: int = 0,
    ) -> tuple[EngineCoreRequest, Optional[str], list[int]]:
        """Returns the request for the engine, the prompt text (None if given as ids) and its ids."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}.")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise TypeError(f"priority must be an int, got {priority!r}.")
        prompt_text, prompt_ids = self.tokenize_prompt(prompt)
        self.validate_prompt(prompt_ids)
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=EngineCoreRequest.pack_token_ids(prompt_ids),
            sampling_params=self.engine_params(params, len(prompt_ids)),
            arrival_time=now() if arrival_time is None else arrival_time,
            priority=priority,
        )
        return request, prompt_text, prompt_ids

    def tokenize_prompt(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, str):
            return prompt, self.renderer.tokenize(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if hasattr(ids, "tolist"):
                    ids = ids.tolist()
                if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                    raise ValueError(f"prompt_token_ids must be a list of int, got {ids!r}.")
                return prompt.get("prompt"), list(ids)
            if "prompt" in prompt:
                return prompt["prompt"], self.renderer.tokenize(prompt["prompt"])
        raise ValueError(
            f"a prompt must be a str, {{'prompt': str}} or {{'prompt_token_ids': list[int]}}, got {prompt!r}."
        )

    def validate_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise ValueError("the prompt is empty: it has no tokens.")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt is {len(prompt_ids)} tokens long, which leaves no room to generate within "
                f"max_model_len={self.max_model_len}; shorten the prompt or raise max_model_len."
            )
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids out of the vocabulary [0, {self.vocab_size}): {bad[:5]}.")

    # ---- pooling (embedding) requests ------------------------------------------------------

    def verify_pooling_params(self, params: PoolingParams) -> None:
        if not isinstance(params, PoolingParams):
            raise TypeError(f"pooling_params must be a PoolingParams, got {type(params).__name__}.")
        if self.hidden_size is not None:
            params.verify(self.hidden_size)

    def tokenize_for_pooling(self, prompts: list[PromptType]) -> list[tuple[Optional[str], list[int]]]:
        """(text, ids) per prompt. Texts are tokenized in one batch call and truncated to
        max_model_len, as sentence-transformers does; given token ids are taken as they are."""
        results: list[Optional[tuple[Optional[str], list[int]]]] = [None] * len(prompts)
        texts, slots = [], []
        for i, prompt in enumerate(prompts):
            text = prompt if isinstance(prompt, str) else prompt.get("prompt") if isinstance(prompt, dict) else None
            given_ids = isinstance(prompt, dict) and "prompt_token_ids" in prompt
            if given_ids or not isinstance(text, str):  # ids as they are; anything else: its error
                results[i] = self.tokenize_prompt(prompt)
            else:
                texts.append(text)
                slots.append(i)
        if texts:
            encoded = self.renderer.tokenizer(texts, truncation=True, max_length=self.max_model_len)["input_ids"]
            for i, text, ids in zip(slots, texts, encoded):
                results[i] = (text, ids)
        return results  # type: ignore[return-value]

    def validate_pooling_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise ValueError("the prompt is empty: it has no tokens.")
        if len(prompt_ids) > self.max_model_len:
            raise ValueError(
                f"prompt_token_ids has {len(prompt_ids)} tokens, more than max_model_len={self.max_model_len}."
            )
        low, high = min(prompt_ids), max(prompt_ids)
        if low < 0 or high >= self.vocab_size:
            raise ValueError(f"prompt_token_ids out of the vocabulary [0, {self.vocab_size}): {low if low < 0 else high}.")

    def engine_params(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        """A copy with the EOS token set and max_tokens capped by what is left of max_model_len."""
        room = self.max_model_len - prompt_len
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        stop_token_ids = list(params.stop_token_ids or [])
        if not params.ignore_eos:
            stop_token_ids += [t for t in self.extra_eos_token_ids if t not in stop_token_ids]
        return msgspec.structs.replace(
            params,
            max_tokens=max_tokens,
            min_tokens=min(params.min_tokens, max_tokens),
            stop_token_ids=stop_token_ids,
            eos_token_id=self.eos_token_id,
        )


def _eos_token_ids(tokenizer: Any, model_dir: Optional[Path]) -> tuple[Optional[int], list[int]]:
    """The tokenizer's EOS id, and the further EOS ids that generation_config.json names."""
    configured: list[int] = []
    path = model_dir / "generation_config.json" if model_dir is not None else None
    if path is not None and path.exists():
        value = json.loads(path.read_text()).get("eos_token_id")
        configured = value if isinstance(value, list) else [value] if value is not None else []
    ids = [t for t in [getattr(tokenizer, "eos_token_id", None), *configured] if t is not None]
    if not ids:
        logger.warning("no EOS token id in generation_config.json or the tokenizer: generation stops only at max_tokens")
        return None, []
    return ids[0], [t for t in dict.fromkeys(ids[1:]) if t != ids[0]]
