"""The C helper as a CPython extension module (METH_FASTCALL, the ring's hot path) and as a
plain library for ctypes: the same results, and a fallback to ctypes without Python's headers."""

from __future__ import annotations

import ctypes
import os
import pickle
import random
import sysconfig
import warnings

import pytest

import ipc.ring as ring_module
from ipc import RingBuffer, RingTimeoutError, native_available
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


def _fast_pair(capacity: int = 4096):
    ring = RingBuffer.create(capacity)
    peer = RingBuffer.attach(ring.name)
    if ring_module._native_lib() is None or ring_module._native_lib().ext is None:
        peer.close()
        ring.close()
        pytest.skip("no extension module: the methods are the Python ones")
    return ring, peer


def test_consume_and_try_consume_in_one_call():
    """consume / try_consume of a whole message run fn on the record in place and free it, also
    when fn raises; the view is released after; an empty ring is None without a wait."""
    tx, rx = _fast_pair()
    try:
        assert rx.try_consume(bytes) is None
        tx.push(b"abc")
        kept = []
        assert rx.try_consume(lambda view: kept.append(view) or bytes(view)) == b"abc"
        with pytest.raises(ValueError, match="released"):
            kept[0][0]
        tx.push(b"boom")
        with pytest.raises(ZeroDivisionError):
            rx.consume(lambda view: 1 / 0, timeout=1)
        assert rx.try_consume(bytes) is None  # the message that raised was consumed
        tx.push(b"x" * 100)
        assert rx.consume(len, timeout=0) == 100 and rx.consume.func is ring_module._native_lib().ext.consume_fast
        tx.push(b"kept")
        with pytest.raises(BufferError):  # fn kept an export of the view: the record is freed all the same
            rx.consume(lambda view: kept.append(pickle.PickleBuffer(view)))
        kept.clear()
        tx.push(b"next")
        assert rx.consume(bytes, timeout=1) == b"next"
        tx.push(b"late")
        with pytest.raises(TypeError):
            rx.consume(bytes, 1.0, bogus=1)  # what the C path does not take goes to the method
        assert rx.consume(bytes, timeout=1) == b"late"
        with pytest.raises(RingTimeoutError):  # empty: consume waits (the method), try_consume does not
            rx.consume(bytes, timeout=0.01)
    finally:
        rx.close()
        tx.close()


def test_try_push_and_push_with_a_timeout_in_one_call():
    """try_push says True for a message that fits now and False for one that does not (after the
    method's spin); push with a timeout takes the C path when the message fits."""
    tx, rx = _fast_pair(256)
    try:
        assert tx.try_push(b"a" * 24) is True and tx.try_push(bytearray(b"b" * 24)) is True
        tx.push(b"c" * 24, 0.0)
        tx.push(memoryview(b"d" * 24), timeout=0.5)
        while tx.try_push(b"e" * 24):
            pass
        assert tx.try_push(b"f") is False
        got = rx.pop_many()
        assert got[:4] == [b"a" * 24, b"b" * 24, b"c" * 24, b"d" * 24] and set(got[4:]) == {b"e" * 24}
        with pytest.raises(ValueError, match="timeout"):  # a full ring reaches the method, which checks it
            while True:
                tx.push(b"g" * 24, -1.0)
    finally:
        rx.close()
        tx.close()
