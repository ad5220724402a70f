"""Executor failures that end the engine (not just the step's requests)."""


class WorkerDeadError(RuntimeError):
    """A worker process of the executor died: the model is gone with its shard."""
