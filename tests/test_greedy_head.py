"""The greedy burst's lm_head on Q8_0 weights (kernels/greedy_head.c): an approximate pass with one int8
piece of x, a bound per row, the candidates recomputed by the exact rows. Its pick must be the argmax of
the exact logits (the build's own Q8_0 GEMV, masked ids -inf, numpy's first-index / NaN rules) in every
case: exact ties, rows one quantum apart, x with outliers, masked winners, NaN / infinite inputs. It is
built where the exact Q8_0 rows are slower than memory (AVX2, AVX-512 without VNNI); the VNNI and portable
builds answer -2 and the burst keeps their exact rows."""

from __future__ import annotations

import numpy as np
import pytest

from shmvllm import LLM, SamplingParams
from shmvllm.model.kernels import quant_isas_supported, quant_kernels

Q8_0 = 8
HEAD_ISAS = [isa for isa in quant_isas_supported() if isa in ("avx2", "avx512")]


def q8_0_rows(q: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Q8_0 rows from q [n, k] int8 and d [n, k / 32] fp16."""
    n, k = q.shape
    blocks = np.empty((n, k // 32, 34), dtype=np.uint8)
    blocks[:, :, :2] = d.astype(np.float16).view(np.uint8).reshape(n, k // 32, 2)
    blocks[:, :, 2:] = q.astype(np.int8).view(np.uint8).reshape(n, k // 32, 32)
    return np.ascontiguousarray(blocks.reshape(n, -1))


def exact_pick(lib, w: np.ndarray, x: np.ndarray, masked: list[int]) -> int:
    n, k = w.shape[0], x.shape[0]
    logits = np.empty(n, dtype=np.float32)
    assert lib.shm_qgemm(logits.ctypes.data, n, x.ctypes.data, k, w.ctypes.data, w.shape[1], Q8_0, None, None, 0, 1, n, k) == 0
    logits[masked] = -np.inf
    return int(np.argmax(logits))


def head_pick(lib, w: np.ndarray, x: np.ndarray, masked: list[int], threads: int) -> int:
    n, k = w.shape[0], x.shape[0]
    norms = np.empty(n, dtype=np.float32)
    assert lib.shm_q8_0_row_norms(w.ctypes.data, w.shape[1], n, k, norms.ctypes.data) == 0
    ids = np.array(masked or [0], dtype=np.int64)
    work = np.empty(2 * n + 4 * threads + 4, dtype=np.float32)
    return lib.shm_greedy_head(w.ctypes.data, w.shape[1], n, k, norms.ctypes.data, x.ctypes.data, ids.ctypes.data,
                               len(masked), threads, work.ctypes.data)


def adversarial_weight(rng: np.random.Generator, n: int, k: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Random rows, then near-ties with the row x favours most: copies of it (exact ties, later
    indices) and copies one quantum off in one value each way (the approximation cannot tell them)."""
    q = rng.integers(-127, 128, size=(n, k)).astype(np.int64)
    d = (rng.random((n, k // 32)) * 0.01 + 0.001).astype(np.float16)
    w = q * np.repeat(d.astype(np.float64), 32, axis=1)
    top = int(np.argmax(w @ x.astype(np.float64)))
    for row in rng.choice(n, 12, replace=False):
        q[row], d[row] = q[top], d[top]
        if row % 3:
            i = int(rng.integers(k))
            q[row, i] = np.clip(q[row, i] + (1 if row % 3 == 1 else -1), -127, 127)
    return q, d


@pytest.mark.parametrize("isa", HEAD_ISAS)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_pick_is_the_exact_argmax(isa, threads):
    lib = quant_kernels(isa)
    rng = np.random.default_rng(3)
    n, k = 1003, 256  # a last group of 3 rows
    for trial in range(12):
        x = rng.standard_normal(k) * np.where(rng.random(k) < 0.02, 1000.0, 1.0)
        x = x.astype(np.float32)
        q, d = adversarial_weight(rng, n, k, x)
        w = q8_0_rows(q, d)
        masked = [] if trial % 3 == 0 else list(rng.choice(n, 5, replace=False))
        if trial % 3 == 2:
            masked.append(exact_pick(lib, w, x, []))  # the winner masked: the runner-up
        assert head_pick(lib, w, x, masked, threads) == exact_pick(lib, w, x, masked), trial


@pytest.mark.parametrize("isa", HEAD_ISAS)
def test_ties_nan_and_infinity_follow_numpy(isa):
    lib = quant_kernels(isa)
    rng = np.random.default_rng(5)
    n, k = 200, 64
    q = rng.integers(-127, 128, size=(n, k))
    d = np.full((n, k // 32), 0.01, dtype=np.float16)
    x = rng.standard_normal(k).astype(np.float32)
    for first, second in ((7, 150), (0, 199), (150, 7)):
        tied_q = q.copy()
        top = int(np.argmax(tied_q @ x))
        tied_q[first] = tied_q[second] = tied_q[top] = q[top]
        w = q8_0_rows(tied_q, d)
        assert head_pick(lib, w, x, [], 2) == exact_pick(lib, w, x, []) == min(first, second, top)
    w = q8_0_rows(q, d)
    zeros = np.zeros(k, dtype=np.float32)
    assert head_pick(lib, w, zeros, [], 2) == exact_pick(lib, w, zeros, []) == 0
    assert head_pick(lib, w, zeros, [0, 1], 2) == 2
    for bad in (np.nan, np.inf):
        odd = x.copy()
        odd[9] = bad
        assert head_pick(lib, w, odd, [3], 2) == exact_pick(lib, w, odd, [3])
    nan_scale = d.copy()
    nan_scale[[40, 90], 1] = np.nan  # rows whose logits are NaN: the first wins, unless masked
    w = q8_0_rows(q, nan_scale)
    assert head_pick(lib, w, x, [], 2) == exact_pick(lib, w, x, []) == 40
    assert head_pick(lib, w, x, [40], 2) == 90


def test_builds_without_the_pass_say_so():
    for isa in quant_isas_supported():
        lib = quant_kernels(isa)
        w = q8_0_rows(np.ones((8, 32), dtype=np.int64), np.ones((8, 1), dtype=np.float16))
        norms = np.empty(8, dtype=np.float32)
        rc = lib.shm_q8_0_row_norms(w.ctypes.data, 34, 8, 32, norms.ctypes.data)
        assert rc == (0 if isa in ("avx2", "avx512") else -2), isa
        if rc == 0:
            assert np.allclose(norms, np.sqrt(32.0)) and np.all(norms >= np.sqrt(32.0))
            assert lib.shm_q8_0_row_norms(w.ctypes.data, 34, 8, 48, norms.ctypes.data) == -1


@pytest.mark.skipif("avx2" not in HEAD_ISAS, reason="no AVX2 build")
def test_the_burst_on_avx2_runs_the_greedy_head(smollm2_dir, monkeypatch):
    """SmolLM2's tied Q8_0 embedding as lm_head: the AVX2 build's bursts take the greedy head, and their
    tokens equal one token a step's (min_tokens' masked EOS included)."""
    monkeypatch.setenv("SHMVLLM_QUANT_ISA", "avx2")
    quant_kernels.cache_clear()
    chat = [f"<|im_start|>user\n{p}<|im_end|>\n<|im_start|>assistant\n"
            for p in ("Tell me about the sea.", "Write a list of fruits.")]
    cases = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
             SamplingParams(temperature=0.0, max_tokens=60, min_tokens=30)]
    results = {}
    try:
        for burst in (1, 8):
            monkeypatch.setenv("SHMVLLM_DECODE_BURST", str(burst))
            with LLM(model=str(smollm2_dir), max_model_len=1024, multiprocess=False) as llm:
                step = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.model.model.decode_step
                results[burst] = [[list(llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids) for p in chat]
                                  for params in cases]
                if burst > 1:
                    assert step.bursts > 0 and step._burst.head_norms
    finally:
        quant_kernels.cache_clear()
    assert results[8] == results[1]
