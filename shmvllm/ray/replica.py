"""The Ray Data replica: a callable class that `map_batches` runs in a pool of actors, each
holding one `LLM` (its engine in a process of its own on the actor's node, over the rings).

A batch is a dict of numpy columns; the replica returns the same columns, row for row, plus
its output columns. Ray kills an actor's process group, its engine included, so each replica has
a janitor process (janitor.py) that unlinks its rings once it is gone.

If the engine dies the actor's process exits instead of raising: Ray then restarts the actor (max_restarts) and runs its unfinished batches again on the new one
(max_task_retries). An exception would only fail the batch, and a retry on the same actor would
find the same dead engine.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

import numpy as np

from shmvllm import envs
from shmvllm.engine.exceptions import EngineDeadError
from shmvllm.entrypoints.llm import LLM
from shmvllm.ray.config import (
    EMBED_COLUMNS,
    GENERATE_COLUMNS,
    PROMPT_COLUMN,
    PROMPT_TOKEN_IDS_COLUMN,
    ProcessorConfig,
    row_sampling_params,
)
from shmvllm.ray.janitor import Janitor
from shmvllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Batch = dict[str, np.ndarray]


class Replica:
    """One LLM per actor; `__call__` maps a batch. Subclasses say what a batch becomes."""

    output_columns: tuple[str, ...] = ()

    def __init__(self, config: ProcessorConfig) -> None:
        # The engine process inherits the environment: its torch runs as many threads as Ray
        # gave this replica CPUs.
        envs.set_omp_num_threads(config.num_cpus)
        # A Ray worker's own threads (gRPC, the core worker) run at any moment: a fork could copy
        # a lock one of them holds, so its engine starts as a fresh program (unless the env says).
        envs.set_default_engine_start("program")
        self.config = config
        self.llm: Optional[LLM] = None
        self.janitor: Optional[Janitor] = None  # set before starting it: __del__ calls close()
        self.janitor = Janitor()
        try:
            self.llm = LLM(config.model, task=config.task, **config.engine_args)
        except BaseException:
            self.close()
            raise

    def __call__(self, batch: Batch) -> Batch:
        clash = sorted(set(self.output_columns) & set(batch))
        if clash:
            raise ValueError(f"the input rows already have the output columns {clash}; rename them first.")
        num_rows = len(next(iter(batch.values()))) if batch else 0
        if num_rows == 0:
            return {**batch, **self.empty_columns()}
        try:
            columns = self.run(batch, num_rows)
        except EngineDeadError as exc:
            logger.error("the replica's engine died (%s): exiting so that Ray restarts this actor and retries", exc)
            self.close()
            os._exit(1)
        return {**batch, **columns}

    def run(self, batch: Batch, num_rows: int) -> Batch:
        raise NotImplementedError

    def empty_columns(self) -> Batch:
        raise NotImplementedError

    def close(self) -> None:
        llm, self.llm = self.llm, None
        if llm is not None:
            llm.shutdown()
        janitor, self.janitor = self.janitor, None
        if janitor is not None:  # the rings are unlinked: nothing left for it to do
            janitor.stop()

    def __del__(self) -> None:
        """Ray Data drops the UDF when it releases an actor gracefully: stop the engine then."""
        self.close()


def _prompts(batch: Batch, allow_token_ids: bool) -> list[Any]:
    if PROMPT_COLUMN in batch:
        prompts = list(batch[PROMPT_COLUMN])
        for i, prompt in enumerate(prompts):
            if not isinstance(prompt, str):
                raise TypeError(f"column {PROMPT_COLUMN!r} must hold str, got {type(prompt).__name__} in row {i} of the batch.")
        return prompts
    if allow_token_ids and PROMPT_TOKEN_IDS_COLUMN in batch:
        return [{"prompt_token_ids": [int(t) for t in ids]} for ids in batch[PROMPT_TOKEN_IDS_COLUMN]]
    wanted = f"{PROMPT_COLUMN!r}" + (f" or {PROMPT_TOKEN_IDS_COLUMN!r}" if allow_token_ids else "")
    raise ValueError(f"the rows need a {wanted} column; they have {sorted(batch)}.")


class GenerateReplica(Replica):
    output_columns = GENERATE_COLUMNS

    def __init__(self, config: ProcessorConfig) -> None:
        super().__init__(config)
        self.default_params: SamplingParams = config.default_sampling_params()

    def run(self, batch: Batch, num_rows: int) -> Batch:
        prompts = _prompts(batch, allow_token_ids=True)
        column = batch.get(self.config.sampling_params_column)
        params = [self.default_params] * num_rows if column is None else [
            row_sampling_params(self.default_params, row) for row in column
        ]
        assert self.llm is not None
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        failed = [(i, o.error) for i, o in enumerate(outputs) if o.error is not None]
        if failed:
            raise RuntimeError(f"the engine failed {len(failed)} rows of the batch, the first (row {failed[0][0]}): {failed[0][1]}")
        completions = [o.outputs[0] for o in outputs]
        return {
            "generated_text": np.array([c.text for c in completions], dtype=object),
            "generated_tokens": _ragged([c.token_ids for c in completions]),
            "num_input_tokens": np.array([len(o.prompt_token_ids or ()) for o in outputs], dtype=np.int64),
            "num_generated_tokens": np.array([len(c.token_ids) for c in completions], dtype=np.int64),
            "finish_reason": np.array([c.finish_reason for c in completions], dtype=object),
        }

    def empty_columns(self) -> Batch:
        return {
            "generated_text": np.array([], dtype=object),
            "generated_tokens": np.array([], dtype=object),
            "num_input_tokens": np.array([], dtype=np.int64),
            "num_generated_tokens": np.array([], dtype=np.int64),
            "finish_reason": np.array([], dtype=object),
        }


class EmbedReplica(Replica):
    output_columns = EMBED_COLUMNS

    def run(self, batch: Batch, num_rows: int) -> Batch:
        assert self.llm is not None
        outputs = self.llm.embed(_prompts(batch, allow_token_ids=False), use_tqdm=False)
        failed = [(i, o.error) for i, o in enumerate(outputs) if o.error is not None]
        if failed:
            raise RuntimeError(f"the engine failed {len(failed)} rows of the batch, the first (row {failed[0][0]}): {failed[0][1]}")
        return {
            "embeddings": np.stack([o.outputs.numpy() for o in outputs]),  # float32, no Python floats
            "num_input_tokens": np.array([len(o.prompt_token_ids) for o in outputs], dtype=np.int64),
        }

    def empty_columns(self) -> Batch:
        hidden = self.llm.llm_engine.config.model_config.hidden_size if self.llm is not None else 0
        return {"embeddings": np.empty((0, hidden), dtype=np.float32), "num_input_tokens": np.array([], dtype=np.int64)}


def _ragged(rows: list[list[int]]) -> np.ndarray:
    """An object column of int64 arrays, one per row (numpy would make a 2-D array of equal ones)."""
    column = np.empty(len(rows), dtype=object)
    for i, row in enumerate(rows):
        column[i] = np.asarray(row, dtype=np.int64)
    return column
