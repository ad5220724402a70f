"""DPSyncMPClient: N data-parallel EngineCoreProcs behind one EngineCoreClient.

`LLM(..., data_parallel_size=N)` with N > 1 gets this client (N = 1 keeps `SyncMPClient`).
Each engine is a replica (its own scheduler, KV cache and worker) in its own process, on its
own channel (two SPSC rings), started with `engine_index` i, and pinned to its share of the
cores (`plan_cpus`). The client:

- routes each request to one engine (`DPLoadBalancer`: least loaded by the counts the engines
  report with their outputs, ties round robin; the children of an n > 1 request together);
- sends an abort to the engine that owns each request, and fans utility calls out to every
  engine and gathers their answers (`call_utility_all`; `get_stats` sums them and lists each);
- gathers outputs without spinning over N rings: it sleeps on one doorbell that every engine
  rings after each message (shmvllm.boundary.doorbell, with the no-lost-wake-up argument),
  then reads the rings that hold something, round robin;
- watches every engine at least every POLL_S, even while others keep answering: one engine's
  death is an EngineDeadError from the call that is waiting (or the next one), and the other
  engines are shut down at once.

Outputs come per engine step, as from one engine; the LLM puts finished requests back into
input order, as it does for one engine.
"""

from __future__ import annotations

import collections
import itertools
import logging
import multiprocessing.util
import os
import threading
import time
from typing import Any, Optional

from ipc import PeerGoneError, RingClosedError
from shmvllm import envs
from shmvllm.boundary.channel import ChannelTimeout, Endpoint, FrontendInbox
from shmvllm.boundary.doorbell import Doorbell, open_frontend_rung
from shmvllm.boundary.messages import (
    EngineCoreAbort,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreShutdown,
    EngineCoreUtility,
    EngineFailed,
    EngineReady,
    make_encoder,
)
from shmvllm.config import EngineConfig
from shmvllm.engine.core_client import (
    ABORT_SEND_TIMEOUT_S,
    SHUTDOWN_SEND_TIMEOUT_S,
    EngineCoreClient,
    EngineUtilityError,
)
from shmvllm.engine.core_proc import POLL_S
from shmvllm.engine.dp_balancer import DPLoadBalancer
from shmvllm.engine.exceptions import EngineDeadError, EngineTimeoutError
from shmvllm.engine.proc_manager import DEFAULT_READY_TIMEOUT_S, CoreEngineProcManager, failure_text
from shmvllm.engine.termination import FrontendTermination

logger = logging.getLogger(__name__)

# After one engine died: how long the others get to exit on SHUTDOWN before they are terminated.
DEAD_PEERS_EXIT_S = 1.0


