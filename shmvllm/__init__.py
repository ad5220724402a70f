"""shmvllm: offline LLM inference with vLLM v1's architecture over shared-memory rings."""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "shmvllm.entrypoints.llm",
    "AsyncLLM": "shmvllm.engine.async_llm",
    "SamplingParams": "shmvllm.sampling_params",
    "RequestOutputKind": "shmvllm.sampling_params",
    "PoolingParams": "shmvllm.pooling_params",
    "RequestOutput": "shmvllm.outputs",
    "CompletionOutput": "shmvllm.outputs",
    "EmbeddingRequestOutput": "shmvllm.outputs",
    "EngineArgs": "shmvllm.engine.arg_utils",
    "EngineDeadError": "shmvllm.engine.exceptions",
    "TextPrompt": "shmvllm.inputs",
    "TokensPrompt": "shmvllm.inputs",
    "BeamSearchParams": "shmvllm.sampling_params",
    "install_as_vllm": "shmvllm.compat",
    "VLLM_API_VERSION": "shmvllm.compat",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Imports lazily, so that `import shmvllm` does not pay for torch until it is used."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'shmvllm' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
