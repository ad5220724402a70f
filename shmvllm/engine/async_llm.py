"""AsyncLLM: vLLM's asyncio engine API over the same LLMEngine, EngineCoreClient and rings.

Many coroutines add requests; each `generate` / `encode` is an async generator of that request's
outputs. One reader thread waits on the engine's output ring (the ring's blocking receive
releases the GIL; it wakes every POLL_S to look at the engine process and at shutdown),
processes each batch of outputs under the state lock, and hands every output to the event
loop of the coroutine that owns it with `call_soon_threadsafe`: nothing spins, the event loop
is woken only when there is something for it. Leaving a stream early (cancelling its task,
`break`, closing the generator) aborts the request in the engine. If the engine dies, every
stream raises EngineDeadError within about POLL_S.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import multiprocessing.util
import threading
from typing import Any, AsyncGenerator, Optional, Union

from shmvllm.config import EngineConfig
from shmvllm.engine.arg_utils import EngineArgs
from shmvllm.boundary.channel import POLL_S
from shmvllm.engine.exceptions import EngineDeadError, EngineTimeoutError
from shmvllm.engine.input_processor import PromptType
from shmvllm.engine.llm_engine import LLMEngine
from shmvllm.outputs import EmbeddingRequestOutput, PoolingRequestOutput, RequestOutput
from shmvllm.pooling_params import PoolingParams
from shmvllm.sampling_params import RequestOutputKind, SamplingParams

Output = Union[RequestOutput, PoolingRequestOutput]


class _Stream:
    """One request's outputs on their way to its coroutine; touched only on its event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, keep_all: bool) -> None:
        self.loop = loop
        self.keep_all = keep_all  # DELTA: every piece; otherwise only the newest output counts
        self.items: collections.deque[Output] = collections.deque()
        self.error: Optional[BaseException] = None
        self.closed = False  # aborted: the stream ends after what it holds
        self.ready = asyncio.Event()

    def put(self, output: Output) -> None:
        if not self.keep_all:
            self.items.clear()
        self.items.append(output)
        self.ready.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.ready.set()

    def close(self) -> None:
        self.closed = True
        self.ready.set()

    async def get(self) -> Optional[Output]:
        """The next output; None once the request was aborted."""
        while not self.items:
            if self.error is not None:
                raise self.error
            if self.closed:
                return None
            self.ready.clear()
            await self.ready.wait()
        return self.items.popleft()


