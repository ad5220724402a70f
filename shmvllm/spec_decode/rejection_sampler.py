"""Verification of proposed tokens by the target model's logits.

Each request that samples has k + 1 consecutive logits rows (k >= 0 proposals): row j is the
target's distribution after proposal j - 1. Greedy requests keep the proposals while they equal
the target's argmax, then add the target's own token there (or, all accepted, the bonus token
from row k): the tokens are exactly those of greedy decoding without speculation. Random
requests use rejection sampling (Leviathan et al., 2023): proposal x at row j, drawn from the
proposer's distribution q_j, is accepted with probability min(1, p_j(x) / q_j(x)); on rejection
the token is drawn from max(p_j - q_j, 0), renormalized, so that every emitted token is
distributed as the target's. An n-gram proposal is the point mass q_j = [x]: accepted with
probability p_j(x), else drawn from p_j with x removed; a draft model's q_j is its own
distribution, a full row. A seeded request draws each position's
randomness from the generator seeded by (seed, output index), as without speculation, so its
tokens are reproducible.
"""

from __future__ import annotations

from typing import Optional

import torch

from shmvllm.model.sampler import Sampler, SamplingMetadata, race_sample


def verify(
    sampler: Sampler, logits: torch.Tensor, meta: SamplingMetadata, proposals: list[list[int]],
    draft_probs: Optional[list[Optional[torch.Tensor]]] = None,
) -> tuple[list[list[int]], Optional[torch.Tensor]]:
    """logits: [sum(len(p) + 1 for p in proposals), vocab], each request's rows consecutive; meta
    describes those rows. draft_probs: per request, the [len(p), vocab] distributions its
    proposals were drawn from (None: point masses; greedy rows need none). Returns each
    request's emitted tokens (1 to len(p) + 1 of them) and the raw logprobs of every row where
    any row asked for logprobs."""
    logits, raw_logprobs = sampler.process(logits, meta)
    greedy_rows = (meta.temperature < 1e-5).tolist()
    argmax = None if meta.all_random else logits.argmax(dim=-1).tolist()
    probs = None if meta.all_greedy else sampler.probabilities(logits, meta)
    emitted: list[list[int]] = []
    start = 0
    for i, drafts in enumerate(proposals):
        if greedy_rows[start]:
            tokens = _greedy(argmax[start : start + len(drafts) + 1], drafts)
        else:
            q = draft_probs[i] if draft_probs is not None else None
            tokens = _rejection(probs, start, drafts, q, meta.generators, sampler.generator)
        emitted.append(tokens)
        start += len(drafts) + 1
    return emitted, raw_logprobs


def _greedy(targets: list[int], drafts: list[int]) -> list[int]:
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
        accepted += 1
    return targets[: accepted + 1]


def _rejection(
    probs: torch.Tensor, start: int, drafts: list[int], q: Optional[torch.Tensor],
    generators: dict[int, torch.Generator], default: Optional[torch.Generator],
) -> list[int]:
    tokens: list[int] = []
    for j, draft in enumerate(drafts):
        row = start + j
        generator = generators.get(row, default)
        u = float(torch.rand((), generator=generator, device=probs.device))
        p_x = float(probs[row, draft])
        q_x = 1.0 if q is None else float(q[j, draft])
        if u * q_x < p_x:  # u < min(1, p / q), without dividing by a q that may be 0
            tokens.append(draft)
            continue
        residual = probs[row : row + 1].clone()
        if q is None:
            residual[0, draft] = 0.0
        else:
            residual = (residual - q[j : j + 1].to(residual.dtype)).clamp_(min=0.0)
        tokens.append(int(race_sample(residual, {}, generator)[0]))  # weights need no normalizing
        return tokens
    row = start + len(drafts)
    generator = generators.get(row, default)
    tokens.append(int(race_sample(probs[row : row + 1], {}, generator)[0]))
    return tokens
