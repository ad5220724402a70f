"""EngineCoreProc: the EngineCore in a process of its own, served over a transport.

The process (started by `CoreEngineProcManager`) attaches to the channel the frontend created,
builds the EngineCore, and answers READY (`EngineReady`), or, if building failed, the traceback
text. Then the busy loop: take what the frontend sent (ADD / ABORT / UTILITY / SHUTDOWN),
`EngineCore.step()`, send the outputs; block on the channel when there is nothing to step.

Two ways to move messages, picked by `io_threads`:
- polling (the default): the busy loop itself drains the channel (`try_recv`) before each step
  and sends each step's outputs;
- threads (vLLM's structure): an input thread (channel -> decode -> input queue) and an output
  thread (output queue -> encode -> channel) around the busy loop.

Polling won: `python benchmarks/e2e_overhead.py --io both --repeats 30` (tiny 2-layer Llama,
one torch thread, 2-core machine shared with other work; median of 30 interleaved repetitions;
LLM.generate walls, and the polling engine's own time in channel calls per step):

    workload  transport  poll: wall (channel/step)   threads: wall
    1x256     shm        0.246 s (  5 us)            0.282 s
    1x256     zmq        0.269 s ( 49 us)            0.294 s
    64x64     shm        0.675 s ( 30 us)            0.703 s
    64x64     zmq        0.680 s (112 us)            0.699 s

With threads every message crosses two queues and two more threads that contend for the GIL
(and, on two cores, for the CPU) with the busy loop: 3-15% slower walls here, and an earlier
run had the threaded shm engine at 2.3 s on 64x64. Differences under ~2% (64x64) are within
this machine's noise.

Failures: an exception in the busy loop (in `step`, say) is logged and sent to the frontend as a
UtilityOutput with call_id `ENGINE_FAILED_CALL_ID`, then the process exits with code 1; the
frontend raises EngineDeadError. When the frontend dies the engine notices within a poll (the
parent pid changes; the ring reports a dead peer), removes what the frontend left of the channel
and exits. SIGINT is ignored: Ctrl-C in a terminal reaches the whole process group, and the
frontend, which catches it, decides when the engine stops.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable, Optional, Union

import msgspec

from shmvllm.config import EngineConfig
from shmvllm.engine.messages import (
    EngineCoreAbort,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestMsg,
    EngineCoreRequestType,
    EngineCoreShutdown,
    EngineCoreUtility,
    EngineReady,
    UtilityOutput,
)
from shmvllm.engine.transport import Addresses, ChannelTimeout, Endpoint, PeerMissingError, open_engine, remove_orphaned

logger = logging.getLogger(__name__)

ENGINE_FAILED_CALL_ID = -1
POLL_S = 0.25  # how often a blocked side looks at its peer

_decode_request = msgspec.msgpack.Decoder(EngineCoreRequestMsg).decode
_decode_any = msgspec.msgpack.Decoder().decode


class UndecodableRequest(msgspec.Struct, gc=False):
    """A message the engine could not decode (a field its own validation refuses, say): an
    ADD whose request id could still be read finishes with ERROR; anything else is logged."""

    request_id: Optional[str]
    error: str


def decode_request(buf: Any) -> Any:
    """The frontend's next message; an UndecodableRequest instead of an exception, so that one
    malformed message cannot stop the busy loop."""
    try:
        return _decode_request(buf)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        request_id = None
        try:
            raw = _decode_any(buf)
            if isinstance(raw, list) and len(raw) > 1 and raw[0] == int(EngineCoreRequestType.ADD):
                request_id = raw[1] if isinstance(raw[1], str) else None
        except Exception:  # not even msgpack: nothing to answer
            pass
        return UndecodableRequest(request_id, f"the engine could not decode the request: {exc}")


decode_handshake = msgspec.msgpack.Decoder(Union[EngineReady, str]).decode  # READY, or a traceback
decode_outputs = msgspec.msgpack.Decoder(EngineCoreOutputs).decode


class FrontendGoneError(Exception):
    """The frontend process died or closed the channel without saying SHUTDOWN."""


class _Shutdown(Exception):
    """SHUTDOWN arrived: leave the busy loop."""


class EngineCoreProc:
    def __init__(
        self,
        config: EngineConfig,
        addresses: Addresses,
        parent_pid: int,
        io_threads: bool = False,
        executor_class: Optional[type] = None,
    ) -> None:
        from shmvllm.engine.core import EngineCore

        self.parent_pid = parent_pid
        self.io_threads = io_threads
        # Seconds the polling busy loop spends in channel calls (encode + send, receive +
        # decode): what the transport costs the engine's step loop. Counted only with
        # SHMVLLM_CHANNEL_TIMING=1 (benchmarks/e2e_overhead.py) and without io threads (whose
        # channel calls are off the loop); read with the `channel_seconds` utility (None: not counted).
        timing = os.environ.get("SHMVLLM_CHANNEL_TIMING") == "1" and not io_threads
        self.channel_seconds: Optional[float] = 0.0 if timing else None
        self.endpoint: Endpoint = open_engine(addresses)
        try:
            self.engine_core = EngineCore(config, executor_class)
        except BaseException:
            self.endpoint.send(traceback.format_exc(), timeout=POLL_S)
            raise
        self.endpoint.send(self.engine_core.ready())

    # ---- the process ---------------------------------------------------------------------

    @staticmethod
    def run_engine_core(
        config: EngineConfig,
        addresses: Addresses,
        parent_pid: int,
        io_threads: bool = False,
        executor_class: Optional[type] = None,
        log_level: int = logging.WARNING,
    ) -> None:
        """The engine process's entry point; exits with 0 after SHUTDOWN, 1 after a failure."""
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        logging.basicConfig(level=log_level, format=f"(EngineCore pid={os.getpid()}) %(levelname)s %(name)s: %(message)s")
        engine: Optional[EngineCoreProc] = None
        code = 0
        try:
            engine = EngineCoreProc(config, addresses, parent_pid, io_threads, executor_class)
            engine.run_busy_loop()
        except FrontendGoneError as exc:
            logger.warning("the frontend is gone (%s): exiting", exc)
            remove_orphaned(addresses)
        except BaseException:
            logger.exception("the engine failed")
            if engine is not None:
                engine._report_failure(traceback.format_exc())
            code = 1
        finally:
            if engine is not None:
                engine.shutdown()
        sys.exit(code)

    def run_busy_loop(self) -> None:
        """Serves until SHUTDOWN (returns) or the frontend's death (FrontendGoneError)."""
        from ipc import PeerGoneError

        try:
            if self.io_threads:
                self._run_threaded()
            else:
                self._run_polling()
        except _Shutdown:
            logger.info("SHUTDOWN received")
        except (PeerGoneError, PeerMissingError) as exc:
            raise FrontendGoneError(str(exc)) from exc

    def shutdown(self) -> None:
        try:
            self.engine_core.shutdown()
        finally:
            self.endpoint.close()

    def _report_failure(self, text: str) -> None:
        failure = UtilityOutput(call_id=ENGINE_FAILED_CALL_ID, failure_message=text)
        try:
            self.endpoint.send(EngineCoreOutputs(utility_output=failure), timeout=POLL_S)
        except Exception:  # the frontend may be gone too; the exit code still tells
            logger.warning("could not report the failure to the frontend")

    def _check_parent(self) -> None:
        if os.getppid() != self.parent_pid:
            raise FrontendGoneError(f"parent process {self.parent_pid} exited")

    # ---- requests ------------------------------------------------------------------------

    def _handle(self, msg: Any) -> Optional[EngineCoreOutputs]:
        """Applies one message; the answer to send back for a UTILITY call."""
        kind = type(msg)
        if kind is EngineCoreRequest:
            self.engine_core.add_request(msg)
        elif kind is EngineCoreAbort:
            self.engine_core.abort_requests(msg.request_ids)
        elif kind is EngineCoreUtility:
            return EngineCoreOutputs(utility_output=self._call_utility(msg))
        elif kind is EngineCoreShutdown:
            raise _Shutdown
        elif kind is UndecodableRequest:
            logger.warning("dropped a message from the frontend: %s", msg.error)
            if msg.request_id is not None:
                self.engine_core.reject(msg.request_id, msg.error)
        else:
            raise TypeError(f"unexpected message type {kind.__name__}")
        return None

    def _call_utility(self, call: EngineCoreUtility) -> UtilityOutput:
        try:
            if call.method.startswith("_"):
                raise AttributeError(f"EngineCore has no public method {call.method!r}")
            if call.method == "channel_seconds":  # the process's own; the rest are EngineCore's
                return UtilityOutput(call.call_id, result=self.channel_seconds)
            result = getattr(self.engine_core, call.method)(*call.args)
            return UtilityOutput(call.call_id, result=msgspec.to_builtins(result))
        except Exception as exc:
            logger.info("utility call %s failed", call.method, exc_info=True)
            return UtilityOutput(call.call_id, failure_message=f"{type(exc).__name__}: {exc}")

    # ---- polling: the busy loop reads and writes the channel itself ------------------------

    def _run_polling(self) -> None:
        core, endpoint = self.engine_core, self.endpoint
        send, try_recv = endpoint.send, endpoint.try_recv
        if self.channel_seconds is not None:
            send, try_recv = self._timed(send), self._timed(try_recv)
        handle = self._handle
        while True:
            if not core.has_unfinished_requests():
                answer = handle(self._wait_for_message())
                if answer is not None:
                    send(answer)
            while (msg := try_recv(decode_request)) is not None:
                answer = handle(msg)
                if answer is not None:
                    send(answer)
            if core.has_unfinished_requests():
                outputs = core.step()
                if outputs.outputs:
                    send(outputs)
            self._check_parent()

    def _timed(self, call: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any) -> Any:
            started = time.perf_counter()
            try:
                return call(*args)
            finally:
                self.channel_seconds += time.perf_counter() - started

        return timed

    def _wait_for_message(self) -> Any:
        while True:
            try:
                return self.endpoint.recv(decode_request, POLL_S)
            except ChannelTimeout:
                self._check_parent()

    # ---- threads: input thread -> busy loop -> output thread --------------------------------

    def _run_threaded(self) -> None:
        inputs: queue.Queue = queue.Queue()
        outputs: queue.Queue = queue.Queue()
        threading.Thread(target=self._input_thread, args=(inputs,), name="EngineInput", daemon=True).start()
        writer = threading.Thread(target=self._output_thread, args=(outputs, inputs), name="EngineOutput", daemon=True)
        writer.start()
        core = self.engine_core
        try:
            while True:
                if not core.has_unfinished_requests():
                    self._handle_queued(inputs.get(), outputs)
                while not inputs.empty():
                    self._handle_queued(inputs.get_nowait(), outputs)
                if core.has_unfinished_requests():
                    step_outputs = core.step()
                    if step_outputs.outputs:
                        outputs.put(step_outputs)
                self._check_parent()
        finally:
            outputs.put(None)  # the writer sends what is queued, then stops
            writer.join(timeout=2 * POLL_S)

    def _handle_queued(self, item: Any, outputs: queue.Queue) -> None:
        if isinstance(item, BaseException):
            raise item
        answer = self._handle(item)
        if answer is not None:
            outputs.put(answer)

    def _input_thread(self, inputs: queue.Queue) -> None:
        recv = self.endpoint.recv
        try:
            while True:
                try:
                    inputs.put(recv(decode_request, POLL_S))
                except ChannelTimeout:
                    self._check_parent()
        except FrontendGoneError as exc:
            inputs.put(exc)
        except Exception as exc:  # a dead peer, a closed channel, a malformed message
            inputs.put(FrontendGoneError(f"input channel failed: {exc!r}"))

    def _output_thread(self, outputs: queue.Queue, inputs: queue.Queue) -> None:
        send = self.endpoint.send
        try:
            while (item := outputs.get()) is not None:
                send(item)
        except Exception as exc:
            inputs.put(FrontendGoneError(f"output channel failed: {exc!r}"))
