"""EngineCoreProc: the EngineCore in a process of its own, served over the channel.

The process is a program of its own, `python -m shmvllm.engine.core_proc`, started by
`CoreEngineProcManager` with its `EngineProcArgs` (msgpack) on stdin: nothing of the caller's
main module runs in it, so scripts without a main guard, `python -c` and notebooks work; or,
with SHMVLLM_ENGINE_START=fork, a fork of the frontend (`serve_forked`, vLLM's way). It
opens its side of the channel (`Addresses.opener`), builds the EngineCore, and answers READY
(`EngineReady`, the engine's limits), or `EngineFailed` with the traceback if building failed;
where its config alone decides the limits (`core.limits_before_load`) it answers READY first and
builds after (a failure then is an `EngineFailed` after READY).
Then the busy loop, which follows the channel's flow-control rule (shmvllm.boundary.channel):
flush the outbox, take everything the frontend sent (ADD / ABORT / UTILITY / SHUTDOWN), step
unless the outbox is backlogged, queue the step's outputs; wait on the input ring when there is
nothing to step.

Failures: an exception in the busy loop (in `step`, say) is logged and sent to the frontend as
`EngineFailed("serving", traceback)`, then the process exits with code 1; the frontend raises
EngineDeadError. When the frontend dies the engine notices within a poll (the parent pid
changes; the ring reports a dead peer), removes what the frontend left of the channel and
exits. SIGTERM or SIGHUP (shmvllm.engine.termination): the engine sends
`EngineFailed("serving", "... terminated by SIGTERM")`, shuts down, closes its side of the
channel and dies of that signal. SIGINT is ignored: Ctrl-C in a terminal reaches the whole
process group, and the frontend, which catches it, decides when the engine stops.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import importlib
import logging
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path, PurePath
from typing import Any, Optional

import msgspec

from shmvllm.boundary.channel import (
    FLUSH_POLL_S,
    LAST_WORDS_S,
    OUTBOX_RING_MULTIPLE,
    POLL_S,
    Addresses,
    ChannelTimeout,
    EngineOutbox,
)
from shmvllm.boundary.messages import (
    EngineCoreAbort,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreShutdown,
    EngineCoreUtility,
    EngineFailed,
    UndecodableRequest,
    UtilityOutput,
    decode_to_engine,
)
from shmvllm import envs
from shmvllm.config import EngineConfig
from shmvllm.engine.exceptions import EngineTerminated, FrontendGoneError
from shmvllm.engine.termination import die_of, ignore_termination, raise_on_termination

logger = logging.getLogger(__name__)



def _error_line(exc: BaseException) -> str:
    """"Type: message" of an exception, on one line."""
    lines = "".join(traceback.format_exception_only(type(exc), exc)).splitlines()
    return " ".join(line.strip() for line in lines if line.strip())


def qualified_name(obj: Any) -> str:
    """"module:qualname" of a class or function the engine process can import (not one defined
    in __main__, which the engine process does not run)."""
    if obj.__module__ == "__main__" or "<locals>" in obj.__qualname__:
        raise ValueError(
            f"{obj!r} must be defined at the top level of an importable module: the engine process "
            "imports it by name and never runs the caller's __main__."
        )
    return f"{obj.__module__}:{obj.__qualname__}"


def import_qualified(name: str) -> Any:
    module, _, qualname = name.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


class EngineProcArgs(msgspec.Struct, kw_only=True):
    """What the engine program reads from its stdin (msgpack): the config and the channel.

    The model's config travels as its values (`HFConfig.to_dict()`; it has no msgspec schema),
    rebuilt as an HFConfig: the engine never imports transformers for it; `sys_path` is the
    frontend's, so that an executor_class or a channel opener from the caller's own modules
    imports here too."""

    config: EngineConfig
    hf_config: dict[str, Any]
    addresses: Addresses
    draft_hf_config: Optional[dict[str, Any]] = None  # speculative_config's draft model's, as hf_config
    parent_pid: int
    executor_class: Optional[str] = None
    log_level: int = logging.WARNING
    sys_path: list[str] = []
    engine_index: int = 0  # which of the data-parallel engines this is (in every EngineCoreOutputs)
    cpus: list[int] = []  # the cores this engine runs on (every thread of it); empty: wherever the OS likes

    @classmethod
    def build(cls, config: EngineConfig, addresses: Addresses, **kwargs: Any) -> "EngineProcArgs":
        hf = config.model_config.hf_config
        bare = dataclasses.replace(config, model_config=dataclasses.replace(config.model_config, hf_config=None))
        if config.draft_model_config is not None:
            kwargs["draft_hf_config"] = config.draft_model_config.hf_config.to_dict()
            bare.draft_model_config = dataclasses.replace(config.draft_model_config, hf_config=None)
        return cls(config=bare, hf_config=hf.to_dict(), addresses=addresses, **kwargs)

    def engine_config(self) -> EngineConfig:
        from shmvllm.model.hf_config import HFConfig

        hf = HFConfig(self.hf_config)
        config = dataclasses.replace(self.config, model_config=dataclasses.replace(self.config.model_config, hf_config=hf))
        if self.draft_hf_config is not None and config.draft_model_config is not None:
            config.draft_model_config = dataclasses.replace(config.draft_model_config, hf_config=HFConfig(self.draft_hf_config))
        return config


def _encode_path(obj: Any) -> Any:
    if isinstance(obj, PurePath):
        return str(obj)
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _decode_path(kind: type, obj: Any) -> Any:
    if kind is Path:
        return Path(obj)
    raise NotImplementedError(f"cannot decode {kind}")


encode_proc_args = msgspec.msgpack.Encoder(enc_hook=_encode_path).encode
decode_proc_args = msgspec.msgpack.Decoder(EngineProcArgs, dec_hook=_decode_path).decode


def main() -> None:
    """`python -m shmvllm.engine.core_proc`, the program CoreEngineProcManager starts: reads
    EngineProcArgs from stdin (until EOF), then serves."""
    args = decode_proc_args(sys.stdin.buffer.read())
    sys.stdin.close()
    serve(args)


FORKED_ENGINE_NAME = "shmvllm-engine"


def serve_forked(args: EngineProcArgs, num_threads: Optional[int]) -> None:
    """The engine in a fork of the frontend (SHMVLLM_ENGINE_START=fork): the caller's modules,
    monkeypatches included, are the engine's. Never returns."""
    # The frontend's objects are not this process's to collect: a finalizer of one (a closed
    # LLM's, say) must not run here.
    gc.freeze()
    try:  # its name in ps and top (the command line stays the caller's)
        with open("/proc/self/comm", "w") as f:
            f.write(FORKED_ENGINE_NAME)
    except OSError:
        pass
    fd = os.open(os.devnull, os.O_RDONLY)  # as multiprocessing's children: the terminal's stdin stays the caller's
    os.dup2(fd, 0)
    os.close(fd)
    if num_threads is not None:
        envs.set_omp_num_threads(num_threads)
        if "torch" in sys.modules:  # imported before the fork: the variable alone comes too late
            sys.modules["torch"].set_num_threads(num_threads)
    serve(args)


