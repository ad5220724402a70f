"""PipelineExecutor: pipeline_parallel_size stages, each holding a contiguous share of the
decoder's layers and their KV cache (`shmvllm.worker.pp_worker`), each stage one process or,
with tensor_parallel_size=T, a tensor-parallel group of T processes (its own gloo group through
a key prefix of the TCPStore this process hosts, and its own all-reduce arena).

This process computes nothing: it writes one command per call to a broadcast ring that every
stage reads (`ipc.broadcast`: the engine config first, then each step's SchedulerOutput with the
tokens sampled since the last command, which the stages before the last have not seen), and
reads the last stage's outputs from an SPSC ring it owns. Hidden states go from stage to stage
over SPSC rings the receiving stages create, rank r of a stage to rank r of the next (every rank
of a stage holds the same hidden states after its all-reduce, so no rank fans out copies). `submit` queues a step and `collect` returns the
oldest step's output, so the engine keeps up to `max_concurrent_batches` (= the number of
stages) micro-batches in flight, each stage working on a different one. `handoff_stats` says
what the hand-offs cost per step (the command, the edges, the output; timed in the stages).

A stage that dies is found while this process waits for an output or writes a command (each
stage's exit status is looked at every 0.05 s, with no collective to block on), or when a step
comes back failed (its ranks' collectives saw a killed peer's sockets close): WorkerDeadError,
which ends the engine. `shutdown` asks the stages to stop (or kills them at once when one is
dead), closes the rings and unlinks the ones a killed stage could not.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import select
import subprocess
import sys
import time
from typing import Any

import torch

from shmvllm.config import EngineConfig
from shmvllm.core.sched.output import ModelRunnerOutput, SchedulerOutput
from shmvllm.engine.exceptions import WorkerDeadError
from shmvllm.executor.worker_procs import WorkerProcs
from shmvllm.model.parallel.group import DEFAULT_TIMEOUT_S, use_arena
from shmvllm.worker.pp_worker import START_TIMEOUT_S, edge_record_bytes
from shmvllm.worker.tp_worker import STORE_HOST

logger = logging.getLogger(__name__)

RING_CAPACITY = 1 << 24  # a step's message (a grammar bitmask included) travels whole below 4 MiB
OUTPUT_CAPACITY = 1 << 24
_POLL_S = 0.05


class PipelineExecutor(WorkerProcs):
    GROUP, MEMBER, FIRST_INDEX = "pipeline stages", "stage", 0

    def __init__(self, config: EngineConfig) -> None:
        from ipc import RingBuffer
        from ipc.broadcast import BroadcastWriter

        started = time.perf_counter()
        self.config = config
        self.size = size = config.parallel_config.pipeline_parallel_size
        self.tp = tp = config.parallel_config.tensor_parallel_size
        if size < 2:
            raise ValueError(f"PipelineExecutor needs pipeline_parallel_size >= 2, got {size}")
        self.max_concurrent_batches = size
        processes = size * tp  # process p is rank p % tp of stage p // tp
        self.threads = max(1, (os.cpu_count() or 1) // processes)
        self.procs: list[subprocess.Popen] = []
        self.edge_names: list[str] = []
        self.arenas: list[Any] = []
        self._sampled: dict[str, list[int]] = {}  # tokens the stages before the last have not been sent
        self._handoff_ns = dict.fromkeys(("steps", "command", "edges", "output"), 0)
        self.ring = BroadcastWriter.create(processes, RING_CAPACITY, poll_interval=_POLL_S)
        self.output = RingBuffer.create(OUTPUT_CAPACITY, poll_interval=_POLL_S)
        try:
            record = edge_record_bytes(config)
            capacity = 2 * max(record, 4096)  # two steps' hidden states in flight per edge
            level = logging.getLogger("shmvllm").getEffectiveLevel()
            group_args: list[str] = []
            if tp > 1:
                self._store = torch.distributed.TCPStore(
                    STORE_HOST, 0, processes, True, timeout=datetime.timedelta(seconds=DEFAULT_TIMEOUT_S),
                    wait_for_workers=False)
                group_args = ["--store-port", str(self._store.port)]
                if use_arena():  # one per stage, every rank a stage process; a slot holds a step's hidden states
                    from ipc.arena import Arena

                    slot = config.scheduler_config.max_num_batched_tokens * config.model_config.hf_config.hidden_size * 4
                    self.arenas = [Arena.create(tp, -(-slot // 64) * 64, seated=False) for _ in range(size)]
            pipes = []
            for index in range(processes):
                read_fd, write_fd = os.pipe()
                arena = ["--arena", self.arenas[index // tp].name] if self.arenas else []
                argv = [sys.executable, "-m", "shmvllm.worker.pp_worker", self.ring.name, str(index), str(size),
                        str(self.threads), str(os.getpid()), str(capacity), str(max(record, 4096)), str(write_fd),
                        "--tp", str(tp), *group_args, *arena, "--log-level", str(level)]
                self.procs.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL, pass_fds=(write_fd,)))
                os.close(write_fd)
                pipes.append(read_fd)
            try:
                self.edge_names = [self._read_name(index, fd) for index, fd in enumerate(pipes) if index >= tp]
            finally:
                for fd in pipes:
                    os.close(fd)
            # edge_names[p]: the ring process p writes to (rank p % tp of the next stage reads it)
            self.edge_names = self.edge_names + [""] * tp
            self.ring.push(pickle.dumps((config, self.edge_names, self.output.name), protocol=pickle.HIGHEST_PROTOCOL))
        except BaseException as exc:
            dead = self._dead()
            self.shutdown()
            if dead and not isinstance(exc, WorkerDeadError):
                raise WorkerDeadError(f"pipeline stages died while starting: {dead}") from exc
            raise
        logger.info("PipelineExecutor: %d stages x %d ranks x %d threads started in %.2f s", size, tp, self.threads,
                    time.perf_counter() - started)

    def _member(self, index: int) -> str:
        stage, rank = divmod(index, self.tp)
        return f"stage {stage}" if self.tp == 1 else f"stage {stage} rank {rank}"

    def _read_name(self, index: int, fd: int) -> str:
        """The name of the ring process `index` reads from (it writes it on its pipe once created)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        data = b""
        while not data.endswith(b"\n"):
            ready, _, _ = select.select([fd], [], [], _POLL_S)
            if ready:
                chunk = os.read(fd, 256)
                if not chunk:
                    raise WorkerDeadError(f"pipeline {self._member(index)} exited before creating its ring: {self._dead()}")
                data += chunk
            elif self._dead():
                raise WorkerDeadError(f"pipeline stages died while starting: {self._dead()}")
            elif time.monotonic() > deadline:
                raise TimeoutError(f"pipeline {self._member(index)} did not start within {START_TIMEOUT_S} s")
        return data.decode().strip()

    def _receive(self) -> Any:
        """The last stage's next message; WorkerDeadError as soon as any stage is gone."""
        from ipc import PeerGoneError, RingTimeoutError

        while True:
            try:
                return self.output.consume(pickle.loads, timeout=_POLL_S)
            except RingTimeoutError:
                pass
            except PeerGoneError as exc:
                raise WorkerDeadError(f"pipeline stages died: {', '.join(self._dead()) or exc}") from exc
            dead = self._dead()
            if dead:
                raise WorkerDeadError(f"pipeline stages died: {', '.join(dead)}")

    def determine_num_kv_blocks(self) -> int:
        """The fewest blocks any stage's budget holds (every stage keeps the same block table)."""
        self._command("num_blocks")
        return int(self._receive())

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._command("init_kv", num_blocks)

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        """Queues a step behind the ones in flight."""
        sampled, self._sampled = self._sampled, {}
        self._command("step", scheduler_output, sampled, time.monotonic_ns())

    def collect(self) -> ModelRunnerOutput:
        """The output of the oldest step in flight (blocks until the last stage sends it)."""
        waiting_since = time.monotonic_ns()
        output, command_ns, edges_ns, sent = self._receive()
        if output.errors:
            self._raise_if_a_stage_died()
        handoff = self._handoff_ns
        handoff["steps"] += 1
        handoff["command"] += command_ns
        handoff["edges"] += edges_ns
        handoff["output"] += max(time.monotonic_ns() - max(waiting_since, sent), 0)
        for req_id, tokens in zip(output.req_ids, output.sampled_token_ids):
            if tokens:
                self._sampled.setdefault(req_id, []).extend(tokens)
        return output

    def _raise_if_a_stage_died(self) -> None:
        """A step that failed because a rank was killed (its peers' collectives see the reset
        sockets) is WorkerDeadError, not the requests' error: a killed rank closes its sockets a
        moment before it can be reaped, hence the second look."""
        dead = self._dead()
        if not dead:
            time.sleep(_POLL_S)
            dead = self._dead()
        if dead:
            raise WorkerDeadError(f"pipeline stages died: {', '.join(dead)}")

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.submit(scheduler_output)
        return self.collect()

    def handoff_stats(self) -> dict[str, float]:
        """Per step since the start, in ms: the command's way to stage 0 (pickling included), the
        hidden states' over every edge (copy and wake-up, summed), the output's way back."""
        steps = max(self._handoff_ns["steps"], 1)
        return {"steps": self._handoff_ns["steps"],
                **{f"{part}_ms": self._handoff_ns[part] / steps / 1e6 for part in ("command", "edges", "output")}}

    def shutdown(self) -> None:
        """Stops the stages (`WorkerProcs._stop_workers`), closes the output ring and unlinks the
        rings the stages created (a killed stage leaves its own)."""
        from ipc import unlink_ring

        if self.ring.closed:
            return
        self._stop_workers()
        self.output.close()
        for arena in self.arenas:
            arena.close()
        for name in filter(None, self.edge_names):  # a killed stage leaves the ring it created
            unlink_ring(name)
