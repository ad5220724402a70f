"""Hardening (issue 14): no input kills, wedges or exhausts the engine.

One engine process (a tiny random Llama) serves the whole module: after every bad input it must
still be alive and serving. Each test names the numbered defect of the issue it covers.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import engine_children, leaked_shm_entries
from ipc.segment import pid_alive
from shmvllm import LLM, SamplingParams

ENGINE_ARGS = dict(max_model_len=256, num_kv_blocks=128, max_num_seqs=16)
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def call_within(seconds: float, fn, *args, **kwargs):
    """fn(*args, **kwargs) in a daemon thread; fails the test if it has not returned (or raised)
    within `seconds` (a hang), else returns its result or re-raises its exception."""
    box: dict = {}

    def run():
        try:
            box["result"] = fn(*args, **kwargs)
        except BaseException as exc:  # handed to the test's thread
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{getattr(fn, '__name__', fn)} still blocked after {seconds} s: a hang"
    if "error" in box:
        raise box["error"]
    return box.get("result")


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    before = leaked_shm_entries()
    with LLM(str(tiny_llama_dir), **ENGINE_ARGS) as instance:
        yield instance
    assert not leaked_shm_entries() - before


def assert_serving(llm: LLM) -> None:
    """The engine process is alive, holds no request of ours, and answers a new one."""
    engine = llm.llm_engine
    assert pid_alive(engine.engine_core.engine_pid), "the engine process died"
    assert not engine.has_unfinished_requests(), "a request stayed registered"
    out = call_within(30, llm.generate, "Hello there", GREEDY, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


# ---- 1. logprobs above the vocabulary killed the engine --------------------------------------

@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("value", [100000, 21])
def test_1_logprobs_above_the_engines_limit_are_refused_before_queuing(llm, field, value):
    with pytest.raises(ValueError, match=rf"{field}={value}.*max_logprobs=20"):
        llm.generate("Hi", SamplingParams(max_tokens=2, **{field: value}), use_tqdm=False)
    assert_serving(llm)


def test_1_the_engine_refuses_logprobs_above_its_limit_sent_past_the_frontend(llm):
    """Defence in depth: a request that skipped the frontend's check finishes alone with ERROR."""
    from shmvllm.boundary.messages import EngineCoreRequest, FinishReason

    client = llm.llm_engine.engine_core
    request = EngineCoreRequest(
        request_id="raw-logprobs", prompt_token_ids=EngineCoreRequest.pack_token_ids([1, 2, 3]),
        sampling_params=SamplingParams(max_tokens=2, logprobs=100000),
    )
    client.add_request(request)
    output = collect_output(client, "raw-logprobs")
    assert output.finish_reason == FinishReason.ERROR and "max_logprobs" in output.error
    assert_serving(llm)


def collect_output(client, request_id: str, timeout: float = 30.0):
    """The engine's first output for `request_id`, read straight off the client."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for output in client.get_output(timeout=timeout).all_outputs():
            if output.request_id == request_id:
                return output
    raise AssertionError(f"no output for {request_id}")


def test_a_request_the_engine_cannot_decode_finishes_with_error(llm):
    """Defence in depth: params the engine's own validation refuses on decoding (here n=0,
    forced past the frontend's) fail that request, not the busy loop."""
    from shmvllm.boundary.messages import EngineCoreRequest, FinishReason
    from shmvllm.sampling_params import _set_field

    params = SamplingParams(max_tokens=2)
    _set_field(params, "n", 0)
    client = llm.llm_engine.engine_core
    client.add_request(EngineCoreRequest(
        request_id="undecodable", prompt_token_ids=EngineCoreRequest.pack_token_ids([1, 2, 3]), sampling_params=params,
    ))
    output = collect_output(client, "undecodable")
    assert output.finish_reason == FinishReason.ERROR and "could not decode" in output.error
    assert "Expected `int` >= 1" in output.error and "(sampling_params.n)" in output.error  # the wire's bound, named
    assert_serving(llm)


def test_1_max_logprobs_minus_one_allows_the_whole_vocabulary(tiny_llama_dir):
    with LLM(str(tiny_llama_dir), max_logprobs=-1, **ENGINE_ARGS) as wide:
        vocab = wide.llm_engine.engine_core.ready.vocab_size
        out = wide.generate("Hi", SamplingParams(max_tokens=1, logprobs=vocab), use_tqdm=False)
        assert len(out[0].outputs[0].logprobs[0]) == vocab
        with pytest.raises(ValueError, match="logprobs"):
            wide.generate("Hi", SamplingParams(max_tokens=1, logprobs=vocab + 1), use_tqdm=False)


