"""Builds a native model for an HF directory and fills it from the directory's safetensors,
or from the GGUF file it was converted from.

The model is created on the meta device (no random init), materialized empty on the target
device and dtype, then every parameter is copied from the checkpoint. A parameter the
checkpoint does not provide (except a tied lm_head), a checkpoint tensor with no parameter, or
a shape mismatch is an error naming the tensor.

GGUF (registry.gguf_source): on the CPU with fp32 activations and the quantized kernels built,
each 2-D weight stays in its GGML blocks (quant.py) and its Linear / embedding runs on them;
the fp32 weights that were materialized for those modules are dropped before any page of them
is touched, so the resident weights are about the file's size. Norms (F32 in GGUF) load as
fp32. `quantization="none"` (or no kernels, or another device/dtype) dequantizes the blocks
in memory, as transformers' GGUF loader does (gguf.quants.dequantize). `quantization="q8_0"` quantizes a safetensors
model's linear weights into Q8_0 blocks after loading them.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import time
from pathlib import Path
from typing import Iterable, Iterator, Union

import torch
from safetensors import safe_open
from torch import nn

from shmvllm.config import ModelConfig
from shmvllm.model.kernels import quant_kernels
from shmvllm.model.linear import Linear, VocabEmbedding
from shmvllm.model.models import ARCHITECTURES, decoder_architecture, family
from shmvllm.model.quant import FORMAT_IDS, QuantizedWeight, quantize, read_gguf
from shmvllm.model.registry import gguf_source, weight_files

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


# HF architecture name -> decoder family (model/models/); a plain dict, read without building models
MODEL_REGISTRY: dict[str, str] = ARCHITECTURES


def torch_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {name!r}.")
    return _DTYPES[name]


def get_model(model_config: ModelConfig) -> nn.Module:
    """Returns the model of `model_config`, weights loaded, in eval mode on its device."""
    started = time.perf_counter()
    hf_config = model_config.hf_config
    builder = family(decoder_architecture(hf_config))
    device = torch.device(model_config.device)
    dtype = torch_dtype(model_config.dtype)
    max_position = max(model_config.max_model_len, 1)
    with built_on_meta():
        model = builder.build(hf_config, max_position)
    model = _materialize(model, device, dtype)
    model_dir = Path(model_config.model_dir)
    source = gguf_source(model_dir)
    on_blocks = source is not None and model_config.quantization != "none"
    if on_blocks and not _blocks_run_here(device, dtype):
        if model_config.quantization == "gguf":
            raise ValueError(
                f"quantization='gguf' runs the blocks on the CPU with dtype float32 and the C kernels; "
                f"got device {device}, dtype {model_config.dtype}, kernels {'built' if quant_kernels() else 'unavailable'}."
            )
        logger.warning("GGUF blocks do not run on %s / %s here: loading dequantized weights", device, model_config.dtype)
        on_blocks = False
    if source is not None:
        load_weights(model, read_gguf(source, hf_config, builder, dequantize=not on_blocks))
    else:
        load_weights(model, _safetensors_tensors(model_dir))
        if model_config.quantization == "q8_0":
            if not _blocks_run_here(device, dtype):
                raise ValueError(f"quantization='q8_0' runs on the CPU with dtype float32; got {device}, {model_config.dtype}.")
            _quantize_linears(model, FORMAT_IDS["Q8_0"])
    process = getattr(model, "process_weights_after_loading", None)
    if process is not None:
        process()
    model.eval()
    return_freed_memory()
    blocks = _block_modules(model)
    num_params = sum(p.numel() for p in model.parameters()) + sum(
        part.n * part.k for module in {id(b): b for b in blocks}.values() for part in _parts(module)
    )
    logger.info(
        "Loaded %s (%s, %.1f M parameters, %s on %s, %d modules on GGML blocks) in %.2f s",
        model_config.model_dir.name, type(model).__name__, num_params / 1e6, model_config.dtype, device,
        len(blocks), time.perf_counter() - started,
    )
    return model


# torch.nn.init's in-place initializers, which modules call while they are built.
_INITIALIZERS = ("normal_", "uniform_", "zeros_", "ones_", "constant_", "kaiming_uniform_", "kaiming_normal_",
                 "xavier_uniform_", "xavier_normal_", "trunc_normal_")


@contextlib.contextmanager
def built_on_meta() -> Iterator[None]:
    """Modules built in this block get meta parameters and no initialization: every weight is
    loaded afterwards, and a meta normal_ (nn.Embedding's) would import torch._dynamo, which
    costs seconds."""
    saved = {name: getattr(nn.init, name) for name in _INITIALIZERS}
    try:
        for name in _INITIALIZERS:
            setattr(nn.init, name, _no_init)
        with torch.device("meta"):
            yield
    finally:
        for name, function in saved.items():
            setattr(nn.init, name, function)


def _no_init(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return tensor


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


def return_freed_memory() -> None:
    """glibc keeps the loader's freed temporaries (copies of shards) in its heap; hand them back
    so that the engine's resident memory is what the model holds (no-op elsewhere)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _safetensors_tensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _blocks_run_here(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and quant_kernels() is not None


Checkpoint = Iterable[tuple[str, Union[torch.Tensor, QuantizedWeight]]]


def load_weights(model: nn.Module, tensors: Checkpoint) -> None:
    """Copies every checkpoint tensor into its parameter (fused shards into their slices); a
    QuantizedWeight for a Linear / VocabEmbedding becomes its blocks (any other is dequantized)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    modules = dict(model.named_modules())
    loaded: set[str] = set()
    unexpected: list[str] = []
    block_parts: dict[str, list[tuple[int, QuantizedWeight]]] = {}
    shard_for = getattr(model, "shard_for", lambda name: None)
    rename = getattr(model, "checkpoint_name", lambda name: name)
    for name, tensor in tensors:
        if "rotary_emb.inv_freq" in name:
            continue
        name = rename(name)
        shard = shard_for(name)
        target, offset, rows = shard if shard is not None and shard[0] in params else (name, 0, None)
        if target not in params:
            unexpected.append(name)
            continue
        if isinstance(tensor, QuantizedWeight):
            module = modules.get(target.rpartition(".")[0])
            if target.endswith(".weight") and isinstance(module, (Linear, VocabEmbedding)):
                _check_shape(name, tensor, (rows if rows is not None else params[target].shape[0], *params[target].shape[1:]))
                block_parts.setdefault(target, []).append((offset, tensor))
                loaded.add(target)
                if rows is not None:
                    loaded.add(f"{target}#{offset}")
                continue
            tensor = tensor.dequantize()
        if rows is not None:
            _check_shape(name, tensor, (rows, *params[target].shape[1:]))
            params[target].data[offset : offset + rows].copy_(tensor)
            loaded.add(f"{target}#{offset}")
        else:
            _check_shape(name, tensor, tuple(params[target].shape))
            params[target].data.copy_(tensor)
        loaded.add(target)
    if unexpected:
        raise ValueError(f"checkpoint tensors {unexpected[:8]} have no place in {type(model).__name__}.")
    _check_complete(model, params, loaded)
    for target, parts in block_parts.items():
        module = modules[target.rpartition(".")[0]]
        if isinstance(module, VocabEmbedding):
            module.set_blocks(parts[0][1])
        else:
            module.set_blocks(parts)
    if getattr(model, "tie_word_embeddings", False):
        tie = getattr(model, "tie_blocks", None)
        if tie is not None:
            tie()


def _quantize_linears(model: nn.Module, qtype: int) -> None:
    """Every Linear's fp32 weight -> blocks of `qtype` (the tied lm_head too, as the embedding's)."""
    for module in model.modules():
        if isinstance(module, Linear) and module.blocks is None and module.weight.numel():
            module.set_blocks([(0, quantize(module.weight.data, qtype))])


def _block_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, (Linear, VocabEmbedding)) and m.blocks is not None]


def _parts(module: nn.Module) -> list[QuantizedWeight]:
    return [module.blocks] if isinstance(module.blocks, QuantizedWeight) else [part for _, part in module.blocks]


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
                if got != expected and not (got == 0 and name in loaded):  # 0 shards: loaded fused (Phi-3)
                    raise ValueError(f"fused parameter {name!r} got {got} of its {expected} checkpoint shards.")
