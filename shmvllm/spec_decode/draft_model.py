"""Draft-model proposer: a small decoder of the target's vocabulary, run by the target's model
runner after each step, proposing k tokens per decoding request for the next step to verify.

Its paged KV cache mirrors the target's block ids (both advance over the same tokens, so one
block table serves both and preemption, prefix caching and freeing need no bookkeeping of
their own), plus a few scratch blocks per batch row for the positions past the blocks the
target holds (the proposals' own KV, never kept). Per request, `draft_num_computed` counts the
tokens whose draft KV is valid; each step the draft first catches up over the tokens after it
(a prefill chunk, or the accepted proposals and the target's next token), then decodes k - 1
more single-row steps for all proposing requests together. Greedy requests propose the draft's
argmax; random ones draw from the draft's distribution q (the request's temperature, top-k,
top-p, min-p), which the runner keeps for the rejection sampler's min(1, p / q).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from shmvllm.config import ModelConfig
from shmvllm.model.attention import build_attention_metadata
from shmvllm.model.loader import get_model, torch_dtype
from shmvllm.model.rotary import RotaryEmbedding
from shmvllm.model.sampler import Sampler, SamplingMetadata, race_sample, seeded_generator
from shmvllm.worker.huge_pages import advise_huge_pages
from shmvllm.worker.input_batch import InputBatch

logger = logging.getLogger(__name__)

# A seeded request's draft draws use output indexes past any real one: a stream apart from the
# target's (whose acceptance draws must not be correlated with the proposals).
_DRAFT_STREAM = 1 << 40
# Catch-ups of up to this many tokens attend as decode rows (the native decode step's path).
_DECODE_ROWS = 8


@dataclass
class DraftRow:
    """One batch row's work for the draft in a step: tokens [start, end) to catch up on, then,
    if num_proposals > 0, that many proposals after token end - 1."""

    row: int
    start: int
    end: int
    num_proposals: int


class DraftModelProposer:
    def __init__(self, config: ModelConfig, num_speculative_tokens: int, block_size: int, max_num_reqs: int,
                 device: torch.device) -> None:
        self.config = config
        self.k = num_speculative_tokens
        self.block_size = block_size
        self.device = device
        self.dtype = torch_dtype(config.dtype)
        self.scratch_per_row = -(-num_speculative_tokens // block_size)
        self.max_num_reqs = max_num_reqs
        self.model: Optional[torch.nn.Module] = None
        self.kv_cache: Optional[torch.Tensor] = None
        self.num_blocks = 0
        self.rope_lengths_needed = False

    def load_model(self) -> None:
        self.model = get_model(self.config)
        self.rope_lengths_needed = any(
            isinstance(m, RotaryEmbedding) and m.length_dependent for m in self.model.modules()
        )
        logger.info("Draft model %r loaded (%d layers)", self.config.model, len(self.model.attention_layers()))

    def kv_cache_bytes_per_block(self) -> int:
        layers = self.model.attention_layers()
        per_layer = 2 * self.block_size * layers[0].num_kv_heads * layers[0].head_dim
        return per_layer * len(layers) * torch.tensor([], dtype=self.dtype).element_size()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """The target's num_blocks (same ids) and the scratch blocks after them, zeroed (decode
        attention reads whole blocks: an uninitialized NaN would leak through a masked score)."""
        layers = self.model.attention_layers()
        total = num_blocks + self.max_num_reqs * self.scratch_per_row
        shape = (len(layers), 2, layers[0].num_kv_heads, total, self.block_size, layers[0].head_dim)
        self.kv_cache = torch.empty(shape, dtype=self.dtype, device=self.device)
        advise_huge_pages(self.kv_cache)
        for index, layer in enumerate(layers):
            layer.k_cache = self.kv_cache[index, 0]
            layer.v_cache = self.kv_cache[index, 1]
        self.num_blocks = num_blocks
        self.kv_cache[:, :, :, num_blocks:].zero_()

    def zero_blocks(self, index: torch.Tensor) -> None:
        self.kv_cache.index_fill_(3, index, 0.0)

    @torch.inference_mode()
    def propose(
        self, batch: InputBatch, work: list[DraftRow], sampling_metadata: Callable[[np.ndarray], SamplingMetadata],
        sampler: Sampler,
    ) -> dict[int, tuple[list[int], Optional[torch.Tensor]]]:
        """Runs the catch-ups and the proposals of `work`; returns, per proposing batch row, its
        proposed tokens and, for a random row, their distributions [n, vocab] (None: greedy)."""
        if not work:
            return {}
        table = self._block_table(batch, work)
        rows = np.array([w.row for w in work], dtype=np.int64)
        starts = np.array([w.start for w in work], dtype=np.int64)
        query_lens = np.array([w.end - w.start for w in work], dtype=np.int64)
        req_idx = np.repeat(np.arange(len(work)), query_lens)
        positions = starts[req_idx] + (np.arange(int(query_lens.sum())) - (np.cumsum(query_lens) - query_lens)[req_idx])
        input_ids = batch.token_ids[rows[req_idx], positions]
        verify = (query_lens > 1) & (query_lens <= _DECODE_ROWS)
        hidden = self._forward(batch, rows, table, input_ids, positions, query_lens, starts, verify)
        proposing = np.flatnonzero(np.array([w.num_proposals for w in work]) > 0)
        if len(proposing) == 0:
            return {}
        last = torch.from_numpy(np.cumsum(query_lens)[proposing] - 1).to(self.device)
        logits = self.model.compute_logits(hidden.index_select(0, last))
        meta = sampling_metadata(rows[proposing])
        self._draft_generators(batch, rows[proposing], meta, 0)
        tokens, probs = self._draw(logits, meta, sampler)
        counts = np.array([work[i].num_proposals for i in proposing])
        proposed = [[t] for t in tokens]
        q_rows: list[list[torch.Tensor]] = [[p] if p is not None else [] for p in probs]
        positions = np.array([work[i].end for i in proposing], dtype=np.int64)  # the next token's
        active = np.arange(len(proposing))
        for step in range(1, int(counts.max())):
            active = active[counts[active] > step]
            sub = proposing[active]
            ids = np.array([proposed[i][-1] for i in active], dtype=np.int64)
            pos = positions[active] + step - 1
            lens = np.ones(len(active), dtype=np.int64)
            hidden = self._forward(batch, rows[sub], table[sub], ids, pos, lens, pos, None)
            logits = self.model.compute_logits(hidden)
            meta = sampling_metadata(rows[sub])
            self._draft_generators(batch, rows[sub], meta, step)
            tokens, probs = self._draw(logits, meta, sampler)
            for j, i in enumerate(active.tolist()):
                proposed[i].append(tokens[j])
                if probs[j] is not None:
                    q_rows[i].append(probs[j])
        result = {}
        for i, w in enumerate(proposing.tolist()):
            q = torch.stack(q_rows[i]) if q_rows[i] else None
            result[work[w].row] = (proposed[i], q)
        return result

    def _block_table(self, batch: InputBatch, work: list[DraftRow]) -> np.ndarray:
        """The work rows' target block table rows, the row's scratch blocks after its own."""
        table = batch.block_table[[w.row for w in work]].copy()
        width = table.shape[1]
        for i, w in enumerate(work):
            own = int(batch.num_blocks[w.row])
            scratch = self.num_blocks + w.row * self.scratch_per_row + np.arange(self.scratch_per_row)
            n = min(self.scratch_per_row, width - own)
            table[i, own : own + n] = scratch[:n]
        return table

    def _forward(
        self, batch: InputBatch, rows: np.ndarray, table: np.ndarray, input_ids: np.ndarray, positions: np.ndarray,
        query_lens: np.ndarray, num_computed: np.ndarray, verify: Optional[np.ndarray],
    ) -> torch.Tensor:
        req_idx = np.repeat(np.arange(len(rows)), query_lens)
        blocks = table[req_idx, positions // self.block_size].astype(np.int64)
        slot_mapping = blocks * self.block_size + positions % self.block_size
        meta = build_attention_metadata(
            query_lens.astype(np.int32), num_computed.astype(np.int32), np.ascontiguousarray(table),
            slot_mapping, self.block_size, self.device, verify,
        )
        if self.rope_lengths_needed:
            lengths = np.maximum(batch.num_prompt_tokens[rows[req_idx]], positions + 1).astype(np.int64)
            meta.rope_lengths = torch.from_numpy(lengths).to(self.device)
        return self.model(
            torch.from_numpy(np.asarray(input_ids, dtype=np.int64)).to(self.device),
            torch.from_numpy(np.asarray(positions, dtype=np.int64)).to(self.device),
            meta,
        )

    @staticmethod
    def _draft_generators(batch: InputBatch, rows: np.ndarray, meta: SamplingMetadata, step: int) -> None:
        """A seeded request's draft draw at output index i comes from its own stream (seed,
        _DRAFT_STREAM + i): reproducible, and apart from the target's draws."""
        meta.generators = {}
        for i, row in enumerate(rows.tolist()):
            state = batch.states[row]
            seed = state.sampling_params.seed
            if seed is not None and not meta.all_greedy:
                index = _DRAFT_STREAM + len(state.output_token_ids) + step
                meta.generators[i] = seeded_generator(seed, index, meta.temperature.device)

    @staticmethod
    def _draw(logits: torch.Tensor, meta: SamplingMetadata, sampler: Sampler) -> tuple[list[int], list[Optional[torch.Tensor]]]:
        meta.max_num_logprobs = None  # the draft's logprobs are nobody's
        logits, _ = sampler.process(logits, meta)
        greedy = (meta.temperature < 1e-5).tolist()
        tokens = logits.argmax(dim=-1)
        probs: list[Optional[torch.Tensor]] = [None] * len(greedy)
        if not meta.all_greedy:
            q = sampler.probabilities(logits, meta)
            drawn = race_sample(q, meta.generators, sampler.generator)
            tokens = torch.where(meta.temperature < 1e-5, tokens, drawn)
            probs = [None if g else q[i] for i, g in enumerate(greedy)]
        return tokens.tolist(), probs
