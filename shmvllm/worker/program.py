"""The frame of a worker program the engine starts (`tp_worker`, `pp_worker`): tied to the
engine's process, Ctrl-C left to the engine, its log lines naming it, and an exit that skips the
interpreter's teardown."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from typing import Callable, NoReturn

logger = logging.getLogger(__name__)


def die_with_parent() -> None:
    """The kernel kills this process when the one that started it dies (Linux's PR_SET_PDEATHSIG)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def run_worker(label: str, log_level: int, serve: Callable[[], None]) -> NoReturn:
    """Runs `serve`, then exits 0 (1 after a failure, logged) without the interpreter's teardown:
    torch.distributed's would wait for the other ranks' groups."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group; the engine decides
    logging.basicConfig(level=log_level, format=f"({label} pid={os.getpid()}) %(levelname)s %(name)s: %(message)s")
    code = 0
    try:
        serve()
    except BaseException:
        logger.exception("%s failed", label)
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
