"""Tensor parallelism end to end: TP=2 (rank 0 in the engine, rank 1 a worker program; the
all-reduces through the shared-memory arena, or gloo) against TP=1 on tiny random Llama and
Qwen2 models with 2 KV heads (and one with 3, split unevenly); a worker killed mid-generate; an
idle TP=2 engine's CPU; the split itself; knobs refused by name."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest

from shmvllm import LLM, SamplingParams
from shmvllm.engine.exceptions import EngineDeadError
from shmvllm.model.parallel.layers import split_range, split_sizes

MAX_MODEL_LEN = 256
MARGIN = 1e-3  # a greedy divergence is forgiven only where TP=1's top-2 logits are this close
LOGPROB_TOL = 1e-4


def mixed_prompts(n: int = 32) -> list[dict]:
    """Token-id prompts of 3..90 tokens; half share a 40-token prefix (prefix-cache hits)."""
    rng = random.Random(0)
    shared = [rng.randrange(3, 49000) for _ in range(40)]
    prompts = []
    for i in range(n):
        tail = [rng.randrange(3, 49000) for _ in range(rng.randint(3, 50))]
        prompts.append({"prompt_token_ids": (shared + tail) if i % 2 else tail})
    return prompts


def params_for(n: int = 32) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=8 + (i * 7) % 25, ignore_eos=True, logprobs=2) for i in range(n)]


def run(model_dir: Path, tp: int, multiprocess: bool) -> tuple[list, dict]:
    # 40 blocks of 16 tokens for 32 requests of up to ~120 tokens: the scheduler preempts
    with LLM(model=str(model_dir), multiprocess=multiprocess, max_model_len=MAX_MODEL_LEN, num_kv_blocks=40,
             tensor_parallel_size=tp) as llm:
        outputs = llm.generate(mixed_prompts(), params_for(), use_tqdm=False)
        stats = llm.llm_engine.engine_core.get_stats()
    return outputs, stats


def assert_same_greedy(reference: list, candidate: list) -> None:
    """Same tokens up to a divergence at a top-2 margin < MARGIN, logprobs within LOGPROB_TOL."""
    forgiven = 0
    for ref, got in zip(reference, candidate):
        ref_c, got_c = ref.outputs[0], got.outputs[0]
        for pos, (a, b) in enumerate(zip(ref_c.token_ids, got_c.token_ids)):
            top = sorted(ref_c.logprobs[pos].values(), key=lambda lp: -lp.logprob)
            if a != b:
                margin = top[0].logprob - top[1].logprob
                assert margin < MARGIN, f"request {ref.request_id}: token {pos} differs ({a} vs {b}) at margin {margin}"
                forgiven += 1
                break
            ref_lp, got_lp = ref_c.logprobs[pos][a].logprob, got_c.logprobs[pos][b].logprob
            assert abs(ref_lp - got_lp) < LOGPROB_TOL, f"request {ref.request_id}: logprob {pos}: {ref_lp} vs {got_lp}"
        else:
            assert len(ref_c.token_ids) == len(got_c.token_ids)
    assert forgiven <= 2, f"{forgiven} forgiven divergences"


@pytest.fixture(scope="module")
def tiny_uneven_llama_dir(tmp_path_factory, smollm2_dir) -> Path:
    """3 KV heads (6 query heads) and an intermediate size of 130: over 2 ranks every split is uneven,
    as SmolLM2-135M's 3 KV heads are."""
    from transformers import LlamaConfig

    from conftest import _save_tiny_causal_lm

    config = LlamaConfig(
        vocab_size=49152, hidden_size=96, intermediate_size=130, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=1024,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )
    return _save_tiny_causal_lm(config, smollm2_dir, tmp_path_factory.mktemp("tiny-uneven-llama"))


@pytest.mark.parametrize(
    "model, allreduce",
    [("tiny_llama_dir", "shm"), ("tiny_qwen2_dir", "shm"), ("tiny_qwen2_dir", "gloo"), ("tiny_uneven_llama_dir", "shm")],
)
def test_tp2_greedy_equals_tp1_with_preemption_and_prefix_hits(model, allreduce, request, monkeypatch):
    monkeypatch.setenv("SHMVLLM_TP_ALLREDUCE", allreduce)
    model_dir = request.getfixturevalue(model)
    reference, _ = run(model_dir, 1, multiprocess=False)
    outputs, stats = run(model_dir, 2, multiprocess=model == "tiny_llama_dir")  # the others in-process
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0, stats
    assert_same_greedy(reference, outputs)


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except (OSError, IndexError):
                pass
    return found


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


def _segments_of(pids: list[int]) -> list[str]:
    return [p.name for p in Path("/dev/shm").iterdir() if any(f"ipcring-{pid}-" in p.name for pid in pids)]


def test_idle_tp2_engine_sleeps_and_a_killed_worker_ends_the_engine(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), multiprocess=True, max_model_len=MAX_MODEL_LEN, num_kv_blocks=64,
              tensor_parallel_size=2)
    client = llm.llm_engine.engine_core
    engine = client.engine_pid
    workers = _children(engine)
    try:
        assert len(workers) == 1, workers
        llm.generate(["warm up"], SamplingParams(max_tokens=4), use_tqdm=False)
        time.sleep(0.5)
        pids = [engine, *workers]
        before = sum(map(_cpu_seconds, pids))
        time.sleep(5.0)
        used = sum(map(_cpu_seconds, pids)) - before
        assert used < 0.05 * 5.0, f"an idle TP=2 engine used {used:.3f} CPU-s in 5 s"

        killed_at: list[float] = []

        def kill_worker() -> None:
            time.sleep(1.0)
            killed_at.append(time.monotonic())
            os.kill(workers[0], signal.SIGKILL)

        threading.Thread(target=kill_worker, daemon=True).start()
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        with pytest.raises(EngineDeadError):
            llm.generate([f"request {i}" for i in range(16)] * 4, params, use_tqdm=False)
        raised_at = time.monotonic()
        assert killed_at, "generate ended before the worker was killed"
        assert raised_at - killed_at[0] < 2.0, f"EngineDeadError {raised_at - killed_at[0]:.2f} s after the kill"
    finally:
        llm.shutdown() if hasattr(llm, "shutdown") else llm.__exit__(None, None, None)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and not all(_gone(p) for p in [engine, *workers]):
        time.sleep(0.05)
    assert all(_gone(p) for p in [engine, *workers])
    assert _segments_of([engine, *workers]) == []


def test_split_covers_everything_once():
    for n in (1, 2, 3, 9, 130, 49152):
        for world in range(1, min(n, 5) + 1):
            ranges = [split_range(n, world, r) for r in range(world)]
            assert ranges[0][0] == 0 and ranges[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            assert max(split_sizes(n, world)) - min(split_sizes(n, world)) <= 1


def test_knobs_refused_by_name(tiny_llama_dir, tiny_bert_dir):
    with pytest.raises(ValueError, match="tensor_parallel_size=3 is more than the model's num_key_value_heads=2"):
        LLM(model=str(tiny_llama_dir), tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive int, got 0"):
        LLM(model=str(tiny_llama_dir), tensor_parallel_size=0)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 with quantization='q8_0'"):
        LLM(model=str(tiny_llama_dir), tensor_parallel_size=2, quantization="q8_0")
    with pytest.raises(ValueError, match="tensor_parallel_size=2 is not supported for task 'embed'"):
        LLM(model=str(tiny_bert_dir), tensor_parallel_size=2)