# ---- 2. ints beyond 64 bits, and a failed send that left a request registered ----------------

@pytest.mark.parametrize(
    "field, value",
    [("seed", 2**64), ("seed", -(2**63) - 1), ("seed", 2**64 - 1), ("top_k", 2**64), ("logprobs", 2**64),
     ("prompt_logprobs", 2**63), ("stop_token_ids", [2**64]), ("max_tokens", 2**64), ("min_tokens", 2**64)],
)
def test_2_ints_beyond_64_bits_are_value_errors(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_2_n2_with_the_largest_seed_is_refused_and_the_llm_serves_on(llm):
    with pytest.raises(ValueError, match="seed"):
        call_within(30, llm.generate, "Hi", SamplingParams(n=2, seed=2**64 - 1, max_tokens=2), use_tqdm=False)
    assert_serving(llm)


def test_2_children_of_the_largest_int64_seed_wrap_around(llm):
    out = call_within(30, llm.generate, "Hi", SamplingParams(n=3, seed=2**63 - 1, max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs) == 3
    assert_serving(llm)


@pytest.mark.parametrize("n", [1, 3])
def test_2_a_send_that_fails_leaves_nothing_registered(llm, monkeypatch, n):
    """Registration and sending are one step: a failure while encoding (here: injected at the
    second send) undoes both, so the next call does not wait for a request that never left."""
    client = llm.llm_engine.engine_core
    real_add = client.add_request
    calls = []

    def failing_add(request, **kwargs):
        calls.append(request.request_id)
        if len(calls) == min(n, 2):
            raise OverflowError("can't serialize: int too big to convert")
        real_add(request, **kwargs)

    monkeypatch.setattr(client, "add_request", failing_add)
    with pytest.raises(OverflowError):
        call_within(30, llm.generate, "Hi", SamplingParams(n=n, max_tokens=2), use_tqdm=False)
    monkeypatch.undo()
    assert_serving(llm)


# ---- 3. n had no upper bound -----------------------------------------------------------------

def test_3_n_is_bounded_like_vllm(monkeypatch):
    started = time.monotonic()
    for n in (2**64, 2**40, 16385):
        with pytest.raises(ValueError, match="n must"):
            SamplingParams(n=n)
    assert SamplingParams(n=16384).n == 16384
    monkeypatch.setenv("SHMVLLM_MAX_N_SEQUENCES", "4")
    with pytest.raises(ValueError, match="SHMVLLM_MAX_N_SEQUENCES"):
        SamplingParams(n=5)
    assert time.monotonic() - started < 5


def test_3_a_huge_n_is_refused_before_the_frontend_grows(llm):
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ValueError, match="n must"):
        call_within(10, llm.generate, "Hi", SamplingParams(n=2**40), use_tqdm=False)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 200_000  # KiB
    assert_serving(llm)


# ---- 6. NaN accepted, and assignments never re-validated -------------------------------------

FLOAT_FIELDS = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"]


@pytest.mark.parametrize("field", FLOAT_FIELDS)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 10**400])
def test_6_non_finite_floats_are_value_errors(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize(
    "field, value",
    [("temperature", math.nan), ("repetition_penalty", math.nan), ("n", 0), ("top_k", -2), ("seed", 2**64),
     ("logprobs", -2), ("stop", [""]), ("max_tokens", 0), ("min_tokens", 100), ("ignore_eos", "yes")],
)
def test_6_assigning_an_invalid_value_raises_and_keeps_the_old_one(field, value):
    params = SamplingParams(max_tokens=16, temperature=0.7)
    old = getattr(params, field)
    with pytest.raises(ValueError, match=field):
        setattr(params, field, value)
    assert getattr(params, field) == old


def test_6_assigning_a_valid_value_is_normalized_and_kept():
    params = SamplingParams()
    params.stop = "END"
    params.temperature = 0.5
    params.n = 3
    assert (params.stop, params.temperature, params.n) == (["END"], 0.5, 3)


def test_6_a_nan_temperature_never_reaches_the_engine(llm):
    params = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="temperature"):
        params.temperature = math.nan
    llm.generate("Hi", params, use_tqdm=False)
    assert_serving(llm)


# ---- 7. a signal handler's exception was lost in a blocked wait ------------------------------

class Alarm(Exception):
    pass


def _raise_alarm(signum, frame):
    raise Alarm("SIGALRM")


