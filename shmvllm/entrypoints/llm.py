"""LLM: vLLM's offline API (`generate`, `chat`, `embed`, `encode`) over an LLMEngine."""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any, Callable, Optional, Sequence, Union

import msgspec

import numpy as np

from shmvllm.beam_search import BeamSearchOutput, beam_prompt_ids, run_beam_search
from shmvllm.boundary.messages import EngineCoreRequest
from shmvllm.config import EngineArgs
from shmvllm.engine.input_processor import PromptType, check_prompt_keys
from shmvllm.engine.llm_engine import LLMEngine
from shmvllm.engine.renderer import Conversation
from shmvllm.entrypoints.output_router import OutputRouter, Sink
from shmvllm.lora import check_no_lora
from shmvllm.metrics import Metric
from shmvllm.engine.validation import as_conversations, as_prompt_list
from shmvllm.model.registry import DEFAULT_MODEL
from shmvllm.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringRequestOutput,
)
from shmvllm.pooling_params import POOLING_TASKS, PoolingParams
from shmvllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

Prompts = Union[PromptType, Sequence[PromptType]]
ParamsArg = Union[SamplingParams, Sequence[SamplingParams], None]
PoolingParamsArg = Union[PoolingParams, Sequence[PoolingParams], None]
UseTqdm = Union[bool, Callable[..., Any]]

# embed/encode tokenize this many texts per tokenizer call, and send them while the engine
# computes what came before.
POOLING_TOKENIZE_CHUNK = 256
# Requests in flight (sent, not yet finished) stay under this many engine steps' worth, so the
# engine always has work queued while the frontend's memory and the progress bar stay bounded.
# (A full ring cannot deadlock the two sides: see the flow-control rule in shmvllm/boundary/channel.py.)
POOLING_MAX_IN_FLIGHT_STEPS = 2  # x max_num_seqs


