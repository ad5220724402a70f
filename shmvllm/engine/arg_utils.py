"""EngineArgs: what the user passes to `LLM(...)` (vLLM's names), checked and turned into an
EngineConfig against the model's config before anything is written or started."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional

from shmvllm.compat.vllm_args import BY_NAME as _VLLM_ONLY_ARGS
from shmvllm.compat.vllm_args import VllmArgs, check_vllm_args
from shmvllm.config import QUANTIZATIONS, CacheConfig, EngineConfig, ModelConfig, ParallelConfig, PoolerConfig, SchedulerConfig, Task
from shmvllm.engine.validation import check_against_model, check_engine_args, check_kv_budget
from shmvllm.model.encoders import is_classifier, pooling_tasks
from shmvllm.model.hf_config import HFConfig
from shmvllm.model.models import check_causal_lm_dir, decoder_architecture, gguf_kv_config
from shmvllm.model.registry import ModelSource, locate_model
from shmvllm.model.st_config import dense_out_features
from shmvllm.spec_decode.config import SpeculativeConfig

logger = logging.getLogger(__name__)

_DTYPES = ("auto", "float32", "float16", "bfloat16")
# vLLM's other spellings of the dtypes.
_DTYPE_ALIASES = {"half": "float16", "float": "float32", "fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
_TASK_ALIASES = {"embedding": "embed"}


@dataclass
class EngineArgs(VllmArgs):
    """Every knob of `LLM(model=..., **engine_args)`, with vLLM's names.

    The fields below are what shmvllm implements; the inherited ones (shmvllm.compat.vllm_args)
    are the rest of vLLM's engine arguments, accepted at any value where they make no difference
    here and refused with a ValueError naming them where they ask for what shmvllm lacks.
    """

    model: str = "smollm2-135m-instruct"
    tokenizer: Optional[str] = None
    task: Optional[str] = "auto"  # "auto" | "generate" | "embed" (vLLM's older spelling of runner)
    runner: str = "auto"  # "auto" | "generate" | "pooling"
    convert: str = "auto"  # "auto" | "none" | "embed" (only for a model that embeds already)
    dtype: str = "auto"  # also vLLM's "half", "float"
    quantization: Optional[str] = None  # see QUANTIZATIONS
    device: str = "auto"
    seed: Optional[int] = 0
    max_model_len: Optional[int] = None
    block_size: Optional[int] = 16
    kv_cache_memory: Optional[int] = None
    kv_cache_memory_bytes: Optional[int] = None  # vLLM's name of kv_cache_memory
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: Optional[int] = None
    num_gpu_blocks_override: Optional[int] = None  # vLLM's name of num_kv_blocks
    enable_prefix_caching: Optional[bool] = True
    max_num_batched_tokens: Optional[int] = None  # None: 2048 (generate) or 16384 (embed)
    max_num_seqs: Optional[int] = None  # None: 128 (generate) or 1024 (embed)
    enable_chunked_prefill: Optional[bool] = True
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1  # N > 1: the layers split over N stage processes (executor/pipeline.py)
    data_parallel_size: int = 1  # N > 1: N engine processes, each on cores / N cores (MPClient)
    max_logprobs: int = 20
    skip_tokenizer_init: bool = False
    tokenizer_mode: str = "auto"  # "auto" | "hf" | "slow"
    generation_config: str = "auto"  # "auto" | "vllm" | a folder holding generation_config.json
    override_generation_config: Optional[dict[str, Any]] = None
    speculative_config: Optional[dict[str, Any]] = None  # {"method": "ngram", "num_speculative_tokens": k, ...}
    pooler_config: Optional[Any] = None  # a PoolerConfig or a dict of its fields (pooling models)
    async_scheduling: bool = False  # schedule step N+1 while step N runs (generation only)
    override_pooler_config: Optional[Any] = None  # vLLM's older name of pooler_config

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """One --flag per field (vLLM's spelling: --max-model-len), defaults as the fields'."""
        hints = typing.get_type_hints(cls)
        group = parser.add_argument_group("EngineArgs")
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            flag = "--" + f.name.lstrip("_").replace("_", "-")
            kind = _VLLM_ONLY_ARGS[f.name].cli_type if f.name in _VLLM_ONLY_ARGS else _cli_type(hints[f.name])
            if kind is bool:
                group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default)
            else:
                group.add_argument(flag, dest=f.name, type=_nullable(kind), default=default)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        return cls(**{name: getattr(args, name) for name in cls.field_names() if hasattr(args, name)})

    def create_engine_config(self) -> EngineConfig:
        check_engine_args(self)
        self._verify()
        speculative = SpeculativeConfig.from_user(self.speculative_config)
        source = locate_model(self.model)  # refuses a GGUF file's unsupported architecture
        model_dir = source.model_dir
        device = self.device if self.device != "auto" else _default_device()
        block_size = self.block_size if self.block_size is not None else 16
        kv_cache_memory = self.kv_cache_memory if self.kv_cache_memory is not None else self.kv_cache_memory_bytes
        num_kv_blocks = self.num_kv_blocks if self.num_kv_blocks is not None else self.num_gpu_blocks_override
        header = gguf_kv_config(source.gguf_file) if not source.converted and kv_cache_memory is not None else None
        if header is not None:  # a GGUF file's first start: the KV budget from its header, before its config is converted
            dtype = _DTYPE_ALIASES.get(self.dtype, self.dtype)
            check_kv_budget(kv_cache_memory, num_kv_blocks, block_size, HFConfig(header),
                            "float32" if dtype == "auto" else dtype, device, self.tensor_parallel_size)
        check_causal_lm_dir(model_dir)  # from config.json alone, before a config is built
        hf_config = source.hf_config()
        task = self._task(model_dir, hf_config)
        if task == "generate":
            decoder_architecture(hf_config)  # an unsupported model is refused here, before the engine starts
            if getattr(hf_config, "use_bidirectional_attention", False):
                raise ValueError(f"model {self.model!r} has use_bidirectional_attention=True: it embeds (task='embed'), "
                                 "it does not generate.")
        dtype = _DTYPE_ALIASES.get(self.dtype, self.dtype)
        dtype = dtype if dtype != "auto" else _default_dtype(device, hf_config, task)
        max_model_len = _resolve_max_model_len(self.max_model_len, hf_config, model_dir)
        model_config = ModelConfig(
            model=self.model,
            model_dir=model_dir,
            hf_config=hf_config,
            task=task,
            dtype=dtype,
            device=device,
            max_model_len=max_model_len,
            seed=self.seed if self.seed is not None else 0,
            tokenizer_dir=Path(self.tokenizer) if self.tokenizer else model_dir,
            max_logprobs=self.max_logprobs,
            skip_tokenizer_init=self.skip_tokenizer_init,
            tokenizer_mode=self.tokenizer_mode,
            generation_config=self.generation_config,
            override_generation_config=dict(self.override_generation_config or {}),
            quantization=self.quantization,
            dense_out_features=dense_out_features(model_dir),
            pooler_config=self._pooler_config(task, hf_config, model_dir),
        )
        _verify_quantization(self.quantization, source, task)
        if speculative is not None and task != "generate":
            raise ValueError(f"speculative_config={self.speculative_config!r} applies to generation only, not to task {task!r}.")
        draft_config, draft_source = None, None
        if speculative is not None and speculative.uses_draft_model:
            draft_config, draft_source = self._draft_model_config(speculative, model_config)
        _verify_tensor_parallel(self.tensor_parallel_size, task, hf_config, device)
        self._verify_pipeline_parallel(task, hf_config, device, speculative)
        chunked_prefill = self.enable_chunked_prefill is not False
        max_batched, max_num_seqs = _scheduler_limits(
            self.max_num_batched_tokens, self.max_num_seqs, task, max_model_len, chunked_prefill
        )
        if not chunked_prefill and max_batched < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({max_batched}) must be at least max_model_len ({max_model_len}) "
                "when enable_chunked_prefill is False."
            )
        config = EngineConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=block_size,
                kv_cache_memory=kv_cache_memory,
                gpu_memory_utilization=self.gpu_memory_utilization,
                num_kv_blocks=num_kv_blocks,
                enable_prefix_caching=self.enable_prefix_caching is not False,
                rope_length_threshold=_rope_length_threshold(hf_config, max_model_len),
                rope_length_exact=(getattr(hf_config, "rope_parameters", None) or {}).get("rope_type") == "dynamic",
            ),
            scheduler_config=SchedulerConfig(
                max_num_batched_tokens=max_batched,
                max_num_seqs=max_num_seqs,
                max_model_len=max_model_len,
                enable_chunked_prefill=chunked_prefill,
                policy=self.scheduling_policy,
                async_scheduling=self._async_scheduling(task, speculative),
            ),
            parallel_config=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size, pipeline_parallel_size=self.pipeline_parallel_size,
                data_parallel_size=self.data_parallel_size,
            ),
            speculative_config=speculative,
            draft_model_config=draft_config,
        )
        check_against_model(config, source)
        if draft_source is not None:
            check_against_model(dataclasses.replace(config, model_config=draft_config), draft_source)
            draft_source.store()
        source.store()  # only now: a refused start leaves the cache as it was
        return config

    def _draft_model_config(self, speculative: SpeculativeConfig, target: ModelConfig) -> tuple[ModelConfig, ModelSource]:
        """The draft model's config from speculative_config's `model`, checked against the target: a decoder
        of the same vocabulary, positions for the target's max_model_len, one rank."""
        if self.tensor_parallel_size != 1:
            raise ValueError(
                f"speculative_config['method']='draft_model' with tensor_parallel_size={self.tensor_parallel_size} "
                "is not supported (the draft and the target run on one rank)."
            )
        if speculative.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"speculative_config['quantization'] must be one of {QUANTIZATIONS}, got {speculative.quantization!r}."
            )
        source = locate_model(speculative.model)
        check_causal_lm_dir(source.model_dir)
        hf_config = source.hf_config()
        decoder_architecture(hf_config)
        if hf_config.vocab_size != target.vocab_size:
            raise ValueError(
                f"speculative_config['model']={speculative.model!r} has vocab_size {hf_config.vocab_size}, the target "
                f"{target.model!r} has {target.vocab_size}: a draft model must share the target's tokenizer."
            )
        draft_len = _resolve_max_model_len(None, hf_config, source.model_dir)
        if draft_len < target.max_model_len:
            raise ValueError(
                f"speculative_config['model']={speculative.model!r} holds {draft_len} positions, fewer than the "
                f"target's max_model_len={target.max_model_len}: lower max_model_len or pick a longer draft."
            )
        _verify_quantization(speculative.quantization, source, "generate")
        draft = dataclasses.replace(
            target, model=speculative.model, model_dir=source.model_dir, hf_config=hf_config,
            tokenizer_dir=source.model_dir, quantization=speculative.quantization, dense_out_features=None,
        )
        return draft, source

    def _task(self, model_dir: Path, hf_config: Any) -> Task:
        """The task from task / runner / convert, checked against what the model is."""
        detected = detect_task(model_dir, hf_config)
        task = _TASK_ALIASES.get(self.task or "auto", self.task or "auto")
        wanted = {"generate": "generate", "pooling": "embed"}.get(self.runner)
        if self.convert == "embed":
            if detected != "embed":
                raise ValueError(
                    f"convert='embed' is not supported for model {self.model!r}: shmvllm embeds with "
                    "encoder (BERT-family) models only and does not turn a generative model into one."
                )
            wanted = "embed"
        if task != "auto":
            if wanted is not None and wanted != task:
                raise ValueError(f"task={self.task!r} contradicts runner={self.runner!r} / convert={self.convert!r}.")
            wanted = task
        return wanted or detected

    def _verify_pipeline_parallel(
        self, task: Task, hf_config: Any, device: str, speculative: Optional[SpeculativeConfig]
    ) -> None:
        """What pipeline parallelism (executor/pipeline.py) does not combine with, refused by name."""
        pp = self.pipeline_parallel_size
        if pp == 1:
            return
        if device != "cpu":
            raise ValueError(f"pipeline_parallel_size={pp} runs on the CPU only; device={device!r} is not supported.")
        if task != "generate":
            raise ValueError(f"pipeline_parallel_size={pp} is not supported for task {task!r}: only decoders are split.")
        if self.data_parallel_size != 1:
            raise ValueError(f"pipeline_parallel_size={pp} with data_parallel_size={self.data_parallel_size} is not "
                             "supported: one engine holds the pipeline.")
        if speculative is not None:
            raise ValueError(f"pipeline_parallel_size={pp} is not supported with speculative_config={self.speculative_config!r}.")
        if self.async_scheduling:
            raise ValueError(f"pipeline_parallel_size={pp} with async_scheduling=True is not supported: the stages "
                             "already keep one micro-batch each in flight.")
        layers = getattr(hf_config, "num_hidden_layers", 0) or 0
        if layers < pp:
            raise ValueError(f"pipeline_parallel_size={pp} is more than the model's num_hidden_layers={layers}: "
                             "every stage needs at least one layer.")

    def _async_scheduling(self, task: Task, speculative: Optional[SpeculativeConfig]) -> bool:
        if self.async_scheduling and task != "generate":
            raise ValueError(f"async_scheduling=True applies to generation; model {self.model!r} runs task {task!r}.")
        if self.async_scheduling and speculative is not None:
            # a step's proposals are drawn from the tokens the step before it sampled
            raise ValueError(f"async_scheduling=True is not supported with speculative_config={self.speculative_config!r}.")
        return self.async_scheduling

    def _pooler_config(self, task: Task, hf_config: Any, model_dir: Path) -> Optional[PoolerConfig]:
        """pooler_config (or its older name) checked against the model: a task it has, pooling
        options that apply to it."""
        if self.pooler_config is not None and self.override_pooler_config is not None:
            raise ValueError("pooler_config and override_pooler_config (its older name) are both set: set one.")
        name = "pooler_config" if self.override_pooler_config is None else "override_pooler_config"
        config = PoolerConfig.from_user(getattr(self, name), name)
        if config is None:
            return None
        if task != "embed":
            raise ValueError(f"{name}={config!r} is for pooling models; model {self.model!r} runs task {task!r}.")
        tasks = tuple(t for t in pooling_tasks(hf_config) if t != "score")  # "score" is no vLLM pooling task
        if config.task is not None and config.task not in tasks:
            raise ValueError(f"Unsupported task: {config.task!r} Supported tasks: {tasks} ({name}.task of model {self.model!r}).")
        if is_classifier(hf_config):
            for field_name in ("seq_pooling_type", "tok_pooling_type", "dimensions"):
                if getattr(config, field_name) is not None:
                    raise ValueError(f"{name}.{field_name}={getattr(config, field_name)!r} is for embedding models; "
                                     f"model {self.model!r} is a classifier (its head pools as the model does).")
        embedding_size = dense_out_features(model_dir) or hf_config.hidden_size
        if config.dimensions is not None and config.dimensions > embedding_size:
            raise ValueError(f"{name}.dimensions must be at most the model's embedding size {embedding_size}, "
                             f"got {config.dimensions}.")
        return config

    def _verify(self) -> None:
        own = set(EngineArgs.__annotations__)  # a knob shmvllm implements itself has its own checks
        check_vllm_args({f.name: getattr(self, f.name) for f in dataclasses.fields(VllmArgs) if f.name not in own})
        task = _TASK_ALIASES.get(self.task or "auto", self.task or "auto")
        if task not in ("auto", "generate", "embed"):
            raise ValueError(f"task must be 'auto', 'generate' or 'embed', got {self.task!r}.")
        if self.runner not in ("auto", "generate", "pooling"):
            raise ValueError(f"runner must be 'auto', 'generate' or 'pooling', got {self.runner!r}.")
        if self.convert not in ("auto", "none", "embed"):
            raise ValueError(
                f"convert={self.convert!r} is not supported: 'auto', 'none', or 'embed' (for a model that embeds already)."
            )
        if _DTYPE_ALIASES.get(self.dtype, self.dtype) not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES + tuple(_DTYPE_ALIASES)}, got {self.dtype!r}.")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}.")
        if self.tokenizer_mode not in ("auto", "hf", "slow"):
            raise ValueError(f"tokenizer_mode={self.tokenizer_mode!r} is not supported: 'auto', 'hf' or 'slow'.")
        if not isinstance(self.max_logprobs, int) or isinstance(self.max_logprobs, bool) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be an int >= 0, or -1 (the whole vocabulary), got {self.max_logprobs!r}.")
        if self.override_generation_config is not None and not isinstance(self.override_generation_config, dict):
            raise ValueError(f"override_generation_config must be a dict, got {self.override_generation_config!r}.")
        block_size = self.block_size if self.block_size is not None else 16
        if not isinstance(block_size, int) or block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}.")
        if self.kv_cache_memory is not None and self.kv_cache_memory_bytes is not None:
            raise ValueError("kv_cache_memory and kv_cache_memory_bytes are the same knob: give one.")
        if self.num_kv_blocks is not None and self.num_gpu_blocks_override is not None:
            raise ValueError("num_kv_blocks and num_gpu_blocks_override are the same knob: give one.")
        for name in ("max_model_len", "kv_cache_memory", "kv_cache_memory_bytes", "num_kv_blocks",
                     "num_gpu_blocks_override", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int, got {value!r}.")
        if self.max_num_seqs is not None and (not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1):
            raise ValueError(f"max_num_seqs must be a positive int, got {self.max_num_seqs!r}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}.")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}.")
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be a positive int, got {tp!r}.")
        dp = self.data_parallel_size
        if not isinstance(dp, int) or isinstance(dp, bool) or dp < 1:
            raise ValueError(f"data_parallel_size must be a positive int, got {dp!r}.")
        pp = self.pipeline_parallel_size
        if not isinstance(pp, int) or isinstance(pp, bool) or pp < 1:
            raise ValueError(f"pipeline_parallel_size must be a positive int, got {pp!r}.")
        if dp > 1 and tp > 1:
            raise ValueError(
                f"data_parallel_size={dp} with tensor_parallel_size={tp} is not supported: "
                "data-parallel engines run one worker each."
            )


