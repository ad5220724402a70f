"""The per-request logits processors of vLLM's v1 SamplingParams: allowed_token_ids, bad_words
and logit_bias, applied to the raw logits in vLLM's order (after the logprobs are taken, before
min_tokens and the penalties).

A row's entry is built by the model runner from its request's params each step; rows without
any of the three cost nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class RequestLogitsProcessors:
    """row -> what that row's request asks for (rows index the logits being sampled)."""

    allowed_token_ids: dict[int, list[int]] = field(default_factory=dict)
    # row -> (bad word token sequences, the request's output token ids so far)
    bad_words: dict[int, tuple[list[list[int]], list[int]]] = field(default_factory=dict)
    logit_bias: dict[int, dict[int, float]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.allowed_token_ids or self.bad_words or self.logit_bias)


def apply_request_logits_processors(logits: torch.Tensor, processors: RequestLogitsProcessors) -> None:
    """In place, on [rows, vocab] logits."""
    apply_allowed_token_ids(logits, processors.allowed_token_ids)
    apply_bad_words(logits, processors.bad_words)
    apply_logit_bias(logits, processors.logit_bias)


def apply_allowed_token_ids(logits: torch.Tensor, allowed: dict[int, list[int]]) -> None:
    """Every token of the row but the allowed ones gets -inf."""
    for row, token_ids in allowed.items():
        index = torch.tensor(token_ids, dtype=torch.int64, device=logits.device)
        kept = logits[row].index_select(0, index)
        logits[row].fill_(float("-inf"))
        logits[row].index_copy_(0, index, kept)


def apply_bad_words(logits: torch.Tensor, bad_words: dict[int, tuple[list[list[int]], list[int]]]) -> None:
    """A bad word's last token gets -inf when the output so far ends with the rest of the word
    (a one-token word is always banned). vLLM looks at output tokens only, not the prompt."""
    for row, (words, output_ids) in bad_words.items():
        for word in words:
            prefix = word[:-1]
            if len(prefix) > len(output_ids):
                continue
            if not prefix or output_ids[-len(prefix):] == prefix:
                logits[row, word[-1]] = float("-inf")


def apply_logit_bias(logits: torch.Tensor, logit_bias: dict[int, dict[int, float]]) -> None:
    """Adds each bias to its token's logit."""
    for row, bias in logit_bias.items():
        index = torch.tensor(list(bias), dtype=torch.int64, device=logits.device)
        values = torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
        logits[row].index_add_(0, index, values)
