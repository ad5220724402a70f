"""EngineCoreClient: the LLMEngine's handle on the EngineCore, wherever that runs: `MPClient`
(the default: N = data_parallel_size engine processes, each on its own shared-memory channel of
shmvllm.boundary) or `InprocClient` (the engine in this process, for tests and debugging)."""

from __future__ import annotations

import collections
import itertools
import logging
import multiprocessing.util
import os
import threading
import time
from abc import ABC, abstractmethod
from typing import Any, Callable, Optional

from ipc import PeerGoneError, RingClosedError
from shmvllm.boundary.channel import ABORT_SEND_TIMEOUT_S, DEAD_ENGINE_EXIT_S, POLL_S, SHUTDOWN_SEND_TIMEOUT_S
from shmvllm.boundary.channel import Addresses, ChannelTimeout, Endpoint, FrontendInbox, open_frontend
from shmvllm.boundary.messages import EngineCoreAbort, EngineCoreOutputs, EngineCoreRequest, EngineCoreShutdown
from shmvllm.boundary.messages import EngineCoreUtility, EngineFailed, EngineReady, make_encoder
from shmvllm.boundary.doorbell import Doorbell, open_frontend_rung
from shmvllm.config import EngineConfig
from shmvllm.engine.dp_balancer import DPLoadBalancer
from shmvllm.engine.dp_client import combine_ready, combine_stats, plan_cpus
from shmvllm.engine.exceptions import EngineDeadError, EngineTimeoutError, EngineUtilityError
from shmvllm.engine.proc_manager import DEFAULT_READY_TIMEOUT_S, CoreEngineProcManager, PrestartedEngine, failure_text
from shmvllm.engine.termination import FrontendTermination

logger = logging.getLogger(__name__)


class EngineCoreClient(ABC):
    @staticmethod
    def make_client(config: EngineConfig, multiprocess: bool = True,
                    started: Optional[Callable[[], None]] = None,
                    prestarted: Optional[PrestartedEngine] = None) -> "EngineCoreClient":
        """MPClient (one engine process per data-parallel rank) when multiprocess, else InprocClient.
        started, prestarted: MPClient's (called once the engine processes exist, before the wait
        for READY; the engine's fork, made before the config)."""
        if multiprocess:
            return MPClient(config, started=started, prestarted=prestarted)
        if (n := config.parallel_config.data_parallel_size) > 1:
            raise ValueError(f"data_parallel_size={n} needs the engines in processes of their own (multiprocess=True).")
        return InprocClient(config)

    @abstractmethod
    def add_request(self, request: EngineCoreRequest, group: Optional[str] = None) -> None:
        """Queues a request. `group`: requests that name the same group go to the same engine
        (the children of an n > 1 request; it matters only with several engines)."""

    @abstractmethod
    def get_output(self, timeout: Optional[float] = None) -> EngineCoreOutputs:
        """The next step's outputs (may be empty); EngineTimeoutError when none came within
        `timeout` seconds (None: no limit). Safe to call from one thread while others add and
        abort requests."""

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def reset_prefix_cache(self) -> bool: ...

    @abstractmethod
    def get_stats(self) -> Any: ...

    @abstractmethod
    def shutdown(self) -> None: ...

    @property
    @abstractmethod
    def ready(self) -> EngineReady:
        """The engine's limits (its READY): KV blocks, max concurrency, the max_model_len the KV
        cache allows, the vocabulary size, max_logprobs."""


class InprocClient(EngineCoreClient):
    """Holds the EngineCore in this process: `get_output` runs one engine step."""

    def __init__(self, config: EngineConfig):
        from shmvllm.engine.core import EngineCore

        self.engine_core = EngineCore(config)
        self._lock = threading.Lock()  # a step and a new request do not touch the scheduler at once

    def add_request(self, request: EngineCoreRequest, group: Optional[str] = None) -> None:
        with self._lock:
            self.engine_core.add_request(request)

    def get_output(self, timeout: Optional[float] = None) -> EngineCoreOutputs:
        """Runs one step here and now: `timeout` cannot interrupt it, and does not apply."""
        with self._lock:
            if not self.engine_core.has_unfinished_requests():
                return EngineCoreOutputs()
            return self.engine_core.step()

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            with self._lock:
                self.engine_core.abort_requests(request_ids)

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def get_stats(self) -> Any:
        return self.engine_core.get_stats()

    def shutdown(self) -> None:
        self.engine_core.shutdown()

    @property
    def ready(self) -> EngineReady:
        return self.engine_core.ready()


