"""CPU kernels in C (cpu_kernels.c, for fp32 and for bf16 activations; logprobs.c, the prompt
logprobs' reductions; encoder_gemm.c and encoder_attention.c, the encoders' AVX2 GEMM and
attention), compiled with the system C compiler on first use.

The library is built for this machine (-march=native; at most AVX2 with ``SHMVLLM_QUANT_ISA=avx2``)
and cached under ``~/.cache/shmvllm/kernels`` (or ``$TMPDIR/shmvllm-kernels-<uid>`` when the home directory
cannot be used), keyed by a hash of the source, the flags and the CPU, so a changed source or
another CPU builds anew; concurrent first uses race harmlessly (each compiles to a temporary
file and renames it into place). Without a working compiler `cpu_kernels()` returns None (with
a warning) and the model keeps to its pure-torch code; so does ``SHMVLLM_NATIVE_KERNELS=0``.
The torch code is the reference the kernels are tested against, and what CUDA and other
dtypes use. The bf16 build (-DSHM_BF16) has the same functions with bf16 tensors (fp32
arithmetic inside); `kernels_for` picks the build by the tensors' dtype.

`native_bf16()` says whether this CPU has bf16 dot-product instructions (AVX512-BF16, AMX-BF16,
Arm BF16), which `dtype="auto"` asks before choosing bf16; ``$SHMVLLM_CPU_BF16`` (0 / 1)
overrides what the CPU reports (tests simulate a CPU without bf16 with it).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.util
import os
import platform
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from ipc._native import find_compiler, private_dir  # the ring's C helper is built the same way
from shmvllm import envs

if TYPE_CHECKING:
    import torch

SOURCE = Path(__file__).with_name("cpu_kernels.c")
ATTENTION_HEADER = Path(__file__).with_name("attention.h")  # included by cpu_kernels.c and decode_step.c
# -ffast-math lets gcc vectorize expf through glibc's libmvec; the kernels never see inf or NaN.
# It is given to the compile step only: linked with -ffast-math, gcc adds crtfastmath.o, which
# would switch the whole process to flush-to-zero arithmetic at load time.
_CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=gnu11", "-c"]
# SHMVLLM_QUANT_ISA=avx2 caps these builds too, at x86-64-v3 (AVX2, FMA, F16C): an AVX-512 CPU then
# runs the instructions an AVX2 one would in every kernel, not only in the quantized ones.
_AVX2_MARCH = ["-march=x86-64-v3", "-mtune=native"]


def _native_cflags() -> list[str]:
    """_CFLAGS, with -march=native capped at AVX2 where $SHMVLLM_QUANT_ISA asks for the AVX2 build."""
    if envs.SHMVLLM_QUANT_ISA() != "avx2" or platform.machine() != "x86_64":
        return _CFLAGS
    return [g for f in _CFLAGS for g in (_AVX2_MARCH if f == "-march=native" else [f])]

_LDFLAGS = ["-shared", "-fopenmp"]
_LIBS = ["-lmvec", "-lm"]

_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
_SIGNATURES = {
    "shm_write_kv_cache": (None, [_ptr, _i64, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64]),
    "shm_paged_decode_attention": (
        ctypes.c_int,
        [_ptr, _i64, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _f32],
    ),
    "shm_paged_decode_attention_ex": (
        ctypes.c_int,
        [_ptr, _i64, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _f32, _i64, _f32, _ptr],
    ),
    "shm_rms_norm": (None, [_ptr, _ptr, _ptr, _i64, _i64, _f32]),
    "shm_silu_and_mul": (None, [_ptr, _ptr, _i64, _i64]),
    "shm_gelu_tanh_and_mul": (None, [_ptr, _ptr, _i64, _i64]),
    "shm_rotary": (None, [_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr]),
    "shm_linear_few_rows": (None, [_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64]),
}


def _cpu_identity() -> bytes:
    """What -march=native depends on: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor().encode()
    wanted = [line for line in lines if line.startswith(("model name", "flags"))][:2]
    return "\n".join(wanted).encode()


def _cache_dirs() -> list[Path]:
    return [Path.home() / ".cache" / "shmvllm" / "kernels", Path(tempfile.gettempdir()) / f"shmvllm-kernels-{os.getuid()}"]


COMPILE_TIMEOUT_S = 600
"""A build of quant_kernels.c took 48-60 s on 2 cores shared with other work (load ~10)."""


