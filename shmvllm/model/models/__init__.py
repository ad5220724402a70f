"""The decoder families and the architecture registry.

`ARCHITECTURES` (HF architecture name -> family module) and `GGUF_ARCHITECTURES` (a GGUF file's
`general.architecture` -> HF architecture name) are plain dicts: reading them, and
`check_architecture`, import neither torch nor a model, so the frontend refuses an unsupported
model before it converts or starts anything. Each family is a short module of this package
declaring `FAMILY` (decoder.Family): its options from the HF config and its GGUF tensor names.
Adding a family: a module here, a line in each dict, a test in tests/test_architectures.py.
"""

from __future__ import annotations

import importlib
import json
import struct
from pathlib import Path
from typing import Any, Mapping, Sequence, Union

ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "GptOssForCausalLM": "gpt_oss",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3TextModel": "gemma3",  # a base model: EmbeddingGemma (bidirectional, pooling only)
    "Phi3ForCausalLM": "phi3",
    "GraniteForCausalLM": "granite",
    "Olmo2ForCausalLM": "olmo2",
    "SmolLM3ForCausalLM": "smollm3",
}

# what transformers' GGUF loader turns each file architecture into (the config's architectures)
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}

# encoders the pooling runner serves (model/encoders.py): by model_type, and by architecture prefix
ENCODER_MODEL_TYPES: tuple[str, ...] = ("bert", "roberta", "xlm-roberta", "modernbert")
ENCODER_ARCHITECTURE_PREFIXES: tuple[str, ...] = ("Bert", "Roberta", "XLMRoberta", "ModernBert")

ArchitectureSource = Union[str, Sequence[str], Mapping[str, Any], Any]


def _names(source: ArchitectureSource) -> tuple[list[str], str | None]:
    """(architecture names, model_type) of an HF config object, a config.json dict, a list of
    names, or one name."""
    if isinstance(source, str):
        return [source], None
    if isinstance(source, Mapping):
        return list(source.get("architectures") or []), source.get("model_type")
    if isinstance(source, Sequence):
        return [str(name) for name in source], None
    return list(getattr(source, "architectures", None) or []), getattr(source, "model_type", None)


def check_architecture(source: ArchitectureSource) -> str:
    """The first supported architecture of `source` (an HF config, a config.json dict, or
    architecture names), or a ValueError naming what it has and what is supported. Encoders
    (BERT) pass too: the pooling runner serves them."""
    names, model_type = _names(source)
    for name in names:
        if name in ARCHITECTURES or name.startswith(ENCODER_ARCHITECTURE_PREFIXES):
            return name
    if model_type in ENCODER_MODEL_TYPES:
        return names[0] if names else str(model_type)
    raise ValueError(
        f"model architectures {names} (model_type {model_type!r}) are not supported; supported: "
        f"{sorted(ARCHITECTURES)} and the encoders of model types {list(ENCODER_MODEL_TYPES)}."
    )


def check_gguf_architecture(gguf_architecture: str) -> str:
    """A GGUF file's `general.architecture` -> the HF architecture it loads as, or a ValueError."""
    if gguf_architecture not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {gguf_architecture!r} is not supported; supported: {sorted(GGUF_ARCHITECTURES)}."
        )
    return GGUF_ARCHITECTURES[gguf_architecture]


def family(architecture: str) -> Any:
    """The `decoder.Family` of a supported decoder architecture (imports its module)."""
    if architecture not in ARCHITECTURES:
        check_architecture([architecture])
        raise ValueError(f"architecture {architecture!r} is an encoder, not a decoder family.")
    return importlib.import_module(f"{__name__}.{ARCHITECTURES[architecture]}").FAMILY


def decoder_architecture(hf_config: Any) -> str:
    """The first of the config's architectures that is a decoder family, or a ValueError."""
    names, model_type = _names(hf_config)
    for name in names:
        if name in ARCHITECTURES:
            return name
    raise ValueError(
        f"model architectures {names} (model_type {model_type!r}) are not supported by the decoder; "
        f"supported: {sorted(ARCHITECTURES)}."
    )


