"""EngineCoreClient: the LLMEngine's handle on the EngineCore, wherever that runs.

`make_client` picks the implementation: `SyncMPClient` (the engine in its own process, reached
over the shared-memory channel of shmvllm.boundary; the default) or `InprocClient` (the engine
in this process, which the tests and debugging use). Both expose the same calls.
"""

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
from shmvllm.boundary.channel import Addresses, ChannelTimeout, Endpoint, FrontendInbox, open_frontend
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
from shmvllm.engine.core_proc import POLL_S
from shmvllm.engine.exceptions import EngineDeadError, EngineTimeoutError
from shmvllm.engine.proc_manager import DEFAULT_READY_TIMEOUT_S, CoreEngineProcManager, failure_text
from shmvllm.engine.termination import FrontendTermination

logger = logging.getLogger(__name__)


class EngineCoreClient(ABC):
    @staticmethod
    def make_client(config: EngineConfig, multiprocess: bool = True) -> "EngineCoreClient":
        """SyncMPClient when multiprocess (DPSyncMPClient for data_parallel_size > 1), else
        InprocClient."""
        if config.parallel_config.data_parallel_size > 1:
            if not multiprocess:
                raise ValueError(
                    f"data_parallel_size={config.parallel_config.data_parallel_size} needs the engines in "
                    "processes of their own (multiprocess=True)."
                )
            from shmvllm.engine.dp_client import DPSyncMPClient

            return DPSyncMPClient(config)
        if multiprocess:
            return SyncMPClient(config)
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

    @property
    def num_kv_blocks(self) -> int:
        return self.ready.num_kv_blocks

    @property
    def block_size(self) -> int:
        return self.ready.block_size

    @property
    def max_concurrency(self) -> float:
        return self.ready.max_concurrency

    @property
    def vocab_size(self) -> int:
        """The engine's vocabulary size: token ids and logprobs stay below it."""
        return self.ready.vocab_size

    @property
    def max_logprobs(self) -> int:
        """The most (prompt) logprobs a request may ask of this engine."""
        return self.ready.max_logprobs


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


class EngineUtilityError(RuntimeError):
    """A UTILITY call raised in the engine; the message carries the engine's exception text."""


ABORT_SEND_TIMEOUT_S = 1.0  # an abort waits this long for room on a full input ring, then gives up
SHUTDOWN_SEND_TIMEOUT_S = 1.0
DEAD_ENGINE_EXIT_S = 1.0  # after the engine failed: how long the call that found out waits to reap it


