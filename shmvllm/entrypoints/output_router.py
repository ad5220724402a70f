"""OutputRouter: many threads share one LLMEngine; each gets exactly the outputs of its requests.

The engine's output side has one reader at a time: whichever waiting caller takes the driver
lock waits for the engine's next outputs, hands every one to the caller that owns its request
(a `Sink` per call), releases the lock and wakes the others. Any waiting caller can take over
driving, so nobody depends on a particular thread staying alive. The driver waits without the
state lock, so other callers add requests meanwhile and they share the engine's next steps
(continuous batching across callers); adding, aborting and processing outputs take the state
lock, so the engine's output processor sees one thread at a time.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Callable, Iterable, Optional, TypeVar

from shmvllm.engine.exceptions import EngineDeadError

T = TypeVar("T")


class Sink:
    """The outputs of one call's requests, in the order the engine produced them."""

    def __init__(self) -> None:
        self.pending: set[str] = set()  # request ids not finished yet
        self.outputs: collections.deque[Any] = collections.deque()

    def expect(self, request_id: str) -> None:
        self.pending.add(request_id)


class OutputRouter:
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._state_lock = threading.Lock()  # held for every call that changes the engine's requests
        self._driver_lock = threading.Lock()  # held by the one thread that reads the engine's outputs
        self._cond = threading.Condition()  # guards the sinks, the generation and the failure
        self._generation = 0  # bumped each time a driver lets go of the engine
        self._owners: dict[str, Sink] = {}
        self._failure: Optional[BaseException] = None

    def locked(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Runs `fn(*args, **kwargs)` with the engine to itself (adding and aborting requests, utilities)."""
        with self._state_lock:
            return fn(*args, **kwargs)

    def register(self, sink: Sink, request_id: str) -> None:
        """Routes `request_id`'s outputs to `sink`; call before the request is added."""
        with self._cond:
            sink.expect(request_id)
            self._owners[request_id] = sink

    def release(self, sink: Sink) -> None:
        """Forgets a call's requests (after it finished, failed or was interrupted)."""
        with self._cond:
            for request_id in sink.pending:
                self._owners.pop(request_id, None)
            sink.pending.clear()

    def next_outputs(self, sink: Sink, timeout: Optional[float] = None) -> list[Any]:
        """Blocks until `sink` has outputs (or nothing is pending) and takes them all;
        EngineTimeoutError when this caller, driving, got nothing from the engine for `timeout` s."""
        while True:
            with self._cond:
                if sink.outputs or not sink.pending:
                    taken = list(sink.outputs)
                    sink.outputs.clear()
                    return taken
                if self._failure is not None:
                    raise self._failure
                generation = self._generation
            if self._driver_lock.acquire(blocking=False):
                try:
                    self._drive_once(sink, timeout)
                finally:
                    self._driver_lock.release()
                    with self._cond:
                        self._generation += 1
                        self._cond.notify_all()
            else:
                with self._cond:
                    # A driver is stepping: wait for it to let go (it notifies), then look again.
                    self._cond.wait_for(lambda: self._generation != generation or self._failure is not None)

    def _drive_once(self, sink: Sink, timeout: Optional[float]) -> None:
        with self._cond:
            if sink.outputs or not sink.pending:
                return  # the previous driver brought what this caller waited for
        try:
            outputs = self.engine.engine_core.get_output(timeout)
        except EngineDeadError as exc:  # every caller learns it
            with self._cond:
                self._failure = exc
                self._cond.notify_all()
            raise
        with self._state_lock:
            processed = self.engine.process_engine_outputs(outputs)
        self._route(processed)

    def _route(self, outputs: Iterable[Any]) -> None:
        with self._cond:
            for output in outputs:
                owner = self._owners.get(output.request_id)
                if owner is None:
                    continue  # a request its caller gave up on
                owner.outputs.append(output)
                if output.finished:
                    owner.pending.discard(output.request_id)
                    del self._owners[output.request_id]