def _verify_tensor_parallel(size: int, task: Task, hf_config: Any, device: str) -> None:
    """What tensor parallelism (shmvllm.model.parallel) cannot split, refused by name (dense
    weights and GGML blocks both shard)."""
    if size == 1:
        return
    if device != "cpu":
        raise ValueError(
            f"tensor_parallel_size={size} runs on the CPU only (gloo collectives); device={device!r} "
            "would need one device per rank, which is not implemented."
        )
    if task != "generate":
        raise ValueError(f"tensor_parallel_size={size} is not supported for task {task!r}: only decoders are sharded.")
    heads = getattr(hf_config, "num_attention_heads", 0) or 0
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    if kv_heads < size:
        raise ValueError(
            f"tensor_parallel_size={size} is more than the model's num_key_value_heads={kv_heads}: "
            "every rank needs at least one KV head."
        )


def _verify_quantization(quantization: Optional[str], source: ModelSource, task: Task) -> None:
    is_gguf, model_dir = source.gguf_file is not None, source.model_dir
    if quantization == "gguf" and not is_gguf:
        raise ValueError(f"quantization='gguf' needs a .gguf model; {str(model_dir)!r} is not one.")
    if quantization == "q8_0" and (is_gguf or task != "generate"):
        raise ValueError(
            f"quantization='q8_0' quantizes a safetensors decoder at load; {str(model_dir)!r} is "
            f"{'a GGUF file, already in blocks' if is_gguf else 'not a generative model'}."
        )


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


