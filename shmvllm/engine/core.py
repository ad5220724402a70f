"""EngineCore: the scheduler, the KV cache and the executor, stepped in one process.

`step()` = `Scheduler.schedule()` -> `executor.execute_model()` -> `update_from_output()`.
A request the engine cannot serve never raises out of `add_request`: it finishes with
finish_reason ERROR (and an `error` text) in the next step's outputs, so one bad request
cannot stop an engine that others share. Likewise in a step: a request whose sampling or
output processing raises finishes alone with ERROR; if the model step itself raises, the
requests of that step do. A failure in `schedule()` (the scheduler's own state) stops the engine.

With async scheduling the model step runs on a thread of its own (it releases the GIL in the
native kernels and torch ops): `step()` schedules step N+1 and queues it behind step N, then
waits for step N's output and updates from it, so that scheduling, output processing and the
sending of outputs overlap the model. While a request with structured outputs is unfinished it
steps one at a time (its next bitmask needs the token sampled before it).

With the model in this process (UniProcExecutor) a lone greedy decode may decode a burst of
`SHMVLLM_DECODE_BURST` tokens a step (Scheduler, ModelRunner); `set_input_check` tells the
runner how to see, between a burst's tokens, that input for the engine has arrived.
"""

from __future__ import annotations

import collections
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional

import numpy as np

from shmvllm import envs
from shmvllm.config import EngineConfig
from shmvllm.core.request import Request, RequestStatus
from shmvllm.core.sched.output import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput, SchedulerOutput
from shmvllm.core.sched.scheduler import Scheduler
from shmvllm.engine.exceptions import WorkerDeadError
from shmvllm.engine.validation import DTYPE_BYTES, kv_cache_bytes_per_block, kv_cache_shape
from shmvllm.model.parallel.split import split_sizes
from shmvllm.boundary.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineReady,
    FinishReason,
    SchedulerStats,
    now,
)
from shmvllm.structured_output.manager import StructuredOutputManager
from shmvllm.worker import kv_memory
from shmvllm.worker.kv_budget import blocks_in_budget, cpu_kv_budget

logger = logging.getLogger(__name__)


def _default_executor_class(config: EngineConfig) -> type:
    if config.parallel_config.pipeline_parallel_size > 1:
        from shmvllm.executor.pipeline import PipelineExecutor

        return PipelineExecutor
    if config.parallel_config.tensor_parallel_size > 1:
        from shmvllm.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor
    from shmvllm.executor.uniproc import UniProcExecutor

    return UniProcExecutor


def _max_logprobs(config: EngineConfig) -> int:
    vocab, limit = config.model_config.vocab_size, config.model_config.max_logprobs
    return vocab if limit < 0 else min(limit, vocab)


def engine_limits(config: EngineConfig, num_kv_blocks: int) -> EngineReady:
    """The READY of an engine of `config` with `num_kv_blocks` blocks: max_model_len clamped to
    what the cache holds (as the Scheduler clamps it), max_logprobs resolved."""
    block_size = config.cache_config.block_size
    max_model_len = min(config.scheduler_config.max_model_len, num_kv_blocks * block_size)
    return EngineReady(num_kv_blocks, block_size, num_kv_blocks * block_size / max_model_len, max_model_len,
                       config.model_config.vocab_size, _max_logprobs(config))


def limits_before_load(config: EngineConfig) -> Optional[EngineReady]:
    """The READY that an engine of `config` will send once built, where the config alone
    decides it (no torch, no model): a decoder on the CPU with the built-in single-process
    executor and no draft model, whose KV block size follows from its config
    (`validation.kv_cache_bytes_per_block`, the model's uniform layers). None elsewhere."""
    model, parallel = config.model_config, config.parallel_config
    if (model.is_embedding or model.device != "cpu" or config.draft_model_config is not None
            or parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1
            or model.dtype not in DTYPE_BYTES):
        return None
    num_blocks = config.cache_config.num_kv_blocks
    if num_blocks is None:
        per_block = kv_cache_bytes_per_block(model.hf_config, model.dtype, config.cache_config.block_size)
        num_blocks = blocks_in_budget(config, cpu_kv_budget(config), per_block)
    return engine_limits(config, num_blocks)


def reserve_kv_cache(config: EngineConfig, num_blocks: int) -> kv_memory.Reservation:
    """The KV cache of `num_blocks` blocks that an engine of `config` (one whose limits
    `limits_before_load` gives) builds, mapped for its runner to take (`kv_memory`)."""
    model = config.model_config
    return kv_memory.reserve(kv_cache_shape(model.hf_config, num_blocks, config.cache_config.block_size),
                             DTYPE_BYTES[model.dtype])


