"""Checks of what users hand the frontend, done before anything starts or is queued.

- `check_engine_args`: every EngineArgs field against its type hint (so a new field is checked
  too), and the values the engine process would otherwise refuse only after it started
  (device, seed).
- `check_against_model`: what the engine would refuse only once it loads the model: weights
  the loader cannot read, engine arguments the model's config rules out (a KV cache budget
  below one block).
- `as_prompt_list` / `as_conversations`: the shapes `generate` and `chat` accept, with errors
  that name the argument and the value instead of whatever Python says about iterating a
  None or indexing a dict.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from typing import Any, Literal, Optional, Union

_INT64_MIN, _UINT64_MAX = -(2**63), 2**64 - 1
_CUDA_DEVICE = re.compile(r"^cuda(?::(\d+))?$")


def _short(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _matches(value: Any, hint: Any) -> bool:
    """Whether `value` is of the type `hint` names (the shapes EngineArgs' hints use)."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return True
    if origin is Union:
        return any(_matches(value, arg) for arg in typing.get_args(hint))
    if origin is Literal:
        return any(value == arg and type(value) is type(arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin is not None:
        return isinstance(value, origin)
    return isinstance(value, hint) if isinstance(hint, type) else True


def _type_name(hint: Any) -> str:
    """'int or None' for Optional[int], 'bool' for bool: the names a user writes."""
    if hint is type(None):
        return "None"
    if isinstance(hint, type):
        return hint.__name__
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(hint))
    return str(hint).replace("typing.", "")


def check_engine_args(args: Any) -> None:
    """TypeError / ValueError naming the EngineArgs field and its value; nothing is started.

    Checks the fields EngineArgs declares itself (shmvllm's knobs; the rest of vLLM's arguments
    have their own checks in the compat layer) against their type hints."""
    hints = typing.get_type_hints(type(args))
    own = type(args).__annotations__
    for f in dataclasses.fields(args):
        if f.name not in own:
            continue
        value = getattr(args, f.name)
        hint = hints.get(f.name, Any)
        if not _matches(value, hint):
            expected = _type_name(hint)
            raise TypeError(f"{f.name} must be {expected}, got {_short(value)} ({type(value).__name__}).")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{f.name} must be a finite number, got {value!r}.")
    if args.seed is not None and not _INT64_MIN <= args.seed <= _UINT64_MAX:
        raise ValueError(f"seed must be in [{_INT64_MIN}, {_UINT64_MAX}], got {args.seed}.")
    _check_device(args.device)


def _check_device(device: str) -> None:
    if device in ("auto", "cpu"):
        return
    match = _CUDA_DEVICE.match(device)
    if match is None:
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}.")
    import torch

    if not torch.cuda.is_available():
        raise ValueError(f"device={device!r}, but CUDA is not available here; use device='cpu' (or 'auto').")
    index = int(match.group(1) or 0)
    if index >= torch.cuda.device_count():
        raise ValueError(f"device={device!r}, but there are {torch.cuda.device_count()} CUDA devices.")


DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def kv_cache_shape(hf_config: Any, num_blocks: int, block_size: int, tensor_parallel_size: int = 1) -> tuple[int, ...]:
    """The KV cache's [layers, 2, kv_heads, num_blocks, block_size, head_dim] on the rank that
    holds the most KV heads, from the config: the layout `ModelRunner.initialize_kv_cache` builds."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    rank_kv_heads = -(-kv_heads // tensor_parallel_size)  # the first ranks take the remainder
    return (hf_config.num_hidden_layers, 2, rank_kv_heads, num_blocks, block_size, head_dim)


def kv_cache_bytes_per_block(hf_config: Any, dtype: str, block_size: int, tensor_parallel_size: int = 1) -> int:
    """Bytes of one KV-cache block across all layers (keys and values) on the rank that holds
    the most KV heads: what `ModelRunner.kv_cache_bytes_per_block` finds once the model is built."""
    return math.prod(kv_cache_shape(hf_config, 1, block_size, tensor_parallel_size)) * DTYPE_BYTES[dtype]


def check_against_model(config: Any, source: Any) -> None:
    """ValueError naming the weights file the loader could not read, or the engine argument
    the model rules out (`config`: an EngineConfig; `source`: its model.registry.ModelSource)."""
    from shmvllm.model.registry import check_safetensors_header, weight_files

    model, cache = config.model_config, config.cache_config
    if source.gguf_file is None:
        for path in weight_files(model.model_dir):
            check_safetensors_header(path)
    if not model.is_embedding:
        check_kv_budget(cache.kv_cache_memory, cache.num_kv_blocks, cache.block_size, model.hf_config, model.dtype,
                        model.device, config.parallel_config.tensor_parallel_size)


def check_kv_budget(kv_cache_memory: Optional[int], num_kv_blocks: Optional[int], block_size: int, hf_config: Any,
                    dtype: str, device: str, tensor_parallel_size: int) -> None:
    """ValueError where a CPU KV budget in bytes holds no block (a count of blocks, or a CUDA
    engine's share of its device, is not checked)."""
    if num_kv_blocks is not None or kv_cache_memory is None or not device.startswith("cpu"):
        return
    per_block = kv_cache_bytes_per_block(hf_config, dtype, block_size, tensor_parallel_size)
    if kv_cache_memory < per_block:
        raise ValueError(
            f"kv_cache_memory={kv_cache_memory} bytes holds no KV-cache block: one block of "
            f"{block_size} tokens takes {per_block} bytes for this model in {dtype}."
        )


def as_prompt_list(prompts: Any) -> list[Any]:
    """The prompts of a call as a list: one prompt (text, a prompt dict, or a bare list of
    token ids) as a list of one; a list of prompts as it is."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            return [list(prompts)]
        return list(prompts)
    raise TypeError(
        "prompts must be a str, a prompt dict ({'prompt': str} or {'prompt_token_ids': list[int]}) or a "
        f"list of those, got {_short(prompts)} ({type(prompts).__name__})."
    )


def as_conversations(messages: Any) -> list[list[dict[str, Any]]]:
    """The conversations of a chat call: one conversation (a list of message dicts) or a list
    of them. Each message's own fields are checked by the renderer."""
    if isinstance(messages, dict):
        raise TypeError(
            f"messages must be a list of message dicts (one conversation) or a list of such lists, got a dict "
            f"{_short(messages)}; wrap it in a list: [{{'role': ..., 'content': ...}}]."
        )
    if not isinstance(messages, (list, tuple)):
        raise TypeError(
            "messages must be a list of {'role', 'content'} dicts or a list of such lists, got "
            f"{_short(messages)} ({type(messages).__name__})."
        )
    if not messages:
        raise ValueError("messages is empty: give at least one {'role', 'content'} message.")
    if all(isinstance(m, dict) for m in messages):
        return [list(messages)]
    if all(isinstance(c, (list, tuple)) for c in messages):
        return [list(c) for c in messages]
    raise TypeError(
        "messages must be a list of {'role', 'content'} dicts (one conversation) or a list of such lists "
        f"(several), not a mix; got {_short(messages)}."
    )
