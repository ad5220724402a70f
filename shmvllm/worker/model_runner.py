"""GPUModelRunner's role, on any device: turns a SchedulerOutput into one forward pass.

Per step: apply the scheduler's changes to the runner's request states and persistent batch,
flatten the scheduled tokens of all requests into one batch (numpy, vectorized), run the
model, compute logits only on the rows that sample (the last scheduled token of a request
whose scheduled tokens reach the end of its known tokens) and on prompt rows whose logprobs
were asked, sample, and append each sampled token to its request's state. A step that gives a
lone greedy decode a burst (SchedulerOutput.burst_tokens) decodes up to its length in one call
of the model's native burst (`decode_burst`), or else here, one token a forward pass, until the
burst's length, a stop token, or `interrupt()` (new input for the engine) says to return.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from shmvllm.config import EngineConfig
from shmvllm.core.sched.output import ModelRunnerOutput, NewRequestData, SchedulerOutput
from shmvllm.boundary.messages import Logprobs
from shmvllm.model.attention import AttentionMetadata, PrefillSeq, build_attention_metadata
from shmvllm.model.loader import get_model, torch_dtype
from shmvllm.model.logits_processors import RequestLogitsProcessors
from shmvllm.model.parallel.group import TPGroup
from shmvllm.model.parallel.pipeline import PipelineStage
from shmvllm.model.prompt_logprobs import prompt_logprobs
from shmvllm.model.rotary import RotaryEmbedding
from shmvllm.model.sampler import (
    Sampler, SamplerOutput, SamplingMetadata, apply_min_tokens, gather_logprobs, seeded_generator,
)
from shmvllm.sampling_params import SamplingParams
from shmvllm.spec_decode.config import draft_may_propose, samples_independently
from shmvllm.spec_decode.draft_model import DraftModelProposer, DraftRow
from shmvllm.spec_decode.ngram_proposer import NgramProposer
from shmvllm.spec_decode.rejection_sampler import verify
from shmvllm.structured_output.bitmask import TokenBitmaskApplier
from shmvllm.worker import kv_memory
from shmvllm.worker.huge_pages import advise_huge_pages
from shmvllm.worker.input_batch import CachedRequestState, InputBatch

logger = logging.getLogger(__name__)


@dataclass
class StepInputs:
    """One step laid out: per batch row its scheduled tokens, tokens computed before, end and
    known tokens (and proposals, when verified); the flat model inputs (None where the step was
    begun for a native burst, which reads none of them)."""

    query_lens: np.ndarray
    num_computed: np.ndarray
    ends: np.ndarray
    known: np.ndarray
    num_proposed: Optional[np.ndarray]
    input_ids: Optional[torch.Tensor]
    positions: Optional[torch.Tensor]
    meta: Optional[AttentionMetadata]


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.config = config
        self.model_config = config.model_config
        self.device = device
        self.dtype = torch_dtype(self.model_config.dtype)
        self.block_size = config.cache_config.block_size
        self.max_model_len = self.model_config.max_model_len
        self.vocab_size = self.model_config.vocab_size
        self.requests: dict[str, CachedRequestState] = {}
        # req_id -> prompt logprob rows already given out (positions 0..n-1). Kept across a
        # preemption, which drops the request's state and recomputes it from its first token:
        # the recompute must not give those rows again (vLLM keeps its num_prompt_logprobs so).
        self.prompt_logprob_rows_done: dict[str, int] = {}
        self.input_batch = InputBatch(
            config.scheduler_config.max_num_seqs, self.max_model_len, self.block_size, self.vocab_size
        )
        generator = torch.Generator(device=device)
        generator.manual_seed(self.model_config.seed)
        self.sampler = Sampler(generator)
        self.bitmask_applier = TokenBitmaskApplier(self.vocab_size, device)
        self.model: Optional[torch.nn.Module] = None
        self.kv_cache: Optional[torch.Tensor] = None
        self._padding_zeroed = False
        self.num_blocks = 0
        self.rope_lengths_needed = False
        # whether the engine has input waiting, asked between a burst's tokens (no caller: never)
        self.interrupt: Callable[[], bool] = _never
        spec = config.speculative_config
        # with n-gram speculation a burst ends where this proposer finds a match (Scheduler._burst_size)
        self.burst_lookup = NgramProposer(spec) if spec is not None and not spec.uses_draft_model else None
        self.drafter: Optional[DraftModelProposer] = None
        if config.draft_model_config is not None and spec is not None:
            self.drafter = DraftModelProposer(
                config.draft_model_config, spec.num_speculative_tokens, self.block_size,
                config.scheduler_config.max_num_seqs, device,
            )

    # ---- set-up -------------------------------------------------------------------------
    def load_model(self, group: Optional[TPGroup] = None, stage: Optional[PipelineStage] = None) -> None:
        """Loads the model, or this tensor-parallel rank's share of it (`group`), or this
        pipeline stage's layers (`stage`)."""
        self.model = get_model(self.model_config, group, stage)
        self.rope_lengths_needed = any(
            isinstance(m, RotaryEmbedding) and m.length_dependent for m in self.model.modules()
        )
        if self.drafter is not None:
            self.drafter.load_model()

    def _kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """[layers, 2, kv_heads, num_blocks, block_size, head_dim] of the built model's attention layers."""
        layers = self._attention_layers()
        return (len(layers), 2, layers[0].num_kv_heads, num_blocks, self.block_size, layers[0].head_dim)

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes of one block across all layers (keys and values), the draft model's too."""
        total = math.prod(self._kv_cache_shape(1)) * self.dtype.itemsize
        return total + (self.drafter.kv_cache_bytes_per_block() if self.drafter is not None else 0)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocates [layers, 2, kv_heads, num_blocks, block_size, head_dim] and binds each layer's
        key/value views. Left uninitialized, so that the OS maps pages only when a block is first
        written (a 4 GiB cache is ready at once, not after seconds of zero-filling). Decode
        attention reads whole blocks, and a masked score times a NaN value is still NaN, so
        block 0 (the padding) is zeroed by the first step and every other block when a request
        first gets it (`_zero_new_blocks`): no page is touched before the engine is ready."""
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}.")
        layers = self._attention_layers()
        attn = layers[0]
        shape = self._kv_cache_shape(num_blocks)
        reserved = kv_memory.take(shape, self.dtype.itemsize) if self.device.type == "cpu" else None
        if reserved is not None:  # mapped and first touched while torch imported
            self.kv_cache = torch.frombuffer(reserved.map, dtype=self.dtype, count=math.prod(shape),
                                             offset=reserved.offset).view(shape)
        else:
            self.kv_cache = torch.empty(shape, dtype=self.dtype, device=self.device)
            advise_huge_pages(self.kv_cache)  # before the first write maps any page
        self._padding_zeroed = False
        for index, layer in enumerate(layers):
            layer.k_cache = self.kv_cache[index, 0]
            layer.v_cache = self.kv_cache[index, 1]
        self.num_blocks = num_blocks
        if self.drafter is not None:
            self.drafter.initialize_kv_cache(num_blocks)
        hf = self.model_config.hf_config
        kv_heads = getattr(hf, "num_key_value_heads", None) or getattr(hf, "num_attention_heads", attn.num_kv_heads)
        share = f", this rank's {attn.num_kv_heads} of {kv_heads} KV heads" if attn.num_kv_heads != kv_heads else ""
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %.1f MiB%s)%s",
            num_blocks, self.block_size, num_blocks * self.block_size,
            self.kv_cache.numel() * self.kv_cache.element_size() / 2**20, share,
            "" if reserved is None else
            f", mapped before torch (its first {kv_memory.TOUCHED_BLOCKS} blocks faulted in {reserved.touch_seconds:.2f} s)",
        )

    def _zero_new_blocks(self, block_ids: list[int]) -> None:
        if block_ids:
            index = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
            self.kv_cache.index_fill_(3, index, 0.0)
            if self.drafter is not None:
                self.drafter.zero_blocks(index)

    def _attention_layers(self) -> list:
        if self.model is None:
            raise RuntimeError("load_model must run first.")
        return self.model.attention_layers()

    # ---- one step ---------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        native = bool(scheduler_output.burst_tokens) and self.burst_lookup is None
        step = self.begin_step(scheduler_output, inputs=not native)
        if step is None:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        if native:
            output = self._native_burst(step, scheduler_output.burst_tokens)
            if output is not None:
                return output
            self._lay_out_inputs(step)
        hidden = self.model(step.input_ids, step.positions, step.meta)
        output = self.finish_step(step, hidden, scheduler_output)
        if scheduler_output.burst_tokens:
            self._burst(scheduler_output.burst_tokens, output)
        return output

    def _native_burst(self, step: StepInputs, bursts: dict[str, int]) -> Optional[ModelRunnerOutput]:
        """The whole burst, the step's own token first, in one call of the model's native burst
        (`decode_burst`: embedding, step, lm_head, argmax and the stop rule in C); None where the
        model has none. The scheduler gives a burst only to a lone request decoding its one last
        token whose argmax alone decides, so the step's token is the argmax as the sampler takes it."""
        decode_burst = getattr(self.model, "decode_burst", None)
        if decode_burst is None:
            return None
        batch = self.input_batch
        (req_id, burst), = bursts.items()
        row = batch.req_id_to_index[req_id]
        state = batch.states[row]
        computed = int(step.num_computed[row])
        masked_tokens = state.sampling_params.min_tokens - len(state.output_token_ids) if state.stop_token_ids else 0
        tokens = decode_burst(
            int(batch.token_ids[row, computed]), computed, batch.block_table[row], burst,
            sorted(_burst_stops(state.sampling_params)), state.stop_token_ids, masked_tokens,
            None if self.interrupt is _never else self.interrupt,
        )
        if tokens is None:
            return None
        sampled: list[list[int]] = [[] for _ in range(batch.num_reqs)]
        sampled[row] = tokens
        self._decoded(row, tokens, computed)
        return ModelRunnerOutput(req_ids=list(batch.req_ids), sampled_token_ids=sampled)

    def _burst(self, bursts: dict[str, int], output: ModelRunnerOutput) -> None:
        """Decodes the lone request's further tokens of its burst where the model has no native
        burst, or with n-gram speculation: each a forward pass of its last token and the argmax
        of its logits (what the sampler takes for a greedy row with no processors; before min_tokens outputs, with the stop tokens masked as the sampler masks
        them), until the burst's length, EOS (unless ignored) or a stop token id (the scheduler
        keeps a burst within max_tokens and max_model_len), new input for the engine, or, with
        n-gram speculation, a token after which the proposer has a proposal to verify."""
        batch = self.input_batch
        (req_id, burst), = bursts.items()
        row = batch.req_id_to_index[req_id]
        state = batch.states[row]
        params = state.sampling_params
        stops = _burst_stops(params)
        tokens = output.sampled_token_ids[row]
        one = np.ones(1, dtype=np.int32)
        while tokens and len(tokens) < burst and tokens[-1] not in stops and not self.interrupt():
            computed = int(batch.num_computed_tokens[row])
            input_ids, positions, meta = self._prepare_inputs(one, np.array([computed], dtype=np.int32))
            logits = self.model.compute_logits(self.model(input_ids, positions, meta)[-1:])
            if state.stop_token_ids and len(state.output_token_ids) < params.min_tokens:
                apply_min_tokens(logits, [(0, state.stop_token_ids)])
            token = _greedy_token(logits[0])
            tokens.append(token)
            self._decoded(row, [token], computed)
            if self.burst_lookup is not None and self.burst_lookup.propose(batch.token_ids[row, : batch.num_tokens[row]], 1):
                break

    def _decoded(self, row: int, tokens: list[int], computed: int) -> None:
        """Records a burst's decoded tokens of `row`, whose first `computed` tokens had their KV."""
        batch = self.input_batch
        state = batch.states[row]
        for token in tokens:
            batch.append_token(row, token)
        state.output_token_ids.extend(tokens)
        batch.num_computed_tokens[row] = state.num_computed_tokens = computed + len(tokens)

    def begin_step(self, scheduler_output: SchedulerOutput, inputs: bool = True) -> Optional[StepInputs]:
        """Applies the scheduler's changes and lays out the step's inputs, the flat model inputs
        only where `inputs` (None: no request runs)."""
        if self.kv_cache is None:
            raise RuntimeError("initialize_kv_cache must run before execute_model.")
        self._update_states(scheduler_output)
        batch = self.input_batch
        if batch.num_reqs == 0:
            return None
        query_lens = np.array([scheduler_output.num_scheduled_tokens[r] for r in batch.req_ids], dtype=np.int32)
        num_computed = batch.num_computed_tokens[: batch.num_reqs].copy()
        ends = num_computed + query_lens
        known = batch.num_tokens[: batch.num_reqs].copy()
        proposals = scheduler_output.scheduled_spec_decode_tokens
        if proposals:
            num_proposed = self._place_proposals(proposals)
            known = known + num_proposed
        overrun = np.flatnonzero(ends > known)
        if len(overrun):
            row = int(overrun[0])
            raise ValueError(
                f"request {batch.req_ids[row]!r}: num_computed_tokens {num_computed[row]} + scheduled "
                f"{query_lens[row]} exceeds its {known[row]} known (and proposed) tokens."
            )
        step = StepInputs(query_lens, num_computed, ends, known, num_proposed if proposals else None, None, None, None)
        if inputs:
            self._lay_out_inputs(step)
        return step

    def _lay_out_inputs(self, step: StepInputs) -> None:
        """The step's flat model inputs: token ids, positions, attention metadata."""
        verify = None if step.num_proposed is None else step.num_proposed > 0
        step.input_ids, step.positions, step.meta = self._prepare_inputs(step.query_lens, step.num_computed, verify)

    def finish_step(self, step: StepInputs, hidden: torch.Tensor, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Samples (or verifies proposals) from the final hidden states, then `advance`s."""
        query_lens, num_computed, ends = step.query_lens, step.num_computed, step.ends
        cu_ends = np.cumsum(query_lens)
        sample_rows = np.flatnonzero(ends == step.known)
        if step.num_proposed is not None:
            output = self._verify(hidden, cu_ends, sample_rows, step.num_proposed, scheduler_output)
        else:
            output = self._sample(hidden, cu_ends, sample_rows, scheduler_output)
        prompt_logprobs = self._prompt_logprobs(hidden, cu_ends - query_lens, query_lens, num_computed, output.errors)
        if prompt_logprobs:
            output.prompt_logprobs = prompt_logprobs
        self.advance(step)
        if self.drafter is not None:
            self._draft(ends, output)
        return output

    def advance(self, step: StepInputs) -> None:
        """The step's tokens are computed (a pipeline stage before the last ends its step here)."""
        batch = self.input_batch
        batch.num_computed_tokens[: batch.num_reqs] = step.ends
        for row, state in enumerate(batch.states):
            state.num_computed_tokens = int(step.ends[row])

    def append_sampled(self, sampled: dict[str, list[int]]) -> None:
        """Tokens another process sampled (a pipeline stage before the last gets them from the
        engine), appended to the requests this runner still holds."""
        batch = self.input_batch
        for req_id, tokens in sampled.items():
            state = self.requests.get(req_id)
            if state is None:
                continue  # finished or preempted since: its state was dropped
            row = batch.req_id_to_index.get(req_id)
            for token in tokens:
                state.output_token_ids.append(token)
                if row is not None:
                    batch.append_token(row, token)

    def _draft(self, ends: np.ndarray, output: ModelRunnerOutput) -> None:
        """The draft model's step: every request catches up to its computed tokens (and, once it
        sampled, its next one); a request that sampled and may speculate proposes up to k tokens
        within max_model_len and max_tokens. If the draft fails, nobody proposes this time."""
        batch = self.input_batch
        work: list[DraftRow] = []
        for row, state in enumerate(batch.states):
            state.draft_tokens, state.draft_probs = [], None
            if state.req_id in output.errors:
                continue
            params = state.sampling_params
            sampled = bool(output.sampled_token_ids[row])
            end = int(batch.num_tokens[row]) if sampled else int(ends[row])
            count = 0
            if (sampled and samples_independently(params) and draft_may_propose(params)
                    and len(state.output_token_ids) >= params.min_tokens):
                count = min(self.drafter.k, self.max_model_len - end - 1)
                if params.max_tokens is not None:
                    count = min(count, params.max_tokens - len(state.output_token_ids) - 1)
            start = min(state.draft_num_computed, end - 1) if count > 0 else state.draft_num_computed
            if start < end:
                work.append(DraftRow(row, start, end, max(count, 0)))
        try:
            proposals = self.drafter.propose(batch, work, self._sampling_metadata, self.sampler)
        except Exception as exc:
            logger.warning("the draft model failed (%s): no proposals in this step", _describe(exc))
            return
        for w in work:
            state = batch.states[w.row]
            # draft KV stays valid for the tokens in blocks the request holds (not in scratch ones)
            state.draft_num_computed = min(w.end, int(batch.num_blocks[w.row]) * self.block_size)
            if w.row in proposals:
                state.draft_tokens, state.draft_probs = proposals[w.row]
                output.spec_token_ids[state.req_id] = list(state.draft_tokens)

    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        fresh_blocks: list[int] = []
        # sorted: a set's order follows the process's string hashing, and tensor-parallel ranks
        # (processes of their own) must lay out the same rows
        for req_id in sorted(so.finished_req_ids | so.preempted_req_ids):
            if req_id in batch.req_id_to_index:
                batch.remove_request(req_id)
            self.requests.pop(req_id, None)
        for req_id in so.finished_req_ids:
            self.prompt_logprob_rows_done.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            if new.req_id in batch.req_id_to_index:
                batch.remove_request(new.req_id)
            self.requests[new.req_id] = self._new_state(new)
            fresh_blocks.extend(new.block_ids[-(-new.num_computed_tokens // self.block_size) :])
        cached = so.scheduled_cached_reqs
        for req_id, new_blocks, num_computed in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens):
            state = self.requests.get(req_id)
            if state is None:
                raise ValueError(f"scheduled_cached_reqs names {req_id!r}, which the runner does not hold.")
            row = batch.req_id_to_index.get(req_id)
            kept = so.kept_block_ids.get(req_id) if so.kept_block_ids else None
            if kept is not None:  # blocks freed after rejected proposals
                del state.block_ids[kept:]
                if row is not None:
                    batch.num_blocks[row] = kept
            state.block_ids.extend(new_blocks)
            fresh_blocks.extend(new_blocks)
            state.num_computed_tokens = num_computed
            if row is not None:
                batch.append_block_ids(row, new_blocks)
                batch.num_computed_tokens[row] = num_computed
        if not self._padding_zeroed:
            fresh_blocks.append(0)
            self._padding_zeroed = True
        self._zero_new_blocks(fresh_blocks)
        for req_id in [r for r in batch.req_ids if r not in so.num_scheduled_tokens]:
            batch.remove_request(req_id)  # not scheduled this step: keep its state, leave the batch
        for req_id in so.num_scheduled_tokens:
            if req_id not in batch.req_id_to_index:
                state = self.requests.get(req_id)
                if state is None:
                    raise ValueError(f"num_scheduled_tokens names {req_id!r}, which the runner does not hold.")
                batch.add_request(state)

    @staticmethod
    def _new_state(new: NewRequestData) -> CachedRequestState:
        if new.sampling_params is None:
            raise ValueError(f"request {new.req_id!r} has no sampling_params (pooling is not served by this runner).")
        params = new.sampling_params
        return CachedRequestState(
            req_id=new.req_id,
            prompt_token_ids=list(new.prompt_token_ids),
            output_token_ids=list(new.output_token_ids),
            sampling_params=params,
            block_ids=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
            stop_token_ids=_min_tokens_masked_ids(params) if params.min_tokens > 0 else [],
        )

    def _prepare_inputs(
        self, query_lens: np.ndarray, num_computed: np.ndarray, verify: Optional[np.ndarray] = None
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        batch = self.input_batch
        n = batch.num_reqs
        total = int(query_lens.sum())
        req_idx = np.repeat(np.arange(n), query_lens)
        starts = np.cumsum(query_lens) - query_lens
        positions = num_computed[req_idx] + (np.arange(total) - starts[req_idx])
        input_ids = batch.token_ids[req_idx, positions]
        blocks = batch.block_table[req_idx, positions // self.block_size].astype(np.int64)
        slot_mapping = blocks * self.block_size + positions % self.block_size
        meta = build_attention_metadata(
            query_lens, num_computed, batch.block_table[:n], slot_mapping, self.block_size, self.device, verify
        )
        if self.rope_lengths_needed:  # the length transformers' generate rotates each token with
            lengths = np.maximum(batch.num_prompt_tokens[req_idx], positions + 1).astype(np.int64)
            meta.rope_lengths = torch.from_numpy(lengths).to(self.device)
        return (
            torch.from_numpy(input_ids.astype(np.int64)).to(self.device),
            torch.from_numpy(positions.astype(np.int64)).to(self.device),
            meta,
        )

    # ---- sampling -----------------------------------------------------------------------
    def _sample(
        self, hidden: torch.Tensor, cu_ends: np.ndarray, sample_rows: np.ndarray, scheduler_output: SchedulerOutput
    ) -> ModelRunnerOutput:
        """Samples the rows that reached their end. If sampling the batch raises, each row is
        sampled alone: a row that still fails is that request's error, the others go on."""
        batch = self.input_batch
        sampled_lists: list[list[int]] = [[] for _ in range(batch.num_reqs)]
        output = ModelRunnerOutput(req_ids=list(batch.req_ids), sampled_token_ids=sampled_lists)
        if len(sample_rows) == 0:
            return output
        logits_idx = torch.from_numpy((cu_ends[sample_rows] - 1).astype(np.int64)).to(self.device)
        logits = self.model.compute_logits(hidden.index_select(0, logits_idx))
        if scheduler_output.grammar_bitmask is not None:
            self._apply_grammar_bitmask(logits, sample_rows, scheduler_output)
        try:
            parts = [(sample_rows, self.sampler(logits, self._sampling_metadata(sample_rows)))]
        except Exception as exc:
            if len(sample_rows) == 1:
                output.errors[batch.req_ids[int(sample_rows[0])]] = _describe(exc)
                return output
            logger.warning("sampling %d rows failed (%s); sampling them one by one", len(sample_rows), _describe(exc))
            parts = []
            for i, row in enumerate(sample_rows.tolist()):
                rows = sample_rows[i : i + 1]
                try:
                    parts.append((rows, self.sampler(logits[i : i + 1], self._sampling_metadata(rows))))
                except Exception as row_exc:
                    logger.warning("request %r: sampling failed: %s", batch.req_ids[row], _describe(row_exc))
                    output.errors[batch.req_ids[row]] = _describe(row_exc)
        for rows, result in parts:
            self._record_samples(rows, result, output)
        return output

    def _place_proposals(self, proposals: dict[str, list[int]]) -> np.ndarray:
        """Writes each request's proposed tokens after its known ones (not counted as known);
        returns the number proposed per batch row."""
        batch = self.input_batch
        num_proposed = np.zeros(batch.num_reqs, dtype=np.int32)
        for req_id, tokens in proposals.items():
            row = batch.req_id_to_index[req_id]
            start = int(batch.num_tokens[row])
            if start + len(tokens) > self.max_model_len:
                raise ValueError(f"request {req_id!r}: {len(tokens)} proposed tokens pass max_model_len={self.max_model_len}.")
            batch.token_ids[row, start : start + len(tokens)] = tokens
            num_proposed[row] = len(tokens)
        return num_proposed

    def _verify(
        self, hidden: torch.Tensor, cu_ends: np.ndarray, sample_rows: np.ndarray, num_proposed: np.ndarray,
        so: SchedulerOutput,
    ) -> ModelRunnerOutput:
        """Samples with proposals: each sampling request's last 1 + k rows are verified (greedy
        match or rejection sampling, spec_decode.rejection_sampler). If that raises for the
        batch, each request is verified alone: one that still fails is that request's error."""
        batch = self.input_batch
        output = ModelRunnerOutput(req_ids=list(batch.req_ids), sampled_token_ids=[[] for _ in range(batch.num_reqs)])
        if len(sample_rows) == 0:
            return output
        widths = num_proposed[sample_rows].astype(np.int64) + 1
        group_starts = np.cumsum(widths) - widths
        rows = np.repeat(sample_rows, widths)
        offsets = np.arange(len(rows)) - np.repeat(group_starts, widths)
        hidden_idx = np.repeat(cu_ends[sample_rows] - widths, widths) + offsets
        logits = self.model.compute_logits(hidden.index_select(0, torch.from_numpy(hidden_idx).to(self.device)))
        if so.grammar_bitmask is not None:
            self._apply_grammar_bitmask(logits, sample_rows, so, group_starts, widths)
        proposals = [so.scheduled_spec_decode_tokens.get(batch.req_ids[r], []) for r in sample_rows.tolist()]
        draft_probs = self._draft_probs(sample_rows, proposals) if self.drafter is not None else None
        try:
            results = [(0, *verify(self.sampler, logits, self._sampling_metadata(rows, offsets), proposals, draft_probs))]
        except Exception as exc:
            if len(sample_rows) == 1:
                output.errors[batch.req_ids[int(sample_rows[0])]] = _describe(exc)
                return output
            logger.warning("verifying %d requests failed (%s); verifying them one by one", len(sample_rows), _describe(exc))
            results = []
            for g in range(len(sample_rows)):
                lo, hi = int(group_starts[g]), int(group_starts[g] + widths[g])
                try:
                    meta = self._sampling_metadata(rows[lo:hi], offsets[lo:hi])
                    q = draft_probs[g : g + 1] if draft_probs is not None else None
                    results.append((g, *verify(self.sampler, logits[lo:hi], meta, proposals[g : g + 1], q)))
                except Exception as row_exc:
                    req_id = batch.req_ids[int(sample_rows[g])]
                    logger.warning("request %r: verification failed: %s", req_id, _describe(row_exc))
                    output.errors[req_id] = _describe(row_exc)
        for first, emitted, raw_logprobs in results:
            base = int(group_starts[first])
            for i, tokens in enumerate(emitted):
                g = first + i
                row = int(sample_rows[g])
                state = batch.states[row]
                output.sampled_token_ids[row] = tokens
                for token in tokens:
                    batch.append_token(row, token)
                    state.output_token_ids.append(token)
                num = state.sampling_params.logprobs
                if num is not None:
                    lo = int(group_starts[g]) - base
                    chosen = torch.tensor(tokens, dtype=torch.int64, device=self.device)
                    ids, lps, ranks = (t.cpu().numpy() for t in gather_logprobs(raw_logprobs[lo : lo + len(tokens)], chosen, num))
                    output.logprobs[batch.req_ids[row]] = Logprobs.from_arrays(ids, lps, ranks)
        return output

    def _draft_probs(self, sample_rows: np.ndarray, proposals: list[list[int]]) -> list[Optional[torch.Tensor]]:
        """Each sampling request's draft distributions for its proposals (a prefix of the draft's
        last ones: the scheduler may cut them); None for a greedy request."""
        batch = self.input_batch
        result: list[Optional[torch.Tensor]] = []
        for row, tokens in zip(sample_rows.tolist(), proposals):
            state = batch.states[row]
            if tokens and state.draft_tokens[: len(tokens)] != tokens:
                raise ValueError(f"request {state.req_id!r}: proposals {tokens} are not the draft model's {state.draft_tokens}.")
            probs = state.draft_probs
            if tokens and probs is None and batch.temperature[row] >= 1e-5:
                raise ValueError(f"request {state.req_id!r}: the draft's distributions of its proposals are missing.")
            result.append(probs[: len(tokens)] if probs is not None and tokens else None)
        return result

    def _record_samples(self, sample_rows: np.ndarray, result: SamplerOutput, output: ModelRunnerOutput) -> None:
        batch = self.input_batch
        tokens = result.sampled_token_ids.tolist()
        for i, row in enumerate(sample_rows.tolist()):
            output.sampled_token_ids[row] = [tokens[i]]
            batch.append_token(row, tokens[i])
            batch.states[row].output_token_ids.append(tokens[i])
        if result.logprobs is not None:
            ids, lps, ranks = (t.cpu().numpy() for t in (result.logprob_token_ids, result.logprobs, result.ranks))
            for i, row in enumerate(sample_rows.tolist()):
                num = batch.states[row].sampling_params.logprobs
                if num is not None:
                    width = 1 + num
                    output.logprobs[batch.req_ids[row]] = Logprobs.from_arrays(
                        ids[i : i + 1, :width], lps[i : i + 1, :width], ranks[i : i + 1]
                    )

    def _apply_grammar_bitmask(
        self, logits: torch.Tensor, sample_rows: np.ndarray, so: SchedulerOutput,
        group_starts: Optional[np.ndarray] = None, widths: Optional[np.ndarray] = None,
    ) -> None:
        """Masks each constrained request's logits row with its bitmask row (before sampling, so
        every sampling knob chooses among allowed tokens). With proposals, group_starts / widths:
        each sampling request's logits rows, which its bitmask rows cover in order."""
        batch_rows = np.fromiter((self.input_batch.req_id_to_index[r] for r in so.structured_output_request_ids),
                                 dtype=np.int64, count=len(so.structured_output_request_ids))
        logits_rows = np.searchsorted(sample_rows, batch_rows)  # sample_rows is sorted
        if not np.array_equal(sample_rows[np.minimum(logits_rows, len(sample_rows) - 1)], batch_rows):
            raise ValueError(f"grammar bitmask for requests that do not sample in this step: {so.structured_output_request_ids}.")
        if group_starts is not None:
            logits_rows = np.concatenate([np.arange(group_starts[g], group_starts[g] + widths[g]) for g in logits_rows])
        self.bitmask_applier.apply(logits, logits_rows, so.grammar_bitmask)

    def _sampling_metadata(self, rows: np.ndarray, offsets: Optional[np.ndarray] = None) -> SamplingMetadata:
        """The metadata of logits rows for batch `rows`; offsets: each logits row's output
        position past the request's known outputs (verified proposals), else all 0."""
        batch = self.input_batch
        device = self.device
        greedy = batch.greedy_mask(rows)
        meta = SamplingMetadata(
            temperature=torch.from_numpy(batch.temperature[rows]).to(device),
            all_greedy=bool(greedy.all()),
            all_random=not bool(greedy.any()),
        )
        if not meta.all_greedy:
            if (batch.top_k[rows] < self.vocab_size).any():
                meta.top_k = torch.from_numpy(batch.top_k[rows]).to(device)
            if (batch.top_p[rows] < 1.0).any():
                meta.top_p = torch.from_numpy(batch.top_p[rows]).to(device)
            if (batch.min_p[rows] > 0.0).any():
                meta.min_p = torch.from_numpy(batch.min_p[rows]).to(device)
        if batch.needs_penalties(rows):
            meta.presence_penalty = torch.from_numpy(batch.presence_penalty[rows]).to(device)
            meta.frequency_penalty = torch.from_numpy(batch.frequency_penalty[rows]).to(device)
            meta.repetition_penalty = torch.from_numpy(batch.repetition_penalty[rows]).to(device)
            meta.output_token_ids = torch.from_numpy(batch.padded_tokens(rows, outputs=True)).to(device)
            meta.prompt_token_ids = torch.from_numpy(batch.padded_tokens(rows, outputs=False)).to(device)
        for i, row in enumerate(rows.tolist()):
            state = batch.states[row]
            params = state.sampling_params
            num_outputs = len(state.output_token_ids) + (int(offsets[i]) if offsets is not None else 0)
            if params.seed is not None and not greedy[i]:
                meta.generators[i] = seeded_generator(params.seed, num_outputs, device)
            if state.stop_token_ids and num_outputs < params.min_tokens:
                meta.stop_token_mask.append((i, state.stop_token_ids))
            if params.logprobs is not None:
                meta.max_num_logprobs = max(meta.max_num_logprobs or 0, params.logprobs)
            _add_request_processors(meta.request_processors, i, params, state.output_token_ids)
        return meta

    def _prompt_logprobs(
        self,
        hidden: torch.Tensor,
        starts: np.ndarray,
        query_lens: np.ndarray,
        num_computed: np.ndarray,
        errors: dict[str, str],
    ) -> dict[str, Logprobs]:
        """Rows for the prompt positions p computed this step with p + 1 < prompt length and no
        row given out yet (a recompute after preemption gives none twice): the logprob of prompt
        token p + 1, its rank, and the top-k. A request whose rows fail gets its error in `errors`."""
        batch = self.input_batch
        result: dict[str, Logprobs] = {}
        done = self.prompt_logprob_rows_done
        for row, state in enumerate(batch.states):
            num = state.sampling_params.prompt_logprobs
            if num is None or state.req_id in errors:
                continue
            prompt_len, computed = len(state.prompt_token_ids), int(num_computed[row])
            first = max(computed, done.get(state.req_id, 0))
            last = min(computed + int(query_lens[row]), prompt_len - 1)
            if first >= last:
                continue
            try:
                offset = int(starts[row]) + first - computed
                targets = torch.tensor(state.prompt_token_ids[first + 1 : last + 1], dtype=torch.int64, device=self.device)
                ids, lps, ranks = prompt_logprobs(
                    self.model.compute_logits, hidden[offset : offset + last - first], targets, num
                )
            except Exception as exc:
                logger.warning("request %r: prompt logprobs failed: %s", state.req_id, _describe(exc))
                errors[state.req_id] = _describe(exc)
                continue
            result[state.req_id] = Logprobs.from_arrays(ids, lps, ranks)
            done[state.req_id] = last
        return result

    # ---- profiling (CUDA memory sizing) -------------------------------------------------
    @torch.inference_mode()
    def profile_run(self) -> None:
        """Runs the largest step the scheduler may plan (max_num_batched_tokens, in prompts of at
        most max_model_len) without a KV cache, then logits and sampling for max_num_seqs rows,
        so that the peak activation memory can be measured."""
        sched = self.config.scheduler_config
        total = min(sched.max_num_batched_tokens, sched.max_num_seqs * self.max_model_len)
        lengths = [min(self.max_model_len, total - start) for start in range(0, total, self.max_model_len)]
        positions = torch.cat([torch.arange(length) for length in lengths]).to(self.device)
        input_ids = torch.zeros(total, dtype=torch.int64, device=self.device)
        meta = AttentionMetadata(slot_mapping=None)
        start = 0
        for length in lengths:
            meta.prefills.append(PrefillSeq(start, start + length, None, None))
            start += length
        if self.rope_lengths_needed:
            meta.rope_lengths = torch.cat([torch.full((n,), n) for n in lengths]).to(self.device)
        hidden = self.model(input_ids, positions, meta)
        rows = min(sched.max_num_seqs, total)
        logits = self.model.compute_logits(hidden[:rows])
        temperature = torch.ones(rows, device=self.device)
        sampling = SamplingMetadata(
            temperature=temperature, all_greedy=False, all_random=True,
            top_k=torch.full((rows,), 50, device=self.device), top_p=torch.full((rows,), 0.9, device=self.device),
            max_num_logprobs=5,
        )
        self.sampler(logits, sampling)


def _add_request_processors(
    processors: RequestLogitsProcessors, row: int, params: SamplingParams, output_token_ids: list[int]
) -> None:
    """The row's allowed_token_ids, bad_words (tokenized by the input processor) and logit_bias."""
    if params.allowed_token_ids:
        processors.allowed_token_ids[row] = params.allowed_token_ids
    if params.bad_words_token_ids:
        processors.bad_words[row] = (params.bad_words_token_ids, output_token_ids)
    if params.logit_bias:
        processors.logit_bias[row] = params.logit_bias


def _never() -> bool:
    return False


def _burst_stops(params: SamplingParams) -> set[int]:
    """The token ids after which a burst ends: stop_token_ids, and EOS unless ignored."""
    stops = set(params.stop_token_ids or ())
    if params.eos_token_id is not None and not params.ignore_eos:
        stops.add(params.eos_token_id)
    return stops


def _greedy_token(logits: torch.Tensor) -> int:
    """The first index of the largest value of one row of logits, as torch's argmax picks it:
    through numpy on the CPU (~4 us against torch's ~45 us for a 49k vocabulary)."""
    if logits.device.type == "cpu":
        return int(logits.numpy().argmax())
    return int(logits.argmax())


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _min_tokens_masked_ids(params: SamplingParams) -> list[int]:
    """What min_tokens keeps from being sampled: the stop tokens and EOS, even under ignore_eos
    (as in vLLM and transformers' min_new_tokens; ignore_eos only means EOS does not stop)."""
    ids = set(params.all_stop_token_ids)
    if params.eos_token_id is not None:
        ids.add(params.eos_token_id)
    return sorted(ids)
