"""CoreEngineProcManager: starts the engine process, waits for READY, watches it, stops it.

By default the engine process is its own program, `python -m shmvllm.engine.core_proc` (a
fresh interpreter, so no torch or thread state is inherited, and not multiprocessing's spawn, so
the caller's main module is never imported again: a script without a main guard, `python -c` and
a notebook cell all work); its `EngineProcArgs` (the config and the channel's addresses,
msgpack) go to its stdin. With SHMVLLM_ENGINE_START=fork (or vLLM's
VLLM_WORKER_MULTIPROC_METHOD=fork) it is a fork of the caller, as vLLM's engine is on Linux: it
has the caller's modules as they are, monkeypatches included; the OpenMP thread pools are ended
before the fork (a forked libgomp pool hangs the child). Either way it answers READY (`EngineReady`)
once its KV cache is sized, or `EngineFailed` with its start-up traceback, which becomes an
`EngineStartupError` here. A child that dies without a word is noticed by polling it.

The engine's tree (the engine and its tensor-parallel workers or pipeline stages, noted at READY) creates segments
and semaphores of its own (the broadcast ring, the all-reduce arena), named after their creator's
pid: once the engine is declared dead (`reap`) or stopped (`shutdown`), what is left of the tree
is killed and everything of those pids is unlinked here, whoever died first; the sweep at the next
start stays the backstop for a frontend that died too.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

from ipc.segment import pid_alive, process_start_time, sweep_stale_segments
from shmvllm import envs
from shmvllm.boundary.channel import POLL_S, Addresses, ChannelTimeout, FrontendInbox
from shmvllm.boundary.messages import EngineFailed, EngineReady
from shmvllm.config import EngineConfig
from shmvllm.engine.core_proc import EngineProcArgs, encode_proc_args, qualified_name, serve_forked, serve_prestarted
from shmvllm.engine.exceptions import EngineStartupError

logger = logging.getLogger(__name__)

DEFAULT_READY_TIMEOUT_S = 600.0
TREE_EXIT_S = 1.0  # how long the workers of a dead engine get to be gone after their SIGKILL
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


def failure_text(failed: EngineFailed) -> str:
    """An engine's failure for an error message: its type and message on the first line, the
    engine's traceback after it."""
    lines = [line for line in failed.traceback.splitlines() if line.strip()]
    summary = failed.error or (lines[-1].strip() if lines else "no reason given")
    return summary if failed.traceback.strip() in ("", summary) else f"{summary}\n{failed.traceback}"


def describe_exit(code: Optional[int]) -> str:
    """An exit code in words: "killed by SIGKILL" for -9, "exited with code 1", "still running"."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


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
        prestarted: Optional["PrestartedEngine"] = None,
    ) -> None:
        """engine_index, cpus (its cores) and num_threads (its OMP_NUM_THREADS) are for one of
        several data-parallel engines (shmvllm.engine.dp_client); the defaults: the only one.
        prestarted: a fork made before the config existed, which becomes the engine (a fork
        start of the only engine) or is discarded."""
        self.engine_index = engine_index
        parallel = config.parallel_config
        self._has_workers = parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1
        self.workers: list[tuple[int, int]] = []  # (pid, start time) of the engine's worker processes
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
        self.start_method = envs.SHMVLLM_ENGINE_START()
        torch = sys.modules.get("torch")
        if self.start_method == "fork" and torch is not None and torch.cuda.is_initialized():
            # as vLLM: a forked child cannot use the CUDA context it inherits
            logger.warning("CUDA is initialized in this process: the engine starts as a program, not a fork")
            self.start_method = "program"
        self.started = time.monotonic()
        if prestarted is not None:
            if self.start_method == "fork" and num_threads is None and not cpus:
                self.started = prestarted.started
                self.proc: Any = prestarted.start(args)
                return
            prestarted.discard()
        if self.start_method == "fork":
            self.proc = ForkedProcess(lambda: serve_forked(args, num_threads))
            return
        payload = encode_proc_args(args)
        # the directory that holds the shmvllm package first on its path, so that it runs this
        # shmvllm whatever the working directory
        env = envs.child_environment(pythonpath_first=_PACKAGE_ROOT)
        if num_threads is not None:
            env["OMP_NUM_THREADS"] = str(num_threads)
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

    def _note_workers(self) -> None:
        """The engine's child processes (its tensor-parallel workers or pipeline stages, started before READY)."""
        if self._has_workers:
            self.workers = [(pid, process_start_time(pid)) for pid in _children(self.proc.pid)]

    def reap(self, grace: float) -> None:
        """The engine was declared dead: `grace` s for it to exit (it may be sending its last
        words or closing its executor), then SIGKILL; then what is left of its tree goes."""
        self.join(grace)
        if self.is_alive():
            logger.warning("engine process %d declared dead but still running: killing it", self.proc.pid)
            self.proc.kill()
            self.join(2.0)
        self._remove_tree()

    def _remove_tree(self) -> None:
        """After the engine exited: kills its workers (PR_SET_PDEATHSIG usually has), waits for
        them to be gone, and unlinks every segment and semaphore the engine and they created."""
        if self.is_alive():
            return
        for pid, started in self.workers:
            if pid_alive(pid, started):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + TREE_EXIT_S
        while any(pid_alive(pid, started) for pid, started in self.workers) and time.monotonic() < deadline:
            time.sleep(0.01)
        removed = sweep_stale_segments(creators={self.proc.pid, *(pid for pid, _ in self.workers)})
        if removed:
            logger.info("removed %d segments left by engine process %d's tree: %s", len(removed), self.proc.pid, removed)

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
        self._note_workers()
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
        self._note_workers()
        logger.info("engine %d (pid %d) ready in %.1f s: %d KV blocks x %d tokens", self.engine_index, self.pid,
                    time.monotonic() - self.started, answer.num_kv_blocks, answer.block_size)
        return answer

    def _failed(self, answer: Any) -> EngineStartupError:
        if isinstance(answer, EngineFailed):
            return EngineStartupError(f"the engine process (pid {self.pid}) failed to start: {failure_text(answer)}")
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
            f"the engine process (pid {self.pid}) died before READY: {describe_exit(self.exitcode)} ({what}); "
            "its own output above says why."
        )

    def shutdown(self, timeout: float = 5.0) -> None:
        """Waits `timeout` s for the process to exit (after SHUTDOWN), then terminates, then
        kills; then removes what is left of its tree."""
        proc = self.proc
        self.join(timeout)
        if self.is_alive():
            logger.warning("engine process %d did not exit in %.1f s: terminating it", proc.pid, timeout)
            proc.terminate()
            self.join(2.0)
        if self.is_alive():
            proc.kill()
            self.join(2.0)
        self._remove_tree()


