"""EngineArgs (what the user passes to `LLM(...)`) and the configs the engine is built from."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

from shmvllm.compat.vllm_args import BY_NAME as _VLLM_ONLY_ARGS
from shmvllm.compat.vllm_args import VllmArgs, check_vllm_args
from shmvllm.spec_decode.config import SpeculativeConfig

logger = logging.getLogger(__name__)

Task = Literal["generate", "embed"]

_DTYPES = ("auto", "float32", "float16", "bfloat16")
# vLLM's other spellings of the dtypes.
_DTYPE_ALIASES = {"half": "float16", "float": "float32", "fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
_TASK_ALIASES = {"embedding": "embed"}

QUANTIZATIONS = (None, "gguf", "none", "q8_0")
"""EngineArgs.quantization: None (default) runs a GGUF file's weights as its GGML blocks (on
the CPU with fp32 activations; elsewhere dequantized) and a safetensors model as stored;
"gguf" insists on the blocks (error for a non-GGUF model); "none" dequantizes a GGUF file to
`dtype` at load (a full-precision copy of the weights, as before blocks were kept);
"q8_0" quantizes a safetensors model's linear weights to Q8_0 blocks at load."""


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

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.hf_config.hidden_size

    @property
    def embedding_size(self) -> int:
        """The length of a pooled embedding: the last sentence-transformers Dense layer's, or hidden_size."""
        from shmvllm.model.st_config import dense_out_features

        return dense_out_features(self.model_dir) or self.hidden_size

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


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1  # engine processes, each a replica (shmvllm.engine.core_client.MPClient)


@dataclass
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    speculative_config: Optional[SpeculativeConfig] = None


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
    data_parallel_size: int = 1  # N > 1: N engine processes, each on cores / N cores (MPClient)
    max_logprobs: int = 20
    skip_tokenizer_init: bool = False
    tokenizer_mode: str = "auto"  # "auto" | "hf" | "slow"
    generation_config: str = "auto"  # "auto" | "vllm" | a folder holding generation_config.json
    override_generation_config: Optional[dict[str, Any]] = None
    speculative_config: Optional[dict[str, Any]] = None  # {"method": "ngram", "num_speculative_tokens": k, ...}

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
        from shmvllm.engine.validation import check_against_model, check_engine_args

        check_engine_args(self)
        self._verify()
        speculative = SpeculativeConfig.from_user(self.speculative_config)
        from shmvllm.model.hf_config import load_hf_config
        from shmvllm.model.models import check_causal_lm_dir, decoder_architecture
        from shmvllm.model.registry import resolve_model_dir

        model_dir = resolve_model_dir(self.model)  # refuses a GGUF file's unsupported architecture
        check_causal_lm_dir(model_dir)  # from config.json alone, before a config is built
        hf_config = load_hf_config(model_dir)
        task = self._task(model_dir, hf_config)
        if task == "generate":
            decoder_architecture(hf_config)  # an unsupported model is refused here, before the engine starts
        device = self.device if self.device != "auto" else _default_device()
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
        )
        _verify_quantization(self.quantization, model_dir, task)
        if speculative is not None and task != "generate":
            raise ValueError(f"speculative_config={self.speculative_config!r} applies to generation only, not to task {task!r}.")
        _verify_tensor_parallel(self.tensor_parallel_size, task, hf_config, device)
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
                block_size=self.block_size if self.block_size is not None else 16,
                kv_cache_memory=self.kv_cache_memory if self.kv_cache_memory is not None else self.kv_cache_memory_bytes,
                gpu_memory_utilization=self.gpu_memory_utilization,
                num_kv_blocks=self.num_kv_blocks if self.num_kv_blocks is not None else self.num_gpu_blocks_override,
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
            ),
            parallel_config=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size, data_parallel_size=self.data_parallel_size
            ),
            speculative_config=speculative,
        )
        check_against_model(config)
        return config

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


def _verify_quantization(quantization: Optional[str], model_dir: Path, task: Task) -> None:
    from shmvllm.model.registry import gguf_source

    is_gguf = gguf_source(model_dir) is not None
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