class LLM:
    """An LLM for offline inference.

    LLM(model=..., **engine_args): engine_args are EngineArgs' fields: shmvllm's knobs under
    vLLM's names (dtype, max_model_len, max_num_seqs, kv_cache_memory_bytes, ...) and the rest of
    vLLM's engine arguments, accepted where they make no difference here and refused with a
    ValueError naming them where they ask for what shmvllm lacks (README, "Porting from vLLM").
    An argument vLLM does not have either is a TypeError. multiprocess: run the engine in its
    own process (the default; over shared-memory rings) or in this one. request_timeout_s: a call that gets no
    output from the engine for this long raises EngineTimeoutError (a TimeoutError naming the
    engine's state) and aborts its requests (None: wait as long as it takes; the engine's death
    is noticed either way).

    Threads: one LLM may be called from many threads at once (generate, chat, embed, encode,
    score, beam_search, get_metrics). Each call returns exactly its own outputs, the requests of
    all callers share the engine's steps (continuous batching across callers), and a caller
    that is interrupted aborts only its own requests. If the engine dies, every waiting call
    raises EngineDeadError.
    """

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        *,
        multiprocess: bool = True,
        request_timeout_s: Optional[float] = None,
        **engine_args: Any,
    ):
        unknown = sorted(set(engine_args) - EngineArgs.field_names())
        if unknown:
            raise TypeError(f"LLM() got unexpected engine arguments {unknown}; known: {sorted(EngineArgs.field_names())}.")
        if request_timeout_s is not None and (
            isinstance(request_timeout_s, bool) or not isinstance(request_timeout_s, (int, float))
            or not request_timeout_s > 0 or request_timeout_s == float("inf")
        ):
            raise ValueError(f"request_timeout_s must be a positive number of seconds or None, got {request_timeout_s!r}.")
        self.request_timeout_s = request_timeout_s
        self.engine_args = EngineArgs(model=model, **engine_args)
        self.llm_engine = LLMEngine.from_engine_args(self.engine_args, multiprocess=multiprocess)
        self.llm_engine.set_request_timeout(request_timeout_s)
        self.model_config = self.llm_engine.model_config
        self.supported_tasks: tuple[str, ...] = ("embed",) if self.model_config.is_embedding else ("generate",)
        self.default_sampling_params: Optional[dict[str, Any]] = None
        self.request_counter = itertools.count()
        self._router = OutputRouter(self.llm_engine)
        self._closed = False

    def get_tokenizer(self) -> Any:
        return self.llm_engine.get_tokenizer()

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the defaults of the model's generation_config.json (temperature,
        top_p, top_k, min_p, repetition_penalty, max_new_tokens as max_tokens), as vLLM's."""
        if self.default_sampling_params is None:
            self.default_sampling_params = self.model_config.get_diff_sampling_param()
        return SamplingParams.from_optional(**self.default_sampling_params)

    def get_metrics(self) -> list[Metric]:
        """A snapshot of vLLM's metrics (vllm:prompt_tokens, vllm:num_requests_running, ...)."""
        return self._router.locked(self.llm_engine.get_metrics)

    def generate(
        self,
        prompts: Prompts,
        sampling_params: ParamsArg = None,
        use_tqdm: UseTqdm = True,
        lora_request: Any = None,
        priority: Optional[list[int]] = None,
        tokenization_kwargs: Optional[dict[str, Any]] = None,
    ) -> list[RequestOutput]:
        """Completes each prompt; returns one finished RequestOutput per prompt, in input order.

        prompts: a str, a list of token ids, {"prompt": str}, {"prompt_token_ids": [...]}, or a
        list of those. sampling_params: one for all prompts, or one per prompt (default:
        get_default_sampling_params()). tokenization_kwargs: {"truncate_prompt_tokens": k,
        "add_special_tokens": bool}. Every prompt is validated before any is queued: a
        ValueError leaves the LLM as it was.
        """
        self.llm_engine.check_task(SamplingParams())
        check_no_lora(lora_request)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        prompt_list = as_prompt_list(prompts)
        params_list = _params_per_prompt(sampling_params, len(prompt_list))
        return self._run(self._prepare(prompt_list, params_list, tokenization_kwargs, priority), use_tqdm)

    def chat(
        self,
        messages: Union[Conversation, list[Conversation]],
        sampling_params: ParamsArg = None,
        use_tqdm: UseTqdm = True,
        lora_request: Any = None,
        chat_template: Optional[str] = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Optional[list[dict[str, Any]]] = None,
        chat_template_kwargs: Optional[dict[str, Any]] = None,
        tokenization_kwargs: Optional[dict[str, Any]] = None,
        mm_processor_kwargs: Optional[dict[str, Any]] = None,
        priority: Optional[list[int]] = None,
    ) -> list[RequestOutput]:
        """Generates the next message of each conversation, rendered by the chat template
        (`chat_template` instead of the tokenizer's; `chat_template_kwargs`: extra template
        variables; `tools`: the template's tool list)."""
        self.llm_engine.check_task(SamplingParams())
        check_no_lora(lora_request)
        if mm_processor_kwargs:
            raise ValueError(f"mm_processor_kwargs={mm_processor_kwargs!r} is not supported: shmvllm serves text-only models.")
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        conversations = as_conversations(messages)
        renderer = self.llm_engine.renderer
        prompts: list[dict[str, Any]] = []
        for conversation in conversations:
            text, ids = renderer.render_chat(
                conversation,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,
                chat_template_kwargs=chat_template_kwargs,
                chat_template_content_format=chat_template_content_format,
            )
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        params_list = _params_per_prompt(sampling_params, len(prompts))
        return self._run(self._prepare(prompts, params_list, tokenization_kwargs, priority), use_tqdm)

    def beam_search(
        self,
        prompts: list[PromptType],
        params: BeamSearchParams,
        lora_request: Any = None,
        use_tqdm: bool = False,
        concurrency_limit: Optional[int] = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search (shmvllm.beam_search): the beam_width best sequences per prompt."""
        check_no_lora(lora_request)
        self.llm_engine.check_task(SamplingParams())
        prompt_ids = beam_prompt_ids(self, as_prompt_list(prompts))
        step = concurrency_limit or len(prompt_ids)
        results: list[BeamSearchOutput] = []
        for start in range(0, len(prompt_ids), step):
            results.extend(run_beam_search(self, prompt_ids[start : start + step], params))
        return results

    def embed(
        self,
        prompts: Prompts,
        pooling_params: PoolingParamsArg = None,
        use_tqdm: UseTqdm = True,
        lora_request: Any = None,
        priority: Optional[list[int]] = None,
        tokenization_kwargs: Optional[dict[str, Any]] = None,
        *,
        truncate_prompt_tokens: Optional[int] = None,
    ) -> list[EmbeddingRequestOutput]:
        """Embeds each prompt; one EmbeddingRequestOutput per prompt, in input order.

        prompts: a str, a list of token ids, {"prompt": str}, {"prompt_token_ids": [...]}, or a
        list of those; text is truncated to max_model_len tokens, as sentence-transformers does
        (truncate_prompt_tokens=k keeps the last k). pooling_params: one for all prompts, or one
        per prompt (default: PoolingParams(), the model's own pooling).
        `.outputs.embedding` is a list of floats, as vLLM's; `.outputs.numpy()` the same vector
        as a float32 numpy array viewing the engine's output bytes (no copy).
        """
        check_no_lora(lora_request)
        kwargs = _with_truncation(tokenization_kwargs, truncate_prompt_tokens)
        return [
            EmbeddingRequestOutput.from_base(o)
            for o in self._pool(prompts, pooling_params, use_tqdm, priority, kwargs, "embed")
        ]

    def encode(
        self,
        prompts: Prompts,
        pooling_params: PoolingParamsArg = None,
        use_tqdm: UseTqdm = True,
        lora_request: Any = None,
        pooling_task: Optional[str] = None,
        tokenization_kwargs: Optional[dict[str, Any]] = None,
        *,
        truncate_prompt_tokens: Optional[int] = None,
        priority: Optional[list[int]] = None,
    ) -> list[PoolingRequestOutput]:
        """Like `embed`, but `.outputs.data` is the pooled vector as a float32 torch tensor.
        pooling_task: "embed" (or vLLM's older "encode", the same vector here); the tasks shmvllm's
        models do not have ("classify", "score", "token_embed", ...) are refused by name."""
        import torch

        check_no_lora(lora_request)
        if pooling_task is not None and pooling_task not in POOLING_TASKS:
            raise ValueError(
                f"pooling_task={pooling_task!r} is not supported by model {self.model_config.model!r}: "
                f"it does {list(POOLING_TASKS)}."
            )
        kwargs = _with_truncation(tokenization_kwargs, truncate_prompt_tokens)
        outputs = self._pool(prompts, pooling_params, use_tqdm, priority, kwargs, pooling_task)
        for output in outputs:
            output.outputs.data = torch.from_numpy(output.outputs.data.copy())  # writable, owned
        return outputs

    def classify(self, prompts: Prompts, **kwargs: Any) -> list[ClassificationRequestOutput]:
        """vLLM's classification API: shmvllm serves no classification models, so it is refused as
        vLLM refuses it for a model without a classifier head."""
        raise ValueError(
            f"Classification API is not supported by model {self.model_config.model!r}: shmvllm serves "
            "generation and embedding models only."
        )

    def score(
        self,
        data_1: Union[PromptType, Sequence[PromptType]],
        data_2: Union[PromptType, Sequence[PromptType]],
        /,
        *,
        use_tqdm: UseTqdm = True,
        pooling_params: Optional[PoolingParams] = None,
        lora_request: Any = None,
        tokenization_kwargs: Optional[dict[str, Any]] = None,
        truncate_prompt_tokens: Optional[int] = None,
        chat_template: Optional[str] = None,
    ) -> list[ScoringRequestOutput]:
        """Similarity of each pair (data_1[i], data_2[i]); one data_1 is paired with every data_2.
        An embedding model scores by the cosine of the two embeddings (vLLM's bi-encoder scoring);
        shmvllm serves no cross-encoders."""
        check_no_lora(lora_request)
        if not self.model_config.is_embedding:
            raise ValueError("LLM.score() is only supported for pooling models; this one generates.")
        if chat_template is not None:
            raise ValueError("chat_template is only supported for cross-encoder models.")
        first = as_prompt_list(data_1)
        second = as_prompt_list(data_2)
        if len(first) == 1:
            first = first * len(second)
        if len(first) != len(second):
            raise ValueError(f"data_1 has {len(first)} inputs and data_2 {len(second)}: give one, or as many as data_2.")
        kwargs = _with_truncation(tokenization_kwargs, truncate_prompt_tokens)
        encoded = self._pool(first + second, pooling_params, use_tqdm, None, kwargs, "embed")
        scores = []
        for a, b in zip(encoded[: len(first)], encoded[len(first) :]):
            va, vb = a.outputs.data.astype(np.float64), b.outputs.data.astype(np.float64)
            cosine = float(va @ vb / max(np.linalg.norm(va) * np.linalg.norm(vb), 1e-12))
            base = PoolingRequestOutput(
                request_id=f"{a.request_id}_{b.request_id}",
                outputs=PoolingOutput(data=np.array([cosine], dtype=np.float32)),
                prompt_token_ids=a.prompt_token_ids + b.prompt_token_ids,
                finished=True,
                error=a.error or b.error,
            )
            scores.append(ScoringRequestOutput.from_base(base))
        return scores

    def _pool(
        self,
        prompts: Prompts,
        pooling_params: PoolingParamsArg,
        use_tqdm: UseTqdm,
        priority: Optional[list[int]],
        tokenization_kwargs: Optional[dict[str, Any]] = None,
        task: Optional[str] = None,
    ) -> list[PoolingRequestOutput]:
        """Validates everything, then tokenizes chunk by chunk while the engine embeds what was
        sent before; returns the outputs in prompt order."""
        engine = self.llm_engine
        prompt_list = as_prompt_list(prompts)
        if not prompt_list:
            raise ValueError("prompts is empty.")
        params_list = _pooling_params_per_prompt(pooling_params, len(prompt_list))
        engine.check_task(params_list[0])
        for params in {id(p): p for p in params_list}.values():
            engine.input_processor.verify_pooling_params(params)
            if task is not None and params.task is not None and params.task != task:
                raise ValueError(f"pooling_params.task={params.task!r} contradicts the pooling task {task!r}.")
        tokenization_kwargs = _pooling_truncation(tokenization_kwargs, params_list)
        if priority is not None and len(priority) != len(prompt_list):
            raise ValueError(f"priority has {len(priority)} entries for {len(prompt_list)} prompts.")
        for prompt in prompt_list:
            self._check_pooling_prompt(prompt, tokenization_kwargs)
        request_ids = [str(next(self.request_counter)) for _ in prompt_list]
        router, sink = self._router, Sink()
        tracker = _PoolingTracker(router, sink, len(prompt_list), use_tqdm, self.request_timeout_s)
        max_in_flight = POOLING_MAX_IN_FLIGHT_STEPS * engine.config.scheduler_config.max_num_seqs
        sent = 0
        try:
            for start in range(0, len(prompt_list), POOLING_TOKENIZE_CHUNK):
                chunk = prompt_list[start : start + POOLING_TOKENIZE_CHUNK]
                for text, ids in engine.input_processor.tokenize_for_pooling(chunk, tokenization_kwargs):
                    while tracker.in_flight >= max_in_flight:
                        tracker.collect()
                    router.register(sink, request_ids[sent])
                    router.locked(
                        engine.add_tokenized_pooling_request,
                        request_ids[sent], text, ids, params_list[sent], priority[sent] if priority else 0,
                    )
                    tracker.in_flight += 1
                    sent += 1
            while sink.pending:
                tracker.collect()
        except BaseException:
            router.release(sink)
            router.locked(engine.abort_request, [rid for rid in request_ids[:sent] if rid not in tracker.finished])
            raise
        finally:
            tracker.close()
        missing = [rid for rid in request_ids if rid not in tracker.finished]
        if missing:
            raise RuntimeError(f"the engine finished without outputs for requests {missing[:10]}.")
        return [tracker.finished[rid] for rid in request_ids]

    def _check_pooling_prompt(self, prompt: PromptType, tokenization_kwargs: Optional[dict[str, Any]]) -> None:
        """What `tokenize_for_pooling` would refuse, found before anything is queued."""
        if isinstance(prompt, str) or (isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str)
                                       and "prompt_token_ids" not in prompt):
            if isinstance(prompt, dict):
                check_prompt_keys(prompt)
            return
        processor = self.llm_engine.input_processor
        _, ids = processor.tokenize_prompt(prompt, tokenization_kwargs)  # a ValueError for anything but token ids
        processor.validate_pooling_prompt(ids)

    def _prepare(
        self,
        prompts: list[PromptType],
        params_list: list[SamplingParams],
        tokenization_kwargs: Optional[dict[str, Any]] = None,
        priority: Optional[list[int]] = None,
    ) -> list[tuple[EngineCoreRequest, Optional[str], list[int]]]:
        """Every prompt and its params checked (each distinct params object once) and made into
        its engine request, so that a bad one fails before any is queued; `_run` queues them as
        they are (their request ids are set there)."""
        if not prompts:
            raise ValueError("prompts is empty.")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority has {len(priority)} entries for {len(prompts)} prompts.")
        processor = self.llm_engine.input_processor
        finals: dict[int, SamplingParams] = {}
        for params in params_list:
            if id(params) not in finals:
                processor.check_params(params)
                # The caller's params stay untouched; offline calls only need each request's end.
                finals[id(params)] = msgspec.structs.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
        return [
            processor.make_request("", prompt, finals[id(params)], None, priority[i] if priority else 0, tokenization_kwargs)
            for i, (prompt, params) in enumerate(zip(prompts, params_list))
        ]

    def _run(self, prepared: list[tuple[EngineCoreRequest, Optional[str], list[int]]], use_tqdm: UseTqdm) -> list[RequestOutput]:
        """Queues what `_prepare` made and waits for all of it."""
        request_ids: list[str] = []
        router, sink = self._router, Sink()
        add = self.llm_engine.add_processed_request
        try:
            for request, prompt_text, prompt_ids in prepared:
                request.request_id = request_id = str(next(self.request_counter))
                router.register(sink, request_id)
                router.locked(add, request, prompt_text, prompt_ids)
                request_ids.append(request_id)
            return self._run_engine(request_ids, use_tqdm, sink)
        except BaseException:
            router.release(sink)
            router.locked(self.llm_engine.abort_request, request_ids)
            raise

    def _run_engine(self, request_ids: list[str], use_tqdm: UseTqdm, sink: Optional[Sink] = None) -> list[RequestOutput]:
        """Waits until every request is finished; returns outputs in `request_ids` order.

        sink: where the router puts these requests' outputs (registered before they were added);
        without one, the requests are registered now (they were added by the caller)."""
        if sink is None:
            sink = Sink()
            for request_id in request_ids:
                self._router.register(sink, request_id)
        started = time.perf_counter()
        bar = _progress_bar(len(request_ids), use_tqdm) if use_tqdm and len(request_ids) > 1 else None
        finished: dict[str, RequestOutput] = {}
        prompt_tokens = output_tokens = 0
        while sink.pending:
            for output in self._router.next_outputs(sink, self.request_timeout_s):
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
    if not isinstance(sampling_params, (list, tuple)):
        raise TypeError(
            f"sampling_params must be a SamplingParams or a list of them, got {type(sampling_params).__name__}."
        )
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

    def __init__(self, router: OutputRouter, sink: Sink, total: int, use_tqdm: UseTqdm, timeout: Optional[float] = None) -> None:
        self.router = router
        self.sink = sink
        self.timeout = timeout
        self.finished: dict[str, PoolingRequestOutput] = {}
        self.in_flight = 0
        self.started = time.perf_counter()
        self.prompt_tokens = 0
        self.bar = _progress_bar(total, use_tqdm) if use_tqdm and total > 1 else None

    def collect(self) -> None:
        """Takes one batch of engine outputs (blocks until it comes)."""
        done = 0
        for output in self.router.next_outputs(self.sink, self.timeout):
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


def _progress_bar(total: int, use_tqdm: UseTqdm = True) -> Any:
    """use_tqdm: True, or (as vLLM allows) a callable that makes the bar, e.g. partial(tqdm, leave=False)."""
    from tqdm.auto import tqdm

    make = use_tqdm if callable(use_tqdm) else tqdm
    return make(total=total, desc="Processed prompts", dynamic_ncols=True)


def _with_truncation(tokenization_kwargs: Optional[dict[str, Any]], truncate_prompt_tokens: Optional[int]) -> Optional[dict[str, Any]]:
    if truncate_prompt_tokens is None:
        return tokenization_kwargs
    return {**(tokenization_kwargs or {}), "truncate_prompt_tokens": truncate_prompt_tokens}


def _pooling_truncation(tokenization_kwargs: Optional[dict[str, Any]], params_list: list[PoolingParams]) -> Optional[dict[str, Any]]:
    """The call's tokenization kwargs with the PoolingParams' truncate_prompt_tokens (one value per call)."""
    values = {p.truncate_prompt_tokens for p in params_list} - {None}
    if not values:
        return tokenization_kwargs
    if len(values) > 1:
        raise ValueError(f"pooling_params ask for different truncate_prompt_tokens {sorted(values)}: give one per call.")
    return _with_truncation(tokenization_kwargs, values.pop())