@pytest.mark.parametrize("nap_window_s", [0.0, 0.02], ids=["sleep", "nap"])
def test_7_a_handlers_exception_interrupts_a_blocked_pop(nap_window_s):
    from ipc import RingBuffer

    ring = RingBuffer.create(4096, nap_window_s=nap_window_s)
    peer = RingBuffer.attach(ring.name, nap_window_s=nap_window_s)
    previous = signal.signal(signal.SIGALRM, _raise_alarm)
    try:
        for timeout in (None, 5.0):
            signal.setitimer(signal.ITIMER_REAL, 0.2)
            started = time.monotonic()
            with pytest.raises(Alarm):
                peer.pop(timeout=timeout)
            assert time.monotonic() - started < 1.0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        peer.close()
        ring.close()


def test_7_a_handler_raising_timeout_error_interrupts_generate(llm):
    """The classic SIGALRM timeout raises TimeoutError: that must not pass for the client's own
    poll timeout. The engine is stopped, so without the signal generate would block for ever."""
    pid = llm.llm_engine.engine_core.engine_pid

    def handler(signum, frame):
        raise TimeoutError("alarm: generate took too long")

    previous = signal.signal(signal.SIGALRM, handler)
    os.kill(pid, signal.SIGSTOP)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="alarm"):
            llm.generate("Hi", SamplingParams(max_tokens=4), use_tqdm=False)
        assert time.monotonic() - started < 2.0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        os.kill(pid, signal.SIGCONT)
    assert_serving(llm)


# ---- 8. unclear errors -----------------------------------------------------------------------

BAD_CALLS = [
    ("chat", ({"role": "user", "content": "hi"},), TypeError, "messages"),
    ("chat", ("hello",), TypeError, "messages"),
    ("chat", (None,), TypeError, "messages"),
    ("chat", ([],), ValueError, "messages"),
    ("chat", ([[]],), ValueError, "messages"),
    ("chat", ([{"role": "user", "content": "x"}, "oops"],), TypeError, "messages"),
    ("chat", ([{"role": "user"}],), ValueError, "content"),
    ("chat", ([{"content": "x"}],), ValueError, "role"),
    ("chat", ([{"role": 5, "content": "x"}],), TypeError, "role"),
    ("chat", ([{"role": "user", "content": 5}],), TypeError, "content"),
    ("chat", ([{"role": "user", "content": [{"type": "image_url"}]}],), ValueError, "content"),
    ("chat", ([{"role": "user", "content": ["text"]}],), TypeError, "content"),
    ("generate", (None,), TypeError, "prompts"),
    ("generate", (5,), TypeError, "prompts"),
    ("generate", ([{"prompt": 5}],), TypeError, "prompt"),
    ("generate", ([{"prompt_token_ids": [10**12]}],), ValueError, "prompt_token_ids"),
    ("generate", ("x", 5), TypeError, "sampling_params"),
    ("generate", ("x", {"temperature": 0}), TypeError, "sampling_params"),
]


