"""What `LLM.get_metrics()` returns: vLLM's metric names and reader types (`vllm.v1.metrics.reader`).

The engine's state and totals come from the engine process (its `get_stats` utility); token
counts, finish reasons and latencies from the frontend's finished requests.
"""

from __future__ import annotations

import bisect
from collections import Counter as _Tally
from dataclasses import dataclass, field
from typing import Any

# Upper bounds (seconds) of the latency histograms' buckets, as vLLM's.
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)


@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Vector(Metric):
    values: list[int]


@dataclass
class Histogram(Metric):
    count: int
    sum: float
    buckets: dict[str, int]  # upper bound -> cumulative count ("+Inf" is the count)


class _Buckets:
    """Observations counted into fixed upper bounds; renders as a cumulative Histogram."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def add(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def histogram(self, name: str, labels: dict[str, str]) -> Histogram:
        cumulative, running = {}, 0
        for bound, count in zip([*(str(float(b)) for b in self.bounds), "+Inf"], self.counts):
            running += count
            cumulative[bound] = running
        return Histogram(name, labels, count=running, sum=self.total, buckets=cumulative)


def _one_two_five(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit`: vLLM's bounds of its per-request token histograms."""
    bounds, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale > limit:
                return tuple(bounds)
            bounds.append(step * scale)
        scale *= 10


class FrontendStats:
    """Counts of the finished generation requests the frontend has seen."""

    def __init__(self, max_model_len: int) -> None:
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finish_reasons: _Tally[str] = _Tally()
        self.time_to_first_token = _Buckets(_LATENCY_BUCKETS)
        self.e2e_latency = _Buckets(_LATENCY_BUCKETS)
        # per finished sequence (each of n completions is one, as vLLM's child requests are)
        self.request_prompt_tokens = _Buckets(_one_two_five(max_model_len))
        self.request_generation_tokens = _Buckets(_one_two_five(max_model_len))

    def record_finished(self, output: Any, now: float) -> None:
        """A finished RequestOutput (its `metrics` set by the output processor)."""
        self.prompt_tokens += len(output.prompt_token_ids or ())
        for completion in output.outputs:
            self.generation_tokens += len(completion.token_ids)
            self.finish_reasons[str(completion.finish_reason)] += 1
            self.request_prompt_tokens.add(len(output.prompt_token_ids or ()))
            self.request_generation_tokens.add(len(completion.token_ids))
        stats = output.metrics
        if stats is not None and stats.arrival_time:
            if stats.first_token_ts:
                self.time_to_first_token.add(stats.first_token_latency)
            self.e2e_latency.add(now - stats.arrival_time)

    def snapshot(self, engine_stats: dict[str, Any], model_name: str) -> list[Metric]:
        labels = {"engine": "0", "model_name": model_name}
        metrics: list[Metric] = [
            Gauge("vllm:num_requests_running", labels, float(engine_stats.get("num_running_reqs", 0))),
            Gauge("vllm:num_requests_waiting", labels, float(engine_stats.get("num_waiting_reqs", 0))),
            Gauge("vllm:kv_cache_usage_perc", labels, float(engine_stats.get("kv_cache_usage", 0.0))),
            Counter("vllm:prefix_cache_queries", labels, int(engine_stats.get("prefix_cache_queries", 0))),
            Counter("vllm:prefix_cache_hits", labels, int(engine_stats.get("prefix_cache_hits", 0))),
            Counter("vllm:num_preemptions", labels, int(engine_stats.get("num_preemptions", 0))),
            Counter("vllm:prompt_tokens", labels, self.prompt_tokens),
            Counter("vllm:generation_tokens", labels, self.generation_tokens),
        ]
        spec = engine_stats.get("spec_decode")
        if spec is not None:  # speculative decoding is on
            for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
                metrics.append(Counter(f"vllm:spec_decode_{name}", labels, int(spec[name])))
            metrics.append(Vector("vllm:spec_decode_num_accepted_tokens_per_pos", labels,
                                  [int(n) for n in spec["num_accepted_tokens_per_pos"]]))
        for reason in ("stop", "length", "abort", "error"):
            metrics.append(Counter("vllm:request_success", {**labels, "finished_reason": reason},
                                   self.finish_reasons.get(reason, 0)))
        metrics.append(self.time_to_first_token.histogram("vllm:time_to_first_token_seconds", labels))
        metrics.append(self.e2e_latency.histogram("vllm:e2e_request_latency_seconds", labels))
        metrics.append(self.request_prompt_tokens.histogram("vllm:request_prompt_tokens", labels))
        metrics.append(self.request_generation_tokens.histogram("vllm:request_generation_tokens", labels))
        return metrics