def serve_prestarted(read_fd: int) -> None:
    """A fork of the frontend made before its config existed (`PrestartedEngine`): loads the
    engine's own code, then imports torch on a thread while the main thread reads its
    EngineProcArgs from `read_fd` until EOF and serves (it answers READY before torch where it can; its own `import torch` then
    waits for the thread's). Nothing to read (the frontend gave up, or died): exits. Never returns."""
    global _torch_import
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as the engine's: the frontend decides on Ctrl-C
    _load_engine_code()
    _torch_import = threading.Thread(target=_import_torch, name="shmvllm-torch-import", daemon=True)
    _torch_import.start()
    with os.fdopen(read_fd, "rb") as pipe:
        payload = pipe.read()
    if not payload:
        os._exit(0)
    serve_forked(decode_proc_args(payload), None)


def _load_engine_code() -> None:
    """Imports the engine's code that runs before torch (its core; the native step's where it is
    on) and loads the rings' C helper, ahead of torch's thread: the fork's main thread would wait
    for its config meanwhile, and after it these would share the GIL with torch's import (the
    first request waits for them)."""
    import ipc
    import shmvllm.engine.core  # noqa: F401

    ipc.native_available()
    if envs.SHMVLLM_FUSED_DECODE() and envs.SHMVLLM_NATIVE_KERNELS():
        import shmvllm.engine.first_requests  # noqa: F401
        import shmvllm.model.kernels  # noqa: F401
        import shmvllm.model.registry  # noqa: F401


class _PausableImport:
    """A finder first on sys.meta_path that holds the torch-importing thread at its next module
    while `torch_may_run` is clear (the engine computes a request without torch meanwhile: the
    import would hold the GIL between each of its C calls); at most PAUSE_MAX_S a module."""

    PAUSE_MAX_S = 1.0

    def __init__(self) -> None:
        self.thread = threading.current_thread()

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if threading.current_thread() is self.thread:
            torch_may_run.wait(self.PAUSE_MAX_S)
        return None


torch_may_run = threading.Event()
torch_may_run.set()