def _cli_type(hint: Any) -> Any:
    """The argparse type of a field's annotation: its non-None member for Optional[X]."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    base = args[0] if typing.get_origin(hint) is typing.Union and args else hint
    if typing.get_origin(base) is Literal:
        return str
    if base in (bool, int, float):
        return base
    if base is dict or typing.get_origin(base) is dict:
        return json.loads
    return str


def _nullable(kind: Any) -> Any:
    """`kind`, with "None" meaning None; a JSON value for the fields without a plain type."""

    def parse(text: str) -> Any:
        if text == "None":
            return None
        if kind is str:
            return text
        if kind in (int, float, json.loads):
            return kind(text)
        return json.loads(text) if text.startswith(("[", "{")) else text

    parse.__name__ = getattr(kind, "__name__", "value")
    return parse


def detect_task(model_dir: Path, hf_config: Any) -> Task:
    """Embedding if the directory is a sentence-transformers model or an encoder-only one."""
    if (model_dir / "modules.json").exists() or (model_dir / "1_Pooling").is_dir():
        return "embed"
    architectures = getattr(hf_config, "architectures", None) or []
    if any(a.endswith("ForCausalLM") for a in architectures):
        return "generate"
    if getattr(hf_config, "model_type", "") in ("bert", "roberta", "xlm-roberta", "modernbert"):
        return "embed"  # an encoder: embeddings, or classify / score with its classification head
    return "generate"


def _default_device() -> str:
    """"cuda" where torch sees a GPU. Without an NVIDIA driver there is none, and torch (seconds
    to import) is not asked."""
    if "torch" not in sys.modules and not os.path.exists("/proc/driver/nvidia/version"):
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _default_dtype(device: str, hf_config: Any, task: str = "generate") -> str:
    """dtype="auto". On the CPU: bfloat16 for a decoder whose config says bfloat16 when the CPU
    has native bf16 dot products (kernels.native_bf16: AVX512-BF16 / AMX-BF16, or
    $SHMVLLM_CPU_BF16), float32 otherwise; a GGUF file's converted config says float32, so it
    runs on its blocks with fp32 activations. Elsewhere: the config's bf16 / fp32 as bf16, else fp16."""
    configured = str(getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or "")
    if device.startswith("cpu"):
        if task != "generate" or "bfloat16" not in configured:
            why = "a pooling model" if task != "generate" else f"the model's config says {configured or 'no dtype'}"
            logger.info("dtype='auto' -> float32 on the CPU: %s", why)
            return "float32"
        from shmvllm.model.kernels import native_bf16

        native, why = native_bf16()
        chosen = "bfloat16" if native else "float32"
        logger.info("dtype='auto' -> %s: the model's config says bfloat16 and %s", chosen, why)
        return chosen
    return "bfloat16" if "bfloat16" in configured or "float32" in configured or not configured else "float16"


