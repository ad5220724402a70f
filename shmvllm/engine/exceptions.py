"""The engine's errors, in one place.

Fatal: the engine is gone and every later call raises too (EngineDeadError, EngineStartupError
for the user; inside the engine, WorkerDeadError, FrontendGoneError and EngineTerminated end
its process). Recoverable: the call failed and the engine serves on (EngineTimeoutError,
EngineUtilityError).
"""

from __future__ import annotations

import signal


class EngineDeadError(RuntimeError):
    """The engine process died or stopped answering; the LLM cannot serve any more requests."""


class EngineStartupError(RuntimeError):
    """The engine process failed while starting: the first line says why (the failure's type
    and message, or how the process ended), the engine's traceback follows."""


class EngineTimeoutError(TimeoutError):
    """A call got no output from the engine for `request_timeout_s`; `state` says what the
    engine process was doing then ("alive, busy", "stopped", ...). Its requests were aborted."""

    def __init__(self, message: str, state: str) -> None:
        super().__init__(message)
        self.state = state


class EngineUtilityError(RuntimeError):
    """A UTILITY call raised in the engine; the message carries the engine's exception text."""


class WorkerDeadError(RuntimeError):
    """A worker process of the executor died: the model is gone with its shard (ends the engine)."""


class FrontendGoneError(Exception):
    """The frontend process died or closed the channel without saying SHUTDOWN (ends the engine)."""


class EngineTerminated(BaseException):
    """SIGTERM or SIGHUP reached the engine process (a BaseException, as SystemExit: no
    `except Exception` of the engine's may swallow it)."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"the engine process was terminated by {signal.Signals(signum).name}")
