"""LLM: vLLM's offline API (`generate`, `chat`, `embed`, `encode`) over an LLMEngine."""

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
from shmvllm.outputs import EmbeddingRequestOutput, PoolingRequestOutput, RequestOutput
from shmvllm.pooling_params import PoolingParams
from shmvllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

Prompts = Union[PromptType, Sequence[PromptType]]
ParamsArg = Union[SamplingParams, Sequence[SamplingParams], None]
PoolingParamsArg = Union[PoolingParams, Sequence[PoolingParams], None]

# embed/encode tokenize this many texts per tokenizer call, and send them while the engine
# computes what came before.
POOLING_TOKENIZE_CHUNK = 256
# Requests in flight (sent, not yet finished) stay under this many engine steps' worth, so the
# engine always has work queued while the frontend's memory and the progress bar stay bounded.
# (A full ring cannot deadlock the two sides: SyncMPClient drains outputs while it waits to send.)
POOLING_MAX_IN_FLIGHT_STEPS = 2  # x max_num_seqs


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
        self.llm_engine.check_task(SamplingParams())
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
        self.llm_engine.check_task(SamplingParams())
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

    def embed(
        self,
        prompts: Prompts,
        pooling_params: PoolingParamsArg = None,
        use_tqdm: bool = True,
        priority: Optional[list[int]] = None,
    ) -> list[EmbeddingRequestOutput]:
        """Embeds each prompt; one EmbeddingRequestOutput per prompt, in input order.

        prompts: a str, {"prompt": str}, {"prompt_token_ids": [...]}, or a list of those; text is
        truncated to max_model_len tokens, as sentence-transformers does. pooling_params: one for
        all prompts, or one per prompt (default: PoolingParams(), the model's own pooling).
        `.outputs.embedding` is a float32 numpy array viewing the engine's output bytes.
        """
        return [EmbeddingRequestOutput.from_base(o) for o in self._pool(prompts, pooling_params, use_tqdm, priority)]

    def encode(
        self,
        prompts: Prompts,
        pooling_params: PoolingParamsArg = None,
        use_tqdm: bool = True,
        priority: Optional[list[int]] = None,
    ) -> list[PoolingRequestOutput]:
        """Like `embed`, but `.outputs.data` is the pooled vector as a float32 torch tensor."""
        import torch

        outputs = self._pool(prompts, pooling_params, use_tqdm, priority)
        for output in outputs:
            output.outputs.data = torch.from_numpy(output.outputs.data.copy())  # writable, owned
        return outputs

    def _pool(
        self, prompts: Prompts, pooling_params: PoolingParamsArg, use_tqdm: bool, priority: Optional[list[int]]
    ) -> list[PoolingRequestOutput]:
        """Validates everything, then tokenizes chunk by chunk while the engine embeds what was
        sent before; returns the outputs in prompt order."""
        engine = self.llm_engine
        prompt_list = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        if not prompt_list:
            raise ValueError("prompts is empty.")
        params_list = _pooling_params_per_prompt(pooling_params, len(prompt_list))
        engine.check_task(params_list[0])
        for params in {id(p): p for p in params_list}.values():
            engine.input_processor.verify_pooling_params(params)
        if priority is not None and len(priority) != len(prompt_list):
            raise ValueError(f"priority has {len(priority)} entries for {len(prompt_list)} prompts.")
        for prompt in prompt_list:
            self._check_pooling_prompt(prompt)
        request_ids = [str(next(self.request_counter)) for _ in prompt_list]
        tracker = _PoolingTracker(engine, len(prompt_list), use_tqdm)
        max_in_flight = POOLING_MAX_IN_FLIGHT_STEPS * engine.config.scheduler_config.max_num_seqs
        sent = 0
        try:
            for start in range(0, len(prompt_list), POOLING_TOKENIZE_CHUNK):
                chunk = prompt_list[start : start + POOLING_TOKENIZE_CHUNK]
                for text, ids in engine.input_processor.tokenize_for_pooling(chunk):
                    while tracker.in_flight >= max_in_flight:
                        tracker.collect()
                    engine.add_tokenized_pooling_request(
                        request_ids[sent], text, ids, params_list[sent], priority[sent] if priority else 0
                    )
                    tracker.in_flight += 1
                    sent += 1
            while engine.has_unfinished_requests():
                tracker.collect()
        except BaseException:
            engine.abort_request([rid for rid in request_ids[:sent] if rid not in tracker.finished])
            raise
        finally:
            tracker.close()
        missing = [rid for rid in request_ids if rid not in tracker.finished]
        if missing:
            raise RuntimeError(f"the engine finished without outputs for requests {missing[:10]}.")
        return [tracker.finished[rid] for rid in request_ids]

    def _check_pooling_prompt(self, prompt: PromptType) -> None:
        """What `tokenize_for_pooling` would refuse, found before anything is queued."""
        if isinstance(prompt, str) or (isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str)
                                       and "prompt_token_ids" not in prompt):
            return
        processor = self.llm_engine.input_processor
        _, ids = processor.tokenize_prompt(prompt)  # a ValueError for anything but given token ids
        processor.validate_pooling_prompt(ids)

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
                if not output.finished or not isinstance(output, RequestOutput):
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


class _PoolingTracker:
    """The finished pooling outputs of one embed/encode call, what is still in flight, and the
    progress bar."""

    def __init__(self, engine: LLMEngine, total: int, use_tqdm: bool) -> None:
        self.engine = engine
        self.finished: dict[str, PoolingRequestOutput] = {}
        self.in_flight = 0
        self.started = time.perf_counter()
        self.prompt_tokens = 0
        self.bar = _progress_bar(total) if use_tqdm and total > 1 else None

    def collect(self) -> None:
        """Takes one batch of engine outputs (blocks until it comes)."""
        done = 0
        for output in self.engine.step():
            if not isinstance(output, PoolingRequestOutput):
                continue
            self.finished[output.request_id] = output
            num_tokens = len(output.prompt_token_ids)
            self.in_flight -= 1
            self.prompt_tokens += num_tokens
            done += 1
            if output.error is not None:
                logger.warning("request %s failed in the engine: %s", output.request_id, output.error)
        if self.bar is not None and done:
            elapsed = max(time.perf_counter() - self.started, 1e-9)
            self.bar.set_postfix_str(f"est. speed input: {self.prompt_tokens / elapsed:.1f} toks/s")
            self.bar.update(done)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elapsed = time.perf_counter() - self.started
        logger.info(
            "%d pooling requests: %d prompt tokens in %.2f s (%.1f requests/s)",
            len(self.finished), self.prompt_tokens, elapsed, len(self.finished) / max(elapsed, 1e-9),
        )


def _pooling_params_per_prompt(pooling_params: PoolingParamsArg, num_prompts: int) -> list[PoolingParams]:
    if pooling_params is None:
        return [PoolingParams()] * num_prompts
    if isinstance(pooling_params, PoolingParams):
        return [pooling_params] * num_prompts
    if isinstance(pooling_params, SamplingParams):
        raise TypeError("pooling_params must be a PoolingParams, got SamplingParams; use generate() to generate.")
    params = list(pooling_params)
    if len(params) != num_prompts:
        raise ValueError(f"pooling_params has {len(params)} entries for {num_prompts} prompts; give one or one per prompt.")
    for p in params:
        if not isinstance(p, PoolingParams):
            raise TypeError(f"pooling_params must hold PoolingParams, got {type(p).__name__}.")
    return params


def _progress_bar(total: int) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
