"""The configs the engine is built from (EngineArgs, in shmvllm.engine.arg_utils, makes them from what the
user passes): plain values, importing neither the engine nor the model."""

from __future__ import annotations

import json
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

from shmvllm.spec_decode.config import SpeculativeConfig

Task = Literal["generate", "embed"]


QUANTIZATIONS = (None, "gguf", "none", "q8_0")
"""EngineArgs.quantization: None (default) runs a GGUF file's weights as its GGML blocks (on
the CPU with fp32 activations; elsewhere dequantized) and a safetensors model as stored;
"gguf" insists on the blocks (error for a non-GGUF model); "none" dequantizes a GGUF file to
`dtype` at load (a full-precision copy of the weights, as before blocks were kept);
"q8_0" quantizes a safetensors model's linear weights to Q8_0 blocks at load."""


SEQ_POOLING_TYPES = ("CLS", "LAST", "MEAN")
# PoolerConfig fields shmvllm has no use for, each accepted only at its default (vLLM's meaning in the why).
_POOLER_REFUSED: dict[str, str] = {
    "enable_chunked_processing": "a prompt longer than max_model_len is refused, not embedded in chunks",
    "max_embed_len": "a prompt longer than max_model_len is refused, not embedded in chunks",
    "logit_mean": "classifier logits are not calibrated",
    "logit_sigma": "classifier logits are not calibrated",
    "logit_bias": "classifier logits are not calibrated",
    "logit_scale": "classifier logits are not calibrated",
    "step_tag_id": "shmvllm serves no process reward models",
    "returned_token_ids": "shmvllm serves no process reward models",
}


