"""Builds and loads the C helper (`_native.c`) with the system C compiler, once per machine.

The shared library is cached under ``$IPC_NATIVE_CACHE`` or ``~/.cache/ipc-ring`` (a private
0700 directory), keyed by a hash of the source, the compiler and the machine, so a changed
source is rebuilt and concurrent first imports race harmlessly (each writes its own temporary
file and renames it into place). When no compiler works, `load()` returns None and the ring
falls back to its pure-Python path (see ring.py); ``IPC_PURE_PYTHON=1`` forces that fallback.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Optional

SOURCE = Path(__file__).with_name("_native.c")
_CFLAGS = ["-O2", "-shared", "-fPIC", "-std=gnu11"]


class NativeLib:
    """The C functions, twice: `fast` keeps the GIL (short calls), `nogil` drops it (spinning).

    The hot functions take (pointer, int, int) and are called without ctypes `argtypes`, which
    halves the call overhead: the base is passed as a `c_void_p`, bytes as their buffer pointer,
    Python ints as C ints (ctypes raises on ints that do not fit, it never truncates).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.fast = ctypes.PyDLL(path)
        self.nogil = ctypes.CDLL(path)
        i64, u64, ptr = ctypes.c_int64, ctypes.c_uint64, ctypes.c_void_p
        signatures = {
            "ipc_reserve": (i64, None),
            "ipc_commit": (ctypes.c_int, None),
            "ipc_push": (i64, None),
            "ipc_peek": (i64, None),
            "ipc_release": (ctypes.c_int, None),
            "ipc_arm_consumer": (ctypes.c_int, None),
            "ipc_arm_producer": (ctypes.c_int, [ptr, i64]),
            "ipc_disarm": (None, None),
            "ipc_spin_consumer": (ctypes.c_int, [ptr, i64]),
            "ipc_spin_producer": (ctypes.c_int, [ptr, i64, i64]),
            "ipc_load": (u64, [ptr, i64]),
            "ipc_store": (None, [ptr, i64, u64]),
            "ipc_floor_pingpong": (i64, [ptr, i64, i64, i64]),
        }
        for lib in (self.fast, self.nogil):
            for name, (restype, argtypes) in signatures.items():
                fn = getattr(lib, name)
                fn.restype, fn.argtypes = restype, argtypes


def _cache_dir() -> Path:
    override = os.environ.get("IPC_NATIVE_CACHE")
    base = Path(override) if override else Path.home() / ".cache" / "ipc-ring"
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    if base.stat().st_uid != os.getuid():
        raise PermissionError(f"native cache {base} is not owned by uid {os.getuid()}")
    return base


def _compiler() -> Optional[str]:
    for candidate in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if candidate and shutil.which(candidate):
            return candidate
    return None


def _build(cc: str, target: Path) -> None:
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name, suffix=".tmp")
    os.close(fd)
    try:
        subprocess.run([cc, *_CFLAGS, "-o", tmp, str(SOURCE)], check=True, capture_output=True, timeout=120)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load() -> Optional[NativeLib]:
    """The compiled helper, building it on first use; None (with a warning) if that fails."""
    if os.environ.get("IPC_PURE_PYTHON") == "1":
        return None
    cc = _compiler()
    try:
        if cc is None:
            raise FileNotFoundError("no C compiler (cc, gcc, clang or $CC) on PATH")
        key = hashlib.sha256(SOURCE.read_bytes() + cc.encode() + " ".join(_CFLAGS).encode())
        tag = f"{key.hexdigest()[:16]}-{platform.machine()}-{sys.implementation.cache_tag}"
        target = _cache_dir() / f"ipc_native-{tag}.so"
        if not target.exists():
            _build(cc, target)
        return NativeLib(str(target))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        warnings.warn(
            f"ipc: could not build the C helper ({exc} {detail.decode(errors='replace')[:500]}); "
            "using the slower pure-Python ring with semaphore fences",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
