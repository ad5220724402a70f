"""The model runner's per-request state, and the persistent batch of the requests it runs.

`InputBatch` keeps one row per request in preallocated numpy arrays (token ids, block table,
sampling knobs), so that a step only writes what changed: a new row when a request joins, one
token when it samples, a few block ids when it grows. Rows stay dense ([0, num_reqs)): a
removed row is filled by moving the last one into it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import numpy as np

from shmvllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

_EPS = 1e-5


@dataclass
class CachedRequestState:
    """Everything the runner knows about one request, in or out of the batch."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    stop_token_ids: list[int] = field(default_factory=list)  # masked while below min_tokens
    # draft-model speculation: tokens whose draft KV is valid; the last proposals and, for a
    # random request, the distributions [n, vocab] they were drawn from
    draft_num_computed: int = 0
    draft_tokens: list[int] = field(default_factory=list)
    draft_probs: Optional["torch.Tensor"] = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int, vocab_size: int) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.vocab_size = vocab_size
        max_blocks = (max_model_len + block_size - 1) // block_size
        self.req_ids: list[str] = []
        self.req_id_to_index: dict[str, int] = {}
        self.states: list[CachedRequestState] = []
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.block_table = np.zeros((max_num_reqs, max_blocks), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)
        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)
        self.top_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.presence_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.frequency_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.repetition_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self._arrays = [
            self.token_ids, self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens,
            self.block_table, self.num_blocks, self.temperature, self.top_k, self.top_p, self.min_p,
            self.presence_penalty, self.frequency_penalty, self.repetition_penalty,
        ]

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    def add_request(self, state: CachedRequestState) -> int:
        """Appends a row for `state`; returns its index."""
        if self.num_reqs >= self.max_num_reqs:
            raise ValueError(f"the batch holds at most max_num_seqs={self.max_num_reqs} requests.")
        if state.num_tokens > self.max_model_len:
            raise ValueError(f"request {state.req_id!r} has {state.num_tokens} tokens > max_model_len={self.max_model_len}.")
        row = self.num_reqs
        self.req_ids.append(state.req_id)
        self.states.append(state)
        self.req_id_to_index[state.req_id] = row
        num_prompt = len(state.prompt_token_ids)
        self.token_ids[row, :num_prompt] = state.prompt_token_ids
        self.token_ids[row, num_prompt : state.num_tokens] = state.output_token_ids
        self.num_tokens[row] = state.num_tokens
        self.num_prompt_tokens[row] = num_prompt
        self.num_computed_tokens[row] = state.num_computed_tokens
        self.num_blocks[row] = 0
        self.append_block_ids(row, state.block_ids)
        self._set_sampling(row, state.sampling_params)
        return row

    def _set_sampling(self, row: int, params: SamplingParams) -> None:
        self.temperature[row] = params.temperature
        self.top_k[row] = params.top_k if params.top_k > 0 else self.vocab_size
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p
        self.presence_penalty[row] = params.presence_penalty
        self.frequency_penalty[row] = params.frequency_penalty
        self.repetition_penalty[row] = params.repetition_penalty

    def append_block_ids(self, row: int, block_ids: list[int]) -> None:
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        if end > self.block_table.shape[1]:
            raise ValueError(f"request {self.req_ids[row]!r} would hold {end} blocks > {self.block_table.shape[1]}.")
        self.block_table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def append_token(self, row: int, token_id: int) -> None:
        position = int(self.num_tokens[row])
        if position >= self.max_model_len:
            raise ValueError(f"request {self.req_ids[row]!r} is already at max_model_len={self.max_model_len}.")
        self.token_ids[row, position] = token_id
        self.num_tokens[row] = position + 1

    def remove_request(self, req_id: str) -> None:
        """Drops the row of `req_id`, moving the last row into its place."""
        row = self.req_id_to_index.pop(req_id)
        last = self.num_reqs - 1
        if row != last:
            moved = self.req_ids[last]
            self.req_ids[row] = moved
            self.states[row] = self.states[last]
            self.req_id_to_index[moved] = row
            for array in self._arrays:
                array[row] = array[last]
        self.req_ids.pop()
        self.states.pop()

    # Batch-wide views of the sampling knobs, for the rows in `rows`.
    def greedy_mask(self, rows: np.ndarray) -> np.ndarray:
        return self.temperature[rows] < _EPS

    def needs_penalties(self, rows: np.ndarray) -> bool:
        return bool(
            (self.repetition_penalty[rows] != 1.0).any()
            or (self.presence_penalty[rows] != 0.0).any()
            or (self.frequency_penalty[rows] != 0.0).any()
        )

    def padded_tokens(self, rows: np.ndarray, outputs: bool) -> np.ndarray:
        """Output (or prompt) token ids of `rows`, padded with vocab_size to the longest: int64."""
        starts = self.num_prompt_tokens[rows] if outputs else np.zeros(len(rows), dtype=np.int32)
        ends = self.num_tokens[rows] if outputs else self.num_prompt_tokens[rows]
        width = max(int((ends - starts).max()) if len(rows) else 0, 1)
        columns = starts[:, None] + np.arange(width)[None, :]
        valid = columns < ends[:, None]
        gathered = self.token_ids[rows[:, None], np.minimum(columns, self.max_model_len - 1)]
        return np.where(valid, gathered, self.vocab_size).astype(np.int64)

    def state(self, req_id: str) -> Optional[CachedRequestState]:
        row = self.req_id_to_index.get(req_id)
        return None if row is None else self.states[row]
