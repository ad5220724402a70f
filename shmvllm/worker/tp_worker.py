"""A tensor-parallel Worker, and the program of ranks 1..N-1 (`python -m shmvllm.worker.tp_worker`).

`TPWorker` is a Worker whose model is built and loaded as its rank's share
(`shmvllm.model.parallel.layers`) and whose KV cache size is the smallest any rank can hold. Rank 0 runs in the engine process (`MultiprocExecutor`); the others run
`main`: attach to the executor's broadcast ring as reader rank - 1, read the engine config
(the ring's first message), join the torch.distributed group, load, then follow the engine's
commands from the ring (size the KV cache, allocate it, run a step, shut down). Every rank runs
each step's forward and sampling on the same inputs with the same seeded generators, so rank
0's sampled tokens are every rank's, and nothing is sent back.

A worker ends when the ring says SHUTDOWN, when the engine closes the ring or dies (the ring's
PeerClosedError / PeerDeadError, within its poll interval), or with the engine's process
(PR_SET_PDEATHSIG on Linux).
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import pickle
from typing import Optional

import torch

from shmvllm.config import EngineConfig
from shmvllm.model.parallel.group import DEFAULT_TIMEOUT_S, TPGroup
from shmvllm.worker.program import die_with_parent, run_worker
from shmvllm.worker.worker import Worker

logger = logging.getLogger(__name__)

POLL_S = 0.1  # how often an idle worker looks at the engine
STORE_HOST = "127.0.0.1"


class TPWorker(Worker):
    def __init__(self, config: EngineConfig, rank: int, group: TPGroup) -> None:
        super().__init__(config, rank)
        self.group = group

    def load_model(self) -> None:
        self.model_runner.load_model(self.group)

    def determine_num_kv_blocks(self) -> int:
        """The fewest blocks any rank's budget holds (every rank keeps the same block table)."""
        return self.group.all_reduce_min(super().determine_num_kv_blocks())


def serve(
    ring_name: str, rank: int, world_size: int, store_port: int, threads: int, parent_pid: int,
    arena_name: Optional[str] = None,
) -> None:
    from ipc import PeerGoneError
    from ipc.broadcast import BroadcastReader

    die_with_parent()
    if os.getppid() != parent_pid:
        return  # the engine is already gone
    torch.set_num_threads(threads)
    reader = BroadcastReader.attach(ring_name, rank - 1, poll_interval=POLL_S)
    try:
        config: EngineConfig = reader.consume(pickle.loads, timeout=DEFAULT_TIMEOUT_S)
        worker = TPWorker(config, rank, join_group(store_port, rank, world_size, arena_name))
        worker.init_device()
        worker.load_model()
        rows: Optional[list[str]] = []  # the request of each batch row in the last step (None: failed)
        while True:
            try:
                command, *args = reader.consume(pickle.loads)
            except PeerGoneError as exc:
                logger.warning("rank %d: the engine is gone (%s): exiting", rank, exc)
                return
            if command == "num_blocks":
                worker.determine_num_kv_blocks()
            elif command == "init_kv":
                worker.initialize_kv_cache(*args)
            elif command == "step":
                scheduler_output, rank0_rows = args
                if rank0_rows is not None and rows is not None and rank0_rows != rows:
                    raise RuntimeError(f"rank {rank} laid out rows {rows}, rank 0 {rank0_rows}: the ranks diverged")
                try:
                    rows = worker.execute_model(scheduler_output).req_ids
                except Exception:  # rank 0 meets the same failure and fails the step's requests
                    logger.warning("rank %d: the step failed", rank, exc_info=True)
                    rows = None
            elif command == "shutdown":
                return
            else:
                raise ValueError(f"rank {rank}: unknown command {command!r}")
    finally:
        reader.close()


def join_group(store_port: int, rank: int, world_size: int, arena_name: Optional[str],
               key_prefix: str = "") -> TPGroup:
    """This process's tensor-parallel group through the engine's TCPStore (under `key_prefix`: a
    pipeline stage's own group), its all-reduces over the arena where one is named, else gloo.
    It says `joined/RANK` first: the engine waits for every rank's before it joins itself."""
    store: torch.distributed.Store = torch.distributed.TCPStore(
        STORE_HOST, store_port, world_size, False, timeout=datetime.timedelta(seconds=DEFAULT_TIMEOUT_S))
    if key_prefix:
        store = torch.distributed.PrefixStore(key_prefix, store)
    store.set(f"joined/{rank}", "1")
    arena = None
    if arena_name is not None:
        from ipc.arena import Arena

        arena = Arena.attach(arena_name, rank)
    return TPGroup.join(store, rank, world_size, arena)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ring")
    parser.add_argument("rank", type=int)
    parser.add_argument("world_size", type=int)
    parser.add_argument("store_port", type=int)
    parser.add_argument("threads", type=int)
    parser.add_argument("parent_pid", type=int)
    parser.add_argument("--log-level", type=int, default=logging.WARNING)
    parser.add_argument("--arena", help="the shared-memory arena of the all-reduces (else gloo)")
    args = parser.parse_args(argv)
    run_worker(f"TPWorker rank={args.rank}", args.log_level, lambda: serve(
        args.ring, args.rank, args.world_size, args.store_port, args.threads, args.parent_pid, args.arena))


if __name__ == "__main__":
    main()
