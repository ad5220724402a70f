"""Counters of proposals and acceptances, as vLLM's `vllm:spec_decode_*` metrics."""

from __future__ import annotations

from typing import Any


class SpecDecodingStats:
    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_drafts = 0  # verification steps of a request with at least one proposal
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * num_speculative_tokens  # position j accepted (all before it too)

    def observe(self, num_proposed: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1

    def as_dict(self) -> dict[str, Any]:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_accepted_tokens_per_pos": list(self.accepted_per_pos),
        }
