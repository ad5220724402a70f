"""What SIGTERM and SIGHUP do to the frontend and to the engine process: clean up, then die.

Both signals terminate a Python process at once by default, without atexit hooks or finally
blocks: the engine's channel and its executor's segments, or the frontend's rings, would stay
in /dev/shm until some later run's sweep. So:

- The engine process (`raise_on_termination`, installed by `EngineCoreProc.run_engine_core`)
  turns the first SIGTERM or SIGHUP into `EngineTerminated`, raised in its main thread: the
  engine tells the frontend why it stops, shuts its EngineCore (and executor) down, closes its
  side of the channel, and then dies of the same signal (`die_of`), so its exit status still
  says which signal ended it. Later ones during that cleanup are ignored (SIGKILL still works).
  SIGINT stays ignored: Ctrl-C reaches the whole process group, and the frontend decides.
- The frontend (`FrontendTermination`, for each engine client) removes every channel of its
  live clients and asks their engines to stop (SIGTERM) before it dies of the signal; the
  engines, whose frontend closed the channel, exit within a poll. This handler is installed
  only where the signal's disposition is still the default one and only from the main thread:
  a program's own handler, or an ignored signal, is left alone (the engine still notices the
  frontend's death within a poll and removes what it left).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import weakref
from typing import Any, Protocol

from shmvllm.engine.exceptions import EngineTerminated

logger = logging.getLogger(__name__)

TERMINATING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _raise_terminated(signum: int, frame: Any) -> None:
    ignore_termination()  # the cleanup that follows runs to its end
    raise EngineTerminated(signum)


def ignore_termination() -> None:
    """SIGTERM and SIGHUP are ignored from now on (the engine, once it is shutting down)."""
    for signum in TERMINATING_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def raise_on_termination() -> None:
    """In the engine process: SIGTERM and SIGHUP raise EngineTerminated in the main thread."""
    for signum in TERMINATING_SIGNALS:
        signal.signal(signum, _raise_terminated)


def die_of(signum: int) -> None:
    """Ends this process by `signum` with its default action (the exit status names it)."""
    signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
    os.kill(os.getpid(), signum)
    os._exit(128 + signum)  # not reached where the default action terminates


class Releasable(Protocol):
    def release_on_termination(self) -> None:
        """Removes the client's channels and signals its engines; never blocks, never raises."""


class FrontendTermination:
    """The frontend's SIGTERM/SIGHUP handler: every live client's `release_on_termination`,
    then death by the signal. One per process; clients register themselves."""

    _lock = threading.Lock()
    _clients: "weakref.WeakSet[Any]" = weakref.WeakSet()
    _installed: set[int] = set()

    @classmethod
    def register(cls, client: Releasable) -> None:
        with cls._lock:
            cls._clients.add(client)
            if threading.current_thread() is not threading.main_thread():
                return
            for signum in TERMINATING_SIGNALS:
                if signum not in cls._installed and signal.getsignal(signum) is signal.SIG_DFL:
                    signal.signal(signum, cls._handle)
                    cls._installed.add(signum)

    @classmethod
    def _handle(cls, signum: int, frame: Any) -> None:
        for client in list(cls._clients):
            try:
                client.release_on_termination()
            except Exception:  # dying anyway: release what the others hold
                logger.exception("could not release an engine client on %s", signal.Signals(signum).name)
        die_of(signum)