def pause_openmp_pools() -> None:
    """Ends the worker threads of every OpenMP runtime loaded here (torch's libgomp, the C
    kernels' own), which start again at the next parallel region: a fork while they exist
    leaves a child that hangs in its first parallel region (libgomp cannot rebuild its pool)."""
    paths = set()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                name = os.path.basename(fields[5].strip()) if len(fields) == 6 else ""
                if "omp" in name and ".so" in name:  # libgomp.so.1, libiomp5.so, libomp.so
                    paths.add(fields[5].strip())
    except OSError:
        return
    for path in sorted(paths):
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):  # not an OpenMP runtime after all, or one before OpenMP 5.0
            continue
        pause.argtypes = [ctypes.c_int]
        if pause(_OMP_PAUSE_HARD) != 0:
            logger.warning("could not stop the OpenMP threads of %s before the engine's fork", path)


_OMP_PAUSE_HARD = 2  # omp_pause_hard: the runtime frees its threads (omp_pause_soft may keep them)


class ForkedProcess:
    """The engine as a fork of this process (SHMVLLM_ENGINE_START=fork), with the part of
    subprocess.Popen's interface the manager uses (pid, poll, wait, terminate, kill)."""

    def __init__(self, target: Callable[[], None]) -> None:
        pause_openmp_pools()
        self.returncode: Optional[int] = None
        pid = os.fork()
        if pid == 0:  # the engine: `target` exits the process itself
            try:
                target()
            finally:
                os._exit(1)
        self.pid = pid

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"engine process {self.pid}", timeout)
            time.sleep(0.005)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class PrestartedEngine:
    """The engine forked first thing (SHMVLLM_ENGINE_START=fork, one engine), before its config
    exists: it imports torch (most of its start-up, on a thread) while this process builds the
    config and the channel, then `start` hands it its EngineProcArgs over a pipe.
    `discard` (the config failed, or another start was chosen) closes the pipe and reaps it; a
    frontend that dies closes the pipe too, and the fork exits on the empty read."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        read_fd, self._write_fd = os.pipe()
        try:
            self._proc: Optional[ForkedProcess] = ForkedProcess(lambda: _prestarted_child(read_fd, self._write_fd))
        finally:
            os.close(read_fd)

    @staticmethod
    def wanted(multiprocess: bool, data_parallel_size: int) -> bool:
        """Whether an engine start would be the one fork that a prestart can become."""
        if not multiprocess or data_parallel_size != 1 or envs.SHMVLLM_ENGINE_START() != "fork":
            return False
        torch = sys.modules.get("torch")
        return torch is None or not torch.cuda.is_initialized()

    def start(self, args: EngineProcArgs) -> "ForkedProcess":
        """Sends `args`: from here on the fork is the engine (its process)."""
        proc, self._proc = self._proc, None
        if proc is None:
            raise RuntimeError("this prestarted engine was already started or discarded.")
        try:
            with os.fdopen(self._write_fd, "wb") as pipe:
                pipe.write(encode_proc_args(args))
        except OSError:  # it died: wait_for_ready reports its exit
            pass
        return proc

    def discard(self) -> None:
        """Closes the pipe, then kills and reaps the fork (idempotent)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        os.close(self._write_fd)
        proc.kill()
        proc.wait()


def _prestarted_child(read_fd: int, write_fd: int) -> None:
    os.close(write_fd)  # the frontend's end: the child's copy would keep the pipe open
    serve_prestarted(read_fd)


def _children(pid: int) -> list[int]:
    """The live child processes of `pid` (Linux: /proc; none found elsewhere)."""
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for name in entries:
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(name))
            except (OSError, IndexError, ValueError):  # gone meanwhile
                pass
    return found
