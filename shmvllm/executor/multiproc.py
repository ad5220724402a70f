"""MultiprocExecutor: a tensor-parallel group of Workers, rank 0 in the engine's process.

Ranks 1..N-1 are programs of their own (`python -m shmvllm.worker.tp_worker`), started with the
name of a broadcast ring (`ipc.broadcast`) that this process writes and they read: first the
engine config, then one command per executor call (the SchedulerOutput of each step,
pickled). The ranks' collectives (the sharded layers' all-reduces, and the logits' gather) run over
torch.distributed (gloo; the all-reduces optionally in a shared-memory arena, see
`shmvllm.model.parallel.group`), rendezvoused through a TCPStore that this process hosts on loopback.
Every rank samples the same tokens (see `shmvllm.worker.tp_worker`), so rank 0's output is
the step's output and nothing travels back.

Threads: each rank gets cpu_count // N torch threads (at least one).

A worker that dies is found at the next call (its process has exited), or in the middle of a
step, where rank 0's collective fails (the arena checks the ranks it waits for every 0.1 s;
gloo fails when the dead rank's socket closes): either way
`WorkerDeadError`, which ends the engine (EngineCore does not catch it; the frontend then raises
EngineDeadError). Gloo does not always notice: a send to a rank killed mid-collective can wait out
the group's 60 s timeout. So a watchdog thread looks at the workers every 0.05 s, and where one is
dead while rank 0 has stayed inside a call for `STUCK_GRACE_S` more, it kills the rest, unlinks
the ring and the arena and ends the engine's process (exit code 1), which the frontend reports
as EngineDeadError at once. `shutdown` asks the workers to stop, then kills what is left after a grace
period, and unlinks the ring. A worker that outlives the engine's process is killed by the
kernel (PR_SET_PDEATHSIG), and one whose engine vanishes notices it on the ring within its poll.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from typing import Any, Optional

import torch

from shmvllm.config import EngineConfig
from shmvllm.core.sched.output import ModelRunnerOutput, SchedulerOutput
from shmvllm.engine.exceptions import WorkerDeadError
from shmvllm.executor.worker_procs import WorkerProcs
from shmvllm.model.parallel.group import DEFAULT_TIMEOUT_S, TPGroup, use_arena
from shmvllm.worker.tp_worker import STORE_HOST, TPWorker

logger = logging.getLogger(__name__)

RING_CAPACITY = 1 << 24  # a step's message (a grammar bitmask included) travels whole below 4 MiB
STUCK_GRACE_S = 0.5  # past the arena's 0.1 s check: the collective that can notice has had its chance
_POLL_S = 0.05


class MultiprocExecutor(WorkerProcs):
    GROUP, MEMBER, FIRST_INDEX = "tensor-parallel workers", "rank", 1

    def __init__(self, config: EngineConfig) -> None:
        from ipc.broadcast import BroadcastWriter

        started = time.perf_counter()
        self.config = config
        self.world_size = size = config.parallel_config.tensor_parallel_size
        if size < 2:
            raise ValueError(f"MultiprocExecutor needs tensor_parallel_size >= 2, got {size}")
        if config.model_config.is_embedding:
            raise ValueError(f"tensor_parallel_size={size} is not supported for embedding models.")
        self.threads = max(1, (os.cpu_count() or 1) // size)
        torch.set_num_threads(self.threads)
        self.procs: list[subprocess.Popen] = []
        self.ring = BroadcastWriter.create(size - 1, RING_CAPACITY, poll_interval=_POLL_S)
        self.arena = None
        self.worker: TPWorker | None = None
        self._last_rows: Optional[list[str]] = []
        self._in_call_since: Optional[float] = None
        try:
            if use_arena():  # a slot holds the largest step's hidden states
                from ipc.arena import Arena

                hidden = config.model_config.hf_config.hidden_size
                slot = config.scheduler_config.max_num_batched_tokens * hidden * 4
                self.arena = Arena.create(size, -(-slot // 64) * 64)
            store = torch.distributed.TCPStore(
                STORE_HOST, 0, size, True, timeout=datetime.timedelta(seconds=DEFAULT_TIMEOUT_S), wait_for_workers=False
            )
            self.ring.push(pickle.dumps(config, protocol=pickle.HIGHEST_PROTOCOL))
            level = logging.getLogger("shmvllm").getEffectiveLevel()
            for rank in range(1, size):
                argv = [sys.executable, "-m", "shmvllm.worker.tp_worker", self.ring.name, str(rank), str(size),
                        str(store.port), str(self.threads), str(os.getpid()), "--log-level", str(level),
                        *(["--arena", self.arena.name] if self.arena is not None else [])]
                self.procs.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL))
            self._wait_for_joins(store)
            group = TPGroup.join(store, 0, size, self.arena)
            self._store = store
            self.worker = TPWorker(config, 0, group)
            self.worker.init_device()
            self.worker.load_model()
        except BaseException as exc:
            dead = self._dead()
            self.shutdown()
            if dead and not isinstance(exc, WorkerDeadError):
                raise WorkerDeadError(f"tensor-parallel workers died while starting: {dead}") from exc
            raise
        threading.Thread(target=self._watch, name="shmvllm-tp-watchdog", daemon=True).start()
        logger.info("MultiprocExecutor: %d ranks x %d threads ready in %.2f s", size, self.threads, time.perf_counter() - started)

    def _watch(self) -> None:
        """Ends the process where a worker is dead and rank 0 stays stuck in a collective."""
        dead_since: Optional[float] = None
        while not self.ring.closed:
            time.sleep(_POLL_S)
            dead = self._dead()
            in_call = self._in_call_since
            if not dead or in_call is None:
                dead_since = None
                continue
            dead_since = dead_since or time.monotonic()
            if time.monotonic() - max(dead_since, in_call) < STUCK_GRACE_S or self.ring.closed:
                continue
            logger.error("tensor-parallel workers died: %s; rank 0 is stuck in a collective: ending the engine",
                         ", ".join(dead))
            self._stop_workers()
            if self.arena is not None:
                self.arena.close()
            os._exit(1)

    def _wait_for_joins(self, store: Any) -> None:
        deadline = time.monotonic() + DEFAULT_TIMEOUT_S
        keys = [f"joined/{rank}" for rank in range(1, self.world_size)]
        while not store.check(keys):
            dead = self._dead()
            if dead:
                raise WorkerDeadError(f"tensor-parallel workers died while starting: {dead}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"tensor-parallel workers did not join within {DEFAULT_TIMEOUT_S} s")
            time.sleep(_POLL_S)

    def _call(self, fn: Any, *args: Any) -> Any:
        """Rank 0's share of a collective call: a failure with a dead worker is WorkerDeadError."""
        self._in_call_since = time.monotonic()
        try:
            return fn(*args)
        except Exception as exc:
            dead = self._dead()
            if not dead:  # a worker closes its sockets a moment before it can be reaped
                time.sleep(_POLL_S)
                dead = self._dead()
            if dead:
                raise WorkerDeadError(f"tensor-parallel workers died: {', '.join(dead)}") from exc
            raise
        finally:
            self._in_call_since = None

    def determine_num_kv_blocks(self) -> int:
        self._command("num_blocks")
        return self._call(self.worker.determine_num_kv_blocks)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._command("init_kv", num_blocks)
        self._call(self.worker.initialize_kv_cache, num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        # rank 0's rows of the previous step travel along: a rank whose batch differs stops
        self._command("step", scheduler_output, self._last_rows)
        self._last_rows = None  # unknown after a failed step
        output = self._call(self.worker.execute_model, scheduler_output)
        self._last_rows = output.req_ids
        return output

    def shutdown(self) -> None:
        """Stops the workers (`WorkerProcs._stop_workers`), then rank 0's own share."""
        if self.ring.closed:
            return
        self._stop_workers()
        if self.arena is not None:
            self.arena.close()
        if self.worker is not None:
            self.worker.shutdown()
        TPGroup.destroy()
