"""shmvllm.ray without Ray: ProcessorConfig's refusals, per-row sampling params, and the replica
(what each Ray actor runs) called directly on numpy batches with the tiny model. The cluster
tests are in test_ray.py (marked `ray`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from conftest import SHM_DIR, leaked_shm_entries
from ipc.segment import pid_alive
from shmvllm import LLM, SamplingParams
from shmvllm.ray.config import ProcessorConfig, row_sampling_params
from shmvllm.ray.replica import EmbedReplica, GenerateReplica

ENGINE_ARGS = {"max_model_len": 256, "num_kv_blocks": 64}


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"engine_args": {"max_model_length": 8}}, ValueError, "max_model_length"),
        ({"engine_args": {"model": "y"}}, ValueError, "'model'"),
        ({"engine_args": [("dtype", "float32")]}, TypeError, "engine_args"),
        ({"concurrency": 0}, ValueError, "concurrency"),
        ({"batch_size": "64"}, ValueError, "batch_size"),
        ({"num_cpus": 1.5}, ValueError, "num_cpus"),
        ({"num_gpus": 2}, ValueError, "num_gpus"),
        ({"num_gpus": 1, "engine_args": {"device": "cpu"}}, ValueError, "device"),
        ({"max_restarts": -2}, ValueError, "max_restarts"),
        ({"task": "classify"}, ValueError, "classify"),
        ({"task": "embed", "sampling_params": {"max_tokens": 4}}, ValueError, "sampling_params"),
        ({"sampling_params": {"temperature": -1.0}}, ValueError, "temperature"),
        ({"sampling_params": {"n": 2}}, ValueError, "n must be 1"),
        ({"sampling_params": "greedy"}, TypeError, "sampling_params"),
        ({"runtime_env": "env"}, TypeError, "runtime_env"),
    ],
)
def test_config_refuses_with_the_field_named(kwargs, error, words):
    with pytest.raises(error, match=words):
        ProcessorConfig(model="m", **kwargs)


def test_row_params_override_the_default_field_by_field():
    default = SamplingParams(temperature=0.0, max_tokens=8, stop=["x"])
    params = row_sampling_params(default, {"max_tokens": np.int64(3), "seed": None, "stop_token_ids": np.array([5, 6])})
    assert (params.max_tokens, params.temperature, params.stop, params.stop_token_ids, params.seed) == (3, 0.0, ["x"], [5, 6], None)
    assert row_sampling_params(default, None) is default
    with pytest.raises(ValueError, match="max_token"):
        row_sampling_params(default, {"max_token": 3})
    with pytest.raises(ValueError, match="top_p"):
        row_sampling_params(default, {"top_p": 2.0})
    with pytest.raises(ValueError, match="n must be 1"):
        row_sampling_params(default, {"n": 3})
    with pytest.raises(TypeError, match="dict"):
        row_sampling_params(default, "greedy")


def test_generate_replica_adds_columns_row_for_row(tiny_llama_dir):
    prompts = ["the cat", "a river of", "shared memory ring", "seven"]
    per_row = [{"max_tokens": 2}, {"max_tokens": None}, {"max_tokens": 5, "stop": None}, {"max_tokens": 1}]
    config = ProcessorConfig(model=str(tiny_llama_dir), engine_args=ENGINE_ARGS, sampling_params={"temperature": 0.0, "max_tokens": 3})
    replica = GenerateReplica(config)
    try:
        batch = {"id": np.arange(4), "prompt": np.array(prompts, dtype=object), "sampling_params": np.array(per_row, dtype=object)}
        out = replica(batch)
        with pytest.raises(ValueError, match="generated_text"):
            replica({**batch, "generated_text": np.array(prompts)})
        with pytest.raises(TypeError, match="row 1"):
            replica({"prompt": np.array(["a", 3], dtype=object)})
        with pytest.raises(ValueError, match="'prompt'"):
            replica({"text": np.array(prompts)})
        empty = replica({"prompt": np.array([], dtype=object)})
        ids = replica.llm.get_tokenizer()(prompts[0])["input_ids"]
        by_ids = replica({"prompt_token_ids": np.array([np.array(ids)], dtype=object)})
    finally:
        replica.close()
    assert list(out["id"]) == [0, 1, 2, 3] and list(out["prompt"]) == prompts
    with LLM(str(tiny_llama_dir), **ENGINE_ARGS) as llm:
        max_tokens = [2, 3, 5, 1]
        ref = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=m) for m in max_tokens], use_tqdm=False)
        ref_ids = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    for i, r in enumerate(ref):
        assert out["generated_text"][i] == r.outputs[0].text
        assert out["generated_tokens"][i].tolist() == r.outputs[0].token_ids
        assert out["num_generated_tokens"][i] == len(r.outputs[0].token_ids) <= max_tokens[i]
        assert out["num_input_tokens"][i] == len(r.prompt_token_ids)
        assert out["finish_reason"][i] == r.outputs[0].finish_reason
    assert by_ids["generated_tokens"][0].tolist() == ref_ids[0].outputs[0].token_ids
    assert all(len(v) == 0 for v in empty.values())


def test_embed_replica_equals_llm_embed(tiny_bert_dir):
    texts = ["hello", "", "Grüße aus Köln", "a b c d e f"]
    replica = EmbedReplica(ProcessorConfig(model=str(tiny_bert_dir), task="embed"))
    try:
        out = replica({"prompt": np.array(texts, dtype=object)})
        empty = replica({"prompt": np.array([], dtype=object)})
    finally:
        replica.close()
    with LLM(str(tiny_bert_dir)) as llm:
        ref = np.stack([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])
    assert out["embeddings"].dtype == np.float32 and out["embeddings"].shape == ref.shape
    np.testing.assert_allclose(out["embeddings"], ref, rtol=1e-5, atol=1e-6)
    assert empty["embeddings"].shape == (0, ref.shape[1])


def test_replica_whose_engine_died_exits_and_leaves_no_ring(tiny_llama_dir, tmp_path):
    """What Ray needs to restart the actor and retry its batch: the process ends (code 1) instead
    of raising, after stopping its LLM, so no segment of it stays in /dev/shm."""
    script = tmp_path / "replica.py"
    script.write_text(textwrap.dedent(f"""
        import os, signal, sys
        import numpy as np
        from shmvllm.ray.config import ProcessorConfig
        from shmvllm.ray.replica import GenerateReplica

        if __name__ == "__main__":
            replica = GenerateReplica(ProcessorConfig(model={str(tiny_llama_dir)!r}, engine_args={ENGINE_ARGS!r}))
            replica({{"prompt": np.array(["warm up"], dtype=object)}})
            os.kill(replica.llm.llm_engine.engine_core.engine_pid, signal.SIGKILL)
            replica({{"prompt": np.array(["after the kill"], dtype=object)}})
            print("the replica returned after its engine died")
    """))
    before = leaked_shm_entries()
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    assert "returned" not in proc.stdout
    assert "EngineDeadError" in proc.stderr or "engine died" in proc.stderr, proc.stderr[-2000:]
    assert not leaked_shm_entries() - before


def test_janitor_unlinks_the_rings_when_ray_kills_the_replicas_process_group(tiny_llama_dir, tmp_path):
    """Ray ends an actor with SIGKILL to its process group, which holds the engine too: neither end
    of the rings can unlink them, so the replica's janitor does, then exits."""
    script = tmp_path / "replica.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        from shmvllm.ray.config import ProcessorConfig
        from shmvllm.ray.replica import GenerateReplica

        if __name__ == "__main__":
            replica = GenerateReplica(ProcessorConfig(model={str(tiny_llama_dir)!r}, engine_args={ENGINE_ARGS!r}))
            print(replica.llm.llm_engine.engine_core.engine_pid, replica.janitor.pid, flush=True)
            time.sleep(600)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        engine_pid, janitor_pid = map(int, proc.stdout.readline().split())
        rings = {e.name for e in SHM_DIR.iterdir() if e.name.startswith((f"ipcring-{proc.pid}-", f"sem.ipcring-{proc.pid}-"))}
        # two rings: a segment each, plus two semaphores each where the ring cannot wake by futex
        assert len({r for r in rings if not r.startswith("sem.")}) == 2 and len(rings) in (2, 6), rings
        assert os.getpgid(engine_pid) == proc.pid != os.getpgid(janitor_pid)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 10
    while (pid_alive(janitor_pid) or pid_alive(engine_pid) or any((SHM_DIR / r).exists() for r in rings)) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [r for r in rings if (SHM_DIR / r).exists()]
    assert not pid_alive(janitor_pid) and not pid_alive(engine_pid)
