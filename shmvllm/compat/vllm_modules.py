"""The `vllm` module tree that `install_as_vllm()` puts on the import path.

A vLLM module name maps to the shmvllm module that holds the same names: `import
vllm.sampling_params` gives shmvllm.sampling_params itself (the same module object, so classes are
identical and names added to it later appear there too). A vLLM name that has submodules is a
small package module that looks names up in its shmvllm counterpart. A module or name vLLM has and
shmvllm lacks gives the ImportError / ModuleNotFoundError that importing it from vLLM would give
when it is missing.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import sys
import types
from pathlib import Path
from typing import Any, Iterable, Optional

# vLLM module -> the shmvllm module with its names (None: a package with submodules only).
MODULES: dict[str, Optional[str]] = {
    "vllm": None,  # its names: TOPLEVEL
    "vllm.sampling_params": "shmvllm.sampling_params",
    "vllm.pooling_params": "shmvllm.pooling_params",
    "vllm.outputs": "shmvllm.outputs",
    "vllm.logprobs": "shmvllm.logprobs",
    "vllm.inputs": "shmvllm.inputs",
    "vllm.inputs.data": "shmvllm.inputs",
    "vllm.lora": None,
    "vllm.lora.request": "shmvllm.lora",
    "vllm.config": "shmvllm.config",
    "vllm.engine": None,
    "vllm.engine.arg_utils": "shmvllm.engine.arg_utils",
    "vllm.engine.llm_engine": "shmvllm.engine.llm_engine",
    "vllm.engine.async_llm_engine": "shmvllm.engine.async_llm",
    "vllm.entrypoints": None,
    "vllm.entrypoints.llm": "shmvllm.entrypoints.llm",
    "vllm.entrypoints.chat_utils": "shmvllm.engine.renderer",
    "vllm.transformers_utils": None,
    "vllm.transformers_utils.tokenizer": "shmvllm.engine.renderer",
    "vllm.beam_search": "shmvllm.beam_search",
    "vllm.platforms": "shmvllm.compat.platforms",
    "vllm.distributed": "shmvllm.compat.distributed",
    "vllm.tasks": "shmvllm.compat.tasks",
    "vllm.utils": "shmvllm.compat.argparse_utils",
    "vllm.utils.argparse_utils": "shmvllm.compat.argparse_utils",
    "vllm.v1": None,
    "vllm.v1.engine": "shmvllm.compat.v1_engine",
    "vllm.v1.engine.detokenizer": "shmvllm.compat.v1_detokenizer",
    "vllm.v1.engine.core": "shmvllm.engine.core",
    "vllm.v1.engine.llm_engine": "shmvllm.engine.llm_engine",
    "vllm.v1.engine.async_llm": "shmvllm.engine.async_llm",
    "vllm.v1.metrics": None,
    "vllm.v1.metrics.reader": "shmvllm.metrics",
}

# `from vllm import X`: X -> the shmvllm module defining it.
TOPLEVEL: dict[str, str] = {
    "LLM": "shmvllm.entrypoints.llm",
    "LLMEngine": "shmvllm.engine.llm_engine",
    "AsyncLLMEngine": "shmvllm.engine.async_llm",
    "EngineArgs": "shmvllm.engine.arg_utils",
    "SamplingParams": "shmvllm.sampling_params",
    "PoolingParams": "shmvllm.pooling_params",
    "TextPrompt": "shmvllm.inputs",
    "TokensPrompt": "shmvllm.inputs",
    "PromptType": "shmvllm.inputs",
    "RequestOutput": "shmvllm.outputs",
    "CompletionOutput": "shmvllm.outputs",
    "PoolingOutput": "shmvllm.outputs",
    "PoolingRequestOutput": "shmvllm.outputs",
    "EmbeddingOutput": "shmvllm.outputs",
    "EmbeddingRequestOutput": "shmvllm.outputs",
    "ClassificationOutput": "shmvllm.outputs",
    "ClassificationRequestOutput": "shmvllm.outputs",
    "ScoringOutput": "shmvllm.outputs",
    "ScoringRequestOutput": "shmvllm.outputs",
}


def _is_package(name: str) -> bool:
    return any(other.startswith(name + ".") for other in MODULES)


class _Facade(types.ModuleType):
    """A vLLM package module: its names come from its shmvllm counterpart, looked up on access."""

    def __getattr__(self, attr: str) -> Any:
        names = _facade_names(self.__name__)
        if attr in names:
            return getattr(importlib.import_module(names[attr]), attr)
        raise AttributeError(f"module {self.__name__!r} has no attribute {attr!r}")

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(_facade_names(self.__name__)))


def _facade_names(name: str) -> dict[str, str]:
    if name == "vllm":
        return TOPLEVEL
    target = MODULES.get(name)
    if target is None:
        return {}
    module = importlib.import_module(target)
    return {attr: target for attr in dir(module) if not attr.startswith("_")}


class _Loader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _Facade(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        name = module.__name__
        if name == "vllm":
            from shmvllm.compat import VLLM_API_VERSION

            module.__version__ = VLLM_API_VERSION
            module.__version_tuple__ = tuple(int(p) for p in VLLM_API_VERSION.split("."))
            return
        target = MODULES[name]
        if target is not None and not _is_package(name):
            # The shmvllm module itself: the import system returns what sys.modules holds now,
            # without touching the module's own __spec__ / __name__.
            sys.modules[name] = importlib.import_module(target)


class _VllmMetadata(importlib.metadata.Distribution):
    """The `vllm` distribution that importlib.metadata.version("vllm") finds: the vLLM API version
    shmvllm implements."""

    def read_text(self, filename: str) -> Optional[str]:
        from shmvllm.compat import VLLM_API_VERSION

        if filename == "METADATA":
            return f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_API_VERSION}\nSummary: shmvllm's vLLM API\n"
        return None

    def locate_file(self, path: Any) -> Path:
        return Path(__file__).resolve().parent.parent / str(path)


class VllmFinder(importlib.metadata.DistributionFinder):
    """On sys.meta_path: finds the `vllm` modules of MODULES, and the `vllm` distribution."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname not in MODULES:
            return None
        return importlib.machinery.ModuleSpec(
            fullname, _Loader(), is_package=_is_package(fullname) or fullname == "vllm"
        )

    def find_distributions(self, context: Any = importlib.metadata.DistributionFinder.Context()) -> Iterable[importlib.metadata.Distribution]:
        name = getattr(context, "name", None)
        if name is None or name.lower().replace("-", "_") == "vllm":
            yield _VllmMetadata()