def plan_cpus(num_engines: int) -> list[tuple[list[int], int]]:
    """Each engine's (cores, torch threads): this process's cores in N contiguous disjoint
    shares, as equal as they divide, with one torch thread per core of the share; fewer cores
    than engines: no pinning and one thread each (they must share). OMP_NUM_THREADS, if set,
    is every engine's thread count instead."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    threads = envs.OMP_NUM_THREADS()
    if len(cores) < num_engines:
        logger.warning("%d engines on %d cores: they share the cores, one torch thread each", num_engines, len(cores))
        return [([], threads or 1)] * num_engines
    shares = [cores[i * len(cores) // num_engines:(i + 1) * len(cores) // num_engines] for i in range(num_engines)]
    return [(share, threads or len(share)) for share in shares]


def combine_ready(readies: list[EngineReady]) -> EngineReady:
    """The limits of N engines as one: what every engine allows (the smallest max_model_len,
    vocabulary, max_logprobs), and their KV caches together."""
    return EngineReady(
        num_kv_blocks=sum(r.num_kv_blocks for r in readies),
        block_size=readies[0].block_size,
        max_concurrency=sum(r.max_concurrency for r in readies),
        max_model_len=min(r.max_model_len for r in readies),
        vocab_size=min(r.vocab_size for r in readies),
        max_logprobs=min(r.max_logprobs for r in readies),
    )


def combine_stats(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """N engines' `get_stats` as one: counts and totals summed, KV usage over all blocks,
    and each engine's own under "engines"."""
    total: dict[str, Any] = {}
    for name, value in stats[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            total[name] = sum(s.get(name, 0) for s in stats)
        elif isinstance(value, dict):
            total[name] = {k: sum(s.get(name, {}).get(k, 0) for s in stats) for k, v in value.items()
                           if isinstance(v, (int, float)) and not isinstance(v, bool)}
    total["block_size"] = stats[0].get("block_size")
    blocks = total.get("num_kv_blocks") or 0
    if blocks:
        total["kv_cache_usage"] = sum(s.get("kv_cache_usage", 0.0) * s.get("num_kv_blocks", 0) for s in stats) / blocks
    total["engines"] = stats
    return total


class _DPResources:
    """What a DPSyncMPClient must release, apart from it so that a finalizer can run it."""

    def __init__(self, doorbell: Doorbell) -> None:
        self.doorbell = doorbell
        self.endpoints: list[Endpoint] = []
        self.managers: list[CoreEngineProcManager] = []
        self.closed = False
        self.pid = os.getpid()

    def shutdown(self, timeout: float = 5.0) -> None:
        """SHUTDOWN to every live engine, `timeout` s for all of them to exit (then terminate,
        kill), then remove the channels and the doorbell. Idempotent."""
        if self.closed or os.getpid() != self.pid:
            return
        self.closed = True
        try:
            shutdown = make_encoder().encode(EngineCoreShutdown())
            for manager, endpoint in zip(self.managers, self.endpoints):
                if manager.is_alive():
                    try:
                        endpoint.send(shutdown, SHUTDOWN_SEND_TIMEOUT_S)
                    except Exception:  # stuck or broken: terminated below
                        pass
            deadline = time.monotonic() + timeout
            for manager in self.managers:
                manager.shutdown(max(deadline - time.monotonic(), 0.0))
        finally:
            for endpoint in self.endpoints:
                endpoint.close()
            self.doorbell.close()

    def release_on_termination(self) -> None:
        """This process dies of SIGTERM/SIGHUP: remove the channels and the doorbell (each
        engine, finding its channel closed, exits within a poll) and tell the engines to stop."""
        if self.closed or os.getpid() != self.pid:
            return
        self.closed = True
        for endpoint in self.endpoints:
            endpoint.close()
        self.doorbell.close()
        for manager in self.managers:
            if manager.is_alive():
                manager.proc.terminate()


class DPSyncMPClient(EngineCoreClient):
    """config.parallel_config.data_parallel_size engines, each in its own process.

    executor_class: for every engine's EngineCore (tests inject faults with it).
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        executor_class: Optional[type] = None,
        ready_timeout: float = DEFAULT_READY_TIMEOUT_S,
    ) -> None:
        self.num_engines = n = config.parallel_config.data_parallel_size
        self._doorbell = Doorbell.create()
        self._resources = resources = _DPResources(self._doorbell)
        self._finalizer = multiprocessing.util.Finalize(self, resources.shutdown, exitpriority=100)
        FrontendTermination.register(resources)
        try:
            addresses = []
            for _ in range(n):
                endpoint, address = open_frontend_rung(self._doorbell)
                resources.endpoints.append(endpoint)
                addresses.append(address)
            self._endpoints = resources.endpoints
            self._inboxes = [FrontendInbox(e) for e in self._endpoints]
            self.cpu_plan = plan_cpus(n)
            for i, (cpus, threads) in enumerate(self.cpu_plan):
                resources.managers.append(CoreEngineProcManager(
                    config, addresses[i], executor_class, engine_index=i, cpus=cpus, num_threads=threads,
                ))
            self._managers = resources.managers
            self.engine_readies = self._wait_for_ready(ready_timeout)
        except BaseException:
            self._finalizer()
            raise
        self._ready = combine_ready(self.engine_readies)
        self.balancer = DPLoadBalancer(n)
        self._encode = make_encoder().encode
        self._send_lock = threading.Lock()  # the encoder and the input rings: one sender at a time
        self._state_lock = threading.Lock()  # the balancer: senders and the reader both update it
        self._recv_lock = threading.RLock()  # the output rings and the doorbell: one reader at a time
        self._pending: collections.deque[EngineCoreOutputs] = collections.deque()
        self._next_ring = 0
        self._last_watch = time.monotonic()
        self.request_timeout_s: Optional[float] = None
        self._call_ids = itertools.count()
        self._dead: Optional[str] = None

    def _wait_for_ready(self, timeout: float) -> list[EngineReady]:
        """READY from every engine (they start at the same time); EngineStartupError if any fails."""
        readies: list[Optional[EngineReady]] = [None] * self.num_engines
        while True:
            self._doorbell.clear()
            for i, manager in enumerate(self._managers):
                if readies[i] is None:
                    readies[i] = manager.poll_ready(self._inboxes[i], timeout)
            if all(r is not None for r in readies):
                return readies  # type: ignore[return-value]
            self._doorbell.wait(POLL_S)

    @property
    def engine_pids(self) -> list[int]:
        return [m.pid for m in self._managers]

    @property
    def requests_per_engine(self) -> list[int]:
        """How many requests each engine has finished (aborted ones included)."""
        with self._state_lock:
            return list(self.balancer.served)

    def owner_of(self, request_id: str) -> Optional[int]:
        """The engine that holds an unfinished request."""
        with self._state_lock:
            return self.balancer.owner.get(request_id)

    # ---- faults --------------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if not self._finalizer.still_active():
            raise EngineDeadError("the engine client is shut down.")

    def _died(self, engine: int, why: str) -> EngineDeadError:
        """Engine `engine` is dead: every other engine is shut down, and every call from now on
        raises EngineDeadError."""
        manager = self._managers[engine]
        self._dead = (
            f"data-parallel engine {engine} of {self.num_engines} (pid {manager.pid}) is dead (the other "
            f"engines were shut down): {why}"
        )
        logger.error("%s", self._dead)
        self._resources.shutdown(DEAD_PEERS_EXIT_S)
        return EngineDeadError(self._dead)

    def _watch(self) -> None:
        """EngineDeadError if any engine has exited (after reading what it said last)."""
        self._last_watch = time.monotonic()
        for i, manager in enumerate(self._managers):
            if manager.is_alive():
                continue
            last: Any = None
            try:
                while (msg := self._inboxes[i].try_recv()) is not None:
                    last = msg
            except Exception:  # what is left of the ring cannot be read: the exit code tells
                pass
            if isinstance(last, EngineFailed):
                raise self._died(i, f"it failed: {failure_text(last)}")
            raise self._died(i, f"it exited with code {manager.exitcode}")

    # ---- sending -------------------------------------------------------------------------

    def _send(self, engine: int, msg: Any, timeout: Optional[float] = None) -> None:
        """As SyncMPClient._send, to one engine."""
        self._check_usable()
        manager, endpoint = self._managers[engine], self._endpoints[engine]
        limit = self.request_timeout_s if timeout is None else timeout
        deadline = None if limit is None else time.monotonic() + limit
        with self._send_lock:
            data = self._encode(msg)
            while True:
                wait = POLL_S if deadline is None else max(min(POLL_S, deadline - time.monotonic()), 0.0)
                try:
                    endpoint.send(data, wait)
                    return
                except PeerGoneError as exc:
                    raise self._died(engine, str(exc)) from exc
                except RingClosedError:  # the ring is closed: the reader found an engine dead meanwhile
                    if self._dead is not None:
                        raise EngineDeadError(self._dead) from None
                    raise
                except ChannelTimeout:
                    if not manager.is_alive():
                        raise self._died(engine, f"it exited with code {manager.exitcode}") from None
                    if deadline is None or time.monotonic() < deadline:
                        continue
                    if timeout is not None:
                        raise
                    state = manager.state()
                    raise EngineTimeoutError(
                        f"data-parallel engine {engine} (pid {manager.pid}) took no input for {limit} s "
                        f"(request_timeout_s); it is {state}", state,
                    ) from None

    # ---- receiving -----------------------------------------------------------------------

    def _accept(self, engine: int, msg: Any) -> EngineCoreOutputs:
        if isinstance(msg, EngineFailed):
            raise self._died(engine, f"it failed: {failure_text(msg)}")
        if not isinstance(msg, EngineCoreOutputs):
            raise self._died(engine, f"it sent an unexpected {type(msg).__name__}")
        if msg.engine_index != engine:
            raise self._died(engine, f"it sent engine_index {msg.engine_index} on engine {engine}'s ring")
        with self._state_lock:
            if msg.scheduler_stats is not None:
                self.balancer.report(engine, msg.scheduler_stats)
            for output in msg.outputs:
                if output.finish_reason is not None:
                    self.balancer.finished(output.request_id)
        return msg

    def _poll(self) -> Optional[EngineCoreOutputs]:
        """The next message of any engine, taking the rings in turn; None if all are empty."""
        n = self.num_engines
        for k in range(n):
            i = (self._next_ring + k) % n
            try:
                msg = self._inboxes[i].try_recv()
            except PeerGoneError as exc:
                raise self._died(i, str(exc)) from exc
            if msg is not None:
                self._next_ring = (i + 1) % n
                return self._accept(i, msg)
        return None

    def _recv(self, timeout: Optional[float] = None) -> EngineCoreOutputs:
        """The next message of any engine; EngineDeadError within ~POLL_S of any engine's
        death (even while the others keep answering); EngineTimeoutError after `timeout` s."""
        self._check_usable()
        deadline = None if timeout is None else time.monotonic() + timeout
        doorbell = self._doorbell
        while True:
            doorbell.clear()  # before the look: see shmvllm.boundary.doorbell
            msg = self._poll()
            if msg is not None:
                if time.monotonic() - self._last_watch > POLL_S:
                    self._watch()
                return msg
            self._watch()
            if deadline is None:
                wait = POLL_S
            else:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    states = ", ".join(f"engine {i}: {m.state()}" for i, m in enumerate(self._managers))
                    raise EngineTimeoutError(
                        f"no output from the {self.num_engines} data-parallel engines for {timeout} s "
                        f"(request_timeout_s); {states}", states,
                    )
                wait = min(POLL_S, remaining)
            doorbell.wait(wait)

    # ---- the client API ------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest, group: Optional[str] = None) -> None:
        with self._state_lock:
            engine = self.balancer.choose(group)
            self.balancer.added(request.request_id, engine, group)
        try:
            self._send(engine, request)
        except BaseException:
            with self._state_lock:
                self.balancer.finished(request.request_id, served=False)
            raise

    def get_output(self, timeout: Optional[float] = None) -> EngineCoreOutputs:
        with self._recv_lock:
            if self._pending:
                return self._pending.popleft()
            return self._recv(timeout)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Each id to the engine that holds it (ids of finished requests are dropped); as
        SyncMPClient's, a dead engine holds nothing and a stuck one is logged, not raised."""
        if not request_ids or self._dead is not None or not self._finalizer.still_active():
            return
        by_engine: dict[int, list[str]] = collections.defaultdict(list)
        with self._state_lock:
            for request_id in request_ids:
                engine = self.balancer.finished(request_id)
                if engine is not None:
                    by_engine[engine].append(request_id)
        for engine, ids in sorted(by_engine.items()):
            try:
                self._send(engine, EngineCoreAbort(ids), timeout=ABORT_SEND_TIMEOUT_S)
            except ChannelTimeout:
                logger.warning("could not abort %d requests: engine %d's input ring stays full", len(ids), engine)

    def call_utility_all(self, method: str, *args: Any) -> list[Any]:
        """`EngineCore.<method>(*args)` in every engine; the answers in engine order.
        EngineUtilityError (naming the engine) if it raised in any."""
        with self._recv_lock:  # nobody else may take the replies
            call_id = next(self._call_ids)
            for engine in range(self.num_engines):
                self._send(engine, EngineCoreUtility(call_id, method, list(args)))
            answers: dict[int, Any] = {}
            failures: list[str] = []
            while len(answers) + len(failures) < self.num_engines:
                outputs = self._recv()
                utility = outputs.utility_output
                if utility is not None and utility.call_id == call_id:
                    if utility.failure_message is not None:
                        failures.append(f"engine {outputs.engine_index}: {utility.failure_message}")
                    else:
                        answers[outputs.engine_index] = utility.result
                elif outputs.outputs or outputs.finished_requests:
                    self._pending.append(outputs)
        if failures:
            raise EngineUtilityError(f"EngineCore.{method}() failed in the engine: {'; '.join(failures)}")
        return [answers[i] for i in range(self.num_engines)]

    def reset_prefix_cache(self) -> bool:
        return all(self.call_utility_all("reset_prefix_cache"))

    def get_stats(self) -> dict[str, Any]:
        return combine_stats(self.call_utility_all("get_stats"))

    def shutdown(self) -> None:
        self._finalizer()

    @property
    def ready(self) -> EngineReady:
        return self._ready