class _OutputReader:
    """The thread that reads the engine's outputs; apart from AsyncLLM so that it can be collected."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.lock = threading.Lock()  # the output processor and the input channel: one thread at a time
        self.streams: dict[str, _Stream] = {}
        self.dead: Optional[EngineDeadError] = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shmvllm-async-output", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        engine = self.engine
        while not self._stopping.is_set():
            try:
                outputs = engine.engine_core.get_output(POLL_S)
            except EngineTimeoutError:
                continue  # nothing in POLL_S: look at the stop flag, wait again
            except EngineDeadError as exc:
                self._fail_all(exc)
                return
            try:
                self._dispatch(outputs)
            except Exception as exc:  # a stream must never wait for a reader that is gone
                self._fail_all(EngineDeadError(f"the output reader failed: {exc!r}"))
                raise

    def _dispatch(self, outputs: Any) -> None:
        with self.lock:
            processed = self.engine.process_engine_outputs(outputs)
            for output in processed:
                stream = self.streams.get(output.request_id)
                if stream is None:
                    continue
                if output.finished:
                    del self.streams[output.request_id]
                _call_soon(stream.loop, stream.put, output)

    def _fail_all(self, error: EngineDeadError) -> None:
        with self.lock:
            self.dead = error
            streams, self.streams = list(self.streams.values()), {}
        for stream in streams:
            _call_soon(stream.loop, stream.fail, error)

    def stop(self) -> None:
        """Stops the thread (within ~POLL_S) and fails what still streams. Idempotent."""
        self._stopping.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
        if self.dead is None:
            self._fail_all(EngineDeadError("the AsyncLLM is shut down."))


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Any, *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop is closed: nobody waits for this stream any more
        pass


class AsyncLLM:
    """vLLM's AsyncLLM: `async for out in llm.generate(prompt, params, request_id)`.

    The engine runs in its own process, over the shared-memory rings. sampling_params.output_kind:
    DELTA yields each new piece, CUMULATIVE (the default) the whole text so far (a consumer
    slower than the engine skips to the newest), FINAL_ONLY only the finished output.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.engine = LLMEngine(config, multiprocess=True)
        self.model_config = self.engine.model_config
        self._reader = _OutputReader(self.engine)
        # Before the engine client's own finalizer (priority 100): the reader must stop reading
        # the ring before the ring goes.
        self._finalizer = multiprocessing.util.Finalize(self, self._reader.stop, exitpriority=101)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **kwargs: Any) -> "AsyncLLM":
        """vLLM's constructor (its start_engine_loop, usage_context, ... are accepted and have no effect
        here: the reader thread always runs)."""
        unknown = sorted(set(kwargs) - _ACCEPTED_FROM_ENGINE_ARGS)
        if unknown:
            raise TypeError(f"AsyncLLM.from_engine_args() got unexpected arguments {unknown}.")
        return cls(engine_args.create_engine_config())

    # ---- requests ------------------------------------------------------------------------

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        tokenization_kwargs: Optional[dict[str, Any]] = None,
        lora_request: Any = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """The request's RequestOutputs as the engine makes them (as sampling_params.output_kind says)."""
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}.")
        async for output in self._stream(prompt, sampling_params, request_id, priority, tokenization_kwargs, lora_request):
            yield output

    async def encode(
        self,
        prompt: PromptType,
        pooling_params: Optional[PoolingParams],
        request_id: str,
        *,
        priority: int = 0,
        tokenization_kwargs: Optional[dict[str, Any]] = None,
        lora_request: Any = None,
    ) -> AsyncGenerator[PoolingRequestOutput, None]:
        """The request's one PoolingRequestOutput (`.outputs.data`: the pooled float32 vector)."""
        params = PoolingParams() if pooling_params is None else pooling_params
        if not isinstance(params, PoolingParams):
            raise TypeError(f"pooling_params must be a PoolingParams, got {type(params).__name__}.")
        async for output in self._stream(prompt, params, request_id, priority, tokenization_kwargs, lora_request):
            yield output

    async def embed(
        self,
        prompt: PromptType,
        pooling_params: Optional[PoolingParams] = None,
        request_id: Optional[str] = None,
        **kwargs: Any,
    ) -> EmbeddingRequestOutput:
        """One prompt's embedding (awaitable; `encode` is vLLM's streaming form of the same)."""
        result = None
        async for output in self.encode(prompt, pooling_params, request_id or _fresh_id(), **kwargs):
            result = output
        assert result is not None  # a stream ends with its finished output or raises
        return EmbeddingRequestOutput.from_base(result)

    async def _stream(
        self, prompt: PromptType, params: Any, request_id: str, priority: int,
        tokenization_kwargs: Optional[dict[str, Any]], lora_request: Any,
    ) -> AsyncGenerator[Any, None]:
        from shmvllm.lora import check_no_lora

        check_no_lora(lora_request)
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {request_id!r}.")
        reader = self._reader
        keep_all = isinstance(params, SamplingParams) and params.output_kind == RequestOutputKind.DELTA
        stream = _Stream(asyncio.get_running_loop(), keep_all)
        with reader.lock:
            if reader.dead is not None:
                raise reader.dead
            if request_id in reader.streams:
                raise ValueError(f"request_id {request_id!r} is already in use.")
            self.engine.add_request(request_id, prompt, params, priority=priority, tokenization_kwargs=tokenization_kwargs)
            reader.streams[request_id] = stream
        finished = False
        try:
            while not finished:
                output = await stream.get()
                if output is None:
                    return
                finished = output.finished
                yield output
        finally:
            if not finished:
                self._abort_now([request_id])

    async def abort(self, request_id: Union[str, list[str]]) -> None:
        """Aborts requests by id; their streams end (without a finished output)."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self._abort_now(ids)

    def _abort_now(self, request_ids: list[str]) -> None:
        reader = self._reader
        with reader.lock:
            streams = [reader.streams.pop(rid) for rid in request_ids if rid in reader.streams]
            if reader.dead is None:
                self.engine.abort_request(request_ids)
        for stream in streams:
            _call_soon(stream.loop, stream.close)

    # ---- the rest of vLLM's surface ------------------------------------------------------

    async def get_tokenizer(self) -> Any:
        return self.engine.get_tokenizer()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def errored(self) -> bool:
        return self._reader.dead is not None

    @property
    def is_running(self) -> bool:
        return self._reader.dead is None

    @property
    def dead_error(self) -> BaseException:
        return self._reader.dead or EngineDeadError("the engine is running.")

    async def check_health(self) -> None:
        if self._reader.dead is not None:
            raise self._reader.dead

    def get_num_unfinished_requests(self) -> int:
        with self._reader.lock:
            return self.engine.get_num_unfinished_requests()

    def shutdown(self) -> None:
        """Stops the reader thread and the engine; streams still open raise EngineDeadError."""
        self._finalizer()
        self.engine.shutdown()

    async def __aenter__(self) -> "AsyncLLM":
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        self.shutdown()


AsyncLLMEngine = AsyncLLM  # vLLM's older name (vllm.engine.async_llm_engine)

# vLLM's from_engine_args keywords that make no difference here.
_ACCEPTED_FROM_ENGINE_ARGS = {"start_engine_loop", "usage_context", "stat_loggers", "enable_log_requests",
                              "disable_log_stats", "client_addresses", "client_count", "client_index"}

_ids = itertools.count()


def _fresh_id() -> str:
    return f"embed-{next(_ids)}"
