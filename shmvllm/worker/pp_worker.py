"""A pipeline-parallel stage: the program of every stage process (`python -m shmvllm.worker.pp_worker`).

Stage i of N holds the decoder layers `PipelineStage.of(layers, N, i)` (the first the
embedding, the last the final norm and the lm_head) and the KV cache of those layers; with
tensor_parallel_size=T it is T processes, process p being rank p % T of stage p // T, each
holding its rank's shard of the stage's layers (a `TPWorker` in the stage's own gloo group).
A process reads the engine's commands from the executor's broadcast ring (as reader p), and the
hidden states of each step from the same rank of the stage before it over an SPSC ring
(`ipc.ring`) that it creates (its name goes back to the engine over a pipe, and the engine
hands it to the sender). Every stage
applies the same scheduler output to the same request states; the hidden states travel in
place (a loan of the next record, written by one copy, read as a tensor over the ring's memory).
Every rank of the last stage samples the same tokens (as tensor-parallel ranks do) and its rank
0 sends the step's ModelRunnerOutput to the engine's output ring; the stages before it get the
sampled tokens with a later step's command.

Each step's hand-offs are timed on the monotonic clock, which every process shares: the
command's (the engine's stamp before pickling to stage 0's unpickled message), each edge's (the
sender's copy into the ring, then from the later of its commit and the receiver starting to
wait to the receiver holding the view), summed along the pipeline in the edge records' header
and sent with the step's output, whose own hand-off the engine times (`PipelineExecutor.handoff_stats`).

An edge record is a 40-byte header (a tag, the copy's start and end, the command's and the
edges' nanoseconds so far) then the payload: HIDDEN (the [tokens, hidden] states),
ERROR (the text of a failure upstream: every later stage passes it on and the last fails the
step's requests), or VALUE (a pickled value folded along the pipeline: the KV cache size).

A stage ends on SHUTDOWN, when the engine closes or dies (the broadcast ring's PeerGoneError,
within its poll), when a neighbour dies while it waits on their ring (PeerDeadError), or with
the engine's process (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import struct
import time
from typing import Any, Optional

import torch

from shmvllm.config import EngineConfig
from shmvllm.core.sched.output import ModelRunnerOutput, SchedulerOutput
from shmvllm.model.loader import torch_dtype
from shmvllm.model.parallel.pipeline import PipelineStage
from shmvllm.worker.program import die_with_parent, run_worker
from shmvllm.worker.tp_worker import TPWorker, join_group
from shmvllm.worker.worker import Worker

logger = logging.getLogger(__name__)

POLL_S = 0.05  # how often a waiting stage looks at its peers
START_TIMEOUT_S = 600.0
HEADER = struct.Struct("=8sQQQQ")  # tag, copy start ns, copy end ns, command ns, edges ns
HEADER_BYTES = HEADER.size
HIDDEN, ERROR, VALUE = b"H", b"E", b"V"


def edge_record_bytes(config: EngineConfig) -> int:
    """The largest edge record: a step's hidden states for max_num_batched_tokens, and its header."""
    element = torch.tensor([], dtype=torch_dtype(config.model_config.dtype)).element_size()
    payload = config.scheduler_config.max_num_batched_tokens * config.model_config.hf_config.hidden_size * element
    return -(-(HEADER_BYTES + payload + 8) // 8) * 8


class Stage:
    """One stage process's worker and its two rings: `inbound` from the stage before (None: the
    first), `outbound` to the next stage or, for the last stage's rank 0, to the engine (None:
    the last stage's other ranks, which send nothing)."""

    def __init__(self, worker: Worker, stage: PipelineStage, inbound: Any, outbound: Any) -> None:
        self.worker, self.stage = worker, stage
        self.runner = worker.model_runner
        self.inbound, self.outbound = inbound, outbound
        self.dtype = self.runner.dtype
        self.hidden_size = worker.config.model_config.hf_config.hidden_size

    def num_blocks(self) -> None:
        """The fewest KV blocks any stage's budget holds, folded along the pipeline."""
        blocks = self.worker.determine_num_kv_blocks()
        if self.inbound is not None:
            blocks = min(blocks, self._receive_value())
        if self.stage.is_last:
            if self.outbound is not None:
                self.outbound.push(pickle.dumps(blocks))
        else:
            self.outbound.push(HEADER.pack(VALUE, 0, 0, 0, 0) + pickle.dumps(blocks))

    def _receive_value(self) -> Any:
        message = self.inbound.pop()
        if message[:1] == ERROR:
            raise RuntimeError(message[HEADER_BYTES:].decode(errors="replace"))
        if message[:1] != VALUE:
            raise RuntimeError(f"pipeline stage {self.stage.index}: expected a value, got tag {message[:1]!r}")
        return pickle.loads(message[HEADER_BYTES:])

    @torch.inference_mode()
    def step(self, scheduler_output: SchedulerOutput, sampled: dict[str, list[int]], command_ns: int) -> None:
        """`command_ns`: how long the step's command took to reach this stage (stage 0's measure
        travels on in the edge header and replaces the later stages' own)."""
        runner, error = self.runner, None
        if not self.stage.is_last:
            runner.append_sampled(sampled)
        step = hidden = None
        edges_ns = 0
        try:
            step = runner.begin_step(scheduler_output)
            if step is None:
                raise RuntimeError("a step with scheduled tokens laid out no request")
        except Exception as exc:  # the stages after this one still take their part of the step
            error = _describe(exc)
        if self.inbound is None:
            if error is None:
                hidden, error = self._forward(step, None)
        else:
            waiting_since = time.monotonic_ns()
            view = self.inbound.pop_view()
            arrived = time.monotonic_ns()
            try:
                tag, copy_start, copy_end, command_ns, edges_ns = HEADER.unpack_from(view)
                edges_ns += copy_end - copy_start + max(arrived - max(waiting_since, copy_end), 0)
                tag = tag[:1]
                if tag == ERROR:
                    error = error or bytes(view[HEADER_BYTES:]).decode(errors="replace")
                elif tag != HIDDEN:
                    error = error or f"pipeline stage {self.stage.index}: expected hidden states, got tag {tag!r}"
                elif error is None:
                    incoming = torch.frombuffer(view, dtype=self.dtype, offset=HEADER_BYTES,
                                                count=len(step.input_ids) * self.hidden_size)
                    hidden, error = self._forward(step, incoming.view(-1, self.hidden_size))
                    del incoming  # the ring's record is freed below: nothing may view it after
            finally:
                self.inbound.release()
        if self.stage.is_last:
            output = None
            if error is None:
                try:
                    output = runner.finish_step(step, hidden, scheduler_output)
                except Exception as exc:
                    error = _describe(exc)
            if error is not None:
                output = ModelRunnerOutput(req_ids=[], sampled_token_ids=[],
                                           errors=dict.fromkeys(scheduler_output.num_scheduled_tokens, error))
            if self.outbound is not None:
                message = (output, command_ns, edges_ns, time.monotonic_ns())
                self.outbound.push(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
        elif error is not None:
            now = time.monotonic_ns()
            self.outbound.push(HEADER.pack(ERROR, now, now, command_ns, edges_ns) + error.encode())
        else:
            self._send_hidden(hidden, command_ns, edges_ns)
            runner.advance(step)

    def _forward(self, step: Any, incoming: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], Optional[str]]:
        try:
            return self.runner.model(step.input_ids, step.positions, step.meta, incoming), None
        except Exception as exc:
            logger.warning("pipeline stage %d: the step failed", self.stage.index, exc_info=True)
            return None, _describe(exc)

    def _send_hidden(self, hidden: torch.Tensor, command_ns: int, edges_ns: int) -> None:
        count = hidden.numel()
        started = time.monotonic_ns()
        loan = self.outbound.reserve(HEADER_BYTES + count * hidden.element_size())
        target = torch.frombuffer(loan, dtype=hidden.dtype, offset=HEADER_BYTES, count=count)
        target.copy_(hidden.reshape(-1))
        del target  # commit ends the loan: nothing may view the record after
        HEADER.pack_into(loan, 0, HIDDEN, started, time.monotonic_ns(), command_ns, edges_ns)
        self.outbound.commit()


def serve(
    ring_name: str, index: int, size: int, threads: int, parent_pid: int, edge_capacity: int, edge_record: int,
    name_fd: int, tp: int = 1, store_port: Optional[int] = None, arena_name: Optional[str] = None,
) -> None:
    from ipc import PeerGoneError, RingBuffer
    from ipc.broadcast import BroadcastReader

    die_with_parent()
    if os.getppid() != parent_pid:
        return  # the engine is already gone
    torch.set_num_threads(threads)
    stage_index, rank = divmod(index, tp)
    label = f"pipeline stage {stage_index}" + (f" rank {rank}" if tp > 1 else "")
    reader = BroadcastReader.attach(ring_name, index, poll_interval=POLL_S)
    inbound = outbound = None
    try:
        if stage_index > 0:
            inbound = RingBuffer.create(edge_capacity, max_record=edge_record, poll_interval=POLL_S)
            os.write(name_fd, f"{inbound.name}\n".encode())
        os.close(name_fd)
        config, edge_names, output_name = reader.consume(pickle.loads, timeout=START_TIMEOUT_S)
        stage = PipelineStage.of(config.model_config.hf_config.num_hidden_layers, size, stage_index)
        if not stage.is_last:
            outbound = RingBuffer.attach(edge_names[index], poll_interval=POLL_S)
        elif rank == 0:
            outbound = RingBuffer.attach(output_name, poll_interval=POLL_S)
        if tp > 1 and store_port is None:
            raise ValueError(f"{label}: tp={tp} needs --store-port")
        group = join_group(store_port, rank, tp, arena_name, f"stage{stage_index}/") if tp > 1 else None
        worker = Worker(config, index) if group is None else TPWorker(config, rank, group)
        worker.init_device()
        worker.model_runner.load_model(group, stage)
        node = Stage(worker, stage, inbound, outbound)
        logger.info("%s of %d: layers [%d, %d)", label, size, stage.start, stage.stop)
        while True:
            waiting_since = time.monotonic_ns()
            try:
                command, *args = reader.consume(pickle.loads)
            except PeerGoneError as exc:
                logger.warning("%s: the engine is gone (%s): exiting", label, exc)
                return
            if command == "step":
                scheduler_output, sampled, sent = args
                node.step(scheduler_output, sampled, max(time.monotonic_ns() - max(waiting_since, sent), 0))
            elif command == "num_blocks":
                node.num_blocks()
            elif command == "init_kv":
                worker.initialize_kv_cache(*args)
            elif command == "shutdown":
                return
            else:
                raise ValueError(f"{label}: unknown command {command!r}")
    finally:
        for ring in (reader, inbound, outbound):
            if ring is not None:
                ring.close()


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ring")
    parser.add_argument("index", type=int)
    parser.add_argument("size", type=int)
    parser.add_argument("threads", type=int)
    parser.add_argument("parent_pid", type=int)
    parser.add_argument("edge_capacity", type=int)
    parser.add_argument("edge_record", type=int)
    parser.add_argument("name_fd", type=int, help="where this stage writes the name of the ring it reads from")
    parser.add_argument("--tp", type=int, default=1, help="ranks per stage (index = stage * tp + rank)")
    parser.add_argument("--store-port", type=int, help="the engine's TCPStore, where tp > 1")
    parser.add_argument("--arena", help="the stage's all-reduce arena (else gloo)")
    parser.add_argument("--log-level", type=int, default=logging.WARNING)
    args = parser.parse_args(argv)
    run_worker(f"PPStage {args.index}", args.log_level, lambda: serve(
        args.ring, args.index, args.size, args.threads, args.parent_pid, args.edge_capacity, args.edge_record,
        args.name_fd, args.tp, args.store_port, args.arena))


if __name__ == "__main__":
    main()
