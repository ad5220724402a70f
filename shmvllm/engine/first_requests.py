"""The engine's first requests, served before torch has imported.

An engine that answers READY from its config (`core.limits_before_load`) imports torch (~1 s)
and builds its model after; meanwhile `FirstRequests` reads the channel and serves, to
completion, the requests it computes exactly as the torch EngineCore would: greedy
(temperature 0), n = 1, no logprobs, penalties, logit bias, allowed / bad words, structured
output or logits processors; EOS, stop_token_ids, max_tokens, min_tokens (the stop tokens
masked below it), ignore_eos, max_model_len and aborts as the scheduler has them (stop strings
are the frontend's: it sends an abort). The model is `gguf_step.GGUFStep` (the native decode
step over the mapped GGUF blocks and the reserved KV cache); a prompt is prefilled
MAX_ROWS tokens a call. Outputs are the EngineCore's messages over the same ring.

Everything else (another request, a utility call, an abort of such a request) waits, in
arrival order, for the torch EngineCore, which `take` hands over. The phase ends once torch has
imported and its own requests are done: requests that arrive after torch has imported wait for
the EngineCore, so the torch scheduler starts with no request running here, and every block it
allocates is zeroed by the runner first (whatever the native requests wrote there).
"""

from __future__ import annotations

import collections
import logging
import os
import sys
import time
from typing import Any, Callable

import numpy as np

from shmvllm.boundary.channel import ChannelTimeout
from shmvllm.core.sched.scheduler import finish_of
from shmvllm.boundary.messages import (
    EngineCoreAbort,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreShutdown,
    decode_to_engine,
    now,
)
from shmvllm.model.gguf_step import MAX_ROWS, GGUFStep
from shmvllm.worker.kv_memory import TOUCHED_BLOCKS

logger = logging.getLogger(__name__)

MAX_PROMPT = 256  # longer prompts wait for the torch core's GEMM prefill
IDLE_WAIT_S = 0.01  # how long an idle wait on the ring lasts before torch's import is looked at again
# while torch imports on a thread: the main thread takes the GIL back within this after each C call
SWITCH_INTERVAL_S = 0.0005