def _import_torch() -> None:
    global _prestart_imports_s
    started = time.monotonic()
    pausable = _PausableImport()
    sys.meta_path.insert(0, pausable)
    try:  # torch only: shmvllm's own modules import on the main thread (no two threads in one import cycle)
        import torch  # noqa: F401  (every built-in executor needs it)
    except Exception:  # the same import fails again in `serve`, which reports why
        pass
    finally:
        sys.meta_path.remove(pausable)
    _prestart_imports_s = time.monotonic() - started


_prestart_imports_s: Optional[float] = None  # a prestarted engine's torch import (its thread)
_torch_import: Optional[threading.Thread] = None  # that thread


def serve(args: EngineProcArgs) -> None:
    """Serves until the end, then exits this process (never returns)."""
    sys.path.extend(p for p in args.sys_path if p not in sys.path)
    if args.cpus:
        pin_process(args.cpus)
    code = EngineCoreProc.run_engine_core(args)
    # As multiprocessing's children do: no interpreter teardown, which would wait for the
    # non-daemon threads of libraries (and run their atexit hooks) after the engine is done.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    if code < 0:
        die_of(-code)
    os._exit(code)


def process_age() -> Optional[float]:
    """Seconds since this process started (/proc, 10 ms resolution); None where unknown."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def pin_process(cpus: list[int]) -> None:
    """Runs every thread of this process, and those it starts later, on `cpus` only.
    (sched_setaffinity applies to one thread: the threads that imports started already, such
    as a BLAS pool, are set one by one.)"""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # that thread ended meanwhile
            pass


class StartupWatch:
    """While the engine starts (imports, model load: seconds in which nothing reads the channel)
    a thread looks at the parent every POLL_S; if the frontend died, it removes the segments the
    frontend left and interrupts the start-up (EngineTerminated in the main thread, `fired`)."""

    def __init__(self, parent_pid: int) -> None:
        self.parent_pid = parent_pid
        self.fired = False
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="shmvllm-startup-watch", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stopped.wait(POLL_S):
            if os.getppid() != self.parent_pid:
                self.fired = True
                try:
                    from ipc import sweep_stale_segments

                    sweep_stale_segments()
                except Exception:  # the sweep of the next start removes them then
                    logger.warning("could not remove the dead frontend's segments", exc_info=True)
                # a real signal to the main thread: it also ends a sleep or a wait in progress
                signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)
                return

    def stop(self) -> None:
        self._stopped.set()


class _Shutdown(Exception):
    """SHUTDOWN arrived: leave the busy loop."""


class EngineCoreProc:
    def __init__(
        self,
        config: EngineConfig,
        addresses: Addresses,
        parent_pid: int,
        executor_class: Optional[type] = None,
        engine_index: int = 0,
    ) -> None:
        at_init = time.monotonic()
        from shmvllm.engine.core import EngineCore, limits_before_load, reserve_kv_cache

        self.parent_pid = parent_pid
        self.engine_index = engine_index
        self.endpoint = import_qualified(addresses.opener)(addresses)
        self.outbox = EngineOutbox(self.endpoint, OUTBOX_RING_MULTIPLE * 4 * self.endpoint.max_message)
        # messages taken from the channel and not yet handled (the first requests' phase defers
        # some to the EngineCore; a step's input check keeps what arrives mid-step)
        self._arrived: collections.deque[Any] = collections.deque()
        opened = time.monotonic()
        try:
            # READY before torch where the config alone decides the limits: the frontend goes on
            # (LLM() returns) while torch imports and the model loads; requests wait in the ring
            early = limits_before_load(config) if executor_class is None else None
            if early is not None:
                self.outbox.send(early)
                # the model gets the blocks announced, whatever the RAM available reads once it is loaded
                config = dataclasses.replace(
                    config, cache_config=dataclasses.replace(config.cache_config, num_kv_blocks=early.num_kv_blocks))
                reservation = reserve_kv_cache(config, early.num_kv_blocks)  # mapped and first touched beside torch's import
                self._arrived.extend(self._serve_first_requests(config, reservation, early.num_kv_blocks))
            early_at = time.monotonic()
            if any(type(msg) is EngineCoreShutdown for msg in self._arrived):
                self.engine_core = None  # SHUTDOWN before torch: nothing to build
                return
            if _torch_import is not None:  # nothing builds (or forks) while that import is half done
                _torch_import.join()
            if executor_class is None:
                import torch  # noqa: F401  (every built-in executor needs it: timed as a phase of its own)
            torch_imported = time.monotonic()
            self.engine_core = EngineCore(config, executor_class)
            built = self.engine_core.ready()
            if early is not None and built != early:
                raise RuntimeError(f"the engine built has the limits {built}, not those of its READY {early}")
        except BaseException as exc:
            self._last_words(EngineFailed("startup", traceback.format_exc(), _error_line(exc)))
            self.endpoint.close()
            raise
        if early is None:
            self.outbox.send(built)
        self.engine_core.set_input_check(self._input_waiting)
        serving = time.monotonic()
        age = process_age()
        born = None if age is None else time.monotonic() - age  # the process's start, on this clock

        def since_start(t: float) -> str:
            return "?" if born is None else f"{t - born:.2f} s"

        logger.info(
            "Start-up of the engine process: READY %s after it started (%s), serving %s after: interpreter and "
            "first imports %s%s, engine code and channel %.3f s, torch %.2f s, EngineCore %.2f s (its lines above)",
            since_start(serving if early is None else early_at),
            "once built" if early is None else "from its config, before torch", since_start(serving),
            since_start(at_init),
            "" if _prestart_imports_s is None else f" (torch {_prestart_imports_s:.2f} s on a thread from the fork on)",
            opened - at_init, torch_imported - early_at, serving - torch_imported,
        )

    def _serve_first_requests(self, config: EngineConfig, reservation: Any, num_blocks: int) -> list[Any]:
        """Serves the requests the native step computes exactly while torch imports
        (first_requests.py); the messages left for the EngineCore. None served where the model
        is not one the step runs, or its set-up fails (the EngineCore serves them all then)."""
        global _torch_import
        from shmvllm.model.gguf_step import unsupported

        if _torch_import is not None and not _torch_import.is_alive():
            return []  # torch is there already (imported before the fork)
        reason = unsupported(config)
        if reason is not None:
            logger.info("requests wait for torch: %s", reason)
            return []
        from ipc import PeerGoneError
        from shmvllm.engine.first_requests import FirstRequests

        if _torch_import is None:  # an engine program: torch imports on a thread from here
            _load_engine_code()  # before it, as a prestarted fork does: the pause below relies on it
            _torch_import = threading.Thread(target=_import_torch, name="shmvllm-torch-import", daemon=True)
            _torch_import.start()
        # torch's import pauses during the set-up: it imports nothing the paused thread may hold
        # (loaded before that thread started, `_load_engine_code`); serving resumes it while idle
        torch_may_run.clear()
        try:
            first = FirstRequests(config, reservation, num_blocks, self.endpoint, self.outbox, self.engine_index)
        except Exception:
            torch_may_run.set()
            logger.warning("requests wait for torch: the native step could not be set up", exc_info=True)
            return []
        torch_import = _torch_import
        try:
            return first.serve(lambda: not torch_import.is_alive(), self._check_parent, torch_may_run)
        except (PeerGoneError, FrontendGoneError) as exc:
            self.endpoint.remove_orphaned()
            raise FrontendGoneError(str(exc)) from exc
        finally:
            torch_may_run.set()

    # ---- the process ---------------------------------------------------------------------

    @staticmethod
    def run_engine_core(args: EngineProcArgs) -> int:
        """Serves; the exit code: 0 after SHUTDOWN or the frontend's death, 1 after a failure,
        -N after signal N (SIGTERM, SIGHUP), once everything is closed."""
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise_on_termination()
        # force: a forked engine has the frontend's handlers, and its lines still name the engine
        logging.basicConfig(level=args.log_level, format=f"(EngineCore pid={os.getpid()}) %(levelname)s %(name)s: %(message)s",
                            force=True)
        engine: Optional[EngineCoreProc] = None
        code = 0
        watch = StartupWatch(args.parent_pid)
        try:
            try:
                try:
                    executor_class = None if args.executor_class is None else import_qualified(args.executor_class)
                    engine = EngineCoreProc(
                        args.engine_config(), args.addresses, args.parent_pid, executor_class, args.engine_index
                    )
                finally:
                    watch.stop()
                engine.run_busy_loop()
            finally:
                ignore_termination()  # the cleanup below runs to its end
        except FrontendGoneError as exc:
            logger.warning("the frontend is gone (%s): exiting", exc)
            if engine is not None:
                engine.endpoint.remove_orphaned()
        except EngineTerminated as exc:
            if watch.fired:
                logger.warning("the frontend (pid %d) died while the engine started: exiting", args.parent_pid)
            else:
                logger.warning("%s: exiting", exc)
                if engine is not None:
                    engine._last_words(EngineFailed("serving", str(exc), str(exc)))
                code = -exc.signum
        except BaseException as exc:
            logger.exception("the engine failed")
            if engine is not None:
                engine._last_words(EngineFailed("serving", traceback.format_exc(), _error_line(exc)))
            code = 1
        finally:
            if engine is not None:
                engine.shutdown()
        return code

    def run_busy_loop(self) -> None:
        """Serves until SHUTDOWN (returns) or the frontend's death (FrontendGoneError)."""
        from ipc import PeerGoneError

        if self.engine_core is None:
            logger.info("SHUTDOWN received before torch had imported")
            return
        try:
            self._run()
        except _Shutdown:
            logger.info("SHUTDOWN received")
        except PeerGoneError as exc:
            raise FrontendGoneError(str(exc)) from exc

    def shutdown(self) -> None:
        try:
            if self.engine_core is not None:
                self.engine_core.shutdown()
        finally:
            self.endpoint.close()

    def _last_words(self, failure: EngineFailed) -> None:
        try:
            self.outbox.send(failure)
            if not self.outbox.drain_for(LAST_WORDS_S):
                logger.warning("could not deliver the failure to the frontend (it reads nothing)")
        except Exception:  # the frontend may be gone too; the exit code still tells
            logger.warning("could not report the failure to the frontend")

    def _check_parent(self) -> None:
        if os.getppid() != self.parent_pid:
            raise FrontendGoneError(f"parent process {self.parent_pid} exited")

    # ---- requests ------------------------------------------------------------------------

    def _handle(self, msg: Any) -> None:
        """Applies one message; a UTILITY call's answer goes to the outbox."""
        kind = type(msg)
        if kind is EngineCoreRequest:
            self.engine_core.add_request(msg)
        elif kind is EngineCoreAbort:
            self.engine_core.abort_requests(msg.request_ids)
        elif kind is EngineCoreUtility:
            self.outbox.send(EngineCoreOutputs(engine_index=self.engine_index, utility_output=self._call_utility(msg)))
        elif kind is EngineCoreShutdown:
            raise _Shutdown
        elif kind is UndecodableRequest:
            logger.warning("dropped a message from the frontend: %s", msg.error)
            if msg.request_id is not None:
                self.engine_core.reject(msg.request_id, msg.error)
        else:
            raise TypeError(f"unexpected message type {kind.__name__}")

    def _call_utility(self, call: EngineCoreUtility) -> UtilityOutput:
        try:
            if call.method.startswith("_"):
                raise AttributeError(f"EngineCore has no public method {call.method!r}")
            result = getattr(self.engine_core, call.method)(*call.args)
            return UtilityOutput(call.call_id, result=msgspec.to_builtins(result))
        except Exception as exc:
            logger.info("utility call %s failed", call.method, exc_info=True)
            return UtilityOutput(call.call_id, failure_message=f"{type(exc).__name__}: {exc}")

    # ---- the busy loop -------------------------------------------------------------------

    def _run(self) -> None:
        core, outbox, endpoint, handle = self.engine_core, self.outbox, self.endpoint, self._handle
        try_recv = endpoint.try_recv
        index = self.engine_index
        while True:
            if outbox.pending:
                outbox.flush()
            can_step = core.has_unfinished_requests() and not outbox.backlogged
            if not can_step and not self._arrived:
                self._wait_for_input()
            while self._arrived:
                handle(self._arrived.popleft())
            while (msg := try_recv(decode_to_engine)) is not None:
                handle(msg)
            if core.has_unfinished_requests() and not outbox.backlogged:
                outputs = core.step()
                if outputs.num_outputs:
                    outputs.engine_index = index
                    outbox.send(outputs)
            self._check_parent()

    def _input_waiting(self) -> bool:
        """Whether the frontend sent something (kept, in order, for the loop to handle after the
        step): a burst then ends, so that a new request or an abort waits at most one token. A
        failing channel also ends it; the loop then meets the failure itself."""
        try:
            msg = self.endpoint.try_recv(decode_to_engine)
        except Exception:
            return True
        if msg is None:
            return False
        self._arrived.append(msg)
        return True

    def _wait_for_input(self) -> None:
        """Blocks until the frontend sends something, or briefly (FLUSH_POLL_S) when the outbox
        has something to flush; at most POLL_S, so that the caller looks at the parent."""
        try:
            self._handle(self.endpoint.recv(decode_to_engine, FLUSH_POLL_S if self.outbox.pending else POLL_S))
        except ChannelTimeout:
            pass


if __name__ == "__main__":
    # Run as shmvllm.engine.core_proc, not as a second copy of it named __main__ (its classes
    # are the ones the rest of shmvllm imports).
    from shmvllm.engine.core_proc import main as _main

    _main()