def _rope_length_threshold(hf_config: Any, max_model_len: int) -> Optional[int]:
    """The length past which the rope rotates a token by its sequence's length, where
    max_model_len passes it (model/rotary.py reads the same fields)."""
    rope = getattr(hf_config, "rope_parameters", None) or {}
    kind = rope.get("rope_type", rope.get("type"))
    threshold = None
    if kind == "dynamic":
        threshold = hf_config.max_position_embeddings
    elif kind == "longrope":
        threshold = getattr(hf_config, "original_max_position_embeddings", None) or rope.get(
            "original_max_position_embeddings", hf_config.max_position_embeddings
        )
    return int(threshold) if threshold is not None and max_model_len > threshold else None


def _resolve_max_model_len(requested: Optional[int], hf_config: Any, model_dir: Path) -> int:
    limit = getattr(hf_config, "max_position_embeddings", None) or 2048
    rope = getattr(hf_config, "rope_parameters", None) or {}
    if rope.get("rope_type") == "dynamic":  # NTK scaling serves `factor` times the trained length, as vLLM derives it
        limit = int(limit * rope["factor"])
    if getattr(hf_config, "model_type", "") in ("roberta", "xlm-roberta"):
        limit -= hf_config.pad_token_id + 1  # its positions start after padding_idx
    st_config = model_dir / "sentence_bert_config.json"
    if st_config.exists():
        limit = min(limit, json.loads(st_config.read_text()).get("max_seq_length", limit))
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(f"max_model_len ({requested}) is larger than the model's limit ({limit}).")
    return requested