class _EngineResources:
    """What a SyncMPClient must release, kept apart from it so that a finalizer can run it."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self.manager: Optional[CoreEngineProcManager] = None
        self.closed = False
        self.pid = os.getpid()  # a child forked from this process inherits the finalizer, not the engine

    def shutdown(self, timeout: float = 5.0) -> None:
        """SHUTDOWN, wait (then terminate/kill), then remove the channel. Idempotent. The engine
        drains its input whatever it has to send, so SHUTDOWN gets through a full output ring."""
        if self.closed or os.getpid() != self.pid:
            return
        self.closed = True
        try:
            if self.manager is not None:
                if self.manager.is_alive():
                    try:
                        self.endpoint.send(make_encoder().encode(EngineCoreShutdown()), SHUTDOWN_SEND_TIMEOUT_S)
                    except Exception:  # a stuck or broken channel: the manager terminates it
                        pass
                self.manager.shutdown(timeout)
        finally:
            self.endpoint.close()

    def release_on_termination(self) -> None:
        """This process dies of SIGTERM/SIGHUP: remove the channel (the engine, finding it
        closed, exits within a poll) and tell the engine to stop now."""
        if self.closed or os.getpid() != self.pid:
            return
        self.closed = True
        self.endpoint.close()
        if self.manager is not None and self.manager.is_alive():
            self.manager.proc.terminate()


ChannelFactory = Callable[[], "tuple[Endpoint, Addresses]"]


class SyncMPClient(EngineCoreClient):
    """The engine in its own process, reached over the channel (shmvllm.boundary.channel).

    Every blocking call waits with the GIL released and looks at the engine process at least
    every POLL_S seconds, so a dead engine becomes an EngineDeadError, never a hang. The engine
    stops on `shutdown()`, when this client is garbage-collected, and at interpreter exit.

    Sends simply block while the input ring is full (the engine drains it every turn of its
    loop: see the channel's flow-control rule).

    executor_class: for the engine's EngineCore (tests inject faults with it).
    channel: what creates the channel (default: the shared-memory rings); benchmarks/ passes
    its own (a ZeroMQ peer, a timed endpoint), whose Addresses name the engine side's opener.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        executor_class: Optional[type] = None,
        ready_timeout: float = DEFAULT_READY_TIMEOUT_S,
        channel: ChannelFactory = open_frontend,
    ) -> None:
        self._endpoint, self.addresses = channel()
        self._inbox = FrontendInbox(self._endpoint)
        self._encode = make_encoder().encode
        self._resources = resources = _EngineResources(self._endpoint)
        # multiprocessing's finalizers run at exit (atexit), before the interpreter tears down
        # what a shutdown needs: the engine gets SHUTDOWN first. SIGTERM and SIGHUP skip atexit:
        # FrontendTermination removes the channel then.
        self._finalizer = multiprocessing.util.Finalize(self, resources.shutdown, exitpriority=100)
        FrontendTermination.register(resources)
        try:
            self._manager = resources.manager = CoreEngineProcManager(config, self.addresses, executor_class)
            self._ready = self._manager.wait_for_ready(self._inbox, ready_timeout)
        except BaseException:
            self._finalizer()
            raise
        # Step outputs that arrive while a utility call waits for its answer, for get_output.
        self._pending: collections.deque[EngineCoreOutputs] = collections.deque()
        # The output channel has one reader at a time: get_output, or a utility call waiting
        # for its reply.
        self._recv_lock = threading.RLock()
        # How long a send may wait for room on a full input ring (None: as long as it takes).
        self.request_timeout_s: Optional[float] = None
        self._call_ids = itertools.count()
        self._dead: Optional[str] = None

    @property
    def engine_pid(self) -> Optional[int]:
        return self._manager.pid

    # ---- sending and receiving ------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if not self._finalizer.still_active():
            raise EngineDeadError("the engine client is shut down.")

    def _died(self, why: str) -> EngineDeadError:
        """The engine is dead (or exiting after its last words): the channel is removed now, the
        process killed if it does not exit within DEAD_ENGINE_EXIT_S, its workers and their
        segments removed, and every call from now on raises EngineDeadError."""
        self._dead = f"the engine process (pid {self._manager.pid}) is dead: {why}"
        self._endpoint.close()
        self._manager.reap(DEAD_ENGINE_EXIT_S)
        return EngineDeadError(self._dead)

    def _send(self, msg: Any, timeout: Optional[float] = None) -> None:
        """Sends to the engine, blocking while the input ring is full. ChannelTimeout after
        `timeout` s without room; without a `timeout`, EngineTimeoutError after
        `request_timeout_s` (if set). EngineDeadError within ~POLL_S of the engine's death."""
        self._check_usable()
        data = self._encode(msg)
        limit = self.request_timeout_s if timeout is None else timeout
        deadline = None if limit is None else time.monotonic() + limit
        while True:
            wait = POLL_S if deadline is None else max(min(POLL_S, deadline - time.monotonic()), 0.0)
            try:
                self._endpoint.send(data, wait)
                return
            except PeerGoneError as exc:
                raise self._died(str(exc)) from exc
            except RingClosedError:  # the ring is closed: another thread found the engine dead meanwhile
                if self._dead is not None:
                    raise EngineDeadError(self._dead) from None
                raise
            except ChannelTimeout:
                if not self._manager.is_alive():
                    raise self._died(f"it exited with code {self._manager.exitcode}") from None
                if deadline is None or time.monotonic() < deadline:
                    continue
                if timeout is not None:
                    raise
                state = self._manager.state()
                raise EngineTimeoutError(
                    f"the engine process (pid {self._manager.pid}) took no input for {limit} s (request_timeout_s); "
                    f"it is {state}", state,
                ) from None

    def _checked(self, msg: Any) -> EngineCoreOutputs:
        if isinstance(msg, EngineFailed):
            raise self._died(f"it failed: {failure_text(msg)}")
        if not isinstance(msg, EngineCoreOutputs):
            raise self._died(f"it sent an unexpected {type(msg).__name__}")
        return msg

    def _recv(self, timeout: Optional[float] = None) -> EngineCoreOutputs:
        """The engine's next message; EngineDeadError within ~POLL_S of its death,
        EngineTimeoutError (naming the engine's state) when nothing came within `timeout` s."""
        self._check_usable()
        inbox = self._inbox
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = POLL_S if deadline is None else max(min(POLL_S, deadline - time.monotonic()), 0.0)
            try:
                msg = inbox.recv(wait)
            except ChannelTimeout:
                if not self._manager.is_alive():
                    msg = inbox.try_recv()  # what it said before it died
                    if msg is None:
                        raise self._died(f"it exited with code {self._manager.exitcode}") from None
                elif deadline is not None and time.monotonic() >= deadline:
                    state = self._manager.state()
                    raise EngineTimeoutError(
                        f"no output from the engine process (pid {self._manager.pid}) for {timeout} s "
                        f"(request_timeout_s); it is {state}", state,
                    ) from None
                else:
                    continue
            except PeerGoneError as exc:
                raise self._died(str(exc)) from exc
            except RingClosedError:  # the ring is closed: a sender found the engine dead meanwhile
                if self._dead is not None:
                    raise EngineDeadError(self._dead) from None
                raise
            return self._checked(msg)

    # ---- the client API -------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest, group: Optional[str] = None) -> None:
        self._send(request)

    def get_output(self, timeout: Optional[float] = None) -> EngineCoreOutputs:
        with self._recv_lock:
            if self._pending:
                return self._pending.popleft()
            return self._recv(timeout)

    def abort_requests(self, request_ids: list[str]) -> None:
        """A dead engine holds no requests: then there is nothing to abort, and no error. An
        engine that does not read its input (stopped, stuck) within ABORT_SEND_TIMEOUT_S on a
        full ring keeps them: logged, not raised (the caller is usually unwinding already)."""
        if request_ids and self._dead is None and self._finalizer.still_active():
            try:
                self._send(EngineCoreAbort(list(request_ids)), timeout=ABORT_SEND_TIMEOUT_S)
            except ChannelTimeout:
                logger.warning("could not abort %d requests: the engine's input ring stays full", len(request_ids))

    def call_utility(self, method: str, *args: Any) -> Any:
        """Calls `EngineCore.<method>(*args)` in the engine; EngineUtilityError if it raised there."""
        call_id = next(self._call_ids)
        with self._recv_lock:  # nobody else may take the reply
            return self._call_utility(call_id, method, args)

    def _call_utility(self, call_id: int, method: str, args: tuple[Any, ...]) -> Any:
        self._send(EngineCoreUtility(call_id, method, list(args)))
        while True:
            outputs = self._recv()
            utility = outputs.utility_output
            if utility is not None and utility.call_id == call_id:
                if utility.failure_message is not None:
                    raise EngineUtilityError(f"EngineCore.{method}() failed in the engine: {utility.failure_message}")
                return utility.result
            if outputs.outputs or outputs.finished_requests:
                self._pending.append(outputs)

    def reset_prefix_cache(self) -> bool:
        return self.call_utility("reset_prefix_cache")

    def get_stats(self) -> Any:
        return self.call_utility("get_stats")

    def shutdown(self) -> None:
        self._finalizer()

    @property
    def ready(self) -> EngineReady:
        return self._ready
