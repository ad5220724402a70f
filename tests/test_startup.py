"""Start-up: GGUF files read straight from the file (a memory-mapped header walk, no converted
weights on disk), configs cached, the frontend without torch and the engine without
transformers, and a start-up interrupted from either side (kill -9, Ctrl-C) leaves no process
and nothing in /dev/shm."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import leaked_shm_entries, wait_until_dead
from ipc.segment import pid_alive
from shmvllm.model.gguf_file import GGML_BLOCKS, GGUFFile
from shmvllm.model.registry import _shipped_model_path, gguf_source

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def smollm2_gguf() -> Path:
    return _shipped_model_path("smollm2-135m-instruct")


# ---- the GGUF file -----------------------------------------------------------------------------

def test_gguf_file_reads_what_gguf_py_reads(smollm2_gguf):
    from gguf import GGUFReader

    ours, theirs = GGUFFile(smollm2_gguf), GGUFReader(str(smollm2_gguf))
    assert ours.keys == [key for key in theirs.fields if not key.startswith("GGUF.")]  # its header pseudo-fields
    for key in ours.keys:
        value, expected = ours.metadata(key), theirs.fields[key].contents()
        value = value.tolist() if isinstance(value, np.ndarray) else value
        assert value == pytest.approx(expected) if isinstance(expected, float) else value == expected, key
    assert len(ours.tensors) == len(theirs.tensors)
    for mine, ref in zip(ours.tensors, theirs.tensors):
        assert (mine.name, mine.tensor_type, mine.shape) == (ref.name, int(ref.tensor_type), tuple(int(d) for d in ref.shape))
        assert mine.data.dtype == ref.data.dtype and np.array_equal(mine.data, ref.data), mine.name


def test_gguf_block_sizes_are_ggmls():
    from gguf.constants import GGML_QUANT_SIZES

    known = {int(kind): sizes for kind, sizes in GGML_QUANT_SIZES.items()}
    assert {kind: GGML_BLOCKS[kind] for kind in known if kind in GGML_BLOCKS} == {k: known[k] for k in known if k in GGML_BLOCKS}
    assert set(known) <= set(GGML_BLOCKS)


def test_gguf_tensors_are_views_of_the_mapped_file(smollm2_gguf, smollm2_dir):
    """Each block tensor lies in the file's mapping, except the q/k rows llama files permute;
    neighbours in the file (gate, up) stack into one view. The builds with the 8-row GEMV pass
    repack the layers' Q4_1 rows once into copies of their own, and the weights a decode token
    streams (those copies, the tied lm_head with its embedding) lie in one buffer advised huge
    pages."""
    import torch

    from shmvllm import envs
    from shmvllm.engine.arg_utils import EngineArgs
    from shmvllm.model.kernels import quant_kernels
    from shmvllm.model.loader import get_model
    from shmvllm.model.quant import FORMAT_IDS, Q4_1_R8

    model = get_model(EngineArgs(model=str(smollm2_dir), max_model_len=64).create_engine_config().model_config)
    mapped = [line.split()[0] for line in Path("/proc/self/maps").read_text().splitlines() if str(smollm2_gguf.resolve()) in line]
    spans = [tuple(int(x, 16) for x in span.split("-")) for span in mapped]
    in_file = lambda t: any(lo <= t.data_ptr() < hi for lo, hi in spans)  # noqa: E731
    layer = model.model.layers[2]
    embedding = model.model.embed_tokens.blocks
    assert not in_file(embedding.data) and model.lm_head.blocks == [(0, embedding)]
    flags = next(line for line in _smaps_of(embedding.data.data_ptr()) if line.startswith("VmFlags:"))
    assert ("hg" in flags.split()) == envs.SHMVLLM_HUGE_PAGES()  # MADV_HUGEPAGE
    viewed = quant_kernels().shm_qrepack_type(FORMAT_IDS["Q4_1"], 8) != Q4_1_R8
    assert in_file(layer.self_attn.o_proj.blocks[0][1].data) == in_file(layer.mlp.down_proj.blocks[0][1].data) == viewed
    (_, gate_up), = layer.mlp.gate_up_proj.blocks
    assert in_file(gate_up.data) == viewed and gate_up.n == 2 * layer.mlp.intermediate_size
    assert not in_file(layer.self_attn.qkv_proj.blocks[0][1].data)  # q and k are unpermuted copies
    assert isinstance(layer.input_layernorm.weight, torch.nn.Parameter)


def _smaps_of(address: int) -> list[str]:
    """The lines of /proc/self/smaps for the mapping that holds `address`."""
    lines, inside = [], False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        if inside:
            lines.append(line)
    return lines


def test_unsupported_gguf_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    import gguf

    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    cache = tmp_path / "cache"
    monkeypatch.setenv("SHMVLLM_CACHE", str(cache))
    from shmvllm.model.registry import resolve_model_dir

    with pytest.raises(ValueError, match="GGUF architecture 'mamba' is not supported"):
        resolve_model_dir(str(path))
    assert not any(p for p in cache.rglob("*") if p.is_file())


def test_gguf_cache_holds_config_and_tokenizer_only(tmp_path, monkeypatch, smollm2_gguf):
    """A fresh cache: the directory a GGUF file gets holds a few MB (no weights); its config is
    transformers' GGUF mapping of the file, its tokenizer transformers' conversion."""
    from transformers import AutoConfig, AutoTokenizer

    from shmvllm.engine.renderer import load_tokenizer
    from shmvllm.model.hf_config import config_values, load_hf_config
    from shmvllm.model.registry import resolve_model_dir

    monkeypatch.setenv("SHMVLLM_CACHE", str(tmp_path))
    model_dir = resolve_model_dir(str(smollm2_gguf))
    assert gguf_source(model_dir) == smollm2_gguf.resolve()
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in written) < 8 * 2**20
    assert not [p for p in written if p.suffix in (".safetensors", ".bin", ".pt")]
    expected = config_values(AutoConfig.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name))
    config = load_hf_config(model_dir).to_dict()
    assert config["architectures"] == ["LlamaForCausalLM"]
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert config[key] == expected[key], key
    ours = load_tokenizer(model_dir)
    theirs = AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    for text in ["The capital of France is", "  spaces\nand ünïcödé 🙂", "<|im_start|>user\nhi<|im_end|>"]:
        assert ours(text)["input_ids"] == theirs(text)["input_ids"]
    conversation = [{"role": "user", "content": "Name three primes."}]
    assert ours.apply_chat_template(conversation, tokenize=False) == theirs.apply_chat_template(conversation, tokenize=False)
    assert resolve_model_dir(str(smollm2_gguf)) == model_dir  # found again, nothing rewritten
    assert sorted(p for p in tmp_path.rglob("*") if p.is_file()) == sorted(written)


def test_config_cache_answers_like_transformers(tiny_llama_dir, tmp_path, monkeypatch):
    from transformers import AutoConfig

    from shmvllm.model.hf_config import HFConfig, load_hf_config

    monkeypatch.setenv("SHMVLLM_CACHE", str(tmp_path))
    first = load_hf_config(tiny_llama_dir)
    assert len(list((tmp_path / "configs").iterdir())) == 1
    again = load_hf_config(tiny_llama_dir)
    reference = AutoConfig.from_pretrained(tiny_llama_dir)
    assert first == again and isinstance(again, HFConfig)
    for name in ("hidden_size", "num_key_value_heads", "rope_parameters", "tie_word_embeddings", "head_dim"):
        assert getattr(again, name) == getattr(reference, name), name
    assert getattr(again, "no_such_value", 7) == 7


# ---- what each process imports -----------------------------------------------------------------

IMPORTS_EXECUTOR = """
import json, os, sys
from shmvllm.executor.uniproc import UniProcExecutor


