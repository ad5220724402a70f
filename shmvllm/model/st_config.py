"""sentence-transformers' files of a model directory, read as written.

modules.json lists the modules a SentenceTransformer (or CrossEncoder) runs in order: the
Transformer, then Pooling, Dense layers and Normalize for an embedder; the Transformer alone for
a sentence-transformers 6 CrossEncoder. config_sentence_transformers.json holds the prompts,
the default prompt's name and a CrossEncoder's activation. Module types are matched by their
last dotted name, so that sentence-transformers 2-6's module paths all read the same.
Anything else in modules.json is refused by name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:  # torch is imported where tensors are made: the frontend reads prompts without it
    import torch

# Activation functions a Dense layer or a CrossEncoder may name, by their last dotted name
# (Softmax: a classifier's, over its labels).
ACTIVATIONS = ("Identity", "Tanh", "Sigmoid", "ReLU", "GELU", "Softmax")


def apply_activation(name: str, x: "torch.Tensor") -> "torch.Tensor":
    import torch

    if name == "Identity":
        return x
    if name == "Softmax":
        return torch.softmax(x, dim=-1)
    return {"Tanh": torch.tanh, "Sigmoid": torch.sigmoid, "ReLU": torch.relu, "GELU": torch.nn.functional.gelu}[name](x)

_MODULE_KINDS = ("Transformer", "Pooling", "Dense", "Normalize")


@dataclass
class DenseLayer:
    """One sentence-transformers Dense module: y = activation(x @ weight^T + bias)."""

    weight: "torch.Tensor"
    bias: "Optional[torch.Tensor]"
    activation: str  # a key of ACTIVATIONS

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: "torch.Tensor") -> "torch.Tensor":
        import torch

        y = torch.nn.functional.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        return apply_activation(self.activation, y)


@dataclass
class STConfig:
    """What a model directory's sentence-transformers files say (all None / empty without them)."""

    pooling_mode: Optional[str] = None  # "mean" | "cls" | "last"
    dense: list[DenseLayer] = field(default_factory=list)
    normalize: bool = False
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: Optional[str] = None
    activation: Optional[str] = None  # a CrossEncoder's activation, a key of ACTIVATIONS
    has_modules: bool = False


def read_st_config(model_dir: Path, modules: bool = True) -> STConfig:
    """modules=False: config_sentence_transformers.json only (prompts, activation), no weights."""
    model_dir = Path(model_dir)
    config = STConfig()
    _read_model_config(model_dir, config)
    modules_file = model_dir / "modules.json"
    if not modules or not modules_file.exists():
        return config
    config.has_modules = True
    modules = json.loads(modules_file.read_text())
    kinds = []
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind not in _MODULE_KINDS:
            raise ValueError(f"{modules_file}: module type {module.get('type')!r} is not supported; supported: {list(_MODULE_KINDS)}.")
        path = model_dir / module.get("path", "")
        if kind == "Pooling":
            if config.pooling_mode is not None:
                raise ValueError(f"{modules_file} lists more than one Pooling module.")
            config.pooling_mode = _pooling_mode(path / "config.json")
        elif kind == "Dense":
            config.dense.append(_dense_layer(path))
        elif kind == "Normalize":
            config.normalize = True
        kinds.append(kind)
    if kinds.count("Transformer") != 1 or kinds[0] != "Transformer":
        raise ValueError(f"{modules_file} must start with its one Transformer module, got {kinds}.")
    if config.dense and config.pooling_mode is None:
        raise ValueError(f"{modules_file} has Dense modules but no Pooling module.")
    return config


def dense_out_features(model_dir: Path) -> Optional[int]:
    """The last Dense module's out_features (the embedding's length), from the configs alone."""
    modules_file = Path(model_dir) / "modules.json"
    if not modules_file.exists():
        return None
    out = None
    for module in json.loads(modules_file.read_text()):
        if str(module.get("type", "")).rsplit(".", 1)[-1] == "Dense":
            out = json.loads((Path(model_dir) / module.get("path", "") / "config.json").read_text())["out_features"]
    return out


