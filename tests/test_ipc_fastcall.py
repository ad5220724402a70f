"""The C helper as a CPython extension module (METH_FASTCALL, the ring's hot path) and as a
plain library for ctypes: the same results, and a fallback to ctypes without Python's headers."""

from __future__ import annotations

import ctypes
import os
import random
import sysconfig
import warnings

import pytest

import ipc.ring as ring_module
from ipc import RingBuffer, native_available
from ipc import _native
from ipc import layout as L

HEADERS = os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))


@pytest.fixture
def plain_lib(tmp_path, monkeypatch) -> _native.NativeLib:
    """The helper built for ctypes alone (as where Python's headers are missing)."""
    monkeypatch.setenv("IPC_NATIVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(_native, "_flag_sets", lambda: [list(_native._CFLAGS)])
    lib = _native.load()
    assert lib is not None and lib.ext is None
    return lib


def test_the_ring_uses_the_extension_where_headers_exist():
    if not HEADERS:
        pytest.skip("Python's headers are not installed: the ring calls the helper through ctypes")
    assert native_available() and ring_module._native_lib().ext is not None


def test_extension_and_ctypes_give_the_same_results(plain_lib):
    """The same random operations on two rings, one per calling convention, return the same
    codes and leave the same bytes, including full, empty, wrapped and padded states."""
    if ring_module._native_lib().ext is None:
        pytest.skip("no extension module to compare (no Python headers)")
    with RingBuffer.create(512) as ext_ring, RingBuffer.create(512) as ctypes_ring:
        ops = [ext_ring._ops, ring_module._NativeOps(plain_lib, ctypes_ring._anchor)]
        rng = random.Random(7)
        for step in range(3000):
            choice, n = rng.random(), rng.randrange(0, 120)
            data = rng.randbytes(n)
            if choice < 0.35:
                results = [op.push(data, n) for op in ops]
            elif choice < 0.5:
                results = [op.reserve(n) for op in ops]
                if results[0] >= 0:
                    results += [op.commit(n, L.KIND_MSG) for op in ops]
            else:
                results = [op.peek() for op in ops]
                if results[0] >= 0:
                    results += [op.release() for op in ops]
            assert results[0::2] == results[1::2], f"step {step}: {results}"
        assert ext_ring._mv[L.DATA:] == ctypes_ring._mv[L.DATA:]
        assert [ext_ring._ops.load(off) for off in (L.OFF_HEAD, L.OFF_TAIL)] == [
            ctypes_ring._ops.load(off) for off in (L.OFF_HEAD, L.OFF_TAIL)
        ]


def test_extension_rejects_bad_arguments():
    ext = ring_module._native_lib().ext
    if ext is None:
        pytest.skip("no extension module (no Python headers)")
    with RingBuffer.create(512) as ring:
        base = ctypes.addressof(ring._anchor)
        with pytest.raises(TypeError, match="bytes"):
            ext.push(base, bytearray(b"abc"), 3)
        with pytest.raises(TypeError, match="bytes"):
            ext.push(base, b"abc", 4)
        with pytest.raises(ValueError, match="-1"):
            ext.reserve(base, -1)
        with pytest.raises(TypeError, match="expected 1 arguments, got 2"):
            ext.peek(base, 1)
        with pytest.raises(ValueError, match="null"):
            ext.peek(0)
        assert ext.peek(base) == L.EMPTY  # nothing was pushed by the bad calls


def test_ring_over_ctypes_alone_works(plain_lib, monkeypatch):
    monkeypatch.setattr(ring_module, "_native_lib", lambda: plain_lib)
    with RingBuffer.create(512) as tx:
        rx = RingBuffer.attach(tx.name)
        try:
            for i in range(500):
                tx.push(bytes([i % 256]) * (i % 100))
                assert rx.pop(timeout=1) == bytes([i % 256]) * (i % 100)
            assert tx.native and isinstance(tx._ops.push.func, ctypes._CFuncPtr)
        finally:
            rx.close()


def test_a_failing_extension_build_falls_back_to_ctypes(tmp_path, monkeypatch):
    plain = list(_native._CFLAGS)
    monkeypatch.setenv("IPC_NATIVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(
        _native, "_flag_sets", lambda: [[*plain, "-DIPC_PYTHON_MODULE", f"-I{tmp_path / 'no-headers'}"], plain]
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "pure-Python fallback" warning: ctypes still works
        lib = _native.load()
    assert lib is not None and lib.ext is None