class ReportImports(UniProcExecutor):
    def __init__(self, config):
        super().__init__(config)
        with open(os.environ["IMPORTS_REPORT"], "w") as f:
            json.dump(sorted(m for m in ("torch", "transformers") if m in sys.modules), f)
"""

IMPORTS_FRONTEND = """
import sys
import types
from shmvllm import EngineArgs, SamplingParams
from shmvllm.engine.core_client import MPClient
from shmvllm.engine.llm_engine import LLMEngine

# the engine builds its EngineCore with report_imports.ReportImports, named here without importing it (torch)
named = types.SimpleNamespace(__module__="report_imports", __qualname__="ReportImports")
MPClient.__init__.__kwdefaults__["executor_class"] = named
engine = LLMEngine(EngineArgs(model={model!r}, max_model_len=64, num_kv_blocks=16).create_engine_config())
engine.add_request("r", "The capital of France is", SamplingParams(temperature=0.0, max_tokens=4))
_, chat_ids = engine.renderer.render_chat([{{"role": "user", "content": "Hi"}}])
engine.add_request("c", {{"prompt_token_ids": chat_ids}}, SamplingParams(temperature=0.0, max_tokens=4))
while engine.has_unfinished_requests():
    engine.step()
print("FRONTEND", sorted(m for m in ("torch", "transformers") if m in sys.modules))
engine.get_tokenizer()
print("ASKED", sorted(m for m in ("torch", "transformers") if m in sys.modules))
engine.shutdown()
"""


def test_frontend_imports_no_torch_and_the_engine_no_transformers(tmp_path, smollm2_dir):
    (tmp_path / "report_imports.py").write_text(IMPORTS_EXECUTOR)
    (tmp_path / "frontend.py").write_text(IMPORTS_FRONTEND.format(model=str(smollm2_dir)))
    report = tmp_path / "engine.json"
    done = subprocess.run([sys.executable, str(tmp_path / "frontend.py")], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "IMPORTS_REPORT": str(report), "PYTHONPATH": f"{REPO}:{tmp_path}"})
    assert done.returncode == 0, done.stderr
    assert "FRONTEND []" in done.stdout  # the tokenizer is the tokenizers library's
    assert "ASKED ['transformers']" in done.stdout  # get_tokenizer(): transformers' tokenizer, not torch
    assert json.loads(report.read_text()) == ["torch"]


LLM_FRONTEND = """
import sys
from shmvllm import LLM, SamplingParams

