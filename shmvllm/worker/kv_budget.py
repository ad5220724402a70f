"""How many KV-cache blocks a CPU engine gets: the rule, without torch, so that the engine
process can answer READY from its config before it imports torch and builds the model."""

from __future__ import annotations

import logging
import os

from shmvllm.config import EngineConfig

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_SHARE = 0.25  # of the available RAM, when kv_cache_memory is not given
DEFAULT_CPU_KV_CACHE_CAP = 4 * 2**30


def cpu_kv_budget(config: EngineConfig) -> int:
    """Bytes of KV cache for one CPU engine (one pipeline stage of it): kv_cache_memory, else
    min(DEFAULT_CPU_KV_CACHE_CAP, DEFAULT_CPU_KV_CACHE_SHARE of the available RAM)."""
    # pipeline stages split the engine's budget: together they hold what one process would
    stages = config.parallel_config.pipeline_parallel_size
    if config.cache_config.kv_cache_memory is not None:
        return config.cache_config.kv_cache_memory // stages
    # data-parallel engines share the default: together they take what one engine would
    engines = config.parallel_config.data_parallel_size
    return int(min(DEFAULT_CPU_KV_CACHE_CAP, DEFAULT_CPU_KV_CACHE_SHARE * available_ram()) / engines / stages)


def blocks_in_budget(config: EngineConfig, budget: int, per_block: int) -> int:
    """The blocks of `per_block` bytes that `budget` bytes hold, capped at what max_num_seqs
    requests of max_model_len tokens could use; ValueError where not one fits."""
    sched, block_size = config.scheduler_config, config.cache_config.block_size
    blocks_per_seq = -(-sched.max_model_len // block_size)
    num_blocks = min(budget // per_block, sched.max_num_seqs * blocks_per_seq)
    if num_blocks < 1:
        raise ValueError(
            f"the KV cache budget ({budget} bytes) holds no block of {per_block} bytes; "
            "raise kv_cache_memory or gpu_memory_utilization."
        )
    if num_blocks < blocks_per_seq:
        logger.warning(
            "KV cache of %d blocks cannot hold one request of max_model_len=%d tokens", num_blocks, sched.max_model_len,
        )
    return int(num_blocks)


def available_ram() -> int:
    """MemAvailable from /proc/meminfo, else free physical pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