ChannelFactory = Callable[[], "tuple[Endpoint, Addresses]"]


class EngineHandle:
    """One engine process and its channel (its endpoint, inbox, process manager)."""

    def __init__(self, index: int, num_engines: int, endpoint: Endpoint, addresses: Addresses) -> None:
        self.index = index
        self.endpoint = endpoint
        self.addresses = addresses
        self.inbox = FrontendInbox(endpoint)
        self.manager: Optional[CoreEngineProcManager] = None
        self._name = "the engine process" if num_engines == 1 else f"data-parallel engine {index} of {num_engines}"

    def __str__(self) -> str:
        return f"{self._name} (pid {self.manager.pid if self.manager else None})"


class BackgroundResources:
    """What an MPClient must release, apart from it so that a finalizer can run it: the
    engines, their channels, the doorbell."""

    def __init__(self) -> None:
        self.handles: list[EngineHandle] = []
        self.doorbell: Any = None
        self.closed = False
        self.pid = os.getpid()  # a child forked from this process inherits the finalizer, not the engines

    def shutdown(self, timeout: float = 5.0) -> None:
        """SHUTDOWN to every live engine (it gets through: an engine drains its input whatever it
        has to send), `timeout` s for all to exit (then kill their trees), then remove the channels."""
        if self.closed or os.getpid() != self.pid:
            return
        self.closed = True
        try:
            shutdown = make_encoder().encode(EngineCoreShutdown())
            for handle in self.handles:
                if handle.manager is not None and handle.manager.is_alive():
                    try:
                        handle.endpoint.send(shutdown, SHUTDOWN_SEND_TIMEOUT_S)
                    except Exception:  # stuck or broken: terminated below
                        pass
            deadline = time.monotonic() + timeout
            for handle in self.handles:
                if handle.manager is not None:
                    handle.manager.shutdown(max(deadline - time.monotonic(), 0.0))
        finally:
            self._close_channels()

    def release_on_termination(self) -> None:
        """This process dies of SIGTERM/SIGHUP: remove the channels (each engine, finding its
        closed, exits within a poll) and tell the engines to stop now."""
        if self.closed or os.getpid() != self.pid:
            return
        self.closed = True
        self._close_channels()
        for handle in self.handles:
            if handle.manager is not None and handle.manager.is_alive():
                handle.manager.proc.terminate()

    def _close_channels(self) -> None:
        for handle in self.handles:
            handle.endpoint.close()
        if self.doorbell is not None:
            self.doorbell.close()


