"""vLLM's task names (`vllm.tasks`), limited to the ones shmvllm serves."""

from __future__ import annotations

from typing import Literal, get_args

GenerationTask = Literal["generate"]
GENERATION_TASKS: tuple[str, ...] = get_args(GenerationTask)

PoolingTask = Literal["embed", "classify", "score", "token_embed"]
POOLING_TASKS: tuple[str, ...] = get_args(PoolingTask)

SupportedTask = Literal["generate", "embed", "classify", "score", "token_embed"]

__all__ = ["GenerationTask", "GENERATION_TASKS", "PoolingTask", "POOLING_TASKS", "SupportedTask"]
