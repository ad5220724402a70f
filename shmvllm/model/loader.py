"""Builds a native model for an HF directory and fills it from the directory's safetensors,
or from the GGUF file it was converted from.

The model is created on the meta device (no random init) at its tensor-parallel rank's shapes
(model/parallel/layers.py; size 1: rank 0 of 1), materialized empty on the target device and
dtype, then each parameter's `weight_loader` reads its share of its checkpoint tensor
(model/checkpoint.py: only those bytes are read). A parameter the checkpoint does not provide
(except a tied lm_head), a checkpoint tensor with no parameter, or a shape mismatch is an error
naming the tensor.

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
import logging
import mmap
import time
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

import torch
from torch import nn

from shmvllm.config import ModelConfig
from shmvllm.model.checkpoint import CheckpointTensor, safetensors_tensors
from shmvllm.model.kernels import quant_kernels
from shmvllm.model.linear import Linear, VocabEmbedding, repacks
from shmvllm.model.models import ARCHITECTURES, decoder_architecture, family
from shmvllm.model.parallel.group import TPGroup
from shmvllm.model.parallel.layers import Placement, default_weight_loader, report
from shmvllm.model.parallel.pipeline import PipelineStage
from shmvllm.model.quant import FORMAT_IDS, GGUFTensorRef, QuantizedWeight, quantize, read_gguf
from shmvllm.model.registry import gguf_source, weight_files
from shmvllm.worker.huge_pages import huge_page_buffer

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


# HF architecture name -> decoder family (model/models/); a plain dict, read without building models
MODEL_REGISTRY: dict[str, str] = ARCHITECTURES


def torch_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {name!r}.")
    return _DTYPES[name]


def get_model(
    model_config: ModelConfig, group: Optional[TPGroup] = None, stage: Optional[PipelineStage] = None
) -> nn.Module:
    """Returns the model of `model_config` (`group`: this tensor-parallel rank's share of it;
    `stage`: the pipeline stage's layers; None: the whole), weights loaded, in eval mode on its
    device. A stage reads only its own tensors from the checkpoint."""
    started = time.perf_counter()
    group = group or TPGroup(0, 1)
    stage = stage or PipelineStage()
    hf_config = model_config.hf_config
    builder = family(decoder_architecture(hf_config))
    device = torch.device(model_config.device)
    dtype = torch_dtype(model_config.dtype)
    max_position = max(model_config.max_model_len, 1)
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
    q8_0 = source is None and model_config.quantization == "q8_0"
    if q8_0 and not _blocks_run_here(device, dtype):
        raise ValueError(f"quantization='q8_0' runs on the CPU with dtype float32; got {device}, {model_config.dtype}.")
    # the format each weight will be held in fixes where a rank's input share may start and stop
    if source is not None:
        tensors: Checkpoint = list(read_gguf(source, hf_config, builder, dequantize=not on_blocks))
        held = {name: t.qtype for name, t in tensors if on_blocks and not t.dense}
        placement = Placement(group, held.get, stage)
    elif q8_0:
        tensors, placement = safetensors_tensors(weight_files(model_dir)), Placement(group, _q8_0_linear_weight, stage)
    else:
        tensors, placement = safetensors_tensors(weight_files(model_dir)), Placement(group, stage=stage)
    if source is None and builder.split_checkpoint is not None:
        tensors = builder.split_checkpoint(tensors)
    with one_torch_thread():
        with built_on_meta():
            model = builder.build(hf_config, max_position, placement)
        model = _materialize(model, device, dtype)
        load_weights(model, tensors)
        _repack(model, next((t.mapped for _, t in tensors if isinstance(t, GGUFTensorRef)), None) if source else None)
        del tensors  # the GGUF handles' mapping stays only where blocks still view it
        if q8_0:
            _quantize_linears(model, FORMAT_IDS["Q8_0"])
        process = getattr(model, "process_weights_after_loading", None)
        if process is not None:
            process()
    model.eval()
    return_freed_memory()
    report(model, group)
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


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """torch's CPU ops in this block run on the calling thread: the load's ops (RoPE tables,
    copies) are small, and each OpenMP region of a team would wait for a second core, which at
    start-up is busy (the frontend loads its tokenizer; other processes): 0.2-0.3 s for the
    RoPE tables alone on a loaded 2-core machine, 0.02-0.04 s on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


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
                new = nn.Parameter(torch.empty(param.shape, device=device, dtype=dtype), requires_grad=False)
                new.__dict__.update(param.__dict__)  # its weight_loader
                replaced[id(param)] = new
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


def _q8_0_linear_weight(name: str) -> Optional[int]:
    """quantization='q8_0': every linear weight is held in Q8_0 blocks (the norms stay dense)."""
    return FORMAT_IDS["Q8_0"] if name.endswith("_proj.weight") else None


def _blocks_run_here(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and quant_kernels() is not None


Checkpoint = Iterable[tuple[str, CheckpointTensor]]


def load_weights(model: nn.Module, tensors: Checkpoint) -> None:
    """Hands every checkpoint tensor to its parameter's weight_loader (a fused projection's
    parts with their index), which reads the rank's share; a Linear / VocabEmbedding whose
    share came as GGML blocks then runs on them."""
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    unexpected: list[str] = []
    shard_for = getattr(model, "shard_for", lambda name: None)
    rename = getattr(model, "checkpoint_name", lambda name: name)
    skips = getattr(model, "skips", lambda name: False)
    for name, tensor in tensors:
        if "rotary_emb.inv_freq" in name:
            continue
        name = rename(name)
        if skips(name):  # another pipeline stage's: never read
            continue
        shard = shard_for(name)
        target, part = shard if shard is not None and shard[0] in params else (name, None)
        if target not in params:
            unexpected.append(name)
            continue
        param = params[target]
        getattr(param, "weight_loader", default_weight_loader)(param, tensor, part)
        loaded.add(target)
        if part is not None:
            loaded.add(f"{target}#{part}")
    if unexpected:
        raise ValueError(f"checkpoint tensors {unexpected[:8]} have no place in {type(model).__name__}.")
    _check_complete(model, params, loaded)
    for module in model.modules():
        parts = getattr(module, "pending_blocks", None)
        if parts:
            module.set_blocks(parts[0][1] if isinstance(module, VocabEmbedding) else parts)
            module.pending_blocks = []
    if getattr(model, "tie_word_embeddings", False):
        tie = getattr(model, "tie_blocks", None)
        if tie is not None:
            tie()


def _repack(model: nn.Module, mapping: Optional[torch.Tensor]) -> None:
    """Every Linear's blocks in the layout this kernel build reads fastest (Linear.repack), but a
    tied lm_head's (the embedding's rows, which its lookups read: one copy of the table). The
    weights a decode token streams, the repacked parts and the lm_head's (tied: the embedding's
    too), then lie in one buffer on huge pages (huge_pages.py: on 4 KiB pages the AVX2 greedy
    lm_head read SmolLM2's 30 MB in ~0.78 ms a token, on 2 MiB pages in ~0.57). The pages of
    `mapping` (the GGUF file) that only the moved parts viewed leave this process's resident
    memory: read once by the copy, never again (the page cache keeps them)."""
    kernels = quant_kernels()
    if kernels is None:
        return
    embeddings = [m for m in model.modules() if isinstance(m, VocabEmbedding) and m.blocks is not None]
    embedded = {m.blocks.data.data_ptr() for m in embeddings}
    head = getattr(model, "lm_head", None)
    linears = [m for m in model.modules() if isinstance(m, Linear) and m.blocks]
    tied = {id(m) for m in linears if any(w.data.data_ptr() in embedded for _, w in m.blocks)}
    moving = {id(w): w for m in linears for _, w in m.blocks
              if m is head or (id(m) not in tied and repacks(w, kernels))}
    if not moving:
        return
    arena = huge_page_buffer(sum(-(-w.data.numel() // 64) * 64 for w in moving.values()))
    used = 0

    def take(nbytes: int) -> torch.Tensor:  # the arena's next slot, 64-byte aligned
        nonlocal used
        slot = arena[used:used + nbytes]
        used += -(-nbytes // 64) * 64
        return slot

    moved: dict[int, QuantizedWeight] = {}
    for module in linears:
        if id(module) not in tied:
            module.repack(take)
        for i, (offset, weight) in enumerate(module.blocks):
            if module is head and weight.data.data_ptr() - arena.data_ptr() not in range(arena.numel()):
                if id(weight) not in moved:
                    moved[id(weight)] = QuantizedWeight(take(weight.data.numel()).view(weight.data.shape).copy_(weight.data),
                                                        weight.qtype, weight.k)
                module.blocks[i] = (offset, moved[id(weight)])
    for embedding in embeddings:
        embedding.blocks = moved.get(id(embedding.blocks), embedding.blocks)
    if mapping is None:
        return
    start, end, page = mapping.data_ptr(), mapping.data_ptr() + mapping.numel(), mmap.PAGESIZE
    madvise = ctypes.CDLL(None).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for weight in moving.values():
        lo, hi = weight.data.data_ptr(), weight.data.data_ptr() + weight.data.numel()
        lo, hi = -(-lo // page) * page, hi // page * page  # whole pages: the edges may hold a neighbour's bytes
        if start <= lo < hi <= end:
            madvise(lo, hi - lo, _MADV_DONTNEED)


_MADV_DONTNEED = 4  # Linux: drop the pages from this mapping; a file mapping's next read faults them in again


def _quantize_linears(model: nn.Module, qtype: int) -> None:
    """Every Linear's fp32 weight -> blocks of `qtype` (the tied lm_head too, as the embedding's)."""
    for module in model.modules():
        if isinstance(module, Linear) and module.blocks is None and module.weight.numel():
            module.set_blocks([(0, quantize(module.weight.data, qtype))])


def _block_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, (Linear, VocabEmbedding)) and m.blocks is not None]


def _parts(module: nn.Module) -> list[QuantizedWeight]:
    return [module.blocks] if isinstance(module.blocks, QuantizedWeight) else [part for _, part in module.blocks]


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