class _Native:
    """A request served here: its tokens, blocks and how far it is computed."""

    def __init__(self, msg: EngineCoreRequest, blocks: list[int], block_size: int) -> None:
        self.request_id = msg.request_id
        self.params = msg.sampling_params
        self.tokens = [int(t) for t in msg.prompt_token_ids]
        self.num_prompt = len(self.tokens)
        self.computed = 0
        self.outputs = 0
        self.blocks = np.asarray(blocks, dtype=np.int32)
        self.block_size = block_size
        params = self.params
        masked = set(params.all_stop_token_ids)
        if params.eos_token_id is not None:  # masked below min_tokens even under ignore_eos, as the runner does
            masked.add(params.eos_token_id)
        self.min_tokens_masked = np.array(sorted(masked), dtype=np.int64)

    def slots(self, positions: np.ndarray) -> np.ndarray:
        return self.blocks[positions // self.block_size].astype(np.int64) * self.block_size + positions % self.block_size


def servable(msg: EngineCoreRequest, vocab_size: int, max_model_len: int) -> bool:
    """Whether `msg` is a request this phase computes exactly as the torch EngineCore would."""
    params = msg.sampling_params
    prompt = msg.prompt_token_ids
    if params is None or msg.pooling_params is not None or not 0 < len(prompt) <= min(MAX_PROMPT, max_model_len - 1):
        return False
    if int(prompt.min()) < 0 or int(prompt.max()) >= vocab_size:
        return False  # the EngineCore rejects it, with its message
    return (params.argmax_decides and params.n == 1 and params.prompt_logprobs is None and not params.bad_words
            and params.guided_decoding is None and params.extra_args is None)


class FirstRequests:
    """Serves the first requests of an engine of `config` in its KV cache of `num_blocks`
    (kv_memory's `reservation`), over `endpoint` and `outbox` (EngineCoreProc's)."""

    def __init__(self, config: Any, reservation: Any, num_blocks: int, endpoint: Any, outbox: Any,
                 engine_index: int) -> None:
        from shmvllm.model.registry import gguf_source

        model = config.model_config
        self.endpoint, self.outbox, self.engine_index = endpoint, outbox, engine_index
        self.block_size = config.cache_config.block_size
        self.max_model_len = model.max_model_len
        self.vocab_size = model.vocab_size
        self.max_running = min(MAX_ROWS, config.scheduler_config.max_num_seqs)
        self.cpus = len(os.sched_getaffinity(0))
        self.step = GGUFStep(gguf_source(model.model_dir), model.hf_config, reservation.address, num_blocks,
                             self.block_size, self.max_model_len, self.cpus)
        # the reservation's thread zeroes the first TOUCHED_BLOCKS blocks of each region: requests
        # here write the blocks after them (within the same first huge page), or wait for it where
        # the cache has no more; never block 0, the runner's padding block
        first = TOUCHED_BLOCKS if num_blocks > 2 * TOUCHED_BLOCKS else 1
        if first == 1:
            reservation.wait()
        self.free_blocks = collections.deque(range(first, num_blocks))
        self.waiting: collections.deque[_Native] = collections.deque()
        self.running: list[_Native] = []
        self.deferred: list[Any] = []  # for the torch EngineCore, in arrival order
        self.aborted: list[str] = []  # native requests aborted since the last outputs
        self.served = 0
        self.tokens = 0
        self.shutdown = False

    def serve(self, torch_ready: Callable[[], bool], check_parent: Callable[[], None], torch_may_run: Any) -> list[Any]:
        """Serves until torch has imported (`torch_ready`) and no request of its own is left,
        or SHUTDOWN; returns the messages that wait for the EngineCore (SHUTDOWN among them).
        `torch_may_run` (a threading.Event) is cleared while requests of its own run and nothing
        waits for the EngineCore: torch's import pauses at its next module then."""
        interval = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        started = time.monotonic()
        try:
            while not self.shutdown:
                if self.outbox.pending:
                    self.outbox.flush()
                while (msg := self.endpoint.try_recv(decode_to_engine)) is not None:
                    self._take(msg, torch_ready())
                self._admit()
                if self.running and not self.deferred:
                    torch_may_run.clear()
                else:
                    torch_may_run.set()
                if self.running and not self.outbox.backlogged:
                    self._step(torch_ready() or not torch_may_run.is_set())
                elif not self.running:
                    if torch_ready():
                        break
                    try:
                        self._take(self.endpoint.recv(decode_to_engine, IDLE_WAIT_S), False)
                    except ChannelTimeout:
                        pass
                check_parent()
            if self.aborted:
                self._send([])
            if self.outbox.pending:
                self.outbox.flush()
        finally:
            sys.setswitchinterval(interval)
        if self.served:
            logger.info("served %d requests (%d tokens) natively before torch, in %.2f s; %d messages wait for the EngineCore",
                        self.served, self.tokens, time.monotonic() - started, len(self.deferred))
        return self.deferred

    def _take(self, msg: Any, torch_ready: bool) -> None:
        kind = type(msg)
        if kind is EngineCoreRequest and not torch_ready and self._accept(msg):
            return
        if kind is EngineCoreAbort:
            ids = set(msg.request_ids)
            mine = [r for r in (*self.running, *self.waiting) if r.request_id in ids]
            for request in mine:
                self._finish(request)
                self.aborted.append(request.request_id)
            rest = [i for i in msg.request_ids if i not in {r.request_id for r in mine}]
            if rest:
                self.deferred.append(EngineCoreAbort(rest))
            return
        if kind is EngineCoreShutdown:
            self.shutdown = True
        self.deferred.append(msg)

    def _accept(self, msg: EngineCoreRequest) -> bool:
        if not servable(msg, self.vocab_size, self.max_model_len):
            return False
        if any(r.request_id == msg.request_id for r in (*self.running, *self.waiting)):
            return False  # the EngineCore refuses the duplicate with its message
        params = msg.sampling_params
        limit = self.max_model_len if params.max_tokens is None else min(self.max_model_len, len(msg.prompt_token_ids) + params.max_tokens)
        need = -(-limit // self.block_size)
        if need > len(self.free_blocks):
            return False
        blocks = [self.free_blocks.popleft() for _ in range(need)]
        self.waiting.append(_Native(msg, blocks, self.block_size))
        return True

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_running:
            self.running.append(self.waiting.popleft())

    def _finish(self, request: _Native) -> None:
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.free_blocks.extend(int(b) for b in request.blocks)

    def _step(self, torch_idle: bool) -> None:
        """One call of the step: each running request's next prompt tokens (up to the rows left)
        or its last sampled token; then a token for each request whose tokens are all computed.
        `torch_idle`: torch's import is done or paused (the step may take every core)."""
        rows: list[tuple[_Native, int, int]] = []  # request, first position, count
        room = MAX_ROWS
        for request in self.running:
            if room == 0:
                break
            count = min(room, len(request.tokens) - request.computed)
            rows.append((request, request.computed, count))
            room -= count
        tokens = np.concatenate([np.asarray(r.tokens[p:p + n], dtype=np.int64) for r, p, n in rows])
        positions = np.concatenate([np.arange(p, p + n, dtype=np.int64) for _, p, n in rows])
        slots = np.concatenate([r.slots(np.arange(p, p + n, dtype=np.int64)) for r, p, n in rows])
        width = max(len(r.blocks) for r, _, _ in rows)
        table = np.zeros((len(tokens), width), dtype=np.int32)
        row = 0
        for request, _, count in rows:
            table[row:row + count, :len(request.blocks)] = request.blocks
            row += count
        # 1 thread while torch imports on the other core (a team of 2 would wait at every barrier for it)
        self.step.table.threads = self.cpus if torch_idle else 1
        hidden = self.step.forward(tokens, positions, slots, table, positions.astype(np.int32) + 1)
        sampled, last = [], 0
        for request, first, count in rows:
            last += count
            request.computed = first + count
            if request.computed == len(request.tokens):
                sampled.append((request, last - 1))
        if not sampled:
            return
        logits = self.step.logits(hidden[[row for _, row in sampled]])
        outputs = []
        for (request, _), row_logits in zip(sampled, logits):
            if request.outputs < request.params.min_tokens and request.min_tokens_masked.size:
                row_logits[request.min_tokens_masked] = -np.inf
            token = int(row_logits.argmax())
            request.tokens.append(token)
            request.outputs += 1
            self.tokens += 1
            outputs.append(self._output(request, token))
        self._send(outputs)

    def _output(self, request: _Native, token: int) -> EngineCoreOutput:
        """The request's output for `token`, finished as the scheduler finishes it."""
        reason, stop_reason = finish_of(request.params, token, request.outputs, len(request.tokens), self.max_model_len)
        if reason is not None:
            self._finish(request)
            self.served += 1
        return EngineCoreOutput(request_id=request.request_id, new_token_ids=[token], finish_reason=reason,
                                stop_reason=stop_reason)

    def _send(self, outputs: list[EngineCoreOutput]) -> None:
        finished = [o.request_id for o in outputs if o.finish_reason is not None] + self.aborted
        self.aborted = []
        self.outbox.send(EngineCoreOutputs(engine_index=self.engine_index, outputs=outputs,
                                           finished_requests=finished or None, timestamp=now()))
