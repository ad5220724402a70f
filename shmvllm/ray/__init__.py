"""shmvllm on Ray: batch generation and embedding over a Ray cluster, one engine per replica.

    import ray
    from shmvllm.ray import ProcessorConfig, build_processor

    processor = build_processor(ProcessorConfig(model="smollm2-135m-instruct", concurrency=4,
                                                sampling_params={"temperature": 0.0, "max_tokens": 64}))
    ds = processor(ray.data.from_items([{"prompt": p} for p in prompts]))
    for row in ds.iter_rows(): print(row["prompt"], row["generated_text"])

Needs the `ray` extra (`pip install 'shmvllm[ray]'`).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ProcessorConfig": "shmvllm.ray.config",
    "Processor": "shmvllm.ray.processor",
    "build_processor": "shmvllm.ray.processor",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Imports lazily: the config and the replica (what runs in an actor) do not need Ray Data
    imported, and can be used and tested without it."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'shmvllm.ray' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
