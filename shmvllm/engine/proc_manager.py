"""CoreEngineProcManager: starts the engine process, waits for READY, watches it, stops it.

The engine process is spawned (a fresh interpreter; never forked, so no torch or thread state
is inherited) with the channel's addresses, not its objects. It answers READY (`EngineReady`)
once its KV cache is sized, or its start-up traceback, which becomes an `EngineStartupError`
here. A child that dies without a word is noticed through its process sentinel.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import time
from typing import Any, Callable, Optional

from ipc.segment import pid_alive
from shmvllm.config import EngineConfig
from shmvllm.engine.core_proc import POLL_S, EngineCoreProc, decode_handshake
from shmvllm.engine.exceptions import EngineStartupError
from shmvllm.engine.messages import EngineReady
from shmvllm.engine.transport import Addresses, ChannelTimeout, Endpoint

logger = logging.getLogger(__name__)

DEFAULT_READY_TIMEOUT_S = 600.0
_DRAIN_EVERY_S = 0.02


def describe_process(pid: int) -> str:
    """A process's scheduler state in words: "alive, busy" (running: a long step, or stuck in a
    kernel), "alive, waiting" (asleep: blocked on something), "stopped" (SIGSTOP, a debugger),
    or "dead"."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "alive (its state is unknown here)" if pid_alive(pid) else "dead"
    if state == "R":
        return "alive, busy (running: a long step, or stuck in a kernel)"
    if state in ("S", "D", "I"):
        return f"alive, waiting (asleep in state {state}: blocked on a lock, a device or I/O)"
    if state in ("T", "t"):
        return "stopped (SIGSTOP or a debugger; SIGCONT resumes it)"
    return f"dead (state {state})"


class CoreEngineProcManager:
    def __init__(
        self,
        config: EngineConfig,
        addresses: Addresses,
        io_threads: bool = False,
        executor_class: Optional[type] = None,
    ) -> None:
        context = multiprocessing.get_context("spawn")
        self.proc = context.Process(
            target=EngineCoreProc.run_engine_core,
            name="EngineCore",
            kwargs=dict(
                config=config,
                addresses=addresses,
                parent_pid=os.getpid(),
                io_threads=io_threads,
                executor_class=executor_class,
                log_level=logging.getLogger("shmvllm").getEffectiveLevel(),
            ),
        )
        self.started = time.monotonic()
        self.proc.start()

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid

    def state(self) -> str:
        """What the engine process is doing, in words (see `describe_process`)."""
        if not self.is_alive():
            return f"dead (exit code {self.exitcode})"
        return describe_process(self.proc.pid)

    @property
    def exitcode(self) -> Optional[int]:
        return self.proc.exitcode

    def is_alive(self) -> bool:
        return self.proc.is_alive()

    def wait_for_ready(self, endpoint: Endpoint, timeout: float = DEFAULT_READY_TIMEOUT_S) -> EngineReady:
        """Blocks until READY; EngineStartupError with the child's traceback when it failed."""
        deadline = self.started + timeout
        while True:
            try:
                answer = endpoint.recv(decode_handshake, POLL_S)
                break
            except ChannelTimeout:
                pass
            except Exception as exc:  # the ring reports a dead peer before the sentinel does
                raise self._startup_error(endpoint, f"the channel failed: {exc}") from exc
            if not self.is_alive():
                raise self._startup_error(endpoint, "it exited")
            if time.monotonic() > deadline:
                raise EngineStartupError(f"the engine process (pid {self.pid}) sent no READY within {timeout:.0f} s.")
        if isinstance(answer, str):
            raise EngineStartupError(f"the engine process (pid {self.pid}) failed to start:\n{answer}")
        logger.info(
            "engine process %d ready in %.1f s: %d KV blocks x %d tokens (%.2fx max concurrency at max_model_len=%d)",
            self.pid, time.monotonic() - self.started, answer.num_kv_blocks, answer.block_size,
            answer.max_concurrency, answer.max_model_len,
        )
        return answer

    def _startup_error(self, endpoint: Endpoint, what: str) -> EngineStartupError:
        self.proc.join(timeout=2 * POLL_S)
        try:
            answer: Any = endpoint.try_recv(decode_handshake)
        except Exception:
            answer = None
        if isinstance(answer, str):
            return EngineStartupError(f"the engine process (pid {self.pid}) failed to start:\n{answer}")
        return EngineStartupError(
            f"the engine process (pid {self.pid}) died before READY ({what}; exit code {self.exitcode}); "
            "its own output above says why."
        )

    def shutdown(self, timeout: float = 5.0, while_waiting: Optional[Callable[[], None]] = None) -> None:
        """Waits `timeout` s for the process to exit (after SHUTDOWN), calling `while_waiting`
        every few ms meanwhile, then terminates, then kills."""
        proc = self.proc
        if proc.pid is None:
            return
        deadline = time.monotonic() + timeout
        while proc.exitcode is None and (remaining := deadline - time.monotonic()) > 0:
            if while_waiting is not None:
                while_waiting()
            proc.join(remaining if while_waiting is None else min(remaining, _DRAIN_EVERY_S))
        if proc.exitcode is None:
            logger.warning("engine process %d did not exit in %.1f s: terminating it", proc.pid, timeout)
            proc.terminate()
            proc.join(2.0)
        if proc.exitcode is None:
            proc.kill()
            proc.join(2.0)
