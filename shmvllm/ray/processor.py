"""build_processor: a ProcessorConfig as a `Dataset -> Dataset` stage of a Ray Data pipeline."""

from __future__ import annotations

from typing import Any

try:
    import ray.data
except ImportError as exc:  # the extra is not installed
    raise ImportError("shmvllm.ray needs Ray Data: pip install 'shmvllm[ray]'") from exc

from shmvllm.ray.config import ProcessorConfig
from shmvllm.ray.replica import EmbedReplica, GenerateReplica


class Processor:
    """`processor(ds)` is `ds` with the output columns added, by `config.concurrency` replicas.

    Lazy like every Ray Data transform: replicas start when the result is consumed. The rows
    keep every input column, so a row is identified by its own columns whatever the order; the
    output comes in input order when the dataset's DataContext has
    `execution_options.preserve_order = True` (Ray's default lets faster blocks overtake).
    """

    def __init__(self, config: ProcessorConfig) -> None:
        if not isinstance(config, ProcessorConfig):
            raise TypeError(f"build_processor takes a ProcessorConfig, got {type(config).__name__}.")
        self.config = config

    def __call__(self, ds: ray.data.Dataset) -> ray.data.Dataset:
        config = self.config
        return ds.map_batches(
            GenerateReplica if config.task == "generate" else EmbedReplica,
            fn_constructor_kwargs={"config": config},
            batch_size=config.batch_size,
            batch_format="numpy",
            compute=ray.data.ActorPoolStrategy(size=config.concurrency),
            num_cpus=config.num_cpus,
            num_gpus=config.num_gpus,
            runtime_env=config.runtime_env,
            **self._restart_options(),
        )

    def _restart_options(self) -> dict[str, Any]:
        """max_restarts / max_task_retries where they differ from Ray Data's own default for an
        actor pool (-1 and -1: ActorPoolMapOperator._apply_default_remote_args). Ray 2.60 has no
        named parameter for them and warns that `**ray_remote_args` is deprecated, so the
        default path passes nothing."""
        config = self.config
        return {name: getattr(config, name) for name in ("max_restarts", "max_task_retries") if getattr(config, name) != -1}


def build_processor(config: ProcessorConfig) -> Processor:
    """The Ray Data stage for `config` (vLLM's `build_llm_processor` with shmvllm engines)."""
    return Processor(config)
