"""Running code written for vLLM's offline API unchanged: `install_as_vllm()`.

After it, `import vllm` and the vLLM submodules programs import (vllm.sampling_params,
vllm.outputs, vllm.inputs, vllm.lora.request, vllm.engine.arg_utils, ...) resolve to shmvllm's
own modules (compat/vllm_modules.py), and importlib.metadata.version("vllm") answers
VLLM_API_VERSION. The convention is PyMySQL's install_as_MySQLdb().
"""

from __future__ import annotations

import sys

# The vLLM offline API that shmvllm implements: the v1 engine's LLM / SamplingParams surface.
VLLM_API_VERSION = "0.11.1"

__all__ = ["VLLM_API_VERSION", "install_as_vllm"]


def install_as_vllm() -> None:
    """Makes `import vllm` give shmvllm. Idempotent. A real vLLM already imported in this process
    is a RuntimeError (its modules would mix with shmvllm's). Engines then start as vLLM's do on
    Linux, forked from the caller (SHMVLLM_ENGINE_START / VLLM_WORKER_MULTIPROC_METHOD still choose)."""
    from shmvllm import envs
    from shmvllm.compat.vllm_modules import VllmFinder

    if any(isinstance(finder, VllmFinder) for finder in sys.meta_path):
        return
    loaded = sys.modules.get("vllm")
    if loaded is not None:
        raise RuntimeError(f"a vllm module is already imported ({getattr(loaded, '__file__', loaded)!r}); "
                           "call install_as_vllm() before anything imports vllm.")
    sys.meta_path.insert(0, VllmFinder())
    envs.set_default_engine_start("fork")
