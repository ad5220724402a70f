"""Every environment variable shmvllm reads, in one place (as vLLM's envs.py).

Each is read when it is used (`envs.NAME()`), not at import, so that a test or a program that
sets one before the call is obeyed; a bad value raises ValueError naming the variable. The
engine process inherits the frontend's environment. `VARIABLES` below is the one description
of each; README.md's table is checked against it (tests/test_envs.py).

The ipc/ library reads its own (IPC_NATIVE_CACHE, IPC_PURE_PYTHON, CC): it is a separate
package with no shmvllm knowledge, documented in its own modules.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

# name -> (default, what it does): README.md's table of environment variables.
VARIABLES: dict[str, tuple[str, str]] = {
    "SHMVLLM_CACHE": ("`~/.cache/shmvllm`", "where GGUF files' configs and tokenizers, and configs' full values, are cached"),
    "SHMVLLM_RING_CAPACITY": ("4194304", "bytes of each frontend<->engine ring (a multiple of 8)"),
    "SHMVLLM_MAX_N_SEQUENCES": ("16384", "the largest `SamplingParams.n` (vLLM's `VLLM_MAX_N_SEQUENCES`)"),
    "SHMVLLM_NATIVE_KERNELS": ("1", "0: never build or load the C kernels (torch paths only)"),
    "SHMVLLM_QUANT_ISA": ("the CPU's best", "`avx512vnni`, `avx512`, `avx2` or `portable`: which quantized GEMM build to load (BERT encoders run their AVX2 GEMM on every build but `portable`); `avx2` also builds the fp32 kernels for AVX2 (x86-64-v3), so an AVX-512 CPU stands in for an AVX2 one"),
    "SHMVLLM_FUSED_DECODE": ("1", "0: no fused C decode step for single-sequence decode"),
    "SHMVLLM_DECODE_BURST": (
        "8",
        "the most tokens one engine step decodes for a lone greedy request (in-process model; no draft-model "
        "speculation, async scheduling, logprobs, penalties, logits processors, grammar or stop strings; with n-gram "
        "speculation only in steps without proposals, up to the next token that has one); 1: one a step",
    ),
    "SHMVLLM_HUGE_PAGES": ("1", "0: no `madvise(MADV_HUGEPAGE)` on weights and the KV cache"),
    "SHMVLLM_CPU_BF16": ("from `/proc/cpuinfo`", "1 / 0: whether the CPU has native bf16 dot products"),
    "SHMVLLM_TP_ALLREDUCE": (
        "`shm`",
        "`shm` (the shared-memory arena, where its C helper builds) or `gloo`: how tensor-parallel ranks all-reduce",
    ),
    "SHMVLLM_ENGINE_START": (
        "`fork`",
        "how engine processes start: `program` (a fresh `python -m shmvllm.engine.core_proc`) or `fork` (a fork of "
        "the caller, as vLLM's: it sees the caller's monkeypatches, and is ready sooner, having no interpreter to "
        "start); unset: `VLLM_WORKER_MULTIPROC_METHOD`'s, else `fork` (`program` where CUDA is initialized in the caller)",
    ),
    "VLLM_WORKER_MULTIPROC_METHOD": ("unset", "vLLM's: `fork` or `spawn` (= `program`), read when `SHMVLLM_ENGINE_START` is unset"),
    "OMP_NUM_THREADS": (
        "one per core",
        "the engine's torch threads (with `data_parallel_size=N`: every engine's; default one per core of its "
        "cores / N share); read to decide whether the frontend naps",
    ),
}


def _raw(name: str) -> Optional[str]:
    return os.environ.get(name)


def _flag(name: str, default: bool) -> bool:
    raw = _raw(name)
    if raw is None or raw == "":
        return default
    if raw not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {raw!r}.")
    return raw == "1"


def _int(name: str) -> Optional[int]:
    raw = _raw(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}.") from None


def SHMVLLM_CACHE() -> Path:
    raw = _raw("SHMVLLM_CACHE")
    return Path(raw) if raw else Path.home() / ".cache" / "shmvllm"


def SHMVLLM_CACHE_IS_SET() -> bool:
    return bool(_raw("SHMVLLM_CACHE"))


def SHMVLLM_RING_CAPACITY() -> Optional[int]:
    return _int("SHMVLLM_RING_CAPACITY")


def SHMVLLM_MAX_N_SEQUENCES() -> Optional[int]:
    return _int("SHMVLLM_MAX_N_SEQUENCES")


def SHMVLLM_NATIVE_KERNELS() -> bool:
    return _flag("SHMVLLM_NATIVE_KERNELS", True)


def SHMVLLM_QUANT_ISA() -> Optional[str]:
    return _raw("SHMVLLM_QUANT_ISA") or None


def SHMVLLM_FUSED_DECODE() -> bool:
    return _flag("SHMVLLM_FUSED_DECODE", True)


def SHMVLLM_DECODE_BURST() -> int:
    value = _int("SHMVLLM_DECODE_BURST")
    if value is None:
        return 8
    if value < 1:
        raise ValueError(f"SHMVLLM_DECODE_BURST must be a positive integer, got {value!r}.")
    return value


def SHMVLLM_HUGE_PAGES() -> bool:
    return _flag("SHMVLLM_HUGE_PAGES", True)


def SHMVLLM_CPU_BF16() -> Optional[str]:
    """The raw value ("0" / "1" expected; checked by the caller), or None when unset."""
    return _raw("SHMVLLM_CPU_BF16")


def SHMVLLM_TP_ALLREDUCE() -> str:
    return _raw("SHMVLLM_TP_ALLREDUCE") or "shm"


_ENGINE_STARTS = {"program": "program", "fork": "fork", "spawn": "program"}
_default_engine_start = "fork"  # vLLM's default on Linux; no second interpreter start (startup.md)


def SHMVLLM_ENGINE_START() -> str:
    """"program" or "fork": SHMVLLM_ENGINE_START, else VLLM_WORKER_MULTIPROC_METHOD ("spawn" is
    "program": a fresh interpreter either way), else "fork"."""
    for name, raw, accepted in (
        ("SHMVLLM_ENGINE_START", _raw("SHMVLLM_ENGINE_START"), ("program", "fork")),
        ("VLLM_WORKER_MULTIPROC_METHOD", _raw("VLLM_WORKER_MULTIPROC_METHOD"), ("fork", "spawn")),
    ):
        if raw:
            if raw not in accepted:
                raise ValueError(f"{name} must be one of {accepted}, got {raw!r}.")
            return _ENGINE_STARTS[raw]
    return _default_engine_start


def set_default_engine_start(method: str) -> None:
    """The start method when neither variable is set (a Ray replica sets "program")."""
    global _default_engine_start
    if method not in ("program", "fork"):
        raise ValueError(f"the engine start method must be 'program' or 'fork', got {method!r}.")
    _default_engine_start = method


def OMP_NUM_THREADS() -> Optional[int]:
    """The value, or None when unset or not a positive int (torch then uses its default)."""
    raw = _raw("OMP_NUM_THREADS")
    try:
        value = int(raw) if raw else 0
    except ValueError:
        return None
    return value if value > 0 else None


def set_omp_num_threads(count: int) -> None:
    """Sets OMP_NUM_THREADS for engine processes started from now on (they inherit it)."""
    os.environ["OMP_NUM_THREADS"] = str(count)


def child_environment(pythonpath_first: str) -> dict[str, str]:
    """The environment of an engine process: this one's, with `pythonpath_first` leading PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (pythonpath_first, env.get("PYTHONPATH"))))
    return env
