"""Worker: owns one device, the model runner on it, and the KV cache sizing for it."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Union

import torch

from shmvllm.config import EngineConfig
from shmvllm.core.sched.output import ModelRunnerOutput, SchedulerOutput
from shmvllm.worker.kv_budget import blocks_in_budget, cpu_kv_budget
from shmvllm.worker.model_runner import ModelRunner

if TYPE_CHECKING:
    from shmvllm.worker.pooling_runner import PoolingModelRunner

logger = logging.getLogger(__name__)


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
        if self.is_pooling:  # the first request's activations find their pages mapped
            self.model_runner.warm_up(self.config.scheduler_config.max_num_batched_tokens)

    def determine_num_kv_blocks(self) -> int:
        """The KV cache's block count: the num_kv_blocks override, else the memory budget
        (CPU: kv_cache_memory bytes; CUDA: gpu_memory_utilization after a profile run),
        capped at what max_num_seqs requests of max_model_len tokens could use."""
        cache = self.config.cache_config
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        if self.is_pooling:
            sched = self.config.scheduler_config
            return sched.max_num_seqs * -(-sched.max_model_len // cache.block_size)
        budget = self._cuda_kv_budget() if self.device.type == "cuda" else cpu_kv_budget(self.config)
        return blocks_in_budget(self.config, budget, self.model_runner.kv_cache_bytes_per_block())

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
