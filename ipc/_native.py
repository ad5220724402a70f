"""Builds and loads the C helper (`_native.c`) with the system C compiler, once per machine.

The shared library is cached under ``$IPC_NATIVE_CACHE``, or ``~/.cache/ipc-ring``, or, when
that cannot be used, ``$TMPDIR/ipc-ring-<uid>`` (each a private 0700 directory), keyed by a hash
of the source, the compiler and the machine, so a changed source is rebuilt and concurrent
first imports race harmlessly (each writes its own temporary file and renames it into place). When no compiler works, `load()` returns None and the ring
falls back to its pure-Python path (see ring.py); ``IPC_PURE_PYTHON=1`` forces that fallback.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Optional

SOURCE = Path(__file__).with_name("_native.c")
_CFLAGS = ["-O2", "-shared", "-fPIC", "-std=gnu11"]


class NativeLib:
    """The C functions, twice: `fast` keeps the GIL (short calls), `nogil` drops it (spinning, napping).

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
            "ipc_nap_consumer": (ctypes.c_int, [ptr, i64, i64, i64]),
            "ipc_nap_producer": (ctypes.c_int, [ptr, i64, i64, i64, i64]),
            "ipc_load": (u64, [ptr, i64]),
            "ipc_store": (None, [ptr, i64, u64]),
            "ipc_floor_pingpong": (i64, [ptr, i64, i64, i64, i64]),
        }
        for lib in (self.fast, self.nogil):
            for name, (restype, argtypes) in signatures.items():
                fn = getattr(lib, name)
                fn.restype, fn.argtypes = restype, argtypes


def _cache_dirs() -> list[Path]:
    """Where the library may be cached, best first: $IPC_NATIVE_CACHE alone when set, else
    ~/.cache/ipc-ring and then a per-user directory under the temporary directory (for a home
    that is read-only or missing, as in some containers and CI sandboxes)."""
    override = os.environ.get("IPC_NATIVE_CACHE")
    if override:
        return [Path(override)]
    return [Path.home() / ".cache" / "ipc-ring", Path(tempfile.gettempdir()) / f"ipc-ring-{os.getuid()}"]


def _private_dir(base: Path) -> Path:
    """`base`, created 0700 if missing. We load code from it, so it must be a real directory of
    ours that nobody else can write to; PermissionError otherwise."""
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(base)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise PermissionError(
            f"native cache {base} is not a private directory of uid {os.getuid()} "
            f"(owner {st.st_uid}, mode {stat.S_IMODE(st.st_mode):#o})"
        )
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
    """The compiled helper, building it on first use; None (with a warning) if that fails.

    A cache directory that cannot be used (not writable, not private, a full disk) moves on to
    the next one; a compiler error does not, as no directory would help.
    """
    if os.environ.get("IPC_PURE_PYTHON") == "1":
        return None
    cc = _compiler()
    problems = [] if cc else ["no C compiler (cc, gcc, clang or $CC) on PATH"]
    if cc:
        key = hashlib.sha256(SOURCE.read_bytes() + cc.encode() + " ".join(_CFLAGS).encode())
        filename = f"ipc_native-{key.hexdigest()[:16]}-{platform.machine()}-{sys.implementation.cache_tag}.so"
        for base in _cache_dirs():
            try:
                target = _private_dir(base) / filename
                if not target.exists():
                    _build(cc, target)
                return NativeLib(str(target))
            except subprocess.CalledProcessError as exc:
                problems.append(f"{cc} failed: {exc.stderr.decode(errors='replace')[:500]}")
                break
            except (OSError, subprocess.SubprocessError) as exc:
                problems.append(f"{base}: {exc}")
    warnings.warn(
        f"ipc: could not build the C helper ({'; '.join(problems)}); "
        "using the slower pure-Python ring with semaphore fences",
        RuntimeWarning,
        stacklevel=2,
    )
    return None
