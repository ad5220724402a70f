"""What the scheduler tells the model runner each step, and what the runner gives back.

These stay inside the engine process (they never cross the ring).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from shmvllm.boundary.messages import Logprobs
from shmvllm.pooling_params import PoolingParams
from shmvllm.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen, or one resumed after preemption (its state was dropped).

    output_token_ids: tokens already generated before a preemption (empty for a new request);
    they follow the prompt in the sequence and count as outputs for penalties and seeds.
    """

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: Optional[SamplingParams]
    pooling_params: Optional[PoolingParams]
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    """Requests the runner already holds: the blocks added to each since the last step, and
    how many of their tokens were already computed before this step."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    """One step's plan.

    num_scheduled_tokens[req_id]: tokens to run for that request this step (prefill chunk, or 1
    for decode). A request whose scheduled tokens reach the end of its known tokens samples
    one new token; a partial prefill chunk samples nothing.
    finished_req_ids: requests finished or aborted since the last step (the runner drops them).
    preempted_req_ids: requests preempted this step (the runner drops them; they come back later
    as NewRequestData).
    structured_output_request_ids / grammar_bitmask: the constrained requests that sample in this
    step, and their allowed next tokens, row i for structured_output_request_ids[i] (int32
    [rows, ceil(vocab / 32)], a view of the scheduler's buffer, valid until the next schedule()).
    scheduled_spec_decode_tokens[req_id]: the tokens proposed for a decoding request; they follow
    its known tokens, are counted in its num_scheduled_tokens, and are verified this step (empty
    unless speculative decoding is on). kept_block_ids[req_id]: how many of its blocks a request
    keeps; the ones after were freed after rejected proposals (applied before new_block_ids).
    burst_tokens[req_id]: a lone greedy decode scheduled with one token may decode up to this
    many in the step (its KV slots are reserved; the runner stops at a stop token or when input
    arrives, and the scheduler frees what the burst did not use).

    A request's num_computed_tokens may count prefix-cache blocks that another request writes in
    this same step (both share a prompt prefix and were scheduled together): the runner must
    write each layer's KV for every scheduled token before attention at that layer reads the
    cache. A plan with total_num_scheduled_tokens == 0 is never executed; its finished ids are
    carried to the next executed plan.
    """

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    structured_output_request_ids: list[str] = field(default_factory=list)
    grammar_bitmask: Optional[np.ndarray] = None
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    kept_block_ids: dict[str, int] = field(default_factory=dict)
    placeholder_req_ids: set[str] = field(default_factory=set)  # async scheduling: those that sample this step
    burst_tokens: dict[str, int] = field(default_factory=dict)


@dataclass
class ModelRunnerOutput:
    """sampled_token_ids[i]: the token(s) sampled for req_ids[i] this step ([] for a partial
    prefill chunk or a pooling request; with proposals, the accepted ones and the target's next). logprobs / prompt_logprobs: per request, only for
    requests that asked. pooler_output: per finished pooling request, the float32 vector.
    errors: per request whose processing failed in this step, why (it finishes with ERROR)."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: dict[str, Logprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, Logprobs] = field(default_factory=dict)
    pooler_output: dict[str, np.ndarray] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)  # a draft model's proposals for the next step


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
