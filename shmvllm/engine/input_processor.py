"""Prompt + SamplingParams -> EngineCoreRequest: tokenize, validate, fill in what the model knows.

The one door of every generation request: `process_batch` (a whole `generate` / `chat` call) and
`process_inputs` (one request) find everything that can be wrong, as a ValueError / TypeError,
before anything is queued in the engine: a request of the wrong task, LoRA, an empty prompt,
token ids outside the vocabulary, a prompt that leaves no room to generate within max_model_len,
params the engine refuses, a structured-output constraint that does not parse, a bad priority.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Optional, Union

import msgspec

from shmvllm.boundary.messages import EngineCoreRequest, EngineReady, now
from shmvllm.engine.renderer import Renderer
from shmvllm.engine.validation import as_prompt_list
from shmvllm.lora import check_no_lora
from shmvllm.pooling_params import PoolingParams
from shmvllm.sampling_params import RequestOutputKind, SamplingParams
from shmvllm.structured_output.validator import StructuredOutputValidator

logger = logging.getLogger(__name__)

# What `generate` accepts per prompt: text, {"prompt": text}, {"prompt_token_ids": [...]}, or a
# bare list of token ids (shmvllm.inputs names these shapes).
PromptType = Union[str, dict[str, Any], list[int]]

# The keys of a prompt dict that change nothing here; anything else in it is refused.
_PROMPT_KEYS = {"prompt", "prompt_token_ids"}
# tokenization_kwargs keys (vLLM: overrides for the tokenizer call) and what they do here.
TOKENIZATION_KWARGS = ("truncate_prompt_tokens", "add_special_tokens")


class InputProcessor:
    def __init__(
        self,
        renderer: Renderer,
        max_model_len: int,
        vocab_size: int,
        model_dir: Optional[Path] = None,
        hidden_size: Optional[int] = None,
        task: str = "generate",
        max_logprobs: int = 20,
        model: str = "this model",
    ):
        """hidden_size: the pooled vector's size, for PoolingParams.verify. task: the engine's,
        "generate" or "embed" (an embedding model has no EOS tokens to look up). max_logprobs:
        the most logprobs a request may ask for (vLLM's engine argument; -1: the whole
        vocabulary). model: its name, for the errors."""
        self.renderer = renderer
        self.task, self.model = task, model
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.max_logprobs = vocab_size if max_logprobs == -1 else max_logprobs
        self.eos_token_id: Optional[int] = None
        self.extra_eos_token_ids: list[int] = []
        self.structured_output_validator = StructuredOutputValidator()
        if task == "generate":
            self.eos_token_id, self.extra_eos_token_ids = _eos_token_ids(renderer.tokenizer, model_dir)

    def set_engine_limits(self, ready: EngineReady) -> None:
        """The running engine's limits, from its READY: max_model_len (clamped to what the KV
        cache holds), the vocabulary size and max_logprobs (resolved, never above the vocabulary).
        Every request is validated against these, once, here."""
        self.max_model_len = ready.max_model_len
        self.vocab_size = ready.vocab_size
        self.max_logprobs = ready.max_logprobs

    def process_inputs(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: Optional[float] = None,
        priority: int = 0,
        tokenization_kwargs: Optional[dict[str, Any]] = None,
    ) -> tuple[EngineCoreRequest, Optional[str], list[int]]:
        """Returns the request for the engine, the prompt text (None if given as ids) and its ids:
        `check_params`, then `make_request`."""
        self.check_params(params)
        return self.make_request(request_id, prompt, params, arrival_time, priority, tokenization_kwargs)

    def process_batch(
        self,
        prompts: Any,
        params: Any,
        priority: Optional[list[int]] = None,
        tokenization_kwargs: Optional[dict[str, Any]] = None,
        lora_request: Any = None,
        output_kind: Optional[RequestOutputKind] = None,
    ) -> list[tuple[EngineCoreRequest, Optional[str], list[int]]]:
        """A whole call's requests (their ids left empty), every one checked before any is made:
        prompts (one, or a list), params (one for all, or one per prompt; each distinct object
        checked once), priorities (one per prompt), tokenization_kwargs, lora_request (refused).
        output_kind: the kind every request gets (the caller's params stay untouched)."""
        self.check_task(SamplingParams)
        check_no_lora(lora_request)
        prompt_list = as_prompt_list(prompts)
        if not prompt_list:
            raise ValueError("prompts is empty.")
        params_list = params_per_prompt(params, len(prompt_list))
        if priority is not None and len(priority) != len(prompt_list):
            raise ValueError(f"priority has {len(priority)} entries for {len(prompt_list)} prompts.")
        finals: dict[int, SamplingParams] = {}
        for p in params_list:
            if id(p) not in finals:
                self.check_params(p)
                finals[id(p)] = p if output_kind is None else msgspec.structs.replace(p, output_kind=output_kind)
        return [
            self.make_request("", prompt, finals[id(p)], None, priority[i] if priority else 0, tokenization_kwargs)
            for i, (prompt, p) in enumerate(zip(prompt_list, params_list))
        ]

    def check_task(self, kind: type) -> None:
        """A clear ValueError for a request of the wrong kind (SamplingParams or PoolingParams) for
        this engine's task."""
        if kind is PoolingParams and self.task != "embed":
            raise ValueError(
                f"model {self.model!r} runs task {self.task!r}: it cannot embed; load an "
                "embedding model (or pass task='embed') for embed() / encode()."
            )
        if kind is SamplingParams and self.task == "embed":
            raise ValueError(
                f"model {self.model!r} runs task 'embed': it cannot generate; use "
                "embed() / encode(), or load a generation model for generate() / chat()."
            )

    def check_params(self, params: SamplingParams) -> None:
        """Everything about a request's SamplingParams this engine can refuse."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}.")
        self.verify_sampling_params(params)
        self.verify_structured_outputs(params)

    def make_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: Optional[float] = None,
        priority: int = 0,
        tokenization_kwargs: Optional[dict[str, Any]] = None,
    ) -> tuple[EngineCoreRequest, Optional[str], list[int]]:
        """As `process_inputs`, for params that `check_params` accepted: tokenizes and checks
        the prompt and the priority."""
        check_priority(priority)
        prompt_text, prompt_ids = self.tokenize_prompt(prompt, tokenization_kwargs)
        prompt_ids = self.truncate(prompt_ids, params.truncate_prompt_tokens)
        self.validate_prompt(prompt_ids)
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=EngineCoreRequest.pack_token_ids(prompt_ids),
            sampling_params=self.engine_params(params, len(prompt_ids)),
            arrival_time=now() if arrival_time is None else arrival_time,
            priority=priority,
        )
        return request, prompt_text, prompt_ids

    def verify_structured_outputs(self, params: SamplingParams) -> None:
        """A ValueError naming the field if the constraint does not parse (results are cached)."""
        if params.structured_outputs is not None:
            self.structured_output_validator.validate(params.structured_outputs)

    def tokenize_prompt(
        self, prompt: PromptType, tokenization_kwargs: Optional[dict[str, Any]] = None
    ) -> tuple[Optional[str], list[int]]:
        """(text or None, token ids) of one prompt; tokenization_kwargs: see TOKENIZATION_KWARGS."""
        truncate, add_special_tokens = parse_tokenization_kwargs(tokenization_kwargs)
        text, ids = self._tokenize_prompt(prompt, add_special_tokens)
        return text, self.truncate(ids, truncate)

    def truncate(self, prompt_ids: list[int], truncate_prompt_tokens: Optional[int]) -> list[int]:
        """The last truncate_prompt_tokens ids (vLLM truncates on the left); -1: max_model_len."""
        if truncate_prompt_tokens is None:
            return prompt_ids
        keep = self.max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
        if keep > self.max_model_len:
            raise ValueError(
                f"truncate_prompt_tokens={truncate_prompt_tokens} is more than max_model_len={self.max_model_len}."
            )
        return prompt_ids[-keep:]

    def _tokenize_prompt(self, prompt: PromptType, add_special_tokens: bool) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, str):
            return prompt, self.renderer.tokenize(prompt, add_special_tokens=add_special_tokens)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None, list(prompt)
        if isinstance(prompt, dict):
            check_prompt_keys(prompt)
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if hasattr(ids, "tolist"):
                    ids = ids.tolist()
                if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                    raise ValueError(f"prompt_token_ids must be a list of int, got {ids!r}.")
                return prompt.get("prompt"), list(ids)
            if "prompt" in prompt:
                return prompt["prompt"], self.renderer.tokenize(prompt["prompt"], add_special_tokens=add_special_tokens)
        raise ValueError(
            "a prompt must be a str, a list of token ids, {'prompt': str} or {'prompt_token_ids': list[int]}, "
            f"got {prompt!r}."
        )

    def verify_sampling_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: the vocabulary, max_logprobs (as vLLM's
        processor does), and bad_words' tokens."""
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            wanted = self.vocab_size if value == -1 else value
            if wanted is not None and wanted > self.max_logprobs:
                raise ValueError(
                    f"{name}={value} asks for {wanted} logprobs, more than max_logprobs={self.max_logprobs} "
                    "(an engine argument: LLM(..., max_logprobs=N), -1 for the whole vocabulary)."
                )
        for name, ids in (("allowed_token_ids", params.allowed_token_ids), ("logit_bias", params.logit_bias)):
            bad = [t for t in (ids or ()) if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"{name} has token ids out of the vocabulary [0, {self.vocab_size}): {bad[:5]}.")
        if self.renderer.tokenizer is None and (params.stop or params.bad_words):
            raise ValueError("Tokenizer not available when `skip_tokenizer_init=True`: stop strings and bad_words need one.")
        if params.bad_words:
            self.bad_words_token_ids(params.bad_words)
        bad = [t for t in params.stop_token_ids or () if t >= self.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids out of the vocabulary [0, {self.vocab_size}): {bad[:5]}.")

    def bad_words_token_ids(self, bad_words: list[str]) -> list[list[int]]:
        """Each bad word's tokens, alone and after a space (as vLLM: a word at the start of the
        text and inside it tokenize differently); the spaced form is kept when it is a different
        word token of the same length."""
        result: list[list[int]] = []
        for word in bad_words:
            plain = self.renderer.tokenize(word.lstrip(), add_special_tokens=False)
            if not plain:
                raise ValueError(f"bad_words entry {word!r} has no tokens.")
            result.append(plain)
            spaced = self.renderer.tokenize(" " + word.lstrip(), add_special_tokens=False)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                result.append(spaced)
        return result

    def validate_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise ValueError("The decoder prompt cannot be empty: it has no tokens.")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt "
                f"contains {len(prompt_ids)} input tokens, which leaves no room to generate within "
                f"max_model_len={self.max_model_len}; shorten the prompt or raise max_model_len."
            )
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"Token id {bad[0]} is out of vocabulary: prompt_token_ids {bad[:5]} are outside [0, {self.vocab_size})."
            )

    # ---- pooling (embedding) requests ------------------------------------------------------

    def verify_pooling_params(self, params: PoolingParams) -> None:
        if not isinstance(params, PoolingParams):
            raise TypeError(f"pooling_params must be a PoolingParams, got {type(params).__name__}.")
        if self.hidden_size is not None:
            params.verify(self.hidden_size)

    def tokenize_for_pooling(
        self, prompts: list[PromptType], tokenization_kwargs: Optional[dict[str, Any]] = None
    ) -> list[tuple[Optional[str], list[int]]]:
        """(text, ids) per prompt. Texts are tokenized in one batch call and truncated to
        max_model_len, as sentence-transformers does; given token ids are taken as they are.
        tokenization_kwargs: see TOKENIZATION_KWARGS (truncate_prompt_tokens keeps the last k)."""
        truncate, add_special_tokens = parse_tokenization_kwargs(tokenization_kwargs)
        results: list[Optional[tuple[Optional[str], list[int]]]] = [None] * len(prompts)
        texts, slots = [], []
        for i, prompt in enumerate(prompts):
            text = prompt if isinstance(prompt, str) else prompt.get("prompt") if isinstance(prompt, dict) else None
            given_ids = isinstance(prompt, dict) and "prompt_token_ids" in prompt
            if given_ids or not isinstance(text, str):  # ids as they are; anything else: its error
                results[i] = self._tokenize_prompt(prompt, add_special_tokens)
            else:
                if isinstance(prompt, dict):
                    check_prompt_keys(prompt)
                texts.append(text)
                slots.append(i)
        if texts:
            encoded = self.renderer.tokenizer(
                texts, truncation=truncate is None, max_length=self.max_model_len, add_special_tokens=add_special_tokens
            )["input_ids"]
            for i, text, ids in zip(slots, texts, encoded):
                results[i] = (text, ids)
        return [(text, self.truncate(ids, truncate)) for text, ids in results]  # type: ignore[misc]

    def check_pooling_batch(self, prompts: list[PromptType], priority: Optional[list[int]],
                            tokenization_kwargs: Optional[dict[str, Any]] = None) -> None:
        """What a pooling call's chunked tokenizing and queueing would refuse (priorities, prompt
        shapes and keys, given token ids), found before anything is queued."""
        if priority is not None:
            if len(priority) != len(prompts):
                raise ValueError(f"priority has {len(priority)} entries for {len(prompts)} prompts.")
            for value in priority:
                check_priority(value)
        for prompt in prompts:
            if isinstance(prompt, str) or (isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str)
                                           and "prompt_token_ids" not in prompt):
                if isinstance(prompt, dict):
                    check_prompt_keys(prompt)
                continue
            _, ids = self.tokenize_prompt(prompt, tokenization_kwargs)  # a ValueError for anything but token ids
            self.validate_pooling_prompt(ids)

    def validate_pooling_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise ValueError("The decoder prompt cannot be empty: it has no tokens.")
        if len(prompt_ids) > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt "
                f"contains {len(prompt_ids)} input tokens (prompt_token_ids, more than max_model_len={self.max_model_len})."
            )
        low, high = min(prompt_ids), max(prompt_ids)
        if low < 0 or high >= self.vocab_size:
            raise ValueError(
                f"Token id {low if low < 0 else high} is out of vocabulary: prompt_token_ids must lie in [0, {self.vocab_size})."
            )

    def engine_params(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        """A copy with the EOS token set, max_tokens capped by what is left of max_model_len,
        logprobs=-1 spelled as the vocabulary size, bad_words tokenized, and no
        truncate_prompt_tokens (the prompt is truncated already)."""
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
            logprobs=self.vocab_size if params.logprobs == -1 else params.logprobs,
            prompt_logprobs=self.vocab_size if params.prompt_logprobs == -1 else params.prompt_logprobs,
            bad_words_token_ids=self.bad_words_token_ids(params.bad_words) if params.bad_words else None,
            truncate_prompt_tokens=None,
        )


