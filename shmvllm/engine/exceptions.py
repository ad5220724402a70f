"""Errors the engine client raises to the user."""


class EngineDeadError(RuntimeError):
    """The engine process died or stopped answering; the LLM cannot serve any more requests."""


class EngineStartupError(RuntimeError):
    """The engine process failed while starting; the message carries its traceback."""
