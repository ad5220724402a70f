"""EngineArgs (what the user passes to `LLM(...)`) and the configs the engine is built from."""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

logger = logging.getLogger(__name__)

Task = Literal["generate", "embed"]

_DTYPES = ("auto", "float32", "float16", "bfloat16")


@dataclass
class ModelConfig:
    model: str  # what the user named
    model_dir: Path  # the local HF directory it resolved to
    hf_config: Any  # transformers.PretrainedConfig
    task: Task
    dtype: str  # "float32" | "float16" | "bfloat16"
    device: str  # "cpu" | "cuda" | "cuda:N"
    max_model_len: int
    seed: int = 0
    tokenizer_dir: Optional[Path] = None

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.hf_config.hidden_size

    @property
    def is_embedding(self) -> bool:
        return self.task == "embed"


@dataclass
class CacheConfig:
    block_size: int = 16
    kv_cache_memory: Optional[int] = None  # bytes, CPU; None: a default from free memory
    gpu_memory_utilization: float = 0.9  # CUDA: share of the device's memory the engine may use
    num_kv_blocks: Optional[int] = None  # overrides both budgets (tests use it)
    enable_prefix_caching: bool = True


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    policy: Literal["fcfs", "priority"] = "fcfs"


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1


@dataclass
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig


@dataclass
class EngineArgs:
    """Every knob of `LLM(model=..., **engine_args)`, with vLLM's names."""

    model: str = "smollm2-135m-instruct"
    tokenizer: Optional[str] = None
    task: Literal["auto", "generate", "embed"] = "auto"
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    max_model_len: Optional[int] = None
    block_size: int = 16
    kv_cache_memory: Optional[int] = None
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: Optional[int] = None
    enable_prefix_caching: bool = True
    max_num_batched_tokens: Optional[int] = None  # None: 2048 (generate) or 16384 (embed)
    max_num_seqs: Optional[int] = None  # None: 128 (generate) or 1024 (embed)
    enable_chunked_prefill: bool = True
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    tensor_parallel_size: int = 1
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)} - {"extra"}

    def create_engine_config(self) -> EngineConfig:
        self._verify()
        from transformers import AutoConfig

        from shmvllm.model.registry import resolve_model_dir

        model_dir = resolve_model_dir(self.model)
        hf_config = AutoConfig.from_pretrained(model_dir)
        task = self.task if self.task != "auto" else detect_task(model_dir, hf_config)
        device = self.device if self.device != "auto" else _default_device()
        dtype = self.dtype if self.dtype != "auto" else _default_dtype(device, hf_config)
        max_model_len = _resolve_max_model_len(self.max_model_len, hf_config, model_dir)
        model_config = ModelConfig(
            model=self.model,
            model_dir=model_dir,
            hf_config=hf_config,
            task=task,
            dtype=dtype,
            device=device,
            max_model_len=max_model_len,
            seed=self.seed,
            tokenizer_dir=Path(self.tokenizer) if self.tokenizer else model_dir,
        )
        max_batched, max_num_seqs = _scheduler_limits(
            self.max_num_batched_tokens, self.max_num_seqs, task, max_model_len, self.enable_chunked_prefill
        )
        if not self.enable_chunked_prefill and max_batched < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({max_batched}) must be at least max_model_len ({max_model_len}) "
                "when enable_chunked_prefill is False."
            )
        return EngineConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size,
                kv_cache_memory=self.kv_cache_memory,
                gpu_memory_utilization=self.gpu_memory_utilization,
                num_kv_blocks=self.num_kv_blocks,
                enable_prefix_caching=self.enable_prefix_caching,
            ),
            scheduler_config=SchedulerConfig(
                max_num_batched_tokens=max_batched,
                max_num_seqs=max_num_seqs,
                max_model_len=max_model_len,
                enable_chunked_prefill=self.enable_chunked_prefill,
                policy=self.scheduling_policy,
            ),
            parallel_config=ParallelConfig(tensor_parallel_size=self.tensor_parallel_size),
        )

    def _verify(self) -> None:
        if self.task not in ("auto", "generate", "embed"):
            raise ValueError(f"task must be 'auto', 'generate' or 'embed', got {self.task!r}.")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}.")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}.")
        for name in ("max_model_len", "kv_cache_memory", "num_kv_blocks", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int, got {value!r}.")
        if self.max_num_seqs is not None and (not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1):
            raise ValueError(f"max_num_seqs must be a positive int, got {self.max_num_seqs!r}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}.")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}.")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}.")


# Embedding steps are one whole pass over short prompts with no KV cache kept: larger steps mean
# fewer, larger GEMMs (benchmarks/embed.py: 16384 tokens is ~3% faster than 8192, 2048 far slower).
_EMBED_MAX_NUM_BATCHED_TOKENS = 16384
_EMBED_MAX_NUM_SEQS = 1024
_GENERATE_MAX_NUM_SEQS = 128


def _scheduler_limits(
    max_num_batched_tokens: Optional[int],
    max_num_seqs: Optional[int],
    task: Task,
    max_model_len: int,
    chunked_prefill: bool,
) -> tuple[int, int]:
    """The task's defaults for what the user left unset. A pooling prompt is never split, so the
    embed budget also covers the longest prompt; so does generation's without chunked prefill."""
    if task == "embed":
        default_batched, default_seqs = max(_EMBED_MAX_NUM_BATCHED_TOKENS, max_model_len), _EMBED_MAX_NUM_SEQS
    else:
        default_batched = 2048 if chunked_prefill else max(2048, max_model_len)
        default_seqs = _GENERATE_MAX_NUM_SEQS
    return (
        max_num_batched_tokens if max_num_batched_tokens is not None else default_batched,
        max_num_seqs if max_num_seqs is not None else default_seqs,
    )


def detect_task(model_dir: Path, hf_config: Any) -> Task:
    """Embedding if the directory is a sentence-transformers model or an encoder-only one."""
    if (model_dir / "modules.json").exists() or (model_dir / "1_Pooling").is_dir():
        return "embed"
    architectures = getattr(hf_config, "architectures", None) or []
    if any(a.endswith("ForCausalLM") for a in architectures):
        return "generate"
    if getattr(hf_config, "model_type", "") in ("bert", "roberta", "xlm-roberta"):
        return "embed"
    return "generate"


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _default_dtype(device: str, hf_config: Any) -> str:
    if device.startswith("cpu"):
        return "float32"
    configured = str(getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or "")
    return "bfloat16" if "bfloat16" in configured or "float32" in configured or not configured else "float16"


def _resolve_max_model_len(requested: Optional[int], hf_config: Any, model_dir: Path) -> int:
    limit = getattr(hf_config, "max_position_embeddings", None) or 2048
    st_config = model_dir / "sentence_bert_config.json"
    if st_config.exists():
        limit = min(limit, json.loads(st_config.read_text()).get("max_seq_length", limit))
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(f"max_model_len ({requested}) is larger than the model's limit ({limit}).")
    return requested
