"""A model's transformers config as plain values, read without importing transformers.

transformers' config classes import torch (seconds); what shmvllm needs of a config is its values
with the class defaults filled in: `PretrainedConfig.to_dict()`. That dict is computed once per
config.json (with transformers) and cached under `<cache>/configs/`, keyed by the file's path,
size, mtime and the transformers version; later loads read it back in a millisecond as an
`HFConfig`, which answers attribute reads as the transformers object would.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Optional

from shmvllm import envs

logger = logging.getLogger(__name__)


class HFConfig:
    """A transformers config's values as attributes (a missing one is an AttributeError, so
    `getattr(config, name, default)` works as on the transformers object). A nested config (a
    dict with a model_type, such as a text_config) is an HFConfig too; other dicts stay dicts."""

    def __init__(self, values: dict[str, Any]) -> None:
        for key, value in values.items():
            if isinstance(value, dict) and "model_type" in value:
                value = HFConfig(value)
            self.__dict__[key] = value

    def to_dict(self) -> dict[str, Any]:
        return {k: v.to_dict() if isinstance(v, HFConfig) else v for k, v in self.__dict__.items()}

    @property
    def num_labels(self) -> int:
        """transformers' property: the number of labels of a classification head."""
        return len(self.__dict__.get("id2label") or {}) or 2

    def get_text_config(self, *args: Any, **kwargs: Any) -> "HFConfig":
        text = self.__dict__.get("text_config")
        return text if isinstance(text, HFConfig) else self

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HFConfig) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        return f"HFConfig({self.__dict__.get('model_type', '?')}, {len(self.__dict__)} values)"


def _transformers_version() -> str:
    from importlib.metadata import version

    return version("transformers")


_VALUES_FORMAT = 2  # bumped when config_values() changes what it keeps, so older cached files are not read


def _cache_key(config_file: Path) -> str:
    stat = config_file.stat()
    raw = f"{config_file.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{_transformers_version()}:{_VALUES_FORMAT}"
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


def config_values(config: Any) -> dict[str, Any]:
    """A transformers config's full values (defaults included), JSON-safe, with the values of its
    family's own properties (ModernBERT's sliding_window is derived from local_attention), which
    to_dict() leaves out."""
    values = json.loads(config.to_json_string(use_diff=False))
    from transformers import PretrainedConfig

    for cls in type(config).__mro__:
        if cls is PretrainedConfig or not issubclass(cls, PretrainedConfig):
            break
        for name, member in vars(cls).items():
            if isinstance(member, property) and name not in values and not name.startswith("_"):
                try:
                    value = getattr(config, name)
                    json.dumps(value)
                except Exception:  # a property that needs state the config lacks, or no JSON value
                    continue
                values[name] = value
    return values


def load_hf_config(model_dir: Path, store: bool = True) -> HFConfig:
    """The config of an HF directory: from the cache when this config.json was read before,
    else through transformers' AutoConfig (then cached, unless store=False: remember_hf_config)."""
    config_file = Path(model_dir) / "config.json"
    if not config_file.exists():
        raise ValueError(f"model directory {str(model_dir)!r} has no config.json.")
    key = _cache_key(config_file)
    cached = envs.SHMVLLM_CACHE() / "configs" / f"{key}.json"
    try:
        return HFConfig(json.loads(cached.read_text()))
    except (OSError, ValueError):
        pass
    from transformers import AutoConfig

    values = config_values(AutoConfig.from_pretrained(str(model_dir)))
    if store:
        _store(cached, values)
    return HFConfig(values)


def remember_hf_config(model_dir: Path, values: dict[str, Any]) -> None:
    """Caches the full values of a directory's config.json, unless they are cached already."""
    target = envs.SHMVLLM_CACHE() / "configs" / f"{_cache_key(Path(model_dir) / 'config.json')}.json"
    if not target.exists():
        _store(target, values)


def _store(target: Path, values: dict[str, Any]) -> Optional[Path]:
    """Writes atomically; a cache that cannot be written only costs the next load its time."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(values, f)
        os.replace(tmp, target)
        return target
    except OSError as exc:
        logger.info("could not cache the model config in %s: %s", target.parent, exc)
        return None