llm = LLM(model={model!r}, max_model_len=128, num_kv_blocks=16)
params = SamplingParams(temperature=0.0, max_tokens=4)
text = llm.generate(["The capital of France is"], params, use_tqdm=False)[0].outputs[0].text
chat = llm.chat([{{"role": "user", "content": "Hi"}}], params, use_tqdm=False)[0].outputs[0].text
print("LLM", sorted(m for m in ("torch", "transformers") if m in sys.modules), bool(text), bool(chat))
llm.get_tokenizer()
print("ASKED", "transformers" in sys.modules)
"""


def test_llm_generate_and_chat_import_no_transformers(tmp_path, smollm2_dir):
    """`LLM(model=...)`, a generate and a chat: the frontend's tokenizer is the tokenizers
    library's; `get_tokenizer()` alone imports transformers."""
    (tmp_path / "frontend.py").write_text(LLM_FRONTEND.format(model=str(smollm2_dir)))
    done = subprocess.run([sys.executable, str(tmp_path / "frontend.py")], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    assert "LLM [] True True" in done.stdout
    assert "ASKED True" in done.stdout


# ---- a start-up interrupted ----------------------------------------------------------------------

SLOW_EXECUTOR = """
import os, time
from shmvllm.executor.uniproc import UniProcExecutor


class SlowLoad(UniProcExecutor):
    def __init__(self, config):
        with open(os.environ["LOADING_MARK"], "w") as f:
            f.write(str(os.getpid()))
        time.sleep(120)
        super().__init__(config)
"""

SLOW_FRONTEND = """
import os, signal
from shmvllm import EngineArgs
from shmvllm.engine.core_client import MPClient
from slow_load import SlowLoad

signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as in a terminal
print("FRONTEND", os.getpid(), flush=True)
MPClient(EngineArgs(model={model!r}, max_model_len=64, num_kv_blocks=16).create_engine_config(), executor_class=SlowLoad)
"""


def _launch(tmp_path: Path, script: str, **env: str) -> subprocess.Popen:
    """Run `script` as a frontend in its own session; return once it wrote LOADING_MARK."""
    (tmp_path / "frontend.py").write_text(script)
    mark = tmp_path / "loading"
    proc = subprocess.Popen(
        [sys.executable, str(tmp_path / "frontend.py")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "LOADING_MARK": str(mark), "PYTHONPATH": f"{REPO}:{tmp_path}", "PYTHONUNBUFFERED": "1", **env},
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while not (mark.exists() and mark.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    return proc


def _start_loading(tmp_path: Path, model_dir: Path) -> tuple[subprocess.Popen, int]:
    """A frontend whose engine is loading (it sleeps in its executor); (frontend, engine pid)."""
    (tmp_path / "slow_load.py").write_text(SLOW_EXECUTOR)
    proc = _launch(tmp_path, SLOW_FRONTEND.format(model=str(model_dir)))
    return proc, int((tmp_path / "loading").read_text())


def _left_by(*pids: int) -> set[str]:
    return {name for name in leaked_shm_entries() if any(f"-{pid}-" in name for pid in pids)}


def _assert_nothing_left(frontend: int, engine: int, within: float) -> None:
    assert wait_until_dead(engine, within) < within
    deadline = time.monotonic() + 2.0
    while _left_by(frontend, engine) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _left_by(frontend, engine), sorted(_left_by(frontend, engine))


def test_kill_9_of_the_engine_while_it_loads(tmp_path, tiny_llama_dir):
    proc, engine = _start_loading(tmp_path, tiny_llama_dir)
    try:
        os.kill(engine, signal.SIGKILL)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 1 and "EngineStartupError" in err and "died before READY" in err, err
        _assert_nothing_left(proc.pid, engine, within=1.0)
    finally:
        proc.kill()


# ---- READY from the config, before torch and the model ----------------------------------------------


def _limits_cases(tiny_llama_dir: Path, smollm2_dir: Path) -> list[dict]:
    return [
        dict(model=str(smollm2_dir)),
        dict(model=str(tiny_llama_dir), max_model_len=64, num_kv_blocks=16),
        dict(model=str(tiny_llama_dir), max_model_len=512, kv_cache_memory=3 * 2**20),
        dict(model=str(tiny_llama_dir), max_model_len=1024, kv_cache_memory=2**20, max_logprobs=-1),
        dict(model=str(tiny_llama_dir), max_model_len=64, num_kv_blocks=16, dtype="bfloat16"),
    ]


def test_limits_before_load_are_the_built_engines(tiny_llama_dir, smollm2_dir):
    """What an engine answers READY with before it imports torch is what it finds once built."""
    from shmvllm import EngineArgs
    from shmvllm.engine.core import EngineCore, limits_before_load

    for kwargs in _limits_cases(tiny_llama_dir, smollm2_dir):
        config = EngineArgs(**kwargs).create_engine_config()
        early = limits_before_load(config)
        core = EngineCore(config)
        try:
            assert early is not None and early == core.ready(), kwargs
        finally:
            core.shutdown()


def test_kv_cache_mapped_before_torch_is_the_runners(tiny_llama_dir, smollm2_dir):
    """The cache an engine maps from its config before torch (`core.reserve_kv_cache`) is the
    one its runner builds (same layout, no copy): greedy tokens equal a cache of its own; a
    reservation of another shape is unmapped and the runner allocates anew."""
    from shmvllm import EngineArgs, SamplingParams
    from shmvllm.engine.core import limits_before_load, reserve_kv_cache
    from shmvllm.engine.llm_engine import LLMEngine
    from shmvllm.worker import kv_memory

    def greedy(config, reserve_blocks):
        reservation = None if reserve_blocks is None else reserve_kv_cache(config, reserve_blocks)
        engine = LLMEngine(config, multiprocess=False)
        try:
            cache = engine.engine_core.engine_core.executor.worker.model_runner.kv_cache
            engine.add_request("r", "The capital of France is", SamplingParams(temperature=0.0, max_tokens=6))
            tokens = []
            while engine.has_unfinished_requests():
                tokens += [out.outputs[0].token_ids for out in engine.step() if out.finished]
            return reservation, cache.data_ptr(), tokens
        finally:
            engine.shutdown()

    for kwargs in _limits_cases(tiny_llama_dir, smollm2_dir):
        config = EngineArgs(**kwargs).create_engine_config()
        blocks = limits_before_load(config).num_kv_blocks
        reservation, pointer, tokens = greedy(config, blocks)
        assert pointer == reservation.address and reservation.touch_seconds is not None, kwargs
        assert kv_memory.take(reservation.shape, reservation.itemsize) is None  # taken once
        assert tokens == greedy(config, None)[2], kwargs
    reservation, pointer, _ = greedy(config, blocks + 1)
    assert pointer != reservation.address and reservation.map.closed


def test_limits_before_load_only_where_the_config_decides(tiny_llama_dir):
    from shmvllm import EngineArgs
    from shmvllm.engine.core import limits_before_load

    base = dict(model=str(tiny_llama_dir), max_model_len=64, num_kv_blocks=16)
    assert limits_before_load(EngineArgs(**base).create_engine_config()) is not None
    for extra in (dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)):
        assert limits_before_load(EngineArgs(**base, **extra).create_engine_config()) is None, extra
    embed = EngineArgs(model="all-minilm-l6-v2").create_engine_config()
    assert limits_before_load(embed) is None


LOADS_AFTER_READY = """
import os, signal, sys, time
import shmvllm.engine.core as core
from shmvllm import LLM, SamplingParams


class HeldEngineCore(core.EngineCore):
    \"\"\"Holds the engine between its READY and its model until GO_MARK exists.\"\"\"
    def __init__(self, *args, **kwargs):
        with open(os.environ["LOADING_MARK"], "w") as f:
            f.write(str(os.getpid()))
        while not os.path.exists(os.environ["GO_MARK"]):
            time.sleep(0.02)
        if os.environ.get("FAIL_LOAD"):
            raise FileNotFoundError(2, "no such weights", "/nowhere/model.safetensors")
        super().__init__(*args, **kwargs)


signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as in a terminal
core.EngineCore = HeldEngineCore
llm = LLM({model!r}, max_model_len=64, num_kv_blocks=16)
print("LLM", os.path.exists(os.environ["GO_MARK"]), flush=True)
params = SamplingParams(temperature=0.0, max_tokens=6)
print("TOKENS", llm.generate(["The capital of France is"], params, use_tqdm=False)[0].outputs[0].token_ids, flush=True)
llm.shutdown()
"""


def _held_after_ready(tmp_path: Path, model_dir: Path, **env: str) -> tuple[subprocess.Popen, int]:
    """A frontend whose LLM() returned while its engine is held before building its model; (frontend, engine pid)."""
    proc = _launch(tmp_path, LOADS_AFTER_READY.format(model=str(model_dir)), GO_MARK=str(tmp_path / "go"), **env)
    assert proc.stdout.readline().split() == ["LLM", "False"]  # LLM() is back, the model not built
    return proc, int((tmp_path / "loading").read_text())


def test_llm_returns_before_the_model_loads_and_serves_once_it_has(tmp_path, tiny_llama_dir):
    from shmvllm import LLM, SamplingParams

    proc, engine = _held_after_ready(tmp_path, tiny_llama_dir)
    try:
        time.sleep(0.3)  # the request waits in the ring meanwhile
        (tmp_path / "go").touch()
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
    finally:
        proc.kill()
    # the engine in this process (no READY message; built before LLM() returns) agrees
    llm = LLM(str(tiny_llama_dir), max_model_len=64, num_kv_blocks=16, multiprocess=False)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=6)
        expected = llm.generate(["The capital of France is"], params, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        llm.shutdown()
    assert out.split("TOKENS", 1)[1].strip() == str(list(expected)), out
    _assert_nothing_left(proc.pid, engine, within=5.0)


def test_a_load_failing_after_ready_is_the_first_calls_error(tmp_path, tiny_llama_dir):
    """The engine's traceback reaches the caller as EngineDeadError on the call that needs it."""
    proc, engine = _held_after_ready(tmp_path, tiny_llama_dir, FAIL_LOAD="1")
    try:
        (tmp_path / "go").touch()
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 1 and "EngineDeadError" in err, err
        assert "FileNotFoundError: [Errno 2] no such weights" in err, err
        _assert_nothing_left(proc.pid, engine, within=5.0)
    finally:
        proc.kill()


DIES_AFTER_LLM = """
import os, signal
from shmvllm import LLM
from shmvllm.engine.proc_manager import _children

llm = LLM({model!r}, max_model_len=64, num_kv_blocks=16)
print("PIDS", os.getpid(), *_children(os.getpid()), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_kill_9_of_the_frontend_as_llm_returns(tmp_path, smollm2_dir):
    """The frontend dies the moment LLM() returned, its engine (READY from its config) still
    importing torch or loading: the engine goes, and nothing is left."""
    (tmp_path / "frontend.py").write_text(DIES_AFTER_LLM.format(model=str(smollm2_dir)))
    done = subprocess.run([sys.executable, str(tmp_path / "frontend.py")], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == -signal.SIGKILL, done.stderr
    frontend, engine = (int(pid) for pid in done.stdout.split()[1:])
    try:
        _assert_nothing_left(frontend, engine, within=5.0)
    finally:
        if pid_alive(engine):
            os.kill(engine, signal.SIGKILL)


def test_kill_9_of_the_engine_loading_after_ready(tmp_path, tiny_llama_dir):
    proc, engine = _held_after_ready(tmp_path, tiny_llama_dir)
    try:
        os.kill(engine, signal.SIGKILL)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 1 and "EngineDeadError" in err, err
        _assert_nothing_left(proc.pid, engine, within=1.0)
    finally:
        proc.kill()


# ---- the engine forked before the config (PrestartedEngine) -------------------------------------

SLOW_CONFIG_FRONTEND = """
import os, signal, time
from shmvllm import LLM, EngineArgs


def slow_config(self):
    with open(os.environ["LOADING_MARK"], "w") as f:
        f.write(str(os.getpid()))
    time.sleep(120)


signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as in a terminal
EngineArgs.create_engine_config = slow_config
LLM({model!r}, max_model_len=64, num_kv_blocks=16)
"""


def _making_config(tmp_path: Path, model_dir: Path) -> tuple[subprocess.Popen, int]:
    """A frontend in LLM(), making its config (it sleeps there) while its engine's fork waits for
    it; (frontend, the fork's pid)."""
    proc = _launch(tmp_path, SLOW_CONFIG_FRONTEND.format(model=str(model_dir)), SHMVLLM_ENGINE_START="fork")
    children = _children(proc.pid)
    assert len(children) == 1, children
    return proc, children[0]


# (how the frontend is caught mid-start, how long its engine may take to go once the frontend is killed):
# a loading engine (before or after its READY) notices within a poll; the fork made before the config only once its imports are done.
PHASES = pytest.mark.parametrize("start, kill_within", [
    pytest.param(_start_loading, 3.0, id="engine-loads"),
    pytest.param(_held_after_ready, 3.0, id="engine-loads-after-ready"),
    pytest.param(_making_config, 60.0, id="config"),
])


@PHASES
def test_kill_9_of_the_frontend_mid_start(tmp_path, tiny_llama_dir, start, kill_within):
    proc, engine = start(tmp_path, tiny_llama_dir)
    try:
        proc.kill()
        proc.wait(timeout=10)
        _assert_nothing_left(proc.pid, engine, within=kill_within)
    finally:
        proc.kill()
        proc.communicate()
        if pid_alive(engine):
            os.kill(engine, signal.SIGKILL)


@PHASES
def test_ctrl_c_mid_start(tmp_path, tiny_llama_dir, start, kill_within):
    """SIGINT to the whole process group, as a terminal's Ctrl-C: the frontend raises
    KeyboardInterrupt, stops its engine and removes its rings."""
    proc, engine = start(tmp_path, tiny_llama_dir)
    try:
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=30)
        assert "KeyboardInterrupt" in err, err
        _assert_nothing_left(proc.pid, engine, within=10.0)
    finally:
        proc.kill()
        if pid_alive(engine):
            os.kill(engine, signal.SIGKILL)


def test_a_config_that_fails_leaves_no_fork(tmp_path, monkeypatch):
    """LLM() forks its engine before it makes the config; a config that fails reaps the fork."""
    from shmvllm import LLM

    monkeypatch.setenv("SHMVLLM_ENGINE_START", "fork")
    before = set(_children(os.getpid()))
    with pytest.raises(ValueError, match="missing"):
        LLM(str(tmp_path / "missing"))
    assert set(_children(os.getpid())) == before


def _children(pid: int) -> list[int]:
    from shmvllm.engine.proc_manager import _children as children

    return children(pid)


# ---- the first requests, served before torch (first_requests.py) ---------------------------------

# The engine's torch import waits for GO_MARK: whatever completes before it was served without torch.
NATIVE_FIRST = """
import json, logging, os, signal, sys, threading, time
from shmvllm import LLM, SamplingParams
from shmvllm.engine import core_proc

logging.basicConfig(level=logging.INFO)
signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as in a terminal
_real_import = core_proc._import_torch


def held_import():
    with open(os.environ["LOADING_MARK"], "w") as f:
        f.write(str(os.getpid()))
    while not os.path.exists(os.environ["GO_MARK"]):
        time.sleep(0.02)
    _real_import()


core_proc._import_torch = held_import
llm = LLM({model!r}, max_model_len=512, num_kv_blocks=256)
print("LLM", flush=True)
cases = json.loads(os.environ["CASES"])


def run(cases):
    outs = llm.generate([c[0] for c in cases], [SamplingParams(**c[1]) for c in cases], use_tqdm=False)
    return [[list(o.outputs[0].token_ids), o.outputs[0].finish_reason, o.outputs[0].stop_reason,
             o.outputs[0].logprobs is not None] for o in outs]


if os.environ.get("LONG"):  # a request the engine is still serving without torch when it is interrupted
    run([["Once upon a time", dict(temperature=0.0, max_tokens=480, ignore_eos=True)]])
print("NATIVE", json.dumps(run(cases)), os.path.exists(os.environ["GO_MARK"]), flush=True)
threading.Timer(1.0, lambda: open(os.environ["GO_MARK"], "w").close()).start()
print("MIXED", json.dumps(run(cases[:1] + [[cases[0][0], dict(temperature=0.0, max_tokens=6, logprobs=2)]])), flush=True)
llm.shutdown()
"""

CHAT = "<|im_start|>user\\nSay hi<|im_end|>\\n<|im_start|>assistant\\n"
FIRST_CASES = [
    ["The capital of France is", dict(temperature=0.0, max_tokens=8)],
    ["The capital of France is", dict(temperature=0.0, max_tokens=8, stop_token_ids=[30])],
    ["The capital of France is", dict(temperature=0.0, max_tokens=8, min_tokens=3, stop_token_ids=[7042, 30])],
    ["The capital of France is", dict(temperature=0.0, max_tokens=12, stop=["answer"])],
    [CHAT, dict(temperature=0.0, max_tokens=40)],
    [CHAT, dict(temperature=0.0, max_tokens=12, ignore_eos=True)],
    [CHAT, dict(temperature=0.0, max_tokens=12, min_tokens=12)],
    ["Once upon a time, " * 12, dict(temperature=0.0, max_tokens=5)],
]


def _expected(model_dir: Path, cases: list) -> list:
    from shmvllm import LLM, SamplingParams

    llm = LLM(str(model_dir), max_model_len=512, num_kv_blocks=256, multiprocess=False)
    try:
        outs = llm.generate([c[0] for c in cases], [SamplingParams(**c[1]) for c in cases], use_tqdm=False)
    finally:
        llm.shutdown()
    return [[list(o.outputs[0].token_ids), o.outputs[0].finish_reason, o.outputs[0].stop_reason,
             o.outputs[0].logprobs is not None] for o in outs]


def _native_first(tmp_path: Path, model_dir: Path, **env: str) -> subprocess.Popen:
    return _launch(tmp_path, NATIVE_FIRST.format(model=str(model_dir)), GO_MARK=str(tmp_path / "go"),
                   CASES=json.dumps(FIRST_CASES), SHMVLLM_ENGINE_START="fork", **env)


def test_first_requests_are_served_before_torch_as_torch_serves_them(tmp_path, smollm2_dir):
    """Greedy requests (EOS, stop_token_ids, min_tokens, max_tokens, ignore_eos, a stop string's
    abort, batched prefill and decode) complete while the engine's torch import is held, with the
    torch engine's tokens; then one asking for logprobs waits for torch and torch serves it."""
    proc = _native_first(tmp_path, smollm2_dir)
    try:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
    finally:
        proc.kill()
    lines = dict(line.split(" ", 1) for line in out.splitlines() if line.startswith(("NATIVE", "MIXED")))
    native, go = lines["NATIVE"].rsplit(" ", 1)
    assert go == "False"  # torch had not imported: nothing but the native step could serve them
    expected = _expected(smollm2_dir, FIRST_CASES + [[FIRST_CASES[0][0], dict(temperature=0.0, max_tokens=6, logprobs=2)]])
    assert json.loads(native) == expected[:-1]
    reasons = [e[1] for e in expected]
    assert {"stop", "length"} <= set(reasons) and expected[3][2] == "answer" and expected[1][2] == 30
    assert json.loads(lines["MIXED"]) == [expected[0], expected[-1]] and expected[-1][3]
    assert f"served {len(FIRST_CASES)} requests" in err and "natively before torch" in err, err


@pytest.mark.parametrize("how", ["kill-engine", "kill-frontend", "ctrl-c"])
def test_interrupted_while_serving_before_torch(tmp_path, smollm2_dir, how):
    """kill -9 of either side, or Ctrl-C, while the engine serves without torch: no process and
    no /dev/shm entry left."""
    proc = _native_first(tmp_path, smollm2_dir, LONG="1")
    engine = int((tmp_path / "loading").read_text())
    try:
        assert proc.stdout.readline().strip() == "LLM"
        time.sleep(0.5)
        if how == "kill-engine":
            os.kill(engine, signal.SIGKILL)
        elif how == "kill-frontend":
            proc.kill()
        else:
            os.killpg(proc.pid, signal.SIGINT)
        proc.communicate(timeout=30)
        _assert_nothing_left(proc.pid, engine, within=10.0)
    finally:
        proc.kill()
        if pid_alive(engine):
            os.kill(engine, signal.SIGKILL)
