"""Batched sampling on the device: penalties, temperature, min-p, top-k/top-p, seeds, logprobs.

Order (vLLM's): logprobs come from the raw logits; then min_tokens masks the stop tokens,
penalties change the logits, greedy rows take the argmax; random rows divide by their
temperature, drop tokens under min_p x the top probability, keep their top-k / top-p set, and
draw with the exponential-race trick (argmax of probs / E, E ~ Exp(1)), which equals sampling
from probs. A seeded row draws E from its own generator seeded by (seed, output position), so
its tokens do not depend on the rest of the batch, nor on preemption.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from shmvllm.model.logits_processors import RequestLogitsProcessors, apply_request_logits_processors

_EPS = 1e-5
_MASK64 = (1 << 64) - 1


@dataclass
class SamplingMetadata:
    """What the sampler needs for `num_rows` rows of logits; None means "no row uses it"."""

    temperature: torch.Tensor  # [rows] float32; < _EPS means greedy
    all_greedy: bool
    all_random: bool
    top_k: Optional[torch.Tensor] = None  # [rows] int64; vocab_size means "off"
    top_p: Optional[torch.Tensor] = None  # [rows] float32; 1.0 means "off"
    min_p: Optional[torch.Tensor] = None  # [rows] float32; 0.0 means "off"
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # row -> seeded for this step
    presence_penalty: Optional[torch.Tensor] = None  # [rows]; penalties are all set, or all None
    frequency_penalty: Optional[torch.Tensor] = None
    repetition_penalty: Optional[torch.Tensor] = None
    output_token_ids: Optional[torch.Tensor] = None  # [rows, max_out] int64, padded with vocab_size
    prompt_token_ids: Optional[torch.Tensor] = None  # [rows, max_prompt] int64, padded with vocab_size
    stop_token_mask: list[tuple[int, list[int]]] = field(default_factory=list)  # min_tokens: row, ids
    max_num_logprobs: Optional[int] = None  # the widest top-k asked for (0: sampled token only)
    # allowed_token_ids, bad_words, logit_bias (logits_processors.py)
    request_processors: RequestLogitsProcessors = field(default_factory=RequestLogitsProcessors)


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [rows] int64
    logprob_token_ids: Optional[torch.Tensor] = None  # [rows, 1 + k]: sampled token, then top-k
    logprobs: Optional[torch.Tensor] = None  # [rows, 1 + k] float32
    ranks: Optional[torch.Tensor] = None  # [rows] int64: rank of the sampled token


def seeded_generator(seed: int, output_index: int, device: torch.device) -> torch.Generator:
    """A generator whose state depends only on (seed, output_index)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(_mix(seed, output_index))
    return generator


def _mix(seed: int, index: int) -> int:
    """splitmix64 of the pair: close inputs give unrelated seeds."""
    z = (seed * 0x9E3779B97F4A7C15 + index + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


class Sampler(torch.nn.Module):
    def __init__(self, generator: Optional[torch.Generator] = None) -> None:
        super().__init__()
        self.generator = generator  # for rows without a seed

    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """logits: [rows, vocab] float32 (modified in place)."""
        logits, raw_logprobs = self.process(logits, meta)
        sampled = self._sample(logits, meta)
        out = SamplerOutput(sampled_token_ids=sampled)
        if raw_logprobs is not None:
            out.logprob_token_ids, out.logprobs, out.ranks = gather_logprobs(raw_logprobs, sampled, meta.max_num_logprobs)
        return out

    @staticmethod
    def process(logits: torch.Tensor, meta: SamplingMetadata) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The logits the rows sample from (request processors, min_tokens, penalties applied),
        and the raw logprobs where any row asked for logprobs."""
        raw_logprobs = None
        if meta.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        if meta.request_processors:
            apply_request_logits_processors(logits, meta.request_processors)
        apply_min_tokens(logits, meta.stop_token_mask)
        if meta.repetition_penalty is not None:
            logits = apply_penalties(logits, meta)
        return logits, raw_logprobs

    @staticmethod
    def probabilities(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """The distribution a random row draws from: temperature, min-p, top-k / top-p, softmax."""
        temperature = torch.where(meta.temperature < _EPS, torch.ones_like(meta.temperature), meta.temperature)
        logits = logits / temperature.unsqueeze(1)
        if meta.min_p is not None:
            logits = apply_min_p(logits, meta.min_p)
        if meta.top_k is not None or meta.top_p is not None:
            logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
        return torch.softmax(logits, dim=-1)

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        greedy = None if meta.all_random else logits.argmax(dim=-1)
        if meta.all_greedy:
            return greedy
        probs = self.probabilities(logits, meta)
        random = race_sample(probs, meta.generators, self.generator)
        if greedy is None:
            return random
        return torch.where(meta.temperature < _EPS, greedy, random)


def apply_min_tokens(logits: torch.Tensor, stop_token_mask: list[tuple[int, list[int]]]) -> None:
    for row, token_ids in stop_token_mask:
        logits[row, token_ids] = float("-inf")


def _bin_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, n] ids padded with vocab_size -> [rows, vocab_size] counts."""
    counts = torch.zeros(token_ids.shape[0], vocab_size + 1, dtype=torch.int32, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=torch.int32))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Repetition (HF: over prompt and output; divide positive logits, multiply negative ones),
    then frequency and presence (OpenAI: over output tokens only)."""
    vocab_size = logits.shape[1]
    output_counts = _bin_counts(meta.output_token_ids, vocab_size)
    seen = (_bin_counts(meta.prompt_token_ids, vocab_size) > 0) | (output_counts > 0)
    rep = meta.repetition_penalty.unsqueeze(1)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    logits = logits - meta.frequency_penalty.unsqueeze(1) * output_counts
    return logits - meta.presence_penalty.unsqueeze(1) * (output_counts > 0)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: Optional[torch.Tensor], top_p: Optional[torch.Tensor]
) -> torch.Tensor:
    """Keeps each row's k most likely tokens, then the smallest set whose mass reaches p."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        ranks = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)
        sorted_logits = sorted_logits.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop = mass_before >= top_p.unsqueeze(1)
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def race_sample(
    probs: torch.Tensor, generators: dict[int, torch.Generator], default: Optional[torch.Generator]
) -> torch.Tensor:
    """argmax(probs / E) with E ~ Exp(1): a sample from each row's distribution."""
    noise = torch.empty_like(probs)
    noise.exponential_(generator=default)
    for row, generator in generators.items():
        noise[row].exponential_(generator=generator)
    # A zero draw would turn a masked token's 0 / 0 into NaN, which argmax picks.
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(dim=-1)


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[rows, vocab] logprobs -> ids and logprobs of `token_ids` then the top `num_top`, and the
    rank (1 = most likely) of `token_ids`."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    if num_top == 0:
        return token_ids.unsqueeze(1), chosen, ranks
    top_values, top_ids = logprobs.topk(num_top, dim=-1)
    return torch.cat((token_ids.unsqueeze(1), top_ids), 1), torch.cat((chosen, top_values), 1), ranks