@dataclass
class PoolerConfig:
    """vLLM's PoolerConfig (`LLM(..., pooler_config=PoolerConfig(...) or a dict)`): which pooling
    task the model is bound to and how it pools. Honoured: task, pooling_type / seq_pooling_type
    ("CLS", "LAST", "MEAN"), tok_pooling_type ("ALL"), use_activation (embeddings: normalize;
    classifiers: the activation) and dimensions (the default Matryoshka truncation); vLLM's other
    fields are accepted at their defaults only, refused by name otherwise."""

    task: Optional[str] = None
    pooling_type: Optional[str] = None
    seq_pooling_type: Optional[str] = None
    tok_pooling_type: Optional[str] = None
    use_activation: Optional[bool] = None
    dimensions: Optional[int] = None
    enable_chunked_processing: bool = False
    max_embed_len: Optional[int] = None
    logit_mean: Optional[float] = None
    logit_sigma: Optional[float] = None
    logit_bias: Optional[float] = None
    logit_scale: Optional[float] = None
    step_tag_id: Optional[int] = None
    returned_token_ids: Optional[list[int]] = None

    def __post_init__(self) -> None:
        for name, why in _POOLER_REFUSED.items():
            value, default = getattr(self, name), PoolerConfig.__dataclass_fields__[name].default
            if value != default or isinstance(value, bool) != isinstance(default, bool):
                raise ValueError(f"pooler_config.{name}={value!r} is not supported: {why} (accepted: {default!r}).")
        if self.pooling_type is not None:
            # vLLM's convenience field: it fills seq_pooling_type or tok_pooling_type
            if self.seq_pooling_type is not None or self.tok_pooling_type is not None:
                raise ValueError("Cannot set both `pooling_type` and `seq_pooling_type` / `tok_pooling_type` "
                                 f"(pooler_config.pooling_type={self.pooling_type!r}).")
            if self.pooling_type in SEQ_POOLING_TYPES:
                self.seq_pooling_type = self.pooling_type
            else:
                self.tok_pooling_type = self.pooling_type
        if self.seq_pooling_type is not None and self.seq_pooling_type not in SEQ_POOLING_TYPES:
            raise ValueError(f"pooler_config.seq_pooling_type={self.seq_pooling_type!r} is not supported: "
                             f"one of {SEQ_POOLING_TYPES}.")
        if self.tok_pooling_type is not None and self.tok_pooling_type != "ALL":
            raise ValueError(f"pooler_config.tok_pooling_type={self.tok_pooling_type!r} is not supported: 'ALL' "
                             "(every token's vector; step pooling is for process reward models).")
        if self.use_activation is not None and not isinstance(self.use_activation, bool):
            raise TypeError(f"pooler_config.use_activation must be a bool or None, got {self.use_activation!r}.")
        if self.dimensions is not None and (
            not isinstance(self.dimensions, int) or isinstance(self.dimensions, bool) or self.dimensions < 1
        ):
            raise ValueError(f"pooler_config.dimensions must be a positive int or None, got {self.dimensions!r}.")
        if self.task is not None and not isinstance(self.task, str):
            raise TypeError(f"pooler_config.task must be a str or None, got {self.task!r}.")

    @classmethod
    def from_user(cls, value: Union["PoolerConfig", dict[str, Any], None], name: str = "pooler_config") -> Optional["PoolerConfig"]:
        """A PoolerConfig from what LLM(...) was given: one, a dict of its fields, or None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - {f.name for f in dataclasses.fields(cls)})
            if unknown:
                raise TypeError(f"{name} has unknown fields {unknown}; PoolerConfig's: "
                                f"{[f.name for f in dataclasses.fields(cls)]}.")
            return cls(**value)
        raise TypeError(f"{name} must be a PoolerConfig, a dict or None, got {type(value).__name__}.")


@dataclass
class ModelConfig:
    model: str  # what the user named
    model_dir: Path  # the local HF directory it resolved to
    hf_config: Any  # shmvllm.model.hf_config.HFConfig (transformers' config values)
    task: Task
    dtype: str  # "float32" | "float16" | "bfloat16"
    device: str  # "cpu" | "cuda" | "cuda:N"
    max_model_len: int
    seed: int = 0
    tokenizer_dir: Optional[Path] = None
    max_logprobs: int = 20  # the most logprobs a request may ask for; -1: the whole vocabulary
    skip_tokenizer_init: bool = False  # no tokenizer: prompts are token ids, outputs are not detokenized
    tokenizer_mode: str = "auto"  # "auto": the fast tokenizer; "slow": the Python one
    generation_config: str = "auto"  # where default sampling params come from ("vllm": none)
    override_generation_config: dict[str, Any] = field(default_factory=dict)
    quantization: Optional[str] = None  # see QUANTIZATIONS
    dense_out_features: Optional[int] = None  # a sentence-transformers model's last Dense layer's output size
    pooler_config: Optional[PoolerConfig] = None  # a pooling model's task and pooling, as the user set them

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.hf_config.hidden_size

    @property
    def embedding_size(self) -> int:
        """The length of a pooled embedding: the last sentence-transformers Dense layer's, or hidden_size."""
        return self.dense_out_features or self.hidden_size

    @property
    def is_embedding(self) -> bool:
        return self.task == "embed"

    # vLLM's ModelConfig accessors, for programs that read them.
    @property
    def runner_type(self) -> str:
        return "pooling" if self.is_embedding else "generate"

    @property
    def tokenizer(self) -> str:
        return str(self.tokenizer_dir or self.model_dir)

    def get_vocab_size(self) -> int:
        return self.vocab_size

    def get_hidden_size(self) -> int:
        return self.hidden_size

    def get_diff_sampling_param(self) -> dict[str, Any]:
        """The sampling defaults the model's generation config sets (vLLM's names): what
        `LLM.get_default_sampling_params` starts from. Only values that differ from transformers'
        GenerationConfig defaults (None) count, as in vLLM; "vllm" ignores the file."""
        config: dict[str, Any] = {}
        if self.generation_config != "vllm":
            folder = self.model_dir if self.generation_config == "auto" else Path(self.generation_config)
            if (folder / "generation_config.json").exists():
                config = json.loads((folder / "generation_config.json").read_text())
        config = {**config, **self.override_generation_config}
        diff = {name: config[name] for name in _GENERATION_SAMPLING if config.get(name) is not None}
        if "max_new_tokens" in diff:
            diff["max_tokens"] = diff.pop("max_new_tokens")
        return diff


# The generation_config.json values that become sampling defaults. The file is read as JSON
# (GenerationConfig would import transformers, and torch with it); transformers' own defaults for
# these are all None, so every value the file sets differs from them.
_GENERATION_SAMPLING = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")


@dataclass
class CacheConfig:
    block_size: int = 16
    kv_cache_memory: Optional[int] = None  # bytes, CPU; None: a default from free memory
    gpu_memory_utilization: float = 0.9  # CUDA: share of the device's memory the engine may use
    num_kv_blocks: Optional[int] = None  # overrides both budgets (tests use it)
    enable_prefix_caching: bool = True
    # prompts longer than this file their blocks apart: the model's rope rotates them by their
    # length (dynamic: under that length; longrope: all such prompts alike; model/rotary.py)
    rope_length_threshold: Optional[int] = None
    rope_length_exact: bool = True


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    policy: Literal["fcfs", "priority"] = "fcfs"
    async_scheduling: bool = False  # schedule step N+1 while step N runs (EngineCore, Scheduler)


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1  # stage processes, each with a share of the layers (executor/pipeline.py)
    data_parallel_size: int = 1  # engine processes, each a replica (shmvllm.engine.core_client.MPClient)


@dataclass
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    speculative_config: Optional[SpeculativeConfig] = None
    draft_model_config: Optional[ModelConfig] = None  # speculative_config's draft model (method 'draft_model')
