"""ProcessorConfig: what `build_processor` turns into a Ray Data stage, validated when built.

Everything that can be checked without a cluster is checked here, so that a wrong knob is a
ValueError/TypeError in the driver before any actor starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from shmvllm.engine.arg_utils import EngineArgs
from shmvllm.sampling_params import SamplingParams

# Output columns (ray.data.llm's names where it has one).
GENERATE_COLUMNS = ("generated_text", "generated_tokens", "num_input_tokens", "num_generated_tokens", "finish_reason")
EMBED_COLUMNS = ("embeddings", "num_input_tokens")
# The input columns a replica reads: text, or token ids in place of text (generate only).
PROMPT_COLUMN = "prompt"
PROMPT_TOKEN_IDS_COLUMN = "prompt_token_ids"


@dataclass
class ProcessorConfig:
    """One shmvllm `LLM` per Ray actor, `concurrency` actors, `batch_size` rows per call.

    model: a shmvllm model name, a local HF directory or a .gguf file; a path must exist on every
      node that runs a replica.
    task: "generate" (rows get GENERATE_COLUMNS) or "embed" (rows get EMBED_COLUMNS).
    engine_args: `LLM(model, **engine_args)` (EngineArgs' fields; not model or task).
    num_cpus: CPUs Ray reserves per replica; the engine runs that many torch threads
      (OMP_NUM_THREADS in the engine process).
    num_gpus: 0, or 1 for a replica whose engine runs on the GPU Ray assigns it.
    sampling_params: the default for every row (generate); a SamplingParams or a dict of its
      fields. A row's `sampling_params_column` (a dict of fields) overrides fields of it;
      None values in that dict (Arrow fills a struct's missing keys with null) keep the default.
    max_restarts / max_task_retries: Ray's actor options; -1 (unbounded) makes a replica whose
      engine died come back and its batches run again.
    runtime_env: passed to the replicas' actors (e.g. {"env_vars": {"PYTHONPATH": ...}}).
    """

    model: str
    task: Literal["generate", "embed"] = "generate"
    engine_args: dict[str, Any] = field(default_factory=dict)
    concurrency: int = 1
    batch_size: int = 64
    num_cpus: int = 1
    num_gpus: int = 0
    sampling_params: Union[SamplingParams, dict[str, Any], None] = None
    sampling_params_column: str = "sampling_params"
    max_restarts: int = -1
    max_task_retries: int = -1
    runtime_env: Optional[dict[str, Any]] = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a non-empty str, got {self.model!r}.")
        if self.task not in ("generate", "embed"):
            raise ValueError(f"task must be 'generate' or 'embed', got {self.task!r}.")
        if not isinstance(self.engine_args, dict):
            raise TypeError(f"engine_args must be a dict, got {type(self.engine_args).__name__}.")
        for name in ("model", "task"):
            if name in self.engine_args:
                raise ValueError(f"engine_args must not hold {name!r}; it is ProcessorConfig.{name}.")
        unknown = sorted(set(self.engine_args) - EngineArgs.field_names())
        if unknown:
            raise ValueError(f"engine_args has unknown engine arguments {unknown}; known: {sorted(EngineArgs.field_names())}.")
        for name in ("concurrency", "batch_size", "num_cpus"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}.")
        if self.num_gpus not in (0, 1) or isinstance(self.num_gpus, bool):
            raise ValueError(f"num_gpus must be 0 or 1 (one engine uses at most one GPU), got {self.num_gpus!r}.")
        if self.num_gpus and str(self.engine_args.get("device", "auto")).startswith("cpu"):
            raise ValueError(f"num_gpus=1 with engine_args device={self.engine_args['device']!r}: the GPU would sit idle.")
        for name in ("max_restarts", "max_task_retries"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < -1:
                raise ValueError(f"{name} must be an int >= -1 (-1: unbounded), got {value!r}.")
        if self.runtime_env is not None and not isinstance(self.runtime_env, dict):
            raise TypeError(f"runtime_env must be a dict, got {type(self.runtime_env).__name__}.")
        if not isinstance(self.sampling_params_column, str) or not self.sampling_params_column:
            raise ValueError(f"sampling_params_column must be a non-empty str, got {self.sampling_params_column!r}.")
        if self.task == "embed":
            if self.sampling_params is not None:
                raise ValueError("sampling_params is for task='generate'; an embedding run takes none.")
        else:
            self.sampling_params = row_sampling_params(self.default_sampling_params(), None)

    def default_sampling_params(self) -> SamplingParams:
        params = self.sampling_params
        if params is None:
            return SamplingParams()
        if isinstance(params, SamplingParams):
            return params
        if isinstance(params, dict):
            return SamplingParams(**params)
        raise TypeError(f"sampling_params must be a SamplingParams or a dict, got {type(params).__name__}.")


def row_sampling_params(default: SamplingParams, row: Optional[dict[str, Any]]) -> SamplingParams:
    """`default` with the row's non-None fields; one completion per row (n must be 1)."""
    import msgspec

    params = default
    if row is not None:
        if not isinstance(row, dict):
            raise TypeError(f"a row's sampling params must be a dict of SamplingParams fields, got {type(row).__name__}.")
        known = set(SamplingParams.__struct_fields__) - {"eos_token_id", "output_kind"}
        unknown = sorted(set(row) - known)
        if unknown:
            raise ValueError(f"a row's sampling params have unknown fields {unknown}; known: {sorted(known)}.")
        given = {k: _plain(v) for k, v in row.items() if v is not None}
        params = SamplingParams(**{**msgspec.structs.asdict(default), **given})
    if params.n != 1:
        raise ValueError(f"sampling_params n must be 1 (one output row per input row), got {params.n}.")
    return params


def _plain(value: Any) -> Any:
    """numpy scalars and arrays (how Ray hands struct fields over) as Python values."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return value
