"""Worker: owns one device, the model runner on it, and the KV cache sizing for it."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Union

import torch

from shmvllm.config import EngineConfig
from shmvllm.core.sched.output import ModelRunnerOutput, SchedulerOutput
from shmvllm.worker.model_runner import ModelRunner

if TYPE_CHECKING:
    from shmvllm.worker.pooling_runner import PoolingModelRunner

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_SHARE = 0.25  # of the available RAM, when kv_cache_memory is not given
DEFAULT_CPU_KV_CACHE_CAP = 4 * 2**30


class Worker:
    """Runs generation (ModelRunner, paged KV cache) or embedding (PoolingModelRunner, no KV
    cache: its blocks are only the scheduler's bookkeeping) by the model config's task."""

    def __init__(self, config: EngineConfig, rank: int = 0) -> None:
        self.config = config
        self.rank = rank
        self.device = torch.device(config.model_config.device)
        self.is_pooling = config.model_config.is_embedding
        self.model_runner: Union[ModelRunner, "PoolingModelRunner"]
        if self.is_pooling:
            from shmvllm.worker.pooling_runner import PoolingModelRunner

            self.model_runner = PoolingModelRunner(config.model_config, self.device)
        else:
            self.model_runner = ModelRunner(config, self.device)

    def init_device(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        torch.manual_seed(self.config.model_config.seed)
        logger.info("Worker %d on %s (%d torch threads)", self.rank, self.device, torch.get_num_threads())

    def load_model(self) -> None:
        self.model_runner.load_model()

    def determine_num_kv_blocks(self) -> int:
        """The KV cache's block count: the num_kv_blocks override, else the memory budget
        (CPU: kv_cache_memory bytes; CUDA: gpu_memory_utilization after a profile run),
        capped at what max_num_seqs requests of max_model_len tokens could use."""
        cache = self.config.cache_config
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        sched = self.config.scheduler_config
        blocks_per_seq = -(-sched.max_model_len // cache.block_size)
        if self.is_pooling:
            return sched.max_num_seqs * blocks_per_seq
        per_block = self.model_runner.kv_cache_bytes_per_block()
        budget = self._cuda_kv_budget() if self.device.type == "cuda" else self._cpu_kv_budget()
        num_blocks = min(budget // per_block, sched.max_num_seqs * blocks_per_seq)
        if num_blocks < 1:
            raise ValueError(
                f"the KV cache budget ({budget} bytes) holds no block of {per_block} bytes; "
                "raise kv_cache_memory or gpu_memory_utilization."
            )
        if num_blocks < blocks_per_seq:
            logger.warning(
                "KV cache of %d blocks cannot hold one request of max_model_len=%d tokens",
                num_blocks, sched.max_model_len,
            )
        return int(num_blocks)

    def _cpu_kv_budget(self) -> int:
        # pipeline stages split the engine's budget: together they hold what one process would
        stages = self.config.parallel_config.pipeline_parallel_size
        if self.config.cache_config.kv_cache_memory is not None:
            return self.config.cache_config.kv_cache_memory // stages
        # data-parallel engines share the default: together they take what one engine would
        engines = self.config.parallel_config.data_parallel_size
        return int(min(DEFAULT_CPU_KV_CACHE_CAP, DEFAULT_CPU_KV_CACHE_SHARE * _available_ram()) / engines / stages)

    def _cuda_kv_budget(self) -> int:
        started = time.perf_counter()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.model_runner.profile_run()
        torch.cuda.synchronize(self.device)
        peak_extra = torch.cuda.max_memory_allocated(self.device) - torch.cuda.memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        budget = int(total * self.config.cache_config.gpu_memory_utilization) - (total - free) - peak_extra
        logger.info(
            "Profile run in %.2f s: activation peak %.1f MiB, KV budget %.1f MiB",
            time.perf_counter() - started, peak_extra / 2**20, budget / 2**20,
        )
        torch.cuda.empty_cache()
        return max(budget, 0)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        if not self.is_pooling:
            self.model_runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        self.model_runner.model = None
        if not self.is_pooling:
            self.model_runner.kv_cache = None
            self.model_runner.drafter = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _available_ram() -> int:
    """MemAvailable from /proc/meminfo, else free physical pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