@pytest.mark.parametrize("method, args, error, name", BAD_CALLS, ids=[f"{c[0]}-{i}" for i, c in enumerate(BAD_CALLS)])
def test_8_bad_calls_are_clear_errors_naming_the_argument(llm, method, args, error, name):
    with pytest.raises(error, match=name):
        call_within(30, getattr(llm, method), *args, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_8_a_priority_beyond_64_bits_is_a_value_error(llm):
    with pytest.raises(ValueError, match="priority"):
        llm.generate(["x"], GREEDY, use_tqdm=False, priority=[2**70])
    assert_serving(llm)


@pytest.mark.parametrize("priority, error", [([0, "high"], TypeError), ([0, 2**70], ValueError)])
def test_8_a_bad_priority_in_a_batch_fails_before_any_request_is_queued(llm, monkeypatch, priority, error):
    """Every prompt's priority is checked with the batch, not when its turn to be queued comes."""
    queued = []
    monkeypatch.setattr(llm.llm_engine.engine_core, "add_request", lambda request, **kwargs: queued.append(request))
    with pytest.raises(error, match=f"priority.*{priority[1]!r}"):
        llm.generate(["x", "y"], GREEDY, use_tqdm=False, priority=priority)
    assert queued == []
    monkeypatch.undo()
    assert_serving(llm)


def test_8_generate_checks_each_prompt_and_params_once(llm, monkeypatch):
    """LLM.generate validates at its boundary, once: each prompt's checks run once, and those of
    params shared by the batch once for the batch (the engine path does not check them again)."""
    from shmvllm.engine.input_processor import InputProcessor

    counts = {"validate_prompt": 0, "verify_sampling_params": 0, "verify_structured_outputs": 0}
    for name in counts:
        real = getattr(InputProcessor, name)

        def counted(self, *args, _real=real, _name=name):
            counts[_name] += 1
            return _real(self, *args)

        monkeypatch.setattr(InputProcessor, name, counted)
    outputs = llm.generate(["a", "b", [5, 6, 7]], GREEDY, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [4, 4, 4]
    assert counts == {"validate_prompt": 3, "verify_sampling_params": 1, "verify_structured_outputs": 1}


BAD_ENGINE_ARGS = [
    ("block_size", "16"), ("device", "tpu"), ("device", "cuda:x"), ("seed", "x"), ("seed", 2**64),
    ("max_model_len", "5"), ("max_model_len", True), ("gpu_memory_utilization", math.nan),
    ("enable_prefix_caching", "yes"), ("max_logprobs", -5), ("max_logprobs", 1.5), ("tensor_parallel_size", 0),
    ("dtype", "float64"), ("kv_cache_memory", -1), ("scheduling_policy", "lifo"), ("max_num_seqs", 2.0),
    ("task", "classify"),
]


@pytest.mark.parametrize("name, value", BAD_ENGINE_ARGS, ids=[f"{n}={v!r}" for n, v in BAD_ENGINE_ARGS])
def test_8_bad_engine_args_are_refused_before_the_engine_starts(tiny_llama_dir, monkeypatch, name, value):
    from shmvllm.engine import proc_manager

    def no_engine(*args, **kwargs):
        raise AssertionError("the engine process was started")

    monkeypatch.setattr(proc_manager.CoreEngineProcManager, "__init__", no_engine)
    children = engine_children()
    with pytest.raises((TypeError, ValueError), match=name):
        LLM(str(tiny_llama_dir), **{**ENGINE_ARGS, name: value})
    assert engine_children() <= children


# ---- 10. no way to bound a call --------------------------------------------------------------

def test_10_request_timeout_names_a_stopped_engine_and_aborts(tiny_llama_dir):
    with LLM(str(tiny_llama_dir), request_timeout_s=1.0, **ENGINE_ARGS) as bounded:
        pid = bounded.llm_engine.engine_core.engine_pid
        os.kill(pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(TimeoutError, match="stopped") as info:
                call_within(30, bounded.generate, ["Hi", "there"], SamplingParams(max_tokens=8), use_tqdm=False)
            assert 0.9 < time.monotonic() - started < 5
            assert "request_timeout_s" in str(info.value)
            assert not bounded.llm_engine.has_unfinished_requests()
        finally:
            os.kill(pid, signal.SIGCONT)
        assert_serving(bounded)
        assert bounded.llm_engine.engine_core.get_stats()["num_running_reqs"] == 0


@pytest.mark.parametrize("value", [0, -1, math.nan, math.inf, "5", True])
def test_10_request_timeout_must_be_a_positive_number(tiny_llama_dir, value):
    with pytest.raises(ValueError, match="request_timeout_s"):
        LLM(str(tiny_llama_dir), request_timeout_s=value, **ENGINE_ARGS)


def test_10_the_engine_state_is_described():
    from shmvllm.engine.proc_manager import describe_process

    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.5)
        assert describe_process(busy.pid).startswith("alive, busy")
        assert describe_process(idle.pid).startswith("alive, waiting")
        os.kill(idle.pid, signal.SIGSTOP)
        time.sleep(0.2)
        assert describe_process(idle.pid).startswith("stopped")
    finally:
        busy.kill()
        idle.kill()
        busy.wait()
        idle.wait()
    assert describe_process(busy.pid) == "dead"


def test_10_request_timeout_bounds_a_send_into_a_full_input_ring(tiny_llama_dir, monkeypatch):
    """A stopped engine reads no input: with a small input ring, the sends of a large batch find
    no room, and the call ends after request_timeout_s instead of waiting for ever."""
    monkeypatch.setenv("SHMVLLM_RING_CAPACITY", str(64 << 10))
    with LLM(str(tiny_llama_dir), request_timeout_s=1.0, **ENGINE_ARGS) as bounded:
        pid = bounded.llm_engine.engine_core.engine_pid
        os.kill(pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(TimeoutError, match="took no input.*stopped"):
                call_within(60, bounded.generate, ["Hi"] * 3000, SamplingParams(max_tokens=1), use_tqdm=False)
            assert time.monotonic() - started < 30
            assert not bounded.llm_engine.has_unfinished_requests()
        finally:
            os.kill(pid, signal.SIGCONT)
        assert_serving(bounded)
