"""Errors the engine client raises to the user."""


class EngineDeadError(RuntimeError):
    """The engine process died or stopped answering; the LLM cannot serve any more requests."""


class EngineTimeoutError(TimeoutError):
    """A call got no output from the engine for `request_timeout_s`; `state` says what the
    engine process was doing then ("alive, busy", "stopped", ...). Its requests were aborted."""

    def __init__(self, message: str, state: str) -> None:
        super().__init__(message)
        self.state = state


class EngineStartupError(RuntimeError):
    """The engine process failed while starting; the message carries its traceback."""