class MPClient(EngineCoreClient):
    """N = data_parallel_size engines (1 by default), each in its own process on its own channel,
    with N > 1 each on its share of the cores (`plan_cpus`). Every blocking call waits with the
    GIL released and looks at every engine process at least every POLL_S s: a dead engine is an
    EngineDeadError, never a hang (the others are shut down). Sends block while an input ring is
    full. One engine: the client waits on its output ring. N: a request goes to one engine
    (`DPLoadBalancer`), an abort to the engine that holds it, a utility call to all (answers
    combined); the client sleeps on a doorbell that every engine rings (boundary/doorbell.py).

    executor_class: every engine's (tests inject faults with it). channel: what opens a single
    engine's channel (default: the shared-memory rings; benchmarks/ passes its own). started: called
    once every engine process exists, before the wait for READY. prestarted: a fork made before the
    config (proc_manager.PrestartedEngine), which becomes the first engine where it can."""

    def __init__(self, config: EngineConfig, *, executor_class: Optional[type] = None,
                 ready_timeout: float = DEFAULT_READY_TIMEOUT_S, channel: Optional[ChannelFactory] = None,
                 started: Optional[Callable[[], None]] = None, prestarted: Optional[PrestartedEngine] = None) -> None:
        self.num_engines = n = config.parallel_config.data_parallel_size
        if n > 1 and channel is not None:
            raise ValueError(f"channel= opens one engine's channel; data_parallel_size={n} uses the doorbell rings.")
        self._resources = resources = BackgroundResources()
        # runs at exit (atexit) before the interpreter tears down what a shutdown needs; SIGTERM
        # and SIGHUP skip atexit: FrontendTermination removes the channels then.
        self._finalizer = multiprocessing.util.Finalize(self, resources.shutdown, exitpriority=100)
        FrontendTermination.register(resources)
        try:
            if n == 1:
                resources.handles.append(EngineHandle(0, 1, *(channel or open_frontend)()))
                self.cpu_plan: list[tuple[list[int], Optional[int]]] = [([], None)]
            else:
                resources.doorbell = Doorbell.create()
                for i in range(n):
                    resources.handles.append(EngineHandle(i, n, *open_frontend_rung(resources.doorbell)))
                self.cpu_plan = plan_cpus(n)
            self.handles = resources.handles
            for handle, (cpus, threads) in zip(self.handles, self.cpu_plan):
                handle.manager = CoreEngineProcManager(config, handle.addresses, executor_class, engine_index=handle.index,
                                                       cpus=cpus, num_threads=threads,
                                                       prestarted=prestarted if handle.index == 0 else None)
            if started is not None:  # the caller's own set-up, overlapping the engines' load
                started()
            readies = self._wait_for_ready(ready_timeout)
        except BaseException:
            self._finalizer()
            raise
        self._ready = readies[0] if n == 1 else combine_ready(readies)
        self._doorbell = resources.doorbell
        if n > 1:
            self.balancer = DPLoadBalancer(n)
        self._encode = make_encoder().encode
        self._send_lock = threading.Lock()  # the encoder and the input rings: one sender at a time
        self._state_lock = threading.Lock()  # the balancer: senders and the reader both update it
        self._recv_lock = threading.RLock()  # one reader of the output rings: get_output or a utility call
        self._pending: collections.deque[EngineCoreOutputs] = collections.deque()  # outputs a utility call read
        self._next_ring = 0
        self._last_watch = time.monotonic()
        self.request_timeout_s: Optional[float] = None  # how long a send may wait for room (None: no limit)
        self._call_ids = itertools.count()
        self._dead: Optional[str] = None

    def _wait_for_ready(self, timeout: float) -> list[EngineReady]:
        """READY from every engine (they start at the same time); EngineStartupError if any fails."""
        if self.num_engines == 1:
            handle = self.handles[0]
            return [handle.manager.wait_for_ready(handle.inbox, timeout)]
        readies: list[Optional[EngineReady]] = [None] * self.num_engines
        while True:
            self._resources.doorbell.clear()
            for i, handle in enumerate(self.handles):
                if readies[i] is None:
                    readies[i] = handle.manager.poll_ready(handle.inbox, timeout)
            if all(r is not None for r in readies):
                return readies  # type: ignore[return-value]
            self._resources.doorbell.wait(POLL_S)

    @property
    def addresses(self) -> Addresses:
        """The first engine's channel (the only one's, with one engine)."""
        return self.handles[0].addresses

    @property
    def engine_pid(self) -> Optional[int]:
        return self.handles[0].manager.pid

    @property
    def engine_pids(self) -> list[int]:
        return [h.manager.pid for h in self.handles]

    # ---- faults --------------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if not self._finalizer.still_active():
            raise EngineDeadError("the engine client is shut down.")

    def _died(self, handle: EngineHandle, why: str) -> EngineDeadError:
        """`handle`'s engine is dead (or exiting after its last words): its channel removed, its tree
        killed if it does not exit within DEAD_ENGINE_EXIT_S, the other engines shut down; every call
        from now on raises EngineDeadError."""
        others = " (the other engines were shut down)" if self.num_engines > 1 else ""
        self._dead = f"{handle} is dead{others}: {why}"
        if others:
            logger.error("%s", self._dead)
        handle.endpoint.close()
        handle.manager.reap(DEAD_ENGINE_EXIT_S)
        self._resources.shutdown(DEAD_ENGINE_EXIT_S)
        return EngineDeadError(self._dead)

    def _broken(self, handle: EngineHandle, exc: Exception) -> Exception:
        """What a channel error means: PeerGoneError, the engine died; RingClosedError, another
        thread found an engine dead meanwhile (else the ring's own error stands)."""
        if isinstance(exc, PeerGoneError):
            return self._died(handle, str(exc))
        return EngineDeadError(self._dead) if self._dead is not None else exc

    def _checked(self, handle: EngineHandle, msg: Any) -> EngineCoreOutputs:
        if isinstance(msg, EngineFailed):
            raise self._died(handle, f"it failed: {failure_text(msg)}")
        if not isinstance(msg, EngineCoreOutputs):
            raise self._died(handle, f"it sent an unexpected {type(msg).__name__}")
        if self.num_engines > 1:
            if msg.engine_index != handle.index:
                raise self._died(handle, f"it sent engine_index {msg.engine_index} on engine {handle.index}'s ring")
            with self._state_lock:
                if msg.scheduler_stats is not None:
                    self.balancer.report(handle.index, msg.scheduler_stats)
                for output in msg.outputs:  # a finished request's output is never a row of the columns
                    if output.finish_reason is not None:
                        self.balancer.finished(output.request_id)
        return msg

    def _exited(self, handle: EngineHandle) -> EngineDeadError:
        """`handle`'s engine has exited: EngineDeadError with what it said last, or its exit code."""
        last: Any = None
        try:
            while (msg := handle.inbox.try_recv()) is not None:
                last = msg
        except Exception:  # what is left of the ring cannot be read: the exit code tells
            pass
        if isinstance(last, EngineFailed):
            return self._died(handle, f"it failed: {failure_text(last)}")
        return self._died(handle, f"it exited with code {handle.manager.exitcode}")

    # ---- sending -------------------------------------------------------------------------

    def _send(self, handle: EngineHandle, msg: Any, timeout: Optional[float] = None) -> None:
        """Sends to one engine, blocking while its input ring is full. ChannelTimeout after
        `timeout` s without room; without a `timeout`, EngineTimeoutError after
        `request_timeout_s` (if set). EngineDeadError within ~POLL_S of the engine's death."""
        self._check_usable()
        limit = self.request_timeout_s if timeout is None else timeout
        deadline = None if limit is None else time.monotonic() + limit
        with self._send_lock:
            data = self._encode(msg)
            while True:
                wait = POLL_S if deadline is None else max(min(POLL_S, deadline - time.monotonic()), 0.0)
                try:
                    handle.endpoint.send(data, wait)
                    return
                except (PeerGoneError, RingClosedError) as exc:
                    raise self._broken(handle, exc) from None
                except ChannelTimeout:
                    if not handle.manager.is_alive():
                        raise self._died(handle, f"it exited with code {handle.manager.exitcode}") from None
                    if deadline is None or time.monotonic() < deadline:
                        continue
                    if timeout is not None:
                        raise
                    state = handle.manager.state()
                    raise EngineTimeoutError(f"{handle} took no input for {limit} s (request_timeout_s); it is {state}",
                                             state) from None

    # ---- receiving -----------------------------------------------------------------------

    def _recv(self, timeout: Optional[float] = None) -> EngineCoreOutputs:
        """The next message of any engine; EngineDeadError within ~POLL_S of any engine's death (even
        while the others answer), EngineTimeoutError naming their states after `timeout` s of nothing."""
        self._check_usable()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = POLL_S if deadline is None else max(min(POLL_S, deadline - time.monotonic()), 0.0)
            msg = self._wait_one(wait) if self._doorbell is None else self._wait_any(wait)
            if msg is not None:
                return msg
            if deadline is not None and time.monotonic() >= deadline:
                one = self.num_engines == 1
                what = str(self.handles[0]) if one else f"the {self.num_engines} data-parallel engines"
                states = ", ".join(f"{'it is' if one else f'engine {h.index}:'} {h.manager.state()}" for h in self.handles)
                raise EngineTimeoutError(f"no output from {what} for {timeout} s (request_timeout_s); {states}", states)

    def _wait_one(self, wait: float) -> Optional[EngineCoreOutputs]:
        """One engine: its next message, blocking on its output ring up to `wait` s."""
        handle = self.handles[0]
        try:
            return self._checked(handle, handle.inbox.recv(wait))
        except ChannelTimeout:
            if not handle.manager.is_alive():
                raise self._exited(handle) from None
            return None
        except (PeerGoneError, RingClosedError) as exc:
            raise self._broken(handle, exc) from None

    def _wait_any(self, wait: float) -> Optional[EngineCoreOutputs]:
        """N engines: the next message of any, reading the rings in turn, asleep on the
        doorbell up to `wait` s when all are empty; every engine watched at least every POLL_S."""
        self._doorbell.clear()  # before the look: see shmvllm.boundary.doorbell
        n = self.num_engines
        for k in range(n):
            handle = self.handles[(self._next_ring + k) % n]
            try:
                msg = handle.inbox.try_recv()
            except (PeerGoneError, RingClosedError) as exc:
                raise self._broken(handle, exc) from None
            if msg is not None:
                self._next_ring = (handle.index + 1) % n
                if time.monotonic() - self._last_watch > POLL_S:
                    self._watch()
                return self._checked(handle, msg)
        self._watch()
        self._doorbell.wait(wait)
        return None

    def _watch(self) -> None:
        """EngineDeadError if any engine has exited (after reading what it said last)."""
        self._last_watch = time.monotonic()
        for handle in self.handles:
            if not handle.manager.is_alive():
                raise self._exited(handle)

    # ---- the client API ------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest, group: Optional[str] = None) -> None:
        if self.num_engines == 1:
            self._send(self.handles[0], request)
            return
        with self._state_lock:
            engine = self.balancer.choose(group)
            self.balancer.added(request.request_id, engine, group)
        try:
            self._send(self.handles[engine], request)
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
        """Each id to the engine that holds it (with N > 1, finished ones are dropped); nothing
        after the engines died. An engine that leaves its input ring full for ABORT_SEND_TIMEOUT_S
        keeps them: logged, not raised (the caller is usually unwinding already)."""
        if not request_ids or self._dead is not None or not self._finalizer.still_active():
            return
        if self.num_engines == 1:
            by_engine = {0: list(request_ids)}
        else:
            by_engine = collections.defaultdict(list)
            with self._state_lock:
                for request_id in request_ids:
                    engine = self.balancer.finished(request_id)
                    if engine is not None:
                        by_engine[engine].append(request_id)
        for engine, ids in sorted(by_engine.items()):
            try:
                self._send(self.handles[engine], EngineCoreAbort(ids), timeout=ABORT_SEND_TIMEOUT_S)
            except ChannelTimeout:
                logger.warning("could not abort %d requests: %s's input ring stays full", len(ids), self.handles[engine])

    def call_utility_all(self, method: str, *args: Any) -> list[Any]:
        """`EngineCore.<method>(*args)` in every engine; the answers in engine order.
        EngineUtilityError (naming the engine, with N > 1) if it raised in any."""
        with self._recv_lock:  # nobody else may take the replies
            call_id = next(self._call_ids)
            for handle in self.handles:
                self._send(handle, EngineCoreUtility(call_id, method, list(args)))
            answers: dict[int, Any] = {}
            failures: list[str] = []
            while len(answers) + len(failures) < self.num_engines:
                outputs = self._recv()
                utility = outputs.utility_output
                if utility is not None and utility.call_id == call_id:
                    if utility.failure_message is None:
                        answers[outputs.engine_index] = utility.result
                    else:
                        where = "" if self.num_engines == 1 else f"engine {outputs.engine_index}: "
                        failures.append(where + utility.failure_message)
                elif outputs.num_outputs or outputs.finished_requests:
                    self._pending.append(outputs)
        if failures:
            raise EngineUtilityError(f"EngineCore.{method}() failed in the engine: {'; '.join(failures)}")
        return [answers[i] for i in range(self.num_engines)]

    def call_utility(self, method: str, *args: Any) -> Any:
        """`call_utility_all`'s answer from one engine; with N > 1, the list of them."""
        answers = self.call_utility_all(method, *args)
        return answers[0] if self.num_engines == 1 else answers

    def reset_prefix_cache(self) -> bool:
        return all(self.call_utility_all("reset_prefix_cache"))

    def get_stats(self) -> Any:
        stats = self.call_utility_all("get_stats")
        return stats[0] if self.num_engines == 1 else combine_stats(stats)

    def shutdown(self) -> None:
        self._finalizer()

    @property
    def ready(self) -> EngineReady:
        return self._ready