def _compile(cc: str, target: Path, source: Path = SOURCE, cflags: list[str] = _CFLAGS) -> None:
    cflags = [*cflags, f"-I{source.parent}"]
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name, suffix=".tmp")
    os.close(fd)
    obj = tmp + ".o"
    try:
        subprocess.run([cc, *cflags, "-o", obj, str(source)], check=True, capture_output=True, timeout=COMPILE_TIMEOUT_S)
        subprocess.run([cc, *_LDFLAGS, "-o", tmp, obj, *_LIBS], check=True, capture_output=True, timeout=COMPILE_TIMEOUT_S)
        os.replace(tmp, target)
    finally:
        for leftover in (tmp, obj):
            if os.path.exists(leftover):
                os.unlink(leftover)


@functools.lru_cache(maxsize=None)
def _bind_torch_openmp() -> None:
    """Loads torch's own libgomp.so.1 (by path, without importing torch) before any kernel
    library, so that the kernels and torch share one OpenMP runtime whichever loads first (the
    engine runs the kernels before torch has imported); the system's where torch has none."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return
    bundled = Path(spec.origin).parent / "lib" / "libgomp.so.1"
    if bundled.exists():
        ctypes.CDLL(str(bundled), mode=ctypes.RTLD_GLOBAL)


def _load(path: Path, signatures: dict = _SIGNATURES) -> ctypes.CDLL:
    _bind_torch_openmp()
    lib = ctypes.CDLL(str(path))  # CDLL: calls release the GIL
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def kernels_for(*tensors: torch.Tensor) -> Optional[ctypes.CDLL]:
    """The kernels when they apply to these tensors: all on the CPU and all fp32 (the fp32
    build) or all bf16 (the bf16 build); else None."""
    dtype = tensors[0].dtype
    if _dtype_name(dtype) not in _KERNEL_DTYPES:
        return None
    for t in tensors:
        if t.dtype != dtype or t.device.type != "cpu":
            return None
    return cpu_kernels(dtype)


def _build(stem: str, source: Path, cflags: list[str], signatures: dict, includes: tuple[Path, ...] = ()) -> Optional[ctypes.CDLL]:
    """Compiles `source` (which #includes `includes`) with `cflags` into the private cache (once
    per sources, flags and CPU) and loads it; None, with a warning, when there is no compiler or
    the build fails."""
    if not envs.SHMVLLM_NATIVE_KERNELS() or platform.machine() not in ("x86_64", "aarch64"):
        return None
    cc = find_compiler()
    if cc is None:
        warnings.warn("shmvllm: no C compiler found; the model runs in plain torch (slower)", RuntimeWarning, stacklevel=3)
        return None
    key = hashlib.sha256(b"".join(p.read_bytes() for p in (source, *includes)) + cc.encode() + " ".join(cflags + _LDFLAGS + _LIBS).encode() + _cpu_identity())
    filename = f"{stem}-{key.hexdigest()[:16]}-{platform.machine()}.so"
    problems = []
    for base in _cache_dirs():
        try:
            target = private_dir(base) / filename
            if not target.exists():
                _compile(cc, target, source, cflags)
            return _load(target, signatures)
        except subprocess.CalledProcessError as exc:
            problems.append(f"{cc} failed: {exc.stderr.decode(errors='replace')[:500]}")
            break
        except (OSError, subprocess.SubprocessError) as exc:
            problems.append(f"{base}: {exc}")
    warnings.warn(f"shmvllm: could not build {source.name} ({'; '.join(problems)}); using plain torch", RuntimeWarning, stacklevel=3)
    return None


# by torch dtype name: this module imports no torch (the engine's first requests run without it)
_KERNEL_DTYPES = {"float32": ("cpu_kernels", []), "bfloat16": ("cpu_kernels_bf16", ["-DSHM_BF16"])}


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def cpu_kernels(dtype: Optional[torch.dtype] = None) -> Optional[ctypes.CDLL]:
    """The compiled kernels for `dtype` (torch.float32, the default, or torch.bfloat16)
    activations, built on first use; None when disabled or when building fails."""
    name = "float32" if dtype is None else _dtype_name(dtype)
    if name not in _KERNEL_DTYPES:
        raise ValueError(f"the CPU kernels are built for {sorted(f'torch.{n}' for n in _KERNEL_DTYPES)}, not {dtype}.")
    return _cpu_kernels(name)


@functools.lru_cache(maxsize=None)
def _cpu_kernels(dtype: str) -> Optional[ctypes.CDLL]:
    stem, defines = _KERNEL_DTYPES[dtype]
    return _build(stem, SOURCE, _native_cflags() + defines, _SIGNATURES, (ATTENTION_HEADER,))


LOGPROB_SOURCE = Path(__file__).with_name("logprobs.c")
_LOGPROB_SIGNATURES = {
    "shm_logprob_rows": (
        ctypes.c_int, [_ptr, _i64, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _i64],
    ),
}


@functools.lru_cache(maxsize=None)
def logprob_kernels() -> Optional[ctypes.CDLL]:
    """The fused logprob kernel (logprobs.c) for fp32 logits, built on first use; None when
    disabled or when building fails."""
    return _build("logprob_kernels", LOGPROB_SOURCE, _native_cflags(), _LOGPROB_SIGNATURES)


ENCODER_GEMM_SOURCE = Path(__file__).with_name("encoder_gemm.c")
_ENCODER_GEMM_SIGNATURES = {
    "shm_encoder_packed_floats": (_i64, [_i64, _i64]),
    "shm_encoder_pack": (None, [_ptr, _ptr, _i64, _i64, _ptr]),
    "shm_encoder_gemm": (None, [_ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _i64, _ptr, _i64, ctypes.c_int]),
    "shm_encoder_token_wise": (
        ctypes.c_int,
        [_ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, ctypes.c_int, _ptr, _ptr, _ptr, ctypes.c_float, _ptr, _i64],
    ),
}
# AVX2 + FMA code whatever the build machine (-mtune only): the encoders' kernel on every x86 build but
# `portable` (512-bit FMAs gave no more FLOPs on Zen 4: benchmarks/results/embed.md).
_ENCODER_GEMM_FLAGS = ["-O3", "-mavx2", "-mfma", "-mtune=native", "-fopenmp", "-fPIC", "-std=gnu11", "-c"]


@functools.lru_cache(maxsize=None)
def encoder_gemm_kernels() -> Optional[ctypes.CDLL]:
    """The encoders' AVX2 fp32 GEMM (encoder_gemm.c), built on first use; None when disabled,
    not on x86, or when building fails."""
    if platform.machine() != "x86_64":
        return None
    return _build("encoder_gemm", ENCODER_GEMM_SOURCE, _ENCODER_GEMM_FLAGS, _ENCODER_GEMM_SIGNATURES)


ENCODER_ATTENTION_SOURCE = Path(__file__).with_name("encoder_attention.c")
_ENCODER_ATTENTION_SIGNATURES = {
    "shm_encoder_attention": (ctypes.c_int, [_ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _ptr, _i64, _ptr]),
}


@functools.lru_cache(maxsize=None)
def encoder_attention_kernels() -> Optional[ctypes.CDLL]:
    """The encoders' fp32 attention over packed sequences (encoder_attention.c, AVX2 + FMA code
    like encoder_gemm.c), built on first use; None when disabled, not on x86, or when building fails."""
    if platform.machine() != "x86_64":
        return None
    return _build("encoder_attention", ENCODER_ATTENTION_SOURCE, _ENCODER_GEMM_FLAGS, _ENCODER_ATTENTION_SIGNATURES)


BF16_ENV = "SHMVLLM_CPU_BF16"
_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # x86 AVX512-BF16 / AMX-BF16, Arm FEAT_BF16


def native_bf16() -> tuple[bool, str]:
    """(whether this CPU has native bf16 dot products, why): from /proc/cpuinfo's flags, or
    ``$SHMVLLM_CPU_BF16`` = 1 / 0 when set."""
    forced = envs.SHMVLLM_CPU_BF16()
    if forced is not None:
        if forced not in ("0", "1"):
            raise ValueError(f"{BF16_ENV} must be 0 or 1, got {forced!r}.")
        return forced == "1", f"{BF16_ENV}={forced}"
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False, "/proc/cpuinfo is unreadable"
    flags = set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            flags = set(line.partition(":")[2].split())
            break
    found = [flag for flag in _BF16_FLAGS if flag in flags]
    return (True, f"the CPU reports {', '.join(found)}") if found else (False, "the CPU reports no avx512_bf16 / amx_bf16 / bf16")


QUANT_SOURCE = Path(__file__).with_name("quant_kernels.c")
QUANT_FORMATS_SOURCE = Path(__file__).with_name("quant_formats.h")
QUANT_INT8_SOURCE = Path(__file__).with_name("quant_int8.h")
QUANT_GEMM_INT8_SOURCE = Path(__file__).with_name("quant_gemm_int8.h")
# decode_step.c includes quant_kernels.c: one library per ISA holds both.
STEP_SOURCE = Path(__file__).with_name("decode_step.c")
MOE_SOURCE = Path(__file__).with_name("moe.c")  # included by decode_step.c
GREEDY_HEAD_SOURCE = Path(__file__).with_name("greedy_head.c")  # included by decode_step.c
_QUANT_SIGNATURES = {
    "shm_decode_step": (ctypes.c_int, [_ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr]),
    "shm_decode_scratch_floats": (_i64, [_ptr, _i64]),
    "shm_decode_burst": (_i64, [_ptr, _ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr, _ptr]),
    "shm_decode_burst_floats": (_i64, [_ptr, _ptr]),
    "shm_q8_0_row_norms": (ctypes.c_int, [_ptr, _i64, _i64, _i64, _ptr]),
    "shm_greedy_head": (_i64, [_ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _i64, ctypes.c_int, _ptr]),
    "shm_read_probe": (ctypes.c_double, [_ptr, _i64, ctypes.c_int]),
    "shm_moe_experts": (ctypes.c_int, [_ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, ctypes.c_int]),
    "shm_moe_scratch_floats": (_i64, [_ptr, _i64]),
    "shm_qgemm": (ctypes.c_int, [_ptr, _i64, _ptr, _i64, _ptr, _i64, ctypes.c_int, _ptr, _ptr, _i64, _i64, _i64, _i64]),
    "shm_qdequant_rows": (ctypes.c_int, [_ptr, _ptr, _i64, ctypes.c_int, _ptr, _i64, _i64, _i64]),
    "shm_qrepack_type": (ctypes.c_int, [ctypes.c_int, _i64]),
    "shm_qrepack": (ctypes.c_int, [_ptr, _ptr, _i64, ctypes.c_int, _i64, _i64]),
    "shm_qblock_bytes": (ctypes.c_int, [ctypes.c_int]),
    "shm_qblock_values": (ctypes.c_int, [ctypes.c_int]),
    "shm_qvector_width": (ctypes.c_int, []),
    "shm_quant_cpu_supports": (ctypes.c_int, [ctypes.c_int]),
}
# The quantized kernels' builds, best first: (name, id for shm_quant_cpu_supports, flags). No
# -march=native and no -ffast-math: the ISA is chosen here, and no reassociation may touch the
# dequantization arithmetic (see quant_kernels.c).
_X86 = platform.machine() in ("x86_64", "i686")
QUANT_ISAS: list[tuple[str, int, list[str]]] = [
    ("avx512vnni", 3, ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mavx2", "-mfma", "-mf16c", "-DVW=16"]),
    ("avx512", 2, ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c", "-DVW=16"]),
    ("avx2", 1, ["-mavx2", "-mfma", "-mf16c", "-DVW=8"]),
    ("portable", 0, ["-DVW=8"]),
] if _X86 else [("portable", 0, ["-DVW=8"])]
_QUANT_BASE_FLAGS = ["-O3", "-mtune=native", "-fopenmp", "-fPIC", "-std=gnu11", "-c"]


@functools.lru_cache(maxsize=None)
def _quant_build(isa: str) -> Optional[ctypes.CDLL]:
    flags = next(f for name, _, f in QUANT_ISAS if name == isa)
    return _build(f"quant_kernels-{isa}", STEP_SOURCE, _QUANT_BASE_FLAGS + flags, _QUANT_SIGNATURES,
                  (QUANT_SOURCE, QUANT_FORMATS_SOURCE, QUANT_INT8_SOURCE, QUANT_GEMM_INT8_SOURCE, ATTENTION_HEADER,
                   MOE_SOURCE, GREEDY_HEAD_SOURCE))


def quant_isas_supported() -> list[str]:
    """The quantized-kernel builds this CPU can run, best first (the portable one always)."""
    portable = _quant_build("portable")
    if portable is None:
        return []
    return [name for name, ident, _ in QUANT_ISAS if portable.shm_quant_cpu_supports(ident)]


@functools.lru_cache(maxsize=None)
def quant_kernels(isa: Optional[str] = None) -> Optional[ctypes.CDLL]:
    """The block-quantized GEMM kernels (quant_kernels.c) for `isa`, default the best this CPU
    runs, or ``$SHMVLLM_QUANT_ISA`` (avx512vnni | avx512 | avx2 | portable) when set; None when they cannot be
    built. Asking for a build the CPU cannot run is a ValueError."""
    isa = quant_isa(isa)
    return None if isa is None else _quant_build(isa)


def quant_isa(isa: Optional[str] = None) -> Optional[str]:
    """The quantized-kernel build `quant_kernels(isa)` loads: `isa`, else ``$SHMVLLM_QUANT_ISA``,
    else the best this CPU runs; None when none can be built."""
    isa = isa or envs.SHMVLLM_QUANT_ISA()
    names = [name for name, _, _ in QUANT_ISAS]
    if isa is not None and isa not in names:
        raise ValueError(f"SHMVLLM_QUANT_ISA / isa must be one of {names}, got {isa!r}.")
    supported = quant_isas_supported()
    if not supported:
        return None
    if isa is None:
        return supported[0]
    if isa not in supported:
        raise ValueError(f"quantized kernel build {isa!r} needs instructions this CPU lacks; it runs {supported}.")
    return isa
