"""Verification of proposed tokens by the target model's logits.

Each request that samples has k + 1 consecutive logits rows (k >= 0 proposals): row j is the
target's distribution after proposal j - 1. Greedy requests keep the proposals while they equal
the target's argmax, then add the target's own token there (or, all accepted, the bonus token
from row k): the tokens are exactly those of greedy decoding without speculation. Random
requests use rejection sampling for a point-mass proposal (n-gram): proposal x at row j is
accepted with probability p_j(x); on rejection the token is drawn from p_j with x removed and
renormalized (max(p - q, 0) for q the point mass at x), so that every emitted token is
distributed as the target's (Leviathan et al., 2023). A seeded request draws each position's
randomness from the generator seeded by (seed, output index), as without speculation, so its
tokens are reproducible.
"""

from __future__ import annotations

from typing import Optional

import torch

from shmvllm.model.sampler import Sampler, SamplingMetadata, race_sample


def verify(
    sampler: Sampler, logits: torch.Tensor, meta: SamplingMetadata, proposals: list[list[int]]
) -> tuple[list[list[int]], Optional[torch.Tensor]]:
    """logits: [sum(len(p) + 1 for p in proposals), vocab], each request's rows consecutive; meta
    describes those rows. Returns each request's emitted tokens (1 to len(p) + 1 of them) and
    the raw logprobs of every row where any row asked for logprobs."""
    logits, raw_logprobs = sampler.process(logits, meta)
    greedy_rows = (meta.temperature < 1e-5).tolist()
    argmax = None if meta.all_random else logits.argmax(dim=-1).tolist()
    probs = None if meta.all_greedy else sampler.probabilities(logits, meta)
    emitted: list[list[int]] = []
    start = 0
    for drafts in proposals:
        if greedy_rows[start]:
            tokens = _greedy(argmax[start : start + len(drafts) + 1], drafts)
        else:
            tokens = _rejection(probs, start, drafts, meta.generators, sampler.generator)
        emitted.append(tokens)
        start += len(drafts) + 1
    return emitted, raw_logprobs


def _greedy(targets: list[int], drafts: list[int]) -> list[int]:
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
        accepted += 1
    return targets[: accepted + 1]


def _rejection(
    probs: torch.Tensor, start: int, drafts: list[int], generators: dict[int, torch.Generator],
    default: Optional[torch.Generator],
) -> list[int]:
    tokens: list[int] = []
    for j, draft in enumerate(drafts):
        row = start + j
        generator = generators.get(row, default)
        u = torch.rand((), generator=generator, device=probs.device)
        if float(u) < float(probs[row, draft]):
            tokens.append(draft)
            continue
        residual = probs[row : row + 1].clone()
        residual[0, draft] = 0.0
        tokens.append(int(race_sample(residual, {}, generator)[0]))
        return tokens
    row = start + len(drafts)
    generator = generators.get(row, default)
    tokens.append(int(race_sample(probs[row : row + 1], {}, generator)[0]))
    return tokens