class EngineCore:
    def __init__(self, config: EngineConfig, executor_class: Optional[type] = None) -> None:
        started = time.perf_counter()
        self.config = config
        self.model_config = config.model_config
        self.executor = (executor_class or _default_executor_class(config))(config)
        loaded = time.perf_counter()
        try:
            self.num_kv_blocks = int(self.executor.determine_num_kv_blocks())
            self.executor.initialize_kv_cache(self.num_kv_blocks)
        except BaseException:
            self.executor.shutdown()  # its workers and rings would outlive a half-built engine
            raise
        self.block_size = config.cache_config.block_size
        self.structured_output_manager = None if self.model_config.is_embedding else StructuredOutputManager(
            self.model_config.tokenizer_dir or self.model_config.model_dir,
            self.model_config.vocab_size,
            config.scheduler_config.max_num_seqs,
        )
        # an executor with stages (pipeline parallel) runs up to this many micro-batches at once
        self._depth = getattr(self.executor, "max_concurrent_batches", 1)
        self.scheduler = Scheduler(
            config.scheduler_config, config.cache_config, self.num_kv_blocks, self.structured_output_manager,
            config.speculative_config, micro_batches=self._depth, burst_tokens=self._burst_tokens(),
        )
        self._rejected: list[EngineCoreOutput] = []
        self._in_flight: collections.deque[tuple[SchedulerOutput, Future]] = collections.deque()
        self._step_thread = (
            ThreadPoolExecutor(1, thread_name_prefix="shmvllm-model-step")
            if config.scheduler_config.async_scheduling else None
        )
        self._totals = {"num_steps": 0, "num_preemptions": 0, "prefix_cache_queries": 0, "prefix_cache_hits": 0}
        self._last_stats = SchedulerStats()
        logger.info(
            "EngineCore ready: model loaded in %.2f s, KV cache %d blocks x %d tokens = %d tokens "
            "(%s, %.2fx max concurrency at max_model_len=%d), set up in %.2f s",
            loaded - started, self.num_kv_blocks, self.block_size, self.num_kv_blocks * self.block_size,
            self._describe_kv_cache(), self.max_concurrency, self.scheduler.max_model_len,
            time.perf_counter() - loaded,
        )

    def _burst_tokens(self) -> int:
        """SHMVLLM_DECODE_BURST where this process runs the generating model, else 1."""
        from shmvllm.executor.uniproc import UniProcExecutor
        from shmvllm.worker.model_runner import ModelRunner

        if isinstance(self.executor, UniProcExecutor) and isinstance(self.executor.worker.model_runner, ModelRunner):
            return envs.SHMVLLM_DECODE_BURST()
        return 1

    def set_input_check(self, input_waiting: Callable[[], bool]) -> None:
        """Where bursts run, the runner asks `input_waiting()` between a burst's tokens and
        returns when it is true."""
        if self.scheduler.burst_tokens > 1:
            self.executor.worker.model_runner.interrupt = input_waiting

    @property
    def max_logprobs(self) -> int:
        """The most logprobs a request may ask for: max_logprobs (-1: the vocabulary size),
        never more than the vocabulary holds."""
        return _max_logprobs(self.config)

    def ready(self) -> EngineReady:
        """The limits this engine serves under (its READY message): the frontend validates with them."""
        return engine_limits(self.config, self.num_kv_blocks)

    @property
    def max_concurrency(self) -> float:
        """How many requests of max_model_len tokens the KV cache holds at once."""
        return self.num_kv_blocks * self.block_size / self.scheduler.max_model_len

    # ---- requests ------------------------------------------------------------------------

    def preprocess_add_request(self, request: EngineCoreRequest) -> Request:
        """The scheduler's Request for a message (vLLM's name: programs and tests patch it)."""
        return Request.from_engine_core_request(request)

    def add_request(self, request: EngineCoreRequest) -> None:
        try:
            if isinstance(request.prompt_token_ids, np.ndarray):
                # vLLM's request carries a list, which a patched preprocess_add_request may test
                # for truth; the Request keeps a list anyway, so the conversion only moves here
                request.prompt_token_ids = request.prompt_token_ids.tolist()
            engine_request = self.preprocess_add_request(request)
            error = self._validate(engine_request)
        except Exception as exc:  # a malformed message: still only this request's failure
            error = f"invalid request: {exc!r}"
        if error is not None:
            self.reject(request.request_id, error)
            return
        self.scheduler.add_request(engine_request)

    def reject(self, request_id: str, error: str) -> None:
        """Finishes a request that never reached the scheduler with ERROR (in the next step's outputs)."""
        logger.warning("request %r rejected: %s", request_id, error)
        self._rejected.append(EngineCoreOutput(request_id=request_id, finish_reason=FinishReason.ERROR, error=error))

    def _validate(self, request: Request) -> Optional[str]:
        """Why this engine cannot serve the request, or None."""
        req_id = request.request_id
        if req_id in self.scheduler.requests or any(o.request_id == req_id for o in self._rejected):
            return f"request_id {req_id!r} is already in use"
        if (request.sampling_params is None) == (request.pooling_params is None):
            return "a request needs exactly one of sampling_params and pooling_params"
        if request.is_pooling != self.model_config.is_embedding:
            kind = "pooling" if request.is_pooling else "generation"
            return f"this engine serves task {self.model_config.task!r} and cannot serve a {kind} request"
        num_prompt = request.num_prompt_tokens
        if num_prompt == 0:
            return "the prompt is empty"
        max_len = self.scheduler.max_model_len
        if num_prompt > max_len:
            return f"the prompt has {num_prompt} tokens, more than max_model_len={max_len}"
        low, high = min(request.prompt_token_ids), max(request.prompt_token_ids)
        if low < 0 or high >= self.model_config.vocab_size:
            bad = low if low < 0 else high
            return f"prompt token id {bad} is outside the vocabulary [0, {self.model_config.vocab_size})"
        params = request.sampling_params
        if params is not None:
            for name in ("logprobs", "prompt_logprobs"):
                value = getattr(params, name)
                if value is not None and value > self.max_logprobs:
                    return f"{name}={value} is more than this engine's max_logprobs={self.max_logprobs}"
        budget = self.config.scheduler_config.max_num_batched_tokens
        if request.is_pooling and num_prompt > budget:
            return f"the prompt has {num_prompt} tokens, more than max_num_batched_tokens={budget} for pooling"
        return None

    def abort_requests(self, request_ids: list[str]) -> None:
        ids = set(request_ids)
        self._rejected = [o for o in self._rejected if o.request_id not in ids]
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return bool(self._rejected) or self.scheduler.has_unfinished_requests() or bool(self._in_flight)

    # ---- stepping ------------------------------------------------------------------------

    def step(self) -> EngineCoreOutputs:
        """One engine iteration; empty outputs when there is nothing to do."""
        rejected, self._rejected = self._rejected, []
        if self._step_thread is not None:
            outputs = self._step_async()
        elif self._depth > 1:
            outputs = self._step_pipelined()
        elif not self.scheduler.has_unfinished_requests():
            outputs = None
        else:
            scheduler_output = self.scheduler.schedule()
            runner_output = (
                self._execute(scheduler_output) if scheduler_output.total_num_scheduled_tokens > 0
                else EMPTY_MODEL_RUNNER_OUTPUT
            )
            outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if outputs is None:
            return EngineCoreOutputs(outputs=rejected, timestamp=now()) if rejected else EngineCoreOutputs()
        if rejected:
            outputs.outputs = rejected + outputs.outputs
        self._record(outputs.scheduler_stats)
        return outputs

    def _step_async(self) -> Optional[EngineCoreOutputs]:
        """Schedules the next step and queues it behind the one in flight, then updates from the
        oldest step in flight (None: nothing finished a step yet)."""
        submitted = False
        one_at_a_time = self.scheduler.has_structured_output_requests()
        if self.scheduler.has_unfinished_requests() and not (one_at_a_time and self._in_flight):
            scheduler_output = self.scheduler.schedule()
            if scheduler_output.total_num_scheduled_tokens > 0:
                self._in_flight.append((scheduler_output, self._step_thread.submit(self._execute, scheduler_output)))
                submitted = True
            elif not self._in_flight:
                return self.scheduler.update_from_output(scheduler_output, EMPTY_MODEL_RUNNER_OUTPUT)
        if not self._in_flight or (submitted and len(self._in_flight) == 1 and not one_at_a_time):
            return None  # the first step of a run: the next call schedules the second behind it
        scheduler_output, future = self._in_flight.popleft()
        return self.scheduler.update_from_output(scheduler_output, future.result())

    def _step_pipelined(self) -> Optional[EngineCoreOutputs]:
        """Pipeline parallel (vLLM's batch queue): submits a micro-batch while fewer than the
        stages are in flight (the scheduler leaves out a request whose step is in flight), then
        updates from the oldest one (None: the pipeline is still filling)."""
        if self.scheduler.has_unfinished_requests() and len(self._in_flight) < self._depth:
            scheduler_output = self.scheduler.schedule()
            if scheduler_output.total_num_scheduled_tokens > 0:
                self.executor.submit(scheduler_output)
                self._in_flight.append((scheduler_output, None))
                if len(self._in_flight) < self._depth:
                    return None
            elif not self._in_flight:
                return self.scheduler.update_from_output(scheduler_output, EMPTY_MODEL_RUNNER_OUTPUT)
        if not self._in_flight:
            return None
        scheduler_output, _ = self._in_flight.popleft()
        return self.scheduler.update_from_output(scheduler_output, self.executor.collect())

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        try:
            return self.executor.execute_model(scheduler_output)
        except WorkerDeadError:
            raise  # the model is gone with its worker: the engine stops
        except Exception as exc:
            # Which request is to blame is unknown here (the sampler isolates its own rows):
            # the requests of this step finish with the error, the engine serves the rest.
            logger.exception("the model step failed; its %d requests finish with an error",
                             len(scheduler_output.num_scheduled_tokens))
            error = f"the engine's model step failed: {type(exc).__name__}: {exc}"
            return ModelRunnerOutput(
                req_ids=[], sampled_token_ids=[],
                errors=dict.fromkeys(scheduler_output.num_scheduled_tokens, error),
            )

    def _record(self, stats: Optional[SchedulerStats]) -> None:
        if stats is None:
            return
        self._last_stats = stats
        totals = self._totals
        totals["num_steps"] += 1
        totals["num_preemptions"] += stats.num_preemptions
        totals["prefix_cache_queries"] += stats.prefix_cache_queries
        totals["prefix_cache_hits"] += stats.prefix_cache_hits

    # ---- utilities -----------------------------------------------------------------------

    def reset_prefix_cache(self) -> bool:
        """Forgets all cached prefixes; False (nothing done) while requests hold blocks."""
        return self.scheduler.kv_cache_manager.reset_prefix_cache()

    def get_stats(self) -> dict[str, Any]:
        """Sizes, the current state, and totals since the engine started."""
        kv = self.scheduler.kv_cache_manager
        return {
            "num_kv_blocks": self.num_kv_blocks,
            "block_size": self.block_size,
            "num_free_blocks": kv.get_num_free_blocks(),
            "kv_cache_usage": kv.usage,
            "num_running_reqs": len(self.scheduler.running),
            "num_waiting_reqs": len(self.scheduler.waiting),
            **self._totals,
            **({"spec_decode": self.scheduler.spec_stats.as_dict()} if self.scheduler.spec_stats else {}),
            **({"structured_output": self.structured_output_manager.stats()} if self.structured_output_manager else {}),
            **({"pipeline_handoff": self.executor.handoff_stats()} if hasattr(self.executor, "handoff_stats") else {}),
        }

    def shutdown(self) -> None:
        if self._step_thread is not None:
            self._step_thread.shutdown(wait=True, cancel_futures=True)
        if self.structured_output_manager is not None:
            self.structured_output_manager.shutdown()
        self.executor.shutdown()

    def _describe_kv_cache(self) -> str:
        """The KV cache's size from the model's shape (for the log line); under tensor
        parallelism what each rank holds (its KV heads' share), then the sum."""
        hf = self.model_config.hf_config
        heads = getattr(hf, "num_attention_heads", 0) or 0
        head_dim = getattr(hf, "head_dim", None) or (self.model_config.hidden_size // heads if heads else 0)
        kv_heads = getattr(hf, "num_key_value_heads", None) or heads
        layers = getattr(hf, "num_hidden_layers", 0) or 0
        element = 4 if self.model_config.dtype == "float32" else 2
        per_head = 2 * layers * head_dim * element * self.block_size * self.num_kv_blocks / 2**20
        tp = self.config.parallel_config.tensor_parallel_size
        if tp == 1 or self.model_config.is_embedding:
            return f"{kv_heads * per_head:.1f} MiB"
        shares = split_sizes(kv_heads, tp)
        return (f"per rank {' + '.join(f'{n * per_head:.1f}' for n in shares)} MiB for "
                f"{' + '.join(map(str, shares))} of {kv_heads} KV heads, {kv_heads * per_head:.1f} MiB in all")
