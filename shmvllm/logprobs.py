"""Logprob, and the two shapes a completion's logprobs come in: a list of dicts (vLLM's default) or
one FlatLogprobs (`SamplingParams(flat_logprobs=True)`), which keeps every position's values in
flat lists and builds a position's dict only when it is indexed."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Optional, Union, overload


@dataclass
class Logprob:
    """One token's log probability at one position, its rank (1 = most likely), and its text
    (None when the request has detokenize=False)."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


@dataclass
class FlatLogprobs(Sequence):
    """Positions' logprobs in flat lists: position i holds entries start_indices[i]:end_indices[i].
    Indexing a position gives the same dict[int, Logprob] the list form holds there; a position
    with no logprobs (the first prompt token) is an empty range and reads as None."""

    start_indices: list[int] = field(default_factory=list)
    end_indices: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ranks: list[Optional[int]] = field(default_factory=list)
    decoded_tokens: list[Optional[str]] = field(default_factory=list)

    def append(self, position: Optional[dict[int, Logprob]]) -> None:
        self.start_indices.append(len(self.token_ids))
        for token_id, lp in (position or {}).items():
            self.token_ids.append(token_id)
            self.logprobs.append(lp.logprob)
            self.ranks.append(lp.rank)
            self.decoded_tokens.append(lp.decoded_token)
        self.end_indices.append(len(self.token_ids))

    def extend(self, positions: "Sequence[Optional[dict[int, Logprob]]]") -> None:
        for position in positions:
            self.append(position)

    def __len__(self) -> int:
        return len(self.start_indices)

    @overload
    def __getitem__(self, index: int) -> Optional[dict[int, Logprob]]: ...
    @overload
    def __getitem__(self, index: slice) -> "FlatLogprobs": ...

    def __getitem__(self, index: Union[int, slice]) -> "Union[Optional[dict[int, Logprob]], FlatLogprobs]":
        if isinstance(index, slice):
            part = FlatLogprobs()
            part.extend([self[i] for i in range(*index.indices(len(self)))])
            return part
        start, end = self.start_indices[index], self.end_indices[index]
        if start == end:
            return None
        return {
            self.token_ids[i]: Logprob(self.logprobs[i], self.ranks[i], self.decoded_tokens[i]) for i in range(start, end)
        }

    def __iter__(self) -> Iterator[Optional[dict[int, Logprob]]]:
        for i in range(len(self)):
            yield self[i]


# One dict per position: token id -> Logprob (the sampled/actual token and the top-k).
SampleLogprobs = Union[list[dict[int, Logprob]], FlatLogprobs]
# Prompt logprobs: None for the first prompt token, which has no preceding context.
PromptLogprobs = Union[list[Optional[dict[int, Logprob]]], FlatLogprobs]


def create_sample_logprobs(flat: bool) -> SampleLogprobs:
    return FlatLogprobs() if flat else []


def create_prompt_logprobs(flat: bool) -> PromptLogprobs:
    """With the first prompt token's None already in."""
    logprobs = FlatLogprobs() if flat else []
    logprobs.append(None)
    return logprobs
