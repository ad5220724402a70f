"""Builds and loads the C helper (`_native.c`) with the system C compiler, once per machine.

The shared library is cached under ``$IPC_NATIVE_CACHE``, or ``~/.cache/ipc-ring``, or, when
that cannot be used, ``$TMPDIR/ipc-ring-<uid>`` (each a private 0700 directory), keyed by a hash
of the source, the compiler and the machine, so a changed source is rebuilt and concurrent
first imports race harmlessly (each writes its own temporary file and renames it into place). When no compiler works, `load()` returns None and the ring
falls back to its pure-Python path (see ring.py); ``IPC_PURE_PYTHON=1`` forces that fallback.

Where Python's headers are installed, the library is built as a CPython extension module as
well (``-DIPC_PYTHON_MODULE``), whose METH_FASTCALL functions the ring calls on its hot path
instead of ctypes (`NativeLib.ext`); without them (or if that build fails) it is built for
ctypes alone.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.machinery
import importlib.util
import os
import platform
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
import warnings
from pathlib import Path
from types import ModuleType
from typing import Optional

SOURCE = Path(__file__).with_name("_native.c")
_CFLAGS = ["-O2", "-shared", "-fPIC", "-std=gnu11"]


class NativeLib:
    """The C functions, twice: `fast` keeps the GIL (short calls), `nogil` drops it (spinning, napping).

    The hot functions take (pointer, int, int) and are called without ctypes `argtypes`, which
    halves the call overhead: the base is passed as a `c_void_p`, bytes as their buffer pointer,
    Python ints as C ints (ctypes raises on ints that do not fit, it never truncates).
    `ext`: the same library as an extension module (push, reserve, commit, peek, release, take,
    take_many, push_many, the sleeps and the futex calls, with addresses as ints), or None when
    it was built without Python's headers.
    """

    def __init__(self, path: str, with_module: bool) -> None:
        self.path = path
        self.ext: Optional[ModuleType] = _load_module(path) if with_module else None
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
            "ipc_sleep_consumer": (ctypes.c_int, [ptr, i64, i64]),
            "ipc_sleep_producer": (ctypes.c_int, [ptr, i64, i64, i64]),
            "ipc_wake_sleeper": (ctypes.c_int, [ptr, i64]),
            "ipc_futex_wait": (ctypes.c_int, [ptr, ctypes.c_uint32, i64]),
            "ipc_futex_wake": (ctypes.c_int, [ptr, ctypes.c_int]),
            "ipc_load": (u64, [ptr, i64]),
            "ipc_store": (None, [ptr, i64, u64]),
        }
        for lib in (self.fast, self.nogil):
            for name, (restype, argtypes) in signatures.items():
                fn = getattr(lib, name)
                fn.restype, fn.argtypes = restype, argtypes


def _load_module(path: str) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader("_ipc_fast", path)
    spec = importlib.util.spec_from_loader("_ipc_fast", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _flag_sets() -> list[list[str]]:
    """Compiler flags to try, best first: as an extension module too, then for ctypes alone."""
    include = sysconfig.get_paths().get("include")
    plain = list(_CFLAGS)
    if include and os.path.exists(os.path.join(include, "Python.h")):
        return [[*plain, "-DIPC_PYTHON_MODULE", f"-I{include}"], plain]
    return [plain]


def _cache_dirs() -> list[Path]:
    """Where the library may be cached, best first: $IPC_NATIVE_CACHE alone when set, else
    ~/.cache/ipc-ring and then a per-user directory under the temporary directory (for a home
    that is read-only or missing, as in some containers and CI sandboxes)."""
    override = os.environ.get("IPC_NATIVE_CACHE")
    if override:
        return [Path(override)]
    return [Path.home() / ".cache" / "ipc-ring", Path(tempfile.gettempdir()) / f"ipc-ring-{os.getuid()}"]


def private_dir(base: Path) -> Path:
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


def find_compiler() -> Optional[str]:
    """The system C compiler: $CC, else cc, gcc or clang on PATH; None if there is none."""
    for candidate in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if candidate and shutil.which(candidate):
            return candidate
    return None


def build(cc: str, flags: list[str], target: Path, source: Path = SOURCE) -> None:
    """Compiles `source` to `target` through a temporary file, so a reader never sees half a library."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name, suffix=".tmp")
    os.close(fd)
    try:
        subprocess.run([cc, *flags, "-o", tmp, str(source)], check=True, capture_output=True, timeout=120)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load() -> Optional[NativeLib]:
    """The compiled helper, building it on first use; None (with a warning) if that fails.

    A cache directory that cannot be used (not writable, not private, a full disk) moves on to
    the next one; a compiler error does not, as no directory would help: it moves on to the
    next set of flags (the extension module's build needs Python's headers to be usable).
    """
    if os.environ.get("IPC_PURE_PYTHON") == "1":
        return None
    cc = find_compiler()
    problems = [] if cc else ["no C compiler (cc, gcc, clang or $CC) on PATH"]
    for flags in _flag_sets() if cc else []:
        lib = _load_built(cc, flags, problems)
        if lib is not None:
            return lib
    warnings.warn(
        f"ipc: could not build the C helper ({'; '.join(problems)}); "
        "using the slower pure-Python ring with semaphore fences",
        RuntimeWarning,
        stacklevel=2,
    )
    return None


def _load_built(cc: str, flags: list[str], problems: list[str]) -> Optional[NativeLib]:
    """The library built with `flags`, from the first usable cache directory; None on failure."""
    key = hashlib.sha256(SOURCE.read_bytes() + cc.encode() + " ".join(flags).encode())
    filename = f"ipc_native-{key.hexdigest()[:16]}-{platform.machine()}-{sys.implementation.cache_tag}.so"
    for base in _cache_dirs():
        try:
            target = private_dir(base) / filename
            if not target.exists():
                build(cc, flags, target)
            return NativeLib(str(target), with_module="-DIPC_PYTHON_MODULE" in flags)
        except subprocess.CalledProcessError as exc:
            problems.append(f"{cc} {' '.join(flags)} failed: {exc.stderr.decode(errors='replace')[:500]}")
            return None
        except (OSError, ImportError, subprocess.SubprocessError) as exc:
            problems.append(f"{base}: {exc}")
    return None