# GGUF value types: scalar struct formats (8 = string, 9 = array are read apart)
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def gguf_header_values(path: Union[str, Path]) -> dict[str, Any]:
    """A GGUF file's scalar and string metadata, read from its header alone (arrays, such as the
    tokenizer's, are skipped, not parsed): milliseconds for any file size."""
    with open(path, "rb") as f:
        def read(fmt: str) -> Any:
            size = struct.calcsize(fmt)
            data = f.read(size)
            if len(data) != size:
                raise ValueError(f"{str(path)!r} is not a GGUF file: its header ends early.")
            return struct.unpack(fmt, data)[0]

        def read_str() -> str:
            return f.read(read("<Q")).decode("utf-8", "replace")

        def skip(kind: int) -> None:
            if kind in _GGUF_SCALARS:
                f.seek(struct.calcsize(_GGUF_SCALARS[kind]), 1)
            elif kind == 8:
                f.seek(read("<Q"), 1)
            elif kind == 9:
                inner, count = read("<I"), read("<Q")
                if inner in _GGUF_SCALARS:
                    f.seek(struct.calcsize(_GGUF_SCALARS[inner]) * count, 1)
                else:
                    for _ in range(count):
                        skip(inner)
            else:
                raise ValueError(f"{str(path)!r}: unknown GGUF value type {kind}.")

        if f.read(4) != b"GGUF":
            raise ValueError(f"{str(path)!r} is not a GGUF file (no GGUF magic).")
        read("<I")  # version
        read("<Q")  # tensor count
        values: dict[str, Any] = {}
        for _ in range(read("<Q")):
            key, kind = read_str(), read("<I")
            if kind in _GGUF_SCALARS:
                values[key] = read(_GGUF_SCALARS[kind])
            elif kind == 8:
                values[key] = read_str()
            else:
                skip(kind)
    return values


def gguf_file_architecture(path: Union[str, Path]) -> str:
    """`general.architecture` of a GGUF file, from its header."""
    architecture = gguf_header_values(path).get("general.architecture")
    if not isinstance(architecture, str):
        raise ValueError(f"GGUF file {str(path)!r} has no general.architecture.")
    return architecture


def check_gguf_file(path: Union[str, Path]) -> str:
    """The HF architecture a GGUF file loads as, or a ValueError naming its architecture."""
    try:
        return check_gguf_architecture(gguf_file_architecture(path))
    except ValueError as exc:
        raise ValueError(f"{exc} (file {str(path)!r})") from None


def check_causal_lm_dir(model_dir: Union[str, Path]) -> None:
    """An HF directory whose config.json names only causal-LM architectures, none supported: a
    ValueError (read from the JSON alone). Other directories (encoders, sentence-transformers
    models) are left to the task's own checks."""
    config = Path(model_dir) / "config.json"
    if not config.exists() or (Path(model_dir) / "modules.json").exists():
        return
    data = json.loads(config.read_text())
    names = list(data.get("architectures") or [])
    if names and all(name.endswith("ForCausalLM") for name in names):
        decoder_architecture(data)


def gguf_kv_config(path: Union[str, Path]) -> dict[str, int] | None:
    """The HF config values a KV-cache block's size depends on, from a GGUF file's header (llama.cpp's
    key names), or None where the header lacks one: enough to check a KV budget before the file's
    full config is converted (seconds, with transformers)."""
    values = gguf_header_values(path)
    prefix = f"{values.get('general.architecture')}."
    names = {"num_hidden_layers": "block_count", "num_attention_heads": "attention.head_count",
             "hidden_size": "embedding_length", "num_key_value_heads": "attention.head_count_kv",
             "head_dim": "attention.key_length"}
    config = {name: values[prefix + key] for name, key in names.items() if isinstance(values.get(prefix + key), int)}
    if not {"num_hidden_layers", "num_attention_heads", "hidden_size"} <= set(config):
        return None
    return config
