"""Builds a native model for an HF directory and fills it from the directory's safetensors.

The model is created on the meta device (no random init), materialized empty on the target
device and dtype, then every parameter is copied from the checkpoint. A parameter the
checkpoint does not provide (except a tied lm_head), a checkpoint tensor with no parameter, or
a shape mismatch is an error naming the tensor.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open
from torch import nn

from shmvllm.config import ModelConfig

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _llama(config: Any, max_position: int) -> nn.Module:
    from shmvllm.model.llama import LlamaForCausalLM

    return LlamaForCausalLM(config, max_position)


MODEL_REGISTRY: dict[str, Callable[[Any, int], nn.Module]] = {
    "LlamaForCausalLM": _llama,
    "MistralForCausalLM": _llama,
    "Qwen2ForCausalLM": _llama,
}


def torch_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {name!r}.")
    return _DTYPES[name]


def get_model(model_config: ModelConfig) -> nn.Module:
    """Returns the model of `model_config`, weights loaded, in eval mode on its device."""
    started = time.perf_counter()
    hf_config = model_config.hf_config
    architectures = getattr(hf_config, "architectures", None) or []
    builder = next((MODEL_REGISTRY[a] for a in architectures if a in MODEL_REGISTRY), None)
    if builder is None:
        raise ValueError(f"model architectures {architectures} are not supported; supported: {sorted(MODEL_REGISTRY)}.")
    device = torch.device(model_config.device)
    dtype = torch_dtype(model_config.dtype)
    max_position = max(model_config.max_model_len, 1)
    with torch.device("meta"):
        model = builder(hf_config, max_position)
    model = _materialize(model, device, dtype)
    load_weights(model, Path(model_config.model_dir))
    process = getattr(model, "process_weights_after_loading", None)
    if process is not None:
        process()
    model.eval()
    num_params = sum(p.numel() for p in model.parameters())
    logger.info(
        "Loaded %s (%s, %.1f M parameters, %s on %s) in %.2f s",
        model_config.model_dir.name, type(model).__name__, num_params / 1e6, model_config.dtype, device,
        time.perf_counter() - started,
    )
    return model


def _materialize(model: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """Meta parameters -> uninitialized ones on `device` in `dtype` (tied ones stay tied);
    buffers (built on the CPU, like RoPE tables) move to `device` as they are."""
    replaced: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in replaced:
                replaced[id(param)] = nn.Parameter(torch.empty(param.shape, device=device, dtype=dtype), requires_grad=False)
            module._parameters[name] = replaced[id(param)]
        for name, buf in list(module._buffers.items()):
            if buf is not None:
                if buf.is_meta:
                    raise ValueError(f"buffer {name!r} of {type(module).__name__} was built on the meta device.")
                module._buffers[name] = buf.to(device)
    return model


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model directory {str(model_dir)!r} has no *.safetensors weights.")
    return files


def load_weights(model: nn.Module, model_dir: Path) -> None:
    """Copies every checkpoint tensor into its parameter (fused shards into their slices)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    unexpected: list[str] = []
    shard_for = getattr(model, "shard_for", lambda name: None)
    for path in _weight_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                if "rotary_emb.inv_freq" in name:
                    continue
                shard = shard_for(name)
                tensor = f.get_tensor(name)
                if shard is not None and shard[0] in params:
                    target, offset, rows = shard
                    _check_shape(name, tensor, (rows, *params[target].shape[1:]))
                    params[target].data[offset : offset + rows].copy_(tensor)
                    loaded.add(f"{target}#{offset}")
                    loaded.add(target)
                elif name in params:
                    _check_shape(name, tensor, tuple(params[name].shape))
                    params[name].data.copy_(tensor)
                    loaded.add(name)
                else:
                    unexpected.append(name)
    if unexpected:
        raise ValueError(f"checkpoint tensors {unexpected[:8]} have no place in {type(model).__name__}.")
    _check_complete(model, params, loaded)


def _check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != expected:
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {expected}.")


def _check_complete(model: nn.Module, params: dict[str, nn.Parameter], loaded: set[str]) -> None:
    if getattr(model, "tie_word_embeddings", False):
        loaded.add("lm_head.weight")
    elif "lm_head.weight" not in loaded and "lm_head.weight" in params:
        raise ValueError("checkpoint has no lm_head.weight and the config does not tie word embeddings.")
    missing = sorted(n for n in params if n not in loaded)
    if missing:
        raise ValueError(f"checkpoint does not provide parameters {missing[:8]}{' ...' if len(missing) > 8 else ''}.")
    for packed in getattr(model, "packed_modules", {}):
        for name in params:
            if f".{packed}." in name:
                expected = len(model.packed_modules[packed])
                got = sum(1 for key in loaded if key.startswith(f"{name}#"))
                if got != expected:
                    raise ValueError(f"fused parameter {name!r} got {got} of its {expected} checkpoint shards.")
