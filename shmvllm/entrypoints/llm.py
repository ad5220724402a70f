"""LLM: vLLM's offline API (`generate`, `chat`) over an LLMEngine."""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any, Optional, Sequence, Union

import msgspec

from shmvllm.config import EngineArgs
from shmvllm.engine.input_processor import PromptType
from shmvllm.engine.llm_engine import LLMEngine
from shmvllm.engine.renderer import Conversation
from shmvllm.model.registry import DEFAULT_MODEL
from shmvllm.outputs import RequestOutput
from shmvllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

Prompts = Union[PromptType, Sequence[PromptType]]
ParamsArg = Union[SamplingParams, Sequence[SamplingParams], None]


class LLM:
    """An LLM for offline inference.

    LLM(model=..., **engine_args): engine_args are EngineArgs' fields (dtype, max_model_len,
    num_kv_blocks, ...). multiprocess: run the engine in its own process (the default) or in
    this one. transport: the channel to the engine process ("shm": shared-memory rings).
    """

    def __init__(self, model: str = DEFAULT_MODEL, *, multiprocess: bool = True, transport: str = "shm", **engine_args: Any):
        unknown = sorted(set(engine_args) - EngineArgs.field_names())
        if unknown:
            raise TypeError(f"LLM() got unexpected engine arguments {unknown}; known: {sorted(EngineArgs.field_names())}.")
        self.engine_args = EngineArgs(model=model, **engine_args)
        self.llm_engine = LLMEngine.from_engine_args(self.engine_args, multiprocess=multiprocess, transport=transport)
        self.request_counter = itertools.count()
        self._closed = False

    def get_tokenizer(self) -> Any:
        return self.llm_engine.get_tokenizer()

    def generate(
        self,
        prompts: Prompts,
        sampling_params: ParamsArg = None,
        use_tqdm: bool = True,
        priority: Optional[list[int]] = None,
    ) -> list[RequestOutput]:
        """Completes each prompt; returns one finished RequestOutput per prompt, in input order.

        prompts: a str, {"prompt": str}, {"prompt_token_ids": [...]}, or a list of those.
        sampling_params: one for all prompts, or one per prompt (default: SamplingParams()).
        Every prompt is validated before any is queued: a ValueError leaves the LLM as it was.
        """
        prompt_list = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        return self._run(self._prepare(prompt_list), sampling_params, use_tqdm, priority)

    def chat(
        self,
        messages: Union[Conversation, list[Conversation]],
        sampling_params: ParamsArg = None,
        use_tqdm: bool = True,
        chat_template: Optional[str] = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """Generates the next message of each conversation, rendered by the chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        renderer = self.llm_engine.renderer
        prompts: list[dict[str, Any]] = []
        for conversation in conversations:
            text, ids = renderer.render_chat(
                conversation,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
            )
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self._run(self._prepare(prompts), sampling_params, use_tqdm, None)

    def _prepare(self, prompts: list[PromptType]) -> list[dict[str, Any]]:
        """Tokenizes and validates every prompt, so that a bad one fails before any is queued."""
        if not prompts:
            raise ValueError("prompts is empty.")
        processor = self.llm_engine.input_processor
        prepared = []
        for prompt in prompts:
            text, ids = processor.tokenize_prompt(prompt)
            processor.validate_prompt(ids)
            prepared.append({"prompt": text, "prompt_token_ids": ids})
        return prepared

    def _run(
        self, prompts: list[dict[str, Any]], sampling_params: ParamsArg, use_tqdm: bool, priority: Optional[list[int]]
    ) -> list[RequestOutput]:
        params_list = _params_per_prompt(sampling_params, len(prompts))
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority has {len(priority)} entries for {len(prompts)} prompts.")
        request_ids = []
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list)):
                request_id = str(next(self.request_counter))
                # The caller's params stay untouched; offline calls only need each request's end.
                final = msgspec.structs.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
                self.llm_engine.add_request(request_id, prompt, final, priority=priority[i] if priority else 0)
                request_ids.append(request_id)
            return self._run_engine(request_ids, use_tqdm)
        except BaseException:
            self.llm_engine.abort_request(request_ids)
            raise

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        """Steps the engine until every request is finished; returns outputs in `request_ids` order."""
        started = time.perf_counter()
        bar = _progress_bar(len(request_ids)) if use_tqdm and len(request_ids) > 1 else None
        finished: dict[str, RequestOutput] = {}
        prompt_tokens = output_tokens = 0
        while self.llm_engine.has_unfinished_requests():
            for output in self.llm_engine.step():
                if not output.finished:
                    continue
                finished[output.request_id] = output
                prompt_tokens += len(output.prompt_token_ids or ())
                output_tokens += sum(len(c.token_ids) for c in output.outputs)
                if output.error is not None:
                    logger.warning("request %s failed in the engine: %s", output.request_id, output.error)
                if bar is not None:
                    elapsed = max(time.perf_counter() - started, 1e-9)
                    bar.set_postfix_str(
                        f"est. speed input: {prompt_tokens / elapsed:.1f} toks/s, output: {output_tokens / elapsed:.1f} toks/s"
                    )
                    bar.update(1)
        if bar is not None:
            bar.close()
        elapsed = time.perf_counter() - started
        logger.info(
            "%d requests: %d prompt + %d output tokens in %.2f s (%.1f output tok/s)",
            len(request_ids), prompt_tokens, output_tokens, elapsed, output_tokens / max(elapsed, 1e-9),
        )
        missing = [rid for rid in request_ids if rid not in finished]
        if missing:
            raise RuntimeError(f"the engine finished without outputs for requests {missing}.")
        return [finished[rid] for rid in request_ids]

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self.llm_engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.shutdown()


def _params_per_prompt(sampling_params: ParamsArg, num_prompts: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * num_prompts
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    params = list(sampling_params)
    if len(params) != num_prompts:
        raise ValueError(f"sampling_params has {len(params)} entries for {num_prompts} prompts; give one or one per prompt.")
    for p in params:
        if not isinstance(p, SamplingParams):
            raise TypeError(f"sampling_params must hold SamplingParams, got {type(p).__name__}.")
    return params


def _progress_bar(total: int) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
