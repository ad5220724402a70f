"""shmvllm.ray on a real local Ray cluster: a head and one worker node (1 CPU each) started here,
2 replicas (one per node), 500 rows; outputs against one `LLM` in this process; kill -9 of a
replica's engine mid-run; nothing left after the cluster shuts down.

Marked `ray` (deselected by default): `pip install -e '.[ray]' && pytest -q -m ray tests/test_ray.py`.
The tests run in order and share one cluster; the last one shuts it down.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from shmvllm import LLM, SamplingParams
from conftest import SHM_DIR, _RING_NAME

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]

NUM_ROWS = 500
MARKER = f"shmvllm-ray-test-{uuid.uuid4().hex[:12]}"  # in the environment of every replica
REPO = str(Path(__file__).resolve().parents[1])
ENGINE_ARGS = {"max_model_len": 256, "num_kv_blocks": 256, "max_num_seqs": 32}
OBJECT_STORE_BYTES = 128 * 2**20
_WORDS = "the of cat river quantum engine memory ring shared token paris seven blue why".split()


def prompts() -> list[str]:
    import random

    rng = random.Random(17)
    return [" ".join(rng.choices(_WORDS, k=rng.randint(1, 12))) + f" {i}" for i in range(NUM_ROWS)]


def row_params(i: int) -> dict:
    return {"temperature": 0.0, "max_tokens": 4 + i % 7}


# ---- the processes of this test's replicas, found by the marker in their environment ----------


def _marked_pids() -> dict[int, str]:
    """pid -> command line of every live process whose environment holds MARKER."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if MARKER.encode() not in (entry / "environ").read_bytes():
                continue
            found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone, or not ours to read
            continue
    return found


def engine_pids() -> list[int]:
    """The engine processes (`python -m shmvllm.engine.core_proc`) under this test's replicas."""
    return sorted(pid for pid, cmd in _marked_pids().items() if "shmvllm.engine.core_proc" in cmd)


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def engine_facts(pid: int):
    """(its node's raylet pid, its OMP_NUM_THREADS), or None if it ended meanwhile (a replica is
    released after its last batch)."""
    try:
        return parent_of(parent_of(pid)), environ_of(pid).get("OMP_NUM_THREADS")  # engine -> actor -> raylet
    except (OSError, ValueError):
        return None


class PidRecorder:
    """Records every marked process (replica actors and their engines) while the cluster runs, so
    that the end can check that all of them are gone and left no ring behind."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self.seen.update(_marked_pids())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.seen.update(_marked_pids())


def ring_entries_of(pids: set[int]) -> set[str]:
    """/dev/shm entries of shmvllm's rings (ipc/segment.py's names carry the creator's pid)."""
    return {e.name for e in SHM_DIR.iterdir() if (m := _RING_NAME.match(e.name)) and int(m.group(1)) in pids}


def join_ray_data_threads(timeout_s: float = 60.0) -> None:
    """Waits for Ray Data's iterator threads of this process to end. Closing an iteration only
    tells them to stop: one may still be inside its executor's shutdown, and a call of theirs
    reaching the core worker after `ray.shutdown()` makes Ray exit the whole process. (A parked
    block prefetcher thread makes no call until it is given blocks.)"""
    deadline = time.monotonic() + timeout_s
    for thread in threading.enumerate():
        if thread.name == "iter_threaded":
            thread.join(max(0.0, deadline - time.monotonic()))
    alive = [t.name for t in threading.enumerate() if t.name == "iter_threaded" and t.is_alive()]
    assert not alive, f"Ray Data threads still running {timeout_s} s after their iteration ended: {alive}"


# ---- the cluster ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray._private import auto_init_hook
    from ray.cluster_utils import Cluster

    # A Ray Data thread still running after ray.shutdown() (the prefetcher's ray.wait) would
    # otherwise reconnect this driver to the cluster, which then exits the process when the last
    # test kills the cluster's raylets.
    auto_init_hook.enable_auto_connect = False
    # Ray Data's usage-metrics poller (a daemon thread started with the first execution, never
    # stopped) would query the cluster after ray.shutdown(); Ray then exits this process ("The
    # core worker has already been shutdown ... The process will exit"). Usage stats off: no poller.
    environment = pytest.MonkeyPatch()
    environment.setenv("RAY_USAGE_STATS_ENABLED", "0")
    node_args = {"num_cpus": 1, "object_store_memory": OBJECT_STORE_BYTES}
    cluster = Cluster(initialize_head=True, head_node_args={**node_args, "include_dashboard": False})
    cluster.add_node(**node_args)
    ray.init(address=cluster.address, log_to_driver=False)
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = False
    state = {"cluster": cluster, "recorder": PidRecorder(), "shut_down": False}
    yield state
    if not state["shut_down"]:
        join_ray_data_threads()
        ray.shutdown()
        cluster.shutdown()
        state["recorder"].stop()
    environment.undo()


def processor_config(model: Path, **overrides):
    from shmvllm.ray import ProcessorConfig

    base = dict(
        model=str(model), engine_args=ENGINE_ARGS, concurrency=2, batch_size=25, num_cpus=1,
        runtime_env={"env_vars": {"PYTHONPATH": REPO, "SHMVLLM_RAY_TEST": MARKER}},
    )
    return ProcessorConfig(**{**base, **overrides})


