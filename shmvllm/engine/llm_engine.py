"""LLMEngine: renderer + input processor + output processor + engine core client.

`add_request` turns a prompt into EngineCoreRequests (n of them for n > 1), registers them with
the output processor, then sends them to the engine, as one step: if a send fails, nothing of
the request stays registered (and what was sent is aborted). `step` takes one batch of engine
outputs and returns the RequestOutputs they make.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any, Callable, Iterator, Optional, Union

import msgspec

from shmvllm import envs
from shmvllm.boundary.messages import EngineCoreOutputs, EngineCoreRequest, now
from shmvllm.config import EngineConfig
from shmvllm.engine.arg_utils import EngineArgs
from shmvllm.engine.core_client import EngineCoreClient
from shmvllm.engine.input_processor import InputProcessor, PromptType, check_priority
from shmvllm.engine.output_processor import OutputProcessor, ParentRequest
from shmvllm.engine.proc_manager import PrestartedEngine
from shmvllm.engine.fast_tokenizer import FastTokenizer
from shmvllm.engine.renderer import Renderer, load_frontend_tokenizer, load_tokenizer
from shmvllm.metrics import FrontendStats, Metric
from shmvllm.outputs import PoolingRequestOutput, RequestOutput
from shmvllm.pooling_params import PoolingParams
from shmvllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class _Background:
    """`fn(*args)` on a thread of its own; `result()` waits for it and returns (or raises) it."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self._fn, self._args = fn, args
        self._value: Any = None
        self._error: Optional[BaseException] = None
        self.seconds = 0.0
        self._thread = threading.Thread(target=self._run, name=f"shmvllm-{fn.__name__}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        started = time.perf_counter()
        try:
            self._value = self._fn(*self._args)
        except BaseException as exc:  # handed to the caller of result()
            self._error = exc
        self.seconds = time.perf_counter() - started

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


class LLMEngine:
    def __init__(self, config: EngineConfig, multiprocess: bool = True, prestarted: Optional[PrestartedEngine] = None):
        """prestarted: the engine's fork, made before `config` (from_engine_args)."""
        self.config = config
        model_config = config.model_config
        # The engine process loads while this one loads the tokenizer (a thread: imports and file
        # parsing here, a wait with the GIL released there); the engine's failure comes first.
        # A forked engine is forked before the thread starts (`started`, called between the fork
        # and the wait for READY): a fork while it imports would leave the engine's copy of an
        # import lock held by a thread the engine does not have.
        fork = multiprocess and envs.SHMVLLM_ENGINE_START() == "fork"
        load = (load_frontend_tokenizer, model_config.tokenizer_dir or model_config.model_dir, model_config.tokenizer_mode)
        loading: list[_Background] = []

        def start_tokenizer() -> None:
            if not model_config.skip_tokenizer_init:
                loading.append(_Background(*load))

        if not fork:
            start_tokenizer()
        started = time.perf_counter()
        # a failure here leaves the tokenizer's thread (a daemon) to end on its own
        try:
            self.engine_core = EngineCoreClient.make_client(config, multiprocess=multiprocess,
                                                            started=start_tokenizer if fork else None, prestarted=prestarted)
        finally:
            if prestarted is not None:  # unused (a failure before its start, another client): reaped
                prestarted.discard()
        engine_ready = time.perf_counter()
        if fork and not loading:  # a client that did not call `started` (InprocClient, a test's stand-in)
            start_tokenizer()
        tokenizer = loading[0] if loading else None
        try:
            frontend_tokenizer = None if tokenizer is None else tokenizer.result()
        except BaseException:
            self.engine_core.shutdown()
            raise
        logger.info(
            "Start-up: engine ready %.2f s after its start; the tokenizer %s",
            engine_ready - started, "skipped" if tokenizer is None else f"loaded in {tokenizer.seconds:.2f} s alongside",
        )
        # transformers' tokenizer, for get_tokenizer(): loaded on first use where the frontend's is a FastTokenizer
        self._hf_tokenizer = None if isinstance(frontend_tokenizer, FastTokenizer) else frontend_tokenizer
        self._hf_tokenizer_lock = threading.Lock()
        self.renderer = Renderer(frontend_tokenizer)
        self.input_processor = InputProcessor(
            self.renderer, model_config.max_model_len, model_config.vocab_size, model_config.model_dir,
            hidden_size=model_config.embedding_size if model_config.is_embedding else model_config.hidden_size,
            task=model_config.task,
            max_logprobs=model_config.max_logprobs,
            model=model_config.model,
        )
        self.output_processor = OutputProcessor(frontend_tokenizer)
        # The engine's own limits (READY carries them: max_model_len clamped to what the KV cache
        # holds, the vocabulary, max_logprobs), which requests are validated against.
        self.input_processor.set_engine_limits(self.engine_core.ready)
        self.stats = FrontendStats(self.input_processor.max_model_len)

    @property
    def model_config(self) -> Any:
        """vLLM's `llm_engine.model_config` (max_model_len, hf_config, get_vocab_size(), ...)."""
        return self.config.model_config

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, multiprocess: bool = True) -> "LLMEngine":
        started = time.perf_counter()
        # the engine's fork comes first: its imports (torch) overlap the config's making here
        prestarted = PrestartedEngine() if PrestartedEngine.wanted(multiprocess, engine_args.data_parallel_size) else None
        try:
            config = engine_args.create_engine_config()
        except BaseException:
            if prestarted is not None:
                prestarted.discard()
            raise
        logger.info("Start-up: engine config (model %s) in %.3f s", config.model_config.model_dir, time.perf_counter() - started)
        return cls(config, multiprocess=multiprocess, prestarted=prestarted)

    @property
    def tokenizer(self) -> Any:
        """transformers' tokenizer of the model (None with skip_tokenizer_init), loaded on first use:
        the frontend itself encodes and decodes with `renderer.tokenizer`, equal to it."""
        frontend = self.renderer.tokenizer
        if frontend is None or self._hf_tokenizer is not None:
            return self._hf_tokenizer
        with self._hf_tokenizer_lock:
            if self._hf_tokenizer is None:
                model_config = self.config.model_config
                self._hf_tokenizer = load_tokenizer(model_config.tokenizer_dir or model_config.model_dir,
                                                    model_config.tokenizer_mode)
        return self._hf_tokenizer

    def get_tokenizer(self) -> Any:
        if self.renderer.tokenizer is None:
            raise ValueError("Tokenizer not available when `skip_tokenizer_init=True`.")
        return self.tokenizer

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: Union[SamplingParams, PoolingParams],
        arrival_time: Optional[float] = None,
        priority: int = 0,
        tokenization_kwargs: Optional[dict[str, Any]] = None,
    ) -> None:
        """Validates, then queues; a ValueError here means nothing of this request was queued.

        SamplingParams make a generation request, PoolingParams a pooling (embedding) one; each
        needs an engine of its task."""
        self.input_processor.check_task(PoolingParams if isinstance(params, PoolingParams) else SamplingParams)
        if isinstance(params, PoolingParams):
            self._add_pooling_request(request_id, prompt, params, arrival_time, priority, tokenization_kwargs)
            return
        request, prompt_text, prompt_ids = self.input_processor.process_inputs(
            request_id, prompt, params, arrival_time, priority, tokenization_kwargs
        )
        self.add_processed_request(request, prompt_text, prompt_ids)

    def add_processed_request(self, request: EngineCoreRequest, prompt_text: Optional[str], prompt_ids: list[int]) -> None:
        """Queues a generation request that `InputProcessor.process_inputs` (or `make_request`
        after `check_params`) built, and so validated, for this engine: `LLM.generate` checks a
        whole batch first, then queues it without checking any of it again."""
        request_id = request.request_id
        if request.sampling_params.n == 1:
            self.output_processor.add_request(request, prompt_text, prompt_ids)  # reserves the id
            with self._undone_on_failure(request_id) as sent:
                self.engine_core.add_request(request)
                sent.append(request_id)
            return
        parent = ParentRequest(request_id, request.sampling_params)
        self.output_processor.add_parent(parent)  # reserves the id and its children's
        with self._undone_on_failure(request_id) as sent:
            for index, child_id in enumerate(parent.child_ids):
                child = msgspec.structs.replace(request, request_id=child_id, sampling_params=parent.child_params(index))
                self.output_processor.add_request(child, prompt_text, prompt_ids, parent=parent, index=index)
                self.engine_core.add_request(child, group=request_id)
                sent.append(child_id)

    @contextlib.contextmanager
    def _undone_on_failure(self, request_id: str) -> Iterator[list[str]]:
        """Registration and sending as one step: if the block raises, the output processor
        forgets `request_id` (and its children) and the engine aborts the ids the block put in
        the yielded list (those already sent)."""
        sent: list[str] = []
        try:
            yield sent
        except BaseException:
            self.output_processor.abort_requests([request_id])
            if sent:
                try:
                    self.engine_core.abort_requests(sent)
                except Exception:  # the engine is gone: it holds nothing any more
                    logger.warning("could not abort %d requests in the engine", len(sent), exc_info=True)
            raise

    def _add_pooling_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: PoolingParams,
        arrival_time: Optional[float],
        priority: int,
        tokenization_kwargs: Optional[dict[str, Any]] = None,
    ) -> None:
        self.input_processor.verify_pooling_params(params)
        ((prompt_text, prompt_ids),) = self.input_processor.tokenize_for_pooling([prompt], tokenization_kwargs)
        self.add_tokenized_pooling_request(request_id, prompt_text, prompt_ids, params, priority, arrival_time)

    def add_tokenized_pooling_request(
        self,
        request_id: str,
        prompt_text: Optional[str],
        prompt_ids: list[int],
        params: PoolingParams,
        priority: int = 0,
        arrival_time: Optional[float] = None,
    ) -> None:
        """A pooling request whose prompt `tokenize_for_pooling` already tokenized, and whose task and
        params the caller checked (LLM.embed tokenizes its prompts in batches)."""
        check_priority(priority)
        self.input_processor.validate_pooling_prompt(prompt_ids)
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=EngineCoreRequest.pack_token_ids(prompt_ids),
            pooling_params=params,
            arrival_time=now() if arrival_time is None else arrival_time,
            priority=priority,
        )
        self._queue_pooling_request(request, prompt_text, prompt_ids)

    def _queue_pooling_request(self, request: EngineCoreRequest, prompt_text: Optional[str], prompt_ids: list[int]) -> None:
        self.output_processor.add_pooling_request(request.request_id, prompt_text, prompt_ids)  # reserves the id
        with self._undone_on_failure(request.request_id) as sent:
            self.engine_core.add_request(request)
            sent.append(request.request_id)

    def set_request_timeout(self, seconds: Optional[float]) -> None:
        """How long a send may wait for room in a full input channel (step() takes its own
        timeout); EngineTimeoutError after that."""
        if hasattr(self.engine_core, "request_timeout_s"):
            self.engine_core.request_timeout_s = seconds

    def step(self, timeout: Optional[float] = None) -> list[Union[RequestOutput, PoolingRequestOutput]]:
        """One batch of engine outputs -> RequestOutputs; aborts in the engine what stop strings
        ended. EngineTimeoutError when the engine sent nothing for `timeout` s (None: no limit)."""
        return self.process_engine_outputs(self.engine_core.get_output(timeout))

    def process_engine_outputs(self, outputs: EngineCoreOutputs) -> list[Union[RequestOutput, PoolingRequestOutput]]:
        """`step` after the wait: what one batch of engine outputs makes (threads that share the
        engine wait for outputs unlocked and run this under their lock)."""
        processed = self.output_processor.process_outputs(outputs)
        if processed.reqs_to_abort:
            self.engine_core.abort_requests(processed.reqs_to_abort)
        finished_at = now()
        for output in processed.request_outputs:
            if output.finished and isinstance(output, RequestOutput):
                self.stats.record_finished(output, finished_at)
        return processed.request_outputs

    def get_metrics(self) -> list[Metric]:
        """vLLM's metrics: the engine's state and totals, and the frontend's token and latency counts."""
        return self.stats.snapshot(self.engine_core.get_stats(), self.config.model_config.model)

    def abort_request(self, request_ids: list[str]) -> None:
        """Aborts requests by the ids they were added with (a parent id aborts all its children)."""
        engine_ids = self.output_processor.abort_requests(request_ids)
        if engine_ids:
            self.engine_core.abort_requests(engine_ids)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def shutdown(self) -> None:
        self.engine_core.shutdown()
