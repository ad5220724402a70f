"""Scheduler with vLLM v1's semantics.

Each step has one token budget (`max_num_batched_tokens`) shared by all requests; there is no
separate prefill and decode phase. Running requests are served first, then waiting ones (new,
or preempted earlier). A prompt larger than what is left of the budget is chunked over several
steps (unless chunked prefill is off, or the request is a pooling one, which is scheduled whole).
When a running request cannot get a block, the running request that comes last in the policy's
order (FCFS: the latest arrival; priority: the lowest priority, then the latest) is preempted:
its blocks are freed and it is recomputed later, from its prefix-cache hits on.

`running` is kept sorted in that same order, so the victim is always its last element and
never one already scheduled in this step.

A request with structured outputs waits (WAITING_FOR_FSM, outside the waiting queue) until its
grammar has compiled, then joins the queue at its place; each step carries the token bitmask of
the constrained requests that sample, and their sampled tokens advance their matchers.

With speculative decoding, a decoding request whose sampling does not depend on its own recent
outputs (no penalties, no bad_words, past min_tokens) gets up to k proposed tokens (n-gram
lookup over its tokens, or the draft model's, which the runner made after the request's last
step) scheduled after its last one, within the token budget, max_model_len
and max_tokens; it falls back to one token when the blocks for them are not free. After the
step, num_computed_tokens drops back past the rejected proposals and the blocks past the
request's tokens are freed (the runner hears of it through kept_block_ids).

With async scheduling (vLLM's AsyncScheduler) the next step is scheduled while the one before
it still runs: a request that samples in a step in flight counts one placeholder for its token
not yet known (`num_output_placeholders`), is scheduled past it (the runner feeds the token it
sampled itself), and drops the placeholder when the step's output comes. A request is not
scheduled past its max_tokens or max_model_len counting placeholders; one preempted while its
step was in flight keeps that step's token and waits for it before it is scheduled again; the
output of a step for a request that finished meanwhile is dropped.

A lone running request (nothing waiting) that decodes greedily with nothing that reads its
logits but the argmax may decode a burst of up to `burst_tokens` tokens in one step (vLLM's
multi-step idea: one engine round trip for several tokens): it is scheduled with one token, its
KV slots for the burst are reserved (as for proposals), and after the step num_computed_tokens
drops back past what the burst did not decode and the blocks past its tokens are freed. With
n-gram speculation a burst runs only in a step without proposals, and ends where the proposer
would find one.
"""

from __future__ import annotations

import bisect
import itertools
import logging
from typing import TYPE_CHECKING, Iterable, Optional

import numpy as np

from shmvllm.config import CacheConfig, SchedulerConfig
from shmvllm.core.kv_cache_manager import KVCacheManager
from shmvllm.core.request import Request, RequestStatus
from shmvllm.core.sched.output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from shmvllm.core.sched.request_queue import RequestQueue
from shmvllm.boundary.messages import EngineCoreOutput, EngineCoreOutputs, FinishReason, SchedulerStats, now
from shmvllm.spec_decode.config import SpeculativeConfig, draft_may_propose, samples_independently
from shmvllm.spec_decode.metrics import SpecDecodingStats
from shmvllm.spec_decode.ngram_proposer import NgramProposer, TokenArrays

if TYPE_CHECKING:
    from shmvllm.sampling_params import SamplingParams
    from shmvllm.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


# How long an idle schedule() waits for a compiling grammar before it returns an empty plan
# (the engine loop then looks at its input channel, and comes back).
GRAMMAR_WAIT_S = 0.01


