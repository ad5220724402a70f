"""Data parallel's share of the client (`MPClient` runs the N engines, `DPLoadBalancer` routes):
each engine's cores (`plan_cpus`) and how N engines' answers combine into one."""

from __future__ import annotations

import logging
import os
from typing import Any

from shmvllm import envs
from shmvllm.boundary.messages import EngineReady

logger = logging.getLogger(__name__)


def plan_cpus(num_engines: int) -> list[tuple[list[int], int]]:
    """Each engine's (cores, torch threads): this process's cores in N contiguous, as-equal shares,
    one torch thread per core (OMP_NUM_THREADS, if set, instead); fewer cores than engines: no
    pinning and one thread each."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    threads = envs.OMP_NUM_THREADS()
    if len(cores) < num_engines:
        logger.warning("%d engines on %d cores: they share the cores, one torch thread each", num_engines, len(cores))
        return [([], threads or 1)] * num_engines
    shares = [cores[i * len(cores) // num_engines:(i + 1) * len(cores) // num_engines] for i in range(num_engines)]
    return [(share, threads or len(share)) for share in shares]


def combine_ready(readies: list[EngineReady]) -> EngineReady:
    """The limits of N engines as one: what every engine allows (the smallest max_model_len,
    vocabulary, max_logprobs), and their KV caches together."""
    return EngineReady(
        num_kv_blocks=sum(r.num_kv_blocks for r in readies),
        block_size=readies[0].block_size,
        max_concurrency=sum(r.max_concurrency for r in readies),
        max_model_len=min(r.max_model_len for r in readies),
        vocab_size=min(r.vocab_size for r in readies),
        max_logprobs=min(r.max_logprobs for r in readies),
    )


def combine_stats(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """N engines' `get_stats` as one: counts and totals summed, KV usage over all blocks,
    and each engine's own under "engines"."""
    total: dict[str, Any] = {}
    for name, value in stats[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            total[name] = sum(s.get(name, 0) for s in stats)
        elif isinstance(value, dict):
            total[name] = {k: sum(s.get(name, {}).get(k, 0) for s in stats) for k, v in value.items()
                           if isinstance(v, (int, float)) and not isinstance(v, bool)}
            total[name].update({k: [sum(col) for col in zip(*(s.get(name, {}).get(k, v) for s in stats))]
                                for k, v in value.items() if isinstance(v, list)})  # per-position counts
    total["block_size"] = stats[0].get("block_size")
    blocks = total.get("num_kv_blocks") or 0
    if blocks:
        total["kv_cache_usage"] = sum(s.get("kv_cache_usage", 0.0) * s.get("num_kv_blocks", 0) for s in stats) / blocks
    total["engines"] = stats
    return total