@pytest.fixture(scope="module")
def generate_reference(tiny_llama_dir):
    texts = prompts()
    with LLM(str(tiny_llama_dir), **ENGINE_ARGS) as llm:
        outputs = llm.generate(texts, [SamplingParams(**row_params(i)) for i in range(NUM_ROWS)], use_tqdm=False)
    return [(o.outputs[0].text, list(o.outputs[0].token_ids)) for o in outputs]


def generate_dataset(tiny_llama_dir):
    import ray

    from shmvllm.ray import build_processor

    rows = [{"id": i, "prompt": p, "sampling_params": row_params(i)} for i, p in enumerate(prompts())]
    return build_processor(processor_config(tiny_llama_dir))(ray.data.from_items(rows))


def check_generated(rows: list[dict], reference) -> None:
    texts = prompts()
    for row in rows:
        i = row["id"]
        assert row["prompt"] == texts[i]
        assert (row["generated_text"], [int(t) for t in row["generated_tokens"]]) == reference[i], i
        assert row["num_generated_tokens"] == len(reference[i][1])
        assert row["finish_reason"] in ("stop", "length")


# ---- the tests, in order ----------------------------------------------------------------------


def test_generate_equals_one_llm_row_for_row(cluster, tiny_llama_dir, generate_reference):
    import ray

    ds = generate_dataset(tiny_llama_dir)
    rows, engines_during_run, nodes, threads = [], set(), set(), set()
    for row in ds.iter_rows():
        rows.append(row)
        if len(rows) % 100 == 1:
            for pid in engine_pids():
                if (facts := engine_facts(pid)) is not None:
                    engines_during_run.add(pid)
                    nodes.add(facts[0])
                    threads.add(facts[1])
    assert [r["id"] for r in rows] == list(range(NUM_ROWS))  # preserve_order: input order
    check_generated(rows, generate_reference)
    # Two replicas, one per node (1 CPU each), each engine running the 1 torch thread it asked for.
    assert len(nodes) == 2 and len(ray.nodes()) == 2, nodes
    assert len(engines_during_run) == 2 and threads == {"1"}, (engines_during_run, threads)


def test_embed_equals_one_llm(cluster, tiny_bert_dir, embedding_texts):
    import ray

    from shmvllm.ray import build_processor

    texts = [embedding_texts[i % len(embedding_texts)] + f" {i}" for i in range(NUM_ROWS)]
    ds = build_processor(processor_config(tiny_bert_dir, task="embed"))(
        ray.data.from_items([{"id": i, "prompt": t} for i, t in enumerate(texts)])
    )
    rows = list(ds.iter_rows())
    with LLM(str(tiny_bert_dir)) as llm:
        reference = np.stack([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])
    assert [r["id"] for r in rows] == list(range(NUM_ROWS))
    got = np.stack([np.asarray(r["embeddings"]) for r in rows])
    assert got.dtype == np.float32 and got.shape == reference.shape
    np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-6)  # batches differ: fp32 sums reorder


def test_engine_killed_mid_run_every_row_exactly_once(cluster, tiny_llama_dir, generate_reference):
    ds = generate_dataset(tiny_llama_dir)
    rows, killed = [], []
    for row in ds.iter_rows():
        rows.append(row)
        if len(rows) >= 60 and not killed and (engines := engine_pids()):  # replicas busy with later batches
            victim = engines[0]
            try:
                killed.append((victim, parent_of(victim)))
            except (OSError, ValueError):
                continue
            os.kill(victim, signal.SIGKILL)
    assert killed, "the engine was never killed"
    ids = [r["id"] for r in rows]
    assert sorted(ids) == list(range(NUM_ROWS)), (len(ids), len(set(ids)))
    check_generated(rows, generate_reference)
    victim, actor = killed[0]
    # The replica whose engine died exited (so Ray restarted it) and left no ring behind.
    assert not Path(f"/proc/{victim}").exists() and not Path(f"/proc/{actor}").exists()
    assert not ring_entries_of({actor}), ring_entries_of({actor})


def test_cluster_shutdown_mid_run_leaves_no_engine_and_no_segment(cluster, tiny_llama_dir):
    """The cluster goes down while both replicas are busy: their engines exit (their frontend is
    gone) and remove the rings; nothing of shmvllm stays on the node."""
    import ray

    rows, busy = [], []
    iteration = iter(generate_dataset(tiny_llama_dir).iter_rows())
    for row in iteration:
        rows.append(row)
        if len(rows) >= 20 and len(busy := engine_pids()) == 2:
            break
    assert len(busy) == 2 and len(rows) < NUM_ROWS, (busy, len(rows))
    iteration.close()  # the iteration ends before Ray does
    join_ray_data_threads()
    recorder: PidRecorder = cluster["recorder"]
    recorder.stop()
    ray.shutdown()
    cluster["cluster"].shutdown()
    cluster["shut_down"] = True
    deadline = time.monotonic() + 10  # an engine notices its frontend's death within POLL_S
    while _marked_pids() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _marked_pids(), _marked_pids()
    left = ring_entries_of(recorder.seen)
    assert not left, f"shmvllm segments left in /dev/shm: {sorted(left)}"
    others = sorted(e.name for e in SHM_DIR.iterdir() if not _RING_NAME.match(e.name) and re.match(r"^(plasma|ray)", e.name))
    assert not others, f"Ray's object store left files in /dev/shm: {others}"