def params_per_prompt(params: Any, num_prompts: int, kind: type = SamplingParams,
                      field: str = "sampling_params") -> list[Any]:
    """One `kind` (SamplingParams or PoolingParams) for all prompts, or one per prompt, as a list
    of one per prompt; anything else a TypeError naming `field`."""
    if isinstance(params, kind):
        return [params] * num_prompts
    if not isinstance(params, (list, tuple)):
        raise TypeError(f"{field} must be a {kind.__name__} or a list of them, got {type(params).__name__}.")
    if len(params) != num_prompts:
        raise ValueError(f"{field} has {len(params)} entries for {num_prompts} prompts; give one or one per prompt.")
    for p in params:
        if not isinstance(p, kind):
            raise TypeError(f"{field} must hold {kind.__name__}, got {type(p).__name__}.")
    return list(params)


def check_prompt_keys(prompt: dict[str, Any]) -> None:
    unknown = sorted(k for k, v in prompt.items() if k not in _PROMPT_KEYS and v is not None)
    if unknown:
        raise ValueError(
            f"prompt keys {unknown} are not supported (shmvllm serves text-only models without "
            f"cache salts); a prompt may hold {sorted(_PROMPT_KEYS)}."
        )


def parse_tokenization_kwargs(tokenization_kwargs: Optional[dict[str, Any]]) -> tuple[Optional[int], bool]:
    """(truncate_prompt_tokens, add_special_tokens) from vLLM's tokenization_kwargs; other keys
    are refused by name."""
    kwargs = dict(tokenization_kwargs or {})
    unknown = sorted(set(kwargs) - set(TOKENIZATION_KWARGS))
    if unknown:
        raise ValueError(f"tokenization_kwargs keys {unknown} are not supported; supported: {list(TOKENIZATION_KWARGS)}.")
    truncate = kwargs.get("truncate_prompt_tokens")
    if truncate is not None and (not isinstance(truncate, int) or isinstance(truncate, bool) or (truncate < 1 and truncate != -1)):
        raise ValueError(f"tokenization_kwargs['truncate_prompt_tokens'] must be an int >= 1 or -1, got {truncate!r}.")
    add_special_tokens = kwargs.get("add_special_tokens", True)
    if not isinstance(add_special_tokens, bool):
        raise ValueError(f"tokenization_kwargs['add_special_tokens'] must be a bool, got {add_special_tokens!r}.")
    return truncate, add_special_tokens


def check_priority(priority: object) -> None:
    """TypeError / ValueError unless `priority` is an int that fits the message's int64."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise TypeError(f"priority must be an int, got {priority!r}.")
    if not -(2**63) <= priority < 2**63:
        raise ValueError(f"priority must fit in 64 bits, got {priority}.")


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