def _read_model_config(model_dir: Path, config: STConfig) -> None:
    """config_sentence_transformers.json: prompts, default_prompt_name, a CrossEncoder's activation_fn."""
    file = model_dir / "config_sentence_transformers.json"
    if not file.exists():
        return
    data = json.loads(file.read_text())
    prompts = data.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(isinstance(v, str) for v in prompts.values()):
        raise ValueError(f"{file}: prompts must map names to strings, got {prompts!r}.")
    config.prompts = dict(prompts)
    name = data.get("default_prompt_name")
    if name is not None and name not in config.prompts:
        raise ValueError(f"{file}: default_prompt_name {name!r} is not one of the prompts {sorted(config.prompts)}.")
    config.default_prompt_name = name
    if data.get("activation_fn") is not None:
        config.activation = activation_name(data["activation_fn"], f"{file}: activation_fn")


def activation_name(path: str, where: str) -> str:
    """The ACTIVATIONS key of a dotted torch path such as torch.nn.modules.activation.Sigmoid."""
    name = str(path).rsplit(".", 1)[-1]
    if not str(path).startswith("torch.") or name not in ACTIVATIONS or name == "Softmax":
        raise ValueError(f"{where} {path!r} is not supported; supported: torch.nn's {sorted(ACTIVATIONS)}.")
    return name


_POOLING_FLAGS = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "last",
}
_UNSUPPORTED_FLAGS = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


def _pooling_mode(config_file: Path) -> str:
    config = json.loads(config_file.read_text())
    if config.get("include_prompt") is False:
        # Leaving the prompt's tokens out of the mean needs each prompt's length in the engine.
        raise ValueError(f"{config_file}: include_prompt=false is not supported.")
    mode = config.get("pooling_mode")  # sentence-transformers >= 3 write the mode by name
    if isinstance(mode, str):
        chosen = {"mean": "mean", "cls": "cls", "lasttoken": "last"}.get(mode)
        if chosen is None:
            raise ValueError(f"{config_file}: pooling_mode {mode!r} is not supported; supported: mean, cls, lasttoken.")
        return chosen
    unsupported = [flag for flag in _UNSUPPORTED_FLAGS if config.get(flag)]
    chosen_modes = [kind for flag, kind in _POOLING_FLAGS.items() if config.get(flag)]
    if unsupported or len(chosen_modes) != 1:
        raise ValueError(f"{config_file}: exactly one of mean / cls / lasttoken pooling is supported, got {config}.")
    return chosen_modes[0]


def _dense_layer(path: Path) -> DenseLayer:
    config = json.loads((path / "config.json").read_text())
    activation = activation_name(
        config.get("activation_function", "torch.nn.modules.linear.Identity"), f"{path / 'config.json'}: activation_function"
    )
    if (path / "model.safetensors").exists():
        from safetensors.torch import load_file

        weights = load_file(path / "model.safetensors")
    elif (path / "pytorch_model.bin").exists():
        import torch

        weights = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"Dense module {str(path)!r} has no model.safetensors or pytorch_model.bin.")
    weight = weights["linear.weight"].float()
    if tuple(weight.shape) != (config["out_features"], config["in_features"]):
        raise ValueError(f"Dense module {str(path)!r}: linear.weight is {tuple(weight.shape)}, config says "
                         f"{config['out_features']} x {config['in_features']}.")
    bias = weights.get("linear.bias") if config.get("bias", True) else None
    return DenseLayer(weight=weight, bias=None if bias is None else bias.float(), activation=activation)


def hf_classifier_activation(hf_config: Any) -> Optional[str]:
    """A CrossEncoder's activation written in config.json (sentence-transformers 4-5's
    `sentence_transformers.activation_fn`, older ones' `sbert_ce_default_activation_function`)."""
    st = getattr(hf_config, "sentence_transformers", None)
    if isinstance(st, dict) and st.get("activation_fn") is not None:
        return activation_name(st["activation_fn"], "config.json sentence_transformers.activation_fn")
    old = getattr(hf_config, "sbert_ce_default_activation_function", None)
    if old is not None:
        return activation_name(old, "config.json sbert_ce_default_activation_function")
    return None