def finish_of(params: "SamplingParams", last: int, num_output_tokens: int, num_tokens: int,
              max_model_len: int) -> tuple[Optional[FinishReason], Optional[int]]:
    """Whether `last`, a request's newest token, ends it: (STOP, None) at EOS and (STOP, the
    id) at a stop_token_id, both only after min_tokens outputs; (LENGTH, None) at max_tokens or
    max_model_len; else (None, None)."""
    if num_output_tokens >= params.min_tokens:
        if params.eos_token_id is not None and not params.ignore_eos and last == params.eos_token_id:
            return FinishReason.STOP, None
        if params.stop_token_ids and last in params.stop_token_ids:
            return FinishReason.STOP, last
    if num_tokens >= max_model_len or (params.max_tokens is not None and num_output_tokens >= params.max_tokens):
        return FinishReason.LENGTH, None
    return None, None


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        structured_output_manager: Optional["StructuredOutputManager"] = None,
        speculative_config: Optional[SpeculativeConfig] = None,
        micro_batches: int = 1,
        burst_tokens: int = 1,
    ) -> None:
        """micro_batches: how many steps the engine keeps in flight (pipeline parallel); each
        takes at most its share of the running requests, so that the next one has some.
        burst_tokens: the most tokens a lone greedy decode may decode in one step (1: one)."""
        if not isinstance(micro_batches, int) or micro_batches < 1:
            raise ValueError(f"micro_batches must be a positive int, got {micro_batches!r}.")
        if not isinstance(burst_tokens, int) or burst_tokens < 1:
            raise ValueError(f"burst_tokens must be a positive int, got {burst_tokens!r}.")
        self.burst_tokens = burst_tokens
        self.micro_batches = micro_batches
        self.config = scheduler_config
        self.block_size = cache_config.block_size
        self.kv_cache_manager = KVCacheManager(
            num_blocks, self.block_size, cache_config.enable_prefix_caching, cache_config.rope_length_threshold,
            cache_config.rope_length_exact,
        )
        capacity = num_blocks * self.block_size
        # A request that outgrew the whole cache could never be scheduled again: cap its length.
        self.max_model_len = min(scheduler_config.max_model_len, capacity)
        if self.max_model_len < scheduler_config.max_model_len:
            logger.warning(
                "The KV cache holds %d tokens, fewer than max_model_len=%d: requests stop at %d tokens.",
                capacity, scheduler_config.max_model_len, self.max_model_len,
            )
        self.requests: dict[str, Request] = {}
        self.waiting = RequestQueue()
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()  # since the last step that reached the runner
        self._arrivals = itertools.count()
        self._num_preemptions_step = 0
        self.num_preemptions_total = 0
        self.structured_output_manager = structured_output_manager
        self.waiting_for_grammar: list[Request] = []
        self._num_structured = 0  # unfinished requests with a grammar
        self._grammar_failures: list[EngineCoreOutput] = []  # reported by the next update_from_output
        ngram = speculative_config is not None and not speculative_config.uses_draft_model
        self.proposer = NgramProposer(speculative_config) if ngram else None
        self._token_arrays = TokenArrays()  # n-gram: each request's tokens as numpy, appended to
        self._draft_tokens: dict[str, list[int]] = {}  # draft model: req_id -> proposals for its next step
        self.spec_stats = SpecDecodingStats(speculative_config.num_speculative_tokens) if speculative_config else None
        self._kept_blocks: dict[str, int] = {}  # req_id -> blocks kept after a rollback, until it is scheduled
        self.async_scheduling = scheduler_config.async_scheduling

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in the scheduler.")
        priority = request.priority if self.config.policy == "priority" else 0
        request.sched_key = (priority, next(self._arrivals))
        params = request.sampling_params
        if params is not None and params.structured_outputs is not None:
            if self.structured_output_manager is None:
                raise ValueError(f"request {request.request_id!r} has structured_outputs, which this engine does not serve.")
            request.structured_output_request = self.structured_output_manager.new_request(params)
            request.status = RequestStatus.WAITING_FOR_FSM
            self.requests[request.request_id] = request
            self.waiting_for_grammar.append(request)
            self._num_structured += 1
            return
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """Ends requests from outside (aborts); unknown or finished ids are ignored."""
        if not RequestStatus.is_finished(status):
            raise ValueError(f"status must be a finished one, got {status!r}.")
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status == RequestStatus.WAITING_FOR_FSM:
                self.waiting_for_grammar.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free_request(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_structured_output_requests(self) -> bool:
        return self._num_structured > 0

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---- schedule ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        if self.waiting_for_grammar:
            self._admit_compiled()
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        cached = CachedRequestData()
        new_reqs: list[NewRequestData] = []
        preempted: set[str] = set()
        proposals: dict[str, list[int]] = {}
        kept_blocks: dict[str, int] = {}
        bursts: dict[str, int] = {}

        i = scheduled_running = 0
        share = -(-len(self.running) // self.micro_batches)
        while i < len(self.running) and budget > 0 and scheduled_running < share:
            request = self.running[i]
            num_new = min(request.num_tokens + request.num_output_placeholders - request.num_computed_tokens, budget)
            if num_new <= 0 or (request.num_output_placeholders and self._ends_in_flight(request)):
                i += 1
                continue
            new_blocks = None
            if self.spec_stats is not None and request.num_tokens - request.num_computed_tokens == 1:
                tokens = self._propose(request, budget)
                if tokens:  # only if their blocks are free: proposals never preempt anyone
                    new_blocks = self.kv_cache_manager.allocate_slots(request, 1 + len(tokens))
                    if new_blocks is not None:
                        proposals[request.request_id] = tokens
                        num_new = 1 + len(tokens)
            if new_blocks is None and request.request_id not in proposals:
                burst = self._burst_size(request, budget)
                if burst > 1:  # only if its blocks are free: a burst never preempts anyone
                    new_blocks = self.kv_cache_manager.allocate_slots(request, burst)
                    if new_blocks is not None:
                        bursts[request.request_id] = burst
            if new_blocks is None:
                new_blocks = self._allocate_or_preempt(request, num_new, preempted)
            if new_blocks is None:
                break  # the request preempted itself: nothing after it is left either
            if self._kept_blocks and request.request_id in self._kept_blocks:
                kept_blocks[request.request_id] = self._kept_blocks.pop(request.request_id)
            cached.req_ids.append(request.request_id)
            cached.new_block_ids.append([b.block_id for b in new_blocks])
            cached.num_computed_tokens.append(request.num_computed_tokens)
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            scheduled_running += 1
            i += 1

        if not preempted:
            budget = self._schedule_waiting(budget, num_scheduled, new_reqs)

        placeholders: set[str] = set()
        for req_id, n in num_scheduled.items():
            request = self.requests[req_id]
            request.num_computed_tokens += bursts.get(req_id, n)
            if self.async_scheduling and not request.is_pooling and (
                request.num_computed_tokens >= request.num_tokens + request.num_output_placeholders
            ):  # it samples in this step: its token is a placeholder until the step's output comes
                request.num_output_placeholders += 1
                placeholders.add(req_id)
        total = sum(num_scheduled.values())
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=total,
            preempted_req_ids=preempted,
            scheduled_spec_decode_tokens=proposals,
            kept_block_ids=kept_blocks,
            placeholder_req_ids=placeholders,
            burst_tokens=bursts,
        )
        if self._num_structured:
            self._add_grammar_bitmask(output)
        if total > 0:  # a step with no tokens does not reach the runner; keep the news for later
            output.finished_req_ids, self.finished_req_ids = self.finished_req_ids, set()
        return output

    def _ends_in_flight(self, request: Request) -> bool:
        """Whether the steps in flight reach the request's max_tokens or max_model_len (if
        nothing stops it earlier): it needs no further step."""
        params = request.sampling_params
        pending = request.num_output_placeholders
        if request.num_tokens + pending >= self.max_model_len:
            return True
        return params is not None and params.max_tokens is not None and request.num_output_tokens + pending >= params.max_tokens

    def _burst_size(self, request: Request, budget: int) -> int:
        """How many tokens a decoding request may decode in this step: more than one only when
        it runs alone, nothing waits, and only the argmax of its logits (and min_tokens' mask of
        its stop tokens) decides its tokens; the runner checks EOS and stop_token_ids. Not with
        stop strings: the frontend finds them, and the output's token ids would run past them.
        With n-gram speculation, only in a step that has no proposals; the runner then ends the
        burst at the first token after which the n-gram proposer finds a match, so that the next
        step verifies it (a draft model's proposals come from steps: no bursts)."""
        if (self.burst_tokens == 1 or len(self.running) != 1 or self.waiting or self.waiting_for_grammar
                or (self.spec_stats is not None and self.proposer is None) or self.async_scheduling
                or self.micro_batches != 1
                or request.num_tokens - request.num_computed_tokens != 1):
            return 1
        params = request.sampling_params
        if params is None or not params.argmax_decides or params.stop:
            return 1
        burst = min(self.burst_tokens, budget, self.max_model_len - request.num_tokens)
        if params.max_tokens is not None:
            burst = min(burst, params.max_tokens - request.num_output_tokens)
        return max(burst, 1)

    def _propose(self, request: Request, budget: int) -> Optional[list[int]]:
        """Proposals for a decoding request, or None where its sampling at a later position
        depends on the outputs before it (penalties, bad_words, min_tokens, a grammar)."""
        params = request.sampling_params
        if params is None or not samples_independently(params) or request.num_output_tokens < params.min_tokens:
            return None
        # room for the proposals and the target's own next token
        limit = min(budget, self.max_model_len - request.num_tokens) - 1
        if params.max_tokens is not None:
            limit = min(limit, params.max_tokens - request.num_output_tokens - 1)
        if limit <= 0:
            return None
        if self.proposer is None:  # a draft model's, made by the runner in the last step
            if not draft_may_propose(params):
                return None
            tokens = self._draft_tokens.get(request.request_id, [])[:limit]
        else:
            tokens = self.proposer.propose(self._token_arrays.update(request.request_id, request.all_token_ids), limit)
        so_request = request.structured_output_request
        if tokens and so_request is not None:  # only what the grammar allows is worth verifying
            del tokens[so_request.allowed_prefix(tokens):]
        return tokens

    def _admit_compiled(self) -> None:
        """Moves requests whose grammar is compiled into the waiting queue (at their place in the
        policy's order); one whose compile failed finishes with an error. With nothing else to
        run, first waits a little for a compile, so that the engine loop does not spin."""
        pending = [r.structured_output_request for r in self.waiting_for_grammar]
        if not self.running and not self.waiting:
            self.structured_output_manager.wait_for_any(pending, GRAMMAR_WAIT_S)
        still_waiting = []
        for request, so_request in zip(self.waiting_for_grammar, pending):
            if not so_request.poll():
                still_waiting.append(request)
            elif so_request.error is not None:
                logger.warning("request %r failed: %s", request.request_id, so_request.error)
                request.status = RequestStatus.FINISHED_ERROR
                self._grammar_failures.append(EngineCoreOutput(
                    request_id=request.request_id, finish_reason=request.get_finish_reason(), error=so_request.error
                ))
                self._free_request(request)
            else:
                request.status = RequestStatus.WAITING
                self.waiting.add(request)
        self.waiting_for_grammar = still_waiting

    def _add_grammar_bitmask(self, output: SchedulerOutput) -> None:
        """The bitmask rows of the constrained requests that sample in this step (their scheduled
        tokens reach the end of their known and proposed tokens): one row each, or with
        proposals one per verified position."""
        sampling = []
        proposals = output.scheduled_spec_decode_tokens
        for req_id in output.num_scheduled_tokens:
            request = self.requests[req_id]
            if request.structured_output_request is not None and (
                request.num_computed_tokens == request.num_tokens + len(proposals.get(req_id, ()))
            ):
                sampling.append(request)
        if not sampling:
            return
        output.structured_output_request_ids = [r.request_id for r in sampling]
        if any(r.request_id in proposals for r in sampling):
            output.grammar_bitmask = self.structured_output_manager.speculative_bitmask(
                [(r.structured_output_request, proposals.get(r.request_id, [])) for r in sampling]
            )
        else:
            output.grammar_bitmask = self.structured_output_manager.grammar_bitmask(
                [r.structured_output_request for r in sampling]
            )

    def _allocate_or_preempt(self, request: Request, num_new: int, preempted: set[str]):
        """Blocks for `request`, preempting from the end of `running` until they fit; None if
        `request` itself had to go."""
        while True:
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new)
            if new_blocks is not None:
                return new_blocks
            victim = self.running.pop()
            self._preempt(victim)
            preempted.add(victim.request_id)
            if victim is request:
                return None

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self._kept_blocks.pop(request.request_id, None)  # it comes back with its whole block list
        self._draft_tokens.pop(request.request_id, None)  # the runner drops the draft's distributions with its state
        self._num_preemptions_step += 1
        self.num_preemptions_total += 1
        self.waiting.add(request)

    def _schedule_waiting(self, budget: int, num_scheduled: dict[str, int], new_reqs: list[NewRequestData]) -> int:
        chunking = self.config.enable_chunked_prefill
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            if request.num_output_placeholders:
                break  # preempted while its step was in flight: its token comes with that step's output
            hits, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit_tokens
            if num_new > budget and (not chunking or request.is_pooling):
                break
            num_new = min(num_new, budget)
            if not request.is_pooling:  # a pooling request keeps no KV cache: it needs no blocks
                if self.kv_cache_manager.allocate_slots(request, num_new, hits, num_hit_tokens) is None:
                    break
            self.waiting.pop()
            bisect.insort(self.running, request, key=lambda r: r.sched_key)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            new_reqs.append(self._new_request_data(request))
            num_scheduled[request.request_id] = num_new
            budget -= num_new
        return budget

    def _new_request_data(self, request: Request) -> NewRequestData:
        return NewRequestData(
            req_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=list(request.output_token_ids),
            sampling_params=request.sampling_params,
            pooling_params=request.pooling_params,
            block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
            num_computed_tokens=request.num_computed_tokens,
        )

    # ---- results -------------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Appends the sampled tokens, finishes requests that stopped, and makes the outputs.

        A request whose processing failed (in the runner, or here) finishes alone with ERROR."""
        index = {req_id: i for i, req_id in enumerate(model_runner_output.req_ids)}
        errors = model_runner_output.errors
        outputs = EngineCoreOutputs()
        finished: list[str] = []
        if self._grammar_failures:
            outputs.outputs, self._grammar_failures = self._grammar_failures, []
            finished = [o.request_id for o in outputs.outputs]
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is None:
                continue  # finished since it was scheduled
            if req_id in scheduler_output.placeholder_req_ids:
                request.num_output_placeholders -= 1
            # async scheduling: preempted by the step scheduled after this one; its token still counts
            preempted = request.status == RequestStatus.PREEMPTED and req_id in scheduler_output.placeholder_req_ids
            if request.status != RequestStatus.RUNNING and not preempted:
                continue
            error = errors.get(req_id)
            proposed = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
            if error is None:
                i = index.get(req_id)
                sampled = model_runner_output.sampled_token_ids[i] if i is not None else []
                if proposed is not None:
                    self._roll_back(request, len(proposed), len(sampled))
                burst = scheduler_output.burst_tokens.get(req_id)
                if burst is not None:  # the KV of the tokens the burst did not decode
                    request.num_computed_tokens -= burst - len(sampled)
                try:
                    self._update_request(request, sampled, model_runner_output, outputs)
                except Exception as exc:
                    logger.exception("request %r failed in update_from_output", req_id)
                    error = f"{type(exc).__name__}: {exc}"
            if error is not None:
                request.status = RequestStatus.FINISHED_ERROR
                outputs.outputs.append(EngineCoreOutput(request_id=req_id, finish_reason=FinishReason.ERROR, error=error))
            if request.is_finished:
                finished.append(req_id)
                (self.waiting if preempted else self.running).remove(request)
                self._free_request(request)
            else:
                if proposed is not None or req_id in scheduler_output.burst_tokens:
                    kept = self.kv_cache_manager.trim(request, request.num_tokens)
                    if kept is not None:
                        self._kept_blocks[req_id] = kept
                if self.spec_stats is not None and self.proposer is None:
                    drafts = model_runner_output.spec_token_ids.get(req_id)
                    if drafts:
                        self._draft_tokens[req_id] = drafts
                    else:
                        self._draft_tokens.pop(req_id, None)
        outputs.finished_requests = finished or None
        outputs.scheduler_stats = self.make_stats()
        outputs.timestamp = now()
        return outputs

    def _roll_back(self, request: Request, num_proposed: int, num_sampled: int) -> None:
        """After verification: the KV of the rejected proposals (and of the last sampled token,
        computed next step) no longer counts; the counters take the accepted ones."""
        request.num_computed_tokens -= num_proposed + 1 - num_sampled
        if num_sampled:
            self.spec_stats.observe(num_proposed, num_sampled - 1)

    def _update_request(
        self, request: Request, sampled: list[int], runner_output: ModelRunnerOutput, into: EngineCoreOutputs
    ) -> None:
        """Appends the sampled tokens to the request and its output, if it has one, to `into`:
        a row of the columns when it is only new tokens, else an EngineCoreOutput (whose first
        one carries num_cached_tokens, which the frontend then keeps)."""
        req_id = request.request_id
        new_token_ids: list[int] = []
        pooling_output: Optional[np.ndarray] = None
        if request.is_pooling:
            pooled = runner_output.pooler_output.get(req_id)
            if pooled is not None:
                # one copy, read-only: the runner's batch buffer is not the caller's to keep
                pooled = np.ascontiguousarray(pooled, dtype="<f4")  # a token_embed output keeps its [tokens, H] shape
                pooling_output = np.frombuffer(pooled.tobytes(), "<f4").reshape(pooled.shape)
                request.status = RequestStatus.FINISHED_STOPPED
        else:
            so_request = request.structured_output_request
            for token_id in sampled:
                request.append_output_token_ids(token_id)
                new_token_ids.append(token_id)
                if so_request is not None and not self.structured_output_manager.accept(so_request, token_id):
                    request.status = RequestStatus.FINISHED_ERROR
                    break
                if self._check_stop(request):
                    break
                if so_request is not None and so_request.is_terminated:
                    request.status = RequestStatus.FINISHED_STOPPED  # the grammar has ended
                    break
        prompt_logprobs = runner_output.prompt_logprobs.get(req_id)
        if not new_token_ids and pooling_output is None and prompt_logprobs is None:
            return
        logprobs = runner_output.logprobs.get(req_id) if new_token_ids else None
        finish_reason = request.get_finish_reason()
        error = request.structured_output_request.error if request.structured_output_request is not None else None
        if (
            new_token_ids and logprobs is None and prompt_logprobs is None and finish_reason is None
            and error is None and request.stop_reason is None and request.num_output_tokens > len(new_token_ids)
        ):
            into.add_tokens(req_id, new_token_ids)
            return
        into.outputs.append(EngineCoreOutput(
            request_id=req_id,
            new_token_ids=new_token_ids,
            new_logprobs=logprobs,
            new_prompt_logprobs=prompt_logprobs,
            finish_reason=finish_reason,
            stop_reason=request.stop_reason,
            pooling_output=pooling_output,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            error=error,
        ))

    def _check_stop(self, request: Request) -> bool:
        """Sets a finished status (and stop reason) if the last token ends the request."""
        assert request.sampling_params is not None
        reason, stop_reason = finish_of(request.sampling_params, request.output_token_ids[-1],
                                        request.num_output_tokens, request.num_tokens, self.max_model_len)
        if reason is None:
            return False
        request.status = RequestStatus.FINISHED_STOPPED if reason == FinishReason.STOP else RequestStatus.FINISHED_LENGTH_CAPPED
        request.stop_reason = stop_reason
        return True

    def _free_request(self, request: Request) -> None:
        if request.structured_output_request is not None:
            self._num_structured -= 1
        if self._kept_blocks:
            self._kept_blocks.pop(request.request_id, None)
        if self.spec_stats is not None:
            self._draft_tokens.pop(request.request_id, None)
            self._token_arrays.drop(request.request_id)
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)

    # ---- stats ---------------------------------------------------------------------------

    def make_stats(self) -> SchedulerStats:
        """Queue sizes and usage now; prefix-cache counts and preemptions since the last call."""
        prefix = self.kv_cache_manager.make_prefix_cache_stats()
        stats = SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            num_preemptions=self._num_preemptions_step,
        )
        self._num_preemptions_step = 0
        return stats
