"""UniProcExecutor: one Worker in the engine's own process."""

from __future__ import annotations

import logging
import time

from shmvllm.config import EngineConfig
from shmvllm.core.sched.output import ModelRunnerOutput, SchedulerOutput
from shmvllm.worker.worker import Worker

logger = logging.getLogger(__name__)


class UniProcExecutor:
    def __init__(self, config: EngineConfig) -> None:
        started = time.perf_counter()
        self.config = config
        self.worker = Worker(config)
        self.worker.init_device()
        self.worker.load_model()
        logger.info("Executor ready in %.2f s", time.perf_counter() - started)

    def determine_num_kv_blocks(self) -> int:
        return self.worker.determine_num_kv_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def shutdown(self) -> None:
        self.worker.shutdown()
