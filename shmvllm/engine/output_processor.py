"""EngineCoreOutputs -> RequestOutputs: detokenization, stop strings, logprobs, n > 1 merging.

Pooling (embedding) requests take a short path: their one output carries the pooled vector as
a float32 array, which the PoolingRequestOutput holds as it is.

The output processor keeps one `RequestState` per request in the engine (a request with n > 1
is n child requests in the engine, merged back by their `ParentRequest`). A request that hits a
stop string finishes here, in the frontend; `reqs_to_abort` tells the caller to abort it in the
engine, which does not know about stop strings.

Request ids: the output processor is the one owner of the ids in use. `reserve` claims a
request's id and, for n > 1, its children's engine ids (`ParentRequest.child_ids`) in one go,
or raises ValueError naming the id taken before anything is registered or sent; an id is free
again once its request (for a parent: all its children) finished or was aborted. The engine's
own duplicate check (EngineCore._validate) is the defensive one behind it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence, Union

import msgspec
import numpy as np

from shmvllm.engine.detokenizer import (
    IncrementalDetokenizer,
    added_token_ids,
    byte_fallback_token_ids,
    find_stop_string,
    special_token_ids,
)
from shmvllm.boundary.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason, Logprobs
from shmvllm.logprobs import FlatLogprobs, create_prompt_logprobs, create_sample_logprobs
from shmvllm.outputs import (
    CompletionOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    PromptLogprobs,
    RequestOutput,
    RequestStateStats,
    SampleLogprobs,
)
from shmvllm.sampling_params import RequestOutputKind, SamplingParams


class ParentRequest:
    """A request with n > 1: fans out into n child requests and merges their completions."""

    def __init__(self, request_id: str, params: SamplingParams):
        self.request_id = request_id
        self.params = params
        self.output_kind = params.output_kind
        self.child_ids = [self.child_request_id(i) for i in range(params.n)]
        self.unfinished = set(self.child_ids)
        self.latest: dict[int, CompletionOutput] = {}
        self.error: Optional[str] = None  # the first child's engine error, if any

    def child_request_id(self, index: int) -> str:
        return f"{index}_{self.request_id}"

    def child_params(self, index: int) -> SamplingParams:
        """n=1, and a seed of its own (seed + index, wrapped to int64) so that seeded children
        differ yet repeat."""
        seed = None if self.params.seed is None else (self.params.seed + index + 2**63) % 2**64 - 2**63
        return msgspec.structs.replace(self.params, n=1, seed=seed)

    def merge(self, child_id: str, completion: Optional[CompletionOutput]) -> Optional[list[CompletionOutput]]:
        """Records a child's completion; returns the completions the parent's output carries now."""
        if completion is not None and completion.finished():
            self.unfinished.discard(child_id)
        if completion is None:
            return None
        self.latest[completion.index] = completion
        if self.output_kind == RequestOutputKind.DELTA:
            return [completion]
        if self.output_kind == RequestOutputKind.FINAL_ONLY and self.unfinished:
            return None
        return [self.latest[i] for i in sorted(self.latest)]

    @property
    def finished(self) -> bool:
        return not self.unfinished


@dataclass
class RequestState:
    """Everything the frontend tracks for one request in the engine."""

    request_id: str
    external_id: str
    index: int
    parent: Optional[ParentRequest]
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    logprobs: Optional[SampleLogprobs] = None
    prompt_logprobs: Optional[PromptLogprobs] = None
    cumulative_logprob: Optional[float] = None
    num_cached_tokens: int = 0
    sent_tokens: int = 0
    sent_text: int = 0
    sent_logprobs: int = 0
    sent_prompt_logprobs: bool = False
    finish_reason: Optional[str] = None
    stop_reason: Any = None
    error: Optional[str] = None
    stats: RequestStateStats = field(default_factory=RequestStateStats)
    stop_floor: int = 0  # where the text after the first min_tokens tokens starts: stop strings end past it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class PoolingRequestState:
    """What the frontend keeps of a pooling request until its vector comes."""

    prompt: Optional[str]
    prompt_token_ids: list[int]


_NO_VECTOR = np.empty(0, dtype="<f4")
_NO_VECTOR.flags.writeable = False


@dataclass
class OutputProcessorOutput:
    request_outputs: list[Union[RequestOutput, PoolingRequestOutput]] = field(default_factory=list)
    reqs_to_abort: list[str] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.byte_token_ids = byte_fallback_token_ids(tokenizer) if tokenizer is not None else frozenset()
        self.special_ids = special_token_ids(tokenizer) if tokenizer is not None else frozenset()
        self.added_ids = added_token_ids(tokenizer) if tokenizer is not None else frozenset()
        self.request_states: dict[str, RequestState] = {}
        self.parents: dict[str, ParentRequest] = {}
        self.pooling_states: dict[str, PoolingRequestState] = {}
        # every id in use (external ids and children's engine ids) -> the external id holding it
        self._reserved: dict[str, str] = {}
        self._token_text: dict[int, str] = {}

    def reserve(self, request_id: str, child_ids: Sequence[str] = ()) -> None:
        """Claims `request_id` and its children's ids; ValueError (nothing claimed) if any is in use."""
        ids = [request_id, *child_ids]
        for rid in ids:
            owner = self._reserved.get(rid)
            if owner is None:
                continue
            if rid == request_id:
                raise ValueError(f"request_id {request_id!r} is already in use.")
            raise ValueError(
                f"request_id {request_id!r}: its child request id {rid!r} (for n > 1) is already in use by "
                f"request {owner!r}."
            )
        if len(set(ids)) != len(ids):
            raise ValueError(f"request_id {request_id!r} collides with one of its own child ids {list(child_ids)}.")
        for rid in ids:
            self._reserved[rid] = request_id

    def add_parent(self, parent: ParentRequest) -> None:
        """Reserves a request with n > 1 and its children's ids; `add_request` then adds each child."""
        self.reserve(parent.request_id, parent.child_ids)
        self.parents[parent.request_id] = parent

    def _release(self, external_id: str, child_ids: Iterable[str] = ()) -> None:
        self._reserved.pop(external_id, None)
        for rid in child_ids:
            self._reserved.pop(rid, None)

    def add_request(
        self,
        request: EngineCoreRequest,
        prompt: Optional[str],
        prompt_token_ids: list[int],
        parent: Optional[ParentRequest] = None,
        index: int = 0,
    ) -> None:
        """Registers a request; without a parent it reserves its id first (ValueError if taken). A
        child's id was reserved by `add_parent`."""
        rid = request.request_id
        params = request.sampling_params
        assert params is not None, "the output processor handles generation requests"
        external_id = parent.request_id if parent is not None else rid
        if parent is None:
            self.reserve(rid)
        elif self.parents.get(external_id) is not parent or rid not in parent.child_ids:
            raise ValueError(f"request {rid!r} is not a child of a parent added with add_parent.")
        self.request_states[rid] = RequestState(
            request_id=rid,
            external_id=external_id,
            index=index,
            parent=parent,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            params=params,
            detokenizer=IncrementalDetokenizer(
                self.tokenizer, params.skip_special_tokens, self.byte_token_ids, self.special_ids,
                self.added_ids if params.spaces_between_special_tokens else frozenset(),
            ),
            logprobs=create_sample_logprobs(params.flat_logprobs) if params.logprobs is not None else None,
            prompt_logprobs=create_prompt_logprobs(params.flat_logprobs) if params.prompt_logprobs is not None else None,
            cumulative_logprob=0.0 if params.logprobs is not None else None,
            stats=RequestStateStats(arrival_time=request.arrival_time),
        )

    def add_pooling_request(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int]) -> None:
        self.reserve(request_id)
        self.pooling_states[request_id] = PoolingRequestState(prompt, prompt_token_ids)

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states) or bool(self.pooling_states)

    def get_num_unfinished_requests(self) -> int:
        return len(self.request_states) + len(self.pooling_states)

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        """Forgets these requests (external ids or engine ids); returns the engine ids to abort."""
        engine_ids = []
        for rid in request_ids:
            owner = self._reserved.get(rid)
            if owner is None:
                continue
            if owner != rid:  # a child's engine id: the child alone stops, its id stays its parent's
                if self.request_states.pop(rid, None) is not None:
                    engine_ids.append(rid)
                    self.parents[owner].unfinished.discard(rid)
                    self._release_parent_if_done(self.parents[owner])
                continue
            parent = self.parents.pop(rid, None)
            ids = parent.child_ids if parent is not None else [rid]
            for engine_id in ids:
                if self.request_states.pop(engine_id, None) is not None:
                    engine_ids.append(engine_id)
                elif self.pooling_states.pop(engine_id, None) is not None:
                    engine_ids.append(engine_id)
            self._release(rid, ids)
        return engine_ids

    def _release_parent_if_done(self, parent: ParentRequest) -> None:
        if parent.finished:
            self.parents.pop(parent.request_id, None)
            self._release(parent.request_id, parent.child_ids)

    def process_outputs(self, outputs: EngineCoreOutputs) -> OutputProcessorOutput:
        """One message's outputs: its EngineCoreOutputs, then the rows of its columns (new tokens
        only), each without a struct of its own."""
        result = OutputProcessorOutput()
        by_external_id: dict[str, RequestOutput] = {}
        states = self.request_states
        for output in outputs.outputs:
            state = states.get(output.request_id)
            if state is None:  # a pooling request, or one aborted or finished by a stop string already
                pooled = self._pooling_output(output)
                if pooled is not None:
                    result.request_outputs.append(pooled)
                continue
            self._process(state, output.new_token_ids, output, result, by_external_id)
        for request_id, new_token_ids in outputs.new_tokens():
            state = states.get(request_id)
            if state is not None:  # else aborted, or finished by a stop string already
                self._process(state, new_token_ids, None, result, by_external_id)
        result.request_outputs.extend(by_external_id.values())
        return result

    def _process(
        self, state: RequestState, new_token_ids: list[int], output: Optional[EngineCoreOutput],
        result: OutputProcessorOutput, by_external_id: dict[str, RequestOutput],
    ) -> None:
        if self._update(state, new_token_ids, output):
            result.reqs_to_abort.append(state.request_id)
        completion = self._make_completion(state)
        if state.finished:
            self.request_states.pop(state.request_id)
            if state.parent is None:
                self._release(state.request_id)
        self._collect(state, completion, by_external_id)

    def _pooling_output(self, output: EngineCoreOutput) -> Optional[PoolingRequestOutput]:
        """The finished PoolingRequestOutput of a pooling request's output (None: not one)."""
        if not output.finished:
            return None
        state = self.pooling_states.pop(output.request_id, None)
        if state is None:
            return None
        self._release(output.request_id)
        data = output.pooling_output if output.pooling_output is not None else _NO_VECTOR
        return PoolingRequestOutput(
            request_id=output.request_id,
            outputs=PoolingOutput(data=data),
            prompt_token_ids=state.prompt_token_ids,
            finished=True,
            prompt=state.prompt,
            num_cached_tokens=output.num_cached_tokens,
            error=output.error,
        )

    def _update(self, state: RequestState, new_ids: list[int], output: Optional[EngineCoreOutput]) -> bool:
        """Applies one step's new tokens and, if there is one, the rest of its output (None: a
        row of the columns, new tokens only); returns True if a stop string finished it here."""
        params = state.params
        if new_ids:
            _record_tokens(state.stats, len(new_ids))
        finished = False
        if output is not None:
            finished = output.finished
            state.num_cached_tokens = output.num_cached_tokens or state.num_cached_tokens
            if output.new_prompt_logprobs is not None and state.prompt_logprobs is not None:
                self._extend_logprobs(state.prompt_logprobs, output.new_prompt_logprobs, params.detokenize)
            if output.new_logprobs is not None and state.logprobs is not None:
                self._extend_logprobs(state.logprobs, output.new_logprobs, params.detokenize)
                _, lps, _ = output.new_logprobs.arrays()
                state.cumulative_logprob += float(lps[:, 0].astype("float64").sum())
        stop_token_hit = (
            finished
            and output.finish_reason == FinishReason.STOP
            and bool(new_ids)
            and new_ids[-1] in params.all_stop_token_ids
            and not params.include_stop_str_in_output
        )
        detok = state.detokenizer
        old_len = len(detok.output_text)
        if params.detokenize and self.tokenizer is not None:
            detok.update(new_ids, skip_last=stop_token_hit)
            if finished:
                detok.flush()
        else:
            detok.token_ids.extend(new_ids)
        stop = self._find_stop_string(state, old_len)
        if stop is not None:
            state.finish_reason, state.stop_reason = str(FinishReason.STOP), stop
            return not finished
        if finished:
            state.finish_reason = str(output.finish_reason)
            state.stop_reason = output.stop_reason
            state.error = output.error
        return False

    def _find_stop_string(self, state: RequestState, old_len: int) -> Optional[str]:
        """Looks for a stop string ending in the text new this step and past the first min_tokens
        tokens' text (vLLM's rule); truncates the text at it."""
        params = state.params
        detok = state.detokenizer
        if not params.stop:
            return None
        if len(detok.token_ids) <= params.min_tokens:
            state.stop_floor = len(detok.output_text)
            return None
        found = find_stop_string(detok.output_text, params.stop, max(old_len, state.stop_floor), params.include_stop_str_in_output)
        if found is None:
            return None
        stop, truncate_to = found
        detok.output_text = detok.output_text[:truncate_to]
        return stop

    def _make_completion(self, state: RequestState) -> Optional[CompletionOutput]:
        """The CompletionOutput this step shows for the request (None: nothing to show yet)."""
        kind = state.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not state.finished:
            return None
        detok = state.detokenizer
        text = detok.output_text
        if not state.finished and state.params.stop and not state.params.include_stop_str_in_output:
            # Hold back what could be the start of a stop string, so that none is ever shown.
            text = text[: max(0, len(text) - (max(len(s) for s in state.params.stop) - 1))]
        token_ids, logprobs = detok.token_ids, state.logprobs
        if kind == RequestOutputKind.DELTA:
            if len(token_ids) == state.sent_tokens and len(text) == state.sent_text and not state.finished:
                return None
            delta_text, delta_ids = text[state.sent_text:], token_ids[state.sent_tokens:]
            delta_logprobs = logprobs[state.sent_logprobs:] if logprobs is not None else None
            state.sent_text, state.sent_tokens = max(state.sent_text, len(text)), len(token_ids)
            state.sent_logprobs = len(logprobs) if logprobs is not None else 0
            text, token_ids, logprobs = delta_text, delta_ids, delta_logprobs
        else:
            token_ids = list(token_ids)
            logprobs = logprobs[:] if logprobs is not None else None  # a copy of the same kind
        return CompletionOutput(
            index=state.index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=state.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=state.finish_reason,
            stop_reason=state.stop_reason,
        )

    def _collect(
        self, state: RequestState, completion: Optional[CompletionOutput], by_external_id: dict[str, RequestOutput]
    ) -> None:
        parent = state.parent
        if parent is None:
            if completion is not None:
                by_external_id[state.external_id] = self._request_output(state, [completion], state.finished, state.error)
            return
        completions = parent.merge(state.request_id, completion)
        parent.error = parent.error or state.error
        self._release_parent_if_done(parent)
        if completions is None:
            return
        previous = by_external_id.get(parent.request_id)
        if previous is not None and parent.output_kind == RequestOutputKind.DELTA:
            completions = previous.outputs + completions
        by_external_id[parent.request_id] = self._request_output(state, completions, parent.finished, parent.error)

    def _request_output(
        self, state: RequestState, completions: list[CompletionOutput], finished: bool, error: Optional[str]
    ) -> RequestOutput:
        return RequestOutput(
            request_id=state.external_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=self._take_prompt_logprobs(state),
            outputs=completions,
            finished=finished,
            num_cached_tokens=state.num_cached_tokens,
            error=error,
            metrics=state.stats,
        )

    def _take_prompt_logprobs(self, state: RequestState) -> Optional[PromptLogprobs]:
        """All prompt logprobs; with DELTA only in the first output after the prompt is done."""
        if state.prompt_logprobs is None:
            return None
        if state.params.output_kind != RequestOutputKind.DELTA:
            return state.prompt_logprobs
        if state.sent_prompt_logprobs or len(state.prompt_logprobs) < len(state.prompt_token_ids):
            return None
        state.sent_prompt_logprobs = True
        return state.prompt_logprobs

    def _extend_logprobs(
        self, positions: Union[list[Optional[dict[int, Logprob]]], FlatLogprobs], logprobs: Logprobs, detokenize: bool
    ) -> None:
        if isinstance(positions, FlatLogprobs):
            self._extend_flat(positions, logprobs, detokenize)
        else:
            positions.extend(self._logprob_rows(logprobs, detokenize))

    def _extend_flat(self, flat: FlatLogprobs, logprobs: Logprobs, detokenize: bool) -> None:
        """The rows straight into FlatLogprobs' lists, with no dict or Logprob per row: what
        `flat.extend(self._logprob_rows(...))` would hold (a top-k token that is the row's own
        token is left out, its position kept as the token's rank; top-k tokens are distinct)."""
        ids, lps, ranks = logprobs.arrays()
        texts = self._texts_of(ids) if detokenize and self.tokenizer is not None else _NO_TEXTS
        starts, ends, tokens, values, token_ranks, decoded = (
            flat.start_indices, flat.end_indices, flat.token_ids, flat.logprobs, flat.ranks, flat.decoded_tokens
        )
        for row_ids, row_lps, rank in zip(ids.tolist(), lps.tolist(), ranks.tolist()):
            starts.append(len(tokens))
            token = row_ids[0]
            tokens.append(token)
            values.append(row_lps[0])
            token_ranks.append(rank)
            decoded.append(texts[token])
            for j in range(1, len(row_ids)):
                if row_ids[j] != token:
                    tokens.append(row_ids[j])
                    values.append(row_lps[j])
                    token_ranks.append(j)
                    decoded.append(texts[row_ids[j]])
                else:
                    token_ranks[starts[-1]] = j  # as in _logprob_rows
            ends.append(len(tokens))

    def _logprob_rows(self, logprobs: Logprobs, detokenize: bool = True) -> list[dict[int, Logprob]]:
        """One dict per row; decoded_token is None without detokenize (vLLM's). A prompt's rows
        come by the thousand: one pass over Python lists, each distinct token decoded once."""
        ids, lps, ranks = logprobs.arrays()
        texts = self._texts_of(ids) if detokenize and self.tokenizer is not None else _NO_TEXTS
        rows = []
        for row_ids, row_lps, rank in zip(ids.tolist(), lps.tolist(), ranks.tolist()):
            token = row_ids[0]
            row = {token: Logprob(row_lps[0], rank, texts[token])}
            for j in range(1, len(row_ids)):
                # a top-k token's rank is its position, also where it is the row's own token, so
                # the top k carry ranks 1..k even where logprobs tie (vLLM's rule)
                row[row_ids[j]] = Logprob(row_lps[j], j, texts[row_ids[j]])
            rows.append(row)
        return rows

    def _texts_of(self, ids: np.ndarray) -> dict[int, str]:
        """The token-text cache, holding every id in `ids`."""
        cache = self._token_text
        for token in np.unique(ids).tolist():
            if token not in cache:
                cache[token] = self.tokenizer.decode([token])
        return cache


class _NoTexts(dict):
    """decoded_token None for every id."""

    def __missing__(self, token_id: int) -> None:
        return None


_NO_TEXTS = _NoTexts()


def _record_tokens(stats: RequestStateStats, count: int) -> None:
    now = time.monotonic()
    if not stats.first_token_ts:
        stats.first_token_ts = now
    stats.last_token_ts = now
    stats.num_generation_tokens += count
