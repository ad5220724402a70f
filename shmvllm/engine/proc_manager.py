"""CoreEngineProcManager: starts the engine process, waits for READY, watches it, stops it.

The engine process is its own program, `python -m shmvllm.engine.core_proc` (a fresh
interpreter; never forked, so no torch or thread state is inherited, and not multiprocessing's
spawn, so the caller's main module is never imported again: a script without a main guard,
`python -c` and a notebook cell all work). Its `EngineProcArgs` (the config and the channel's
addresses, msgpack) go to its stdin. It answers READY (`EngineReady`)
once its KV cache is sized, or `EngineFailed` with its start-up traceback, which becomes an
`EngineStartupError` here. A child that dies without a word is noticed by polling it.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from ipc.segment import pid_alive
from shmvllm import envs
from shmvllm.boundary.channel import Addresses, ChannelTimeout, FrontendInbox
from shmvllm.boundary.messages import EngineFailed, EngineReady
from shmvllm.config import EngineConfig
from shmvllm.engine.core_proc import POLL_S, EngineProcArgs, encode_proc_args, qualified_name
from shmvllm.engine.exceptions import EngineStartupError

logger = logging.getLogger(__name__)

DEFAULT_READY_TIMEOUT_S = 600.0
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


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
        executor_class: Optional[type] = None,
        *,
        engine_index: int = 0,
        cpus: Optional[list[int]] = None,
        num_threads: Optional[int] = None,
    ) -> None:
        """engine_index, cpus (its cores) and num_threads (its OMP_NUM_THREADS) are for one of
        several data-parallel engines (shmvllm.engine.dp_client); the defaults: the only one."""
        self.engine_index = engine_index
        args = EngineProcArgs.build(
            config,
            addresses,
            parent_pid=os.getpid(),
            executor_class=None if executor_class is None else qualified_name(executor_class),
            log_level=logging.getLogger("shmvllm").getEffectiveLevel(),
            sys_path=[p for p in sys.path if p],
            engine_index=engine_index,
            cpus=list(cpus or ()),
        )
        payload = encode_proc_args(args)
        # the directory that holds the shmvllm package first on its path, so that it runs this
        # shmvllm whatever the working directory
        env = envs.child_environment(pythonpath_first=_PACKAGE_ROOT)
        if num_threads is not None:
            env["OMP_NUM_THREADS"] = str(num_threads)
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "shmvllm.engine.core_proc"], stdin=subprocess.PIPE, env=env, close_fds=True,
        )
        try:
            self.proc.stdin.write(payload)
            self.proc.stdin.close()
        except OSError:  # it died at once: wait_for_ready reports its exit
            pass

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
        """The exit code; -N when signal N ended it; None while it runs."""
        return self.proc.poll()

    def is_alive(self) -> bool:
        return self.proc.poll() is None

    def join(self, timeout: float) -> None:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def wait_for_ready(self, inbox: FrontendInbox, timeout: float = DEFAULT_READY_TIMEOUT_S) -> EngineReady:
        """Blocks until READY; EngineStartupError with the child's traceback when it failed."""
        deadline = self.started + timeout
        while True:
            try:
                answer = inbox.recv(POLL_S)
                break
            except ChannelTimeout:
                pass
            except Exception as exc:  # the ring reports a dead peer before the poll does
                raise self._startup_error(inbox, f"the channel failed: {exc}") from exc
            if not self.is_alive():
                raise self._startup_error(inbox, "it exited")
            if time.monotonic() > deadline:
                raise EngineStartupError(f"the engine process (pid {self.pid}) sent no READY within {timeout:.0f} s.")
        if not isinstance(answer, EngineReady):
            raise self._failed(answer)
        logger.info(
            "engine process %d ready in %.1f s: %d KV blocks x %d tokens (%.2fx max concurrency at max_model_len=%d)",
            self.pid, time.monotonic() - self.started, answer.num_kv_blocks, answer.block_size,
            answer.max_concurrency, answer.max_model_len,
        )
        return answer

    def poll_ready(self, inbox: FrontendInbox, timeout: float = DEFAULT_READY_TIMEOUT_S) -> Optional[EngineReady]:
        """`wait_for_ready` without waiting (for a caller that waits on several engines at once):
        READY if it came, None if not yet; EngineStartupError when the engine failed, died or
        is later than `timeout` s after its start."""
        try:
            answer = inbox.try_recv()
        except Exception as exc:
            raise self._startup_error(inbox, f"the channel failed: {exc}") from exc
        if answer is None:
            if not self.is_alive():
                raise self._startup_error(inbox, "it exited")
            if time.monotonic() > self.started + timeout:
                raise EngineStartupError(f"the engine process (pid {self.pid}) sent no READY within {timeout:.0f} s.")
            return None
        if not isinstance(answer, EngineReady):
            raise self._failed(answer)
        logger.info("engine %d (pid %d) ready in %.1f s: %d KV blocks x %d tokens", self.engine_index, self.pid,
                    time.monotonic() - self.started, answer.num_kv_blocks, answer.block_size)
        return answer

    def _failed(self, answer: Any) -> EngineStartupError:
        if isinstance(answer, EngineFailed):
            return EngineStartupError(f"the engine process (pid {self.pid}) failed to start:\n{answer.traceback}")
        return EngineStartupError(f"the engine process (pid {self.pid}) answered {type(answer).__name__} before READY.")

    def _startup_error(self, inbox: FrontendInbox, what: str) -> EngineStartupError:
        self.join(2 * POLL_S)
        try:
            answer: Any = inbox.try_recv()
        except Exception:
            answer = None
        if answer is not None:
            return self._failed(answer)
        return EngineStartupError(
            f"the engine process (pid {self.pid}) died before READY ({what}; exit code {self.exitcode}); "
            "its own output above says why."
        )

    def shutdown(self, timeout: float = 5.0) -> None:
        """Waits `timeout` s for the process to exit (after SHUTDOWN), then terminates, then kills."""
        proc = self.proc
        self.join(timeout)
        if self.is_alive():
            logger.warning("engine process %d did not exit in %.1f s: terminating it", proc.pid, timeout)
            proc.terminate()
            self.join(2.0)
        if self.is_alive():
            proc.kill()
            self.join(2.0)
