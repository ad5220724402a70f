"""Shared fixtures: tiny random-weight models written as HF directories, and a leak check."""

from __future__ import annotations

import functools
import os
import re
import time
from pathlib import Path

import pytest

from ipc.segment import pid_alive
from shmvllm.engine.core_proc import FORKED_ENGINE_NAME  # a forked engine's /proc comm

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SHM_DIR = Path("/dev/shm")
_RING_NAME = re.compile(r"^(?:sem\.)?(?:ipcring|shmvllm)-(\d+)-")


def _parent_pid(pid: int) -> int:
    """The parent of a live (or zombie) process; 0 when it is gone."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


class SessionProcesses:
    """The pids of this test session's processes: pytest itself, every child it forks or
    starts (recorded as they start), and every other descendant (an engine's workers, the
    engine of a frontend script) seen creating a segment in /dev/shm while it lived.

    Segments in /dev/shm carry their creator's pid in their names (ipc.segment.new_name); the
    leak check counts only those of these pids, so what other test runs on the same machine
    leave behind (their processes dead or alive) is theirs, not a leak of this session. The
    descendants are found by watching /dev/shm with inotify: a segment is created by a live
    process, whose ancestry /proc still shows (one that dies within the watcher's wake-up of
    creating it is missed, unless pytest started it itself)."""

    def __init__(self) -> None:
        self.root = os.getpid()
        self.pids = {self.root}
        self._watch_shm()

    def add(self, pid: int) -> None:
        self.pids.add(pid)

    def is_ours(self, pid: int) -> bool:
        """Whether `pid` is (or was) one of this session's processes; a live descendant is
        recorded now."""
        if pid in self.pids:
            return True
        seen, ancestor = set(), pid
        while ancestor > 1 and ancestor not in seen:
            seen.add(ancestor)
            ancestor = _parent_pid(ancestor)
            if ancestor in self.pids:
                self.pids.add(pid)
                return True
        return False

    def _watch_shm(self) -> None:
        import ctypes
        import struct
        import threading

        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = libc.inotify_init1(os.O_CLOEXEC)
            in_create, in_moved_to = 0x100, 0x80  # a named semaphore is created under a temp name, then linked
            if fd < 0 or libc.inotify_add_watch(fd, bytes(SHM_DIR), in_create | in_moved_to) < 0:
                raise OSError(ctypes.get_errno(), "inotify")
        except (OSError, AttributeError) as exc:
            import warnings

            warnings.warn(f"cannot watch {SHM_DIR} ({exc}): the leak check sees only the segments of pytest's own children")
            return

        def watch() -> None:
            while True:
                data = os.read(fd, 1 << 16)
                offset = 0
                while offset < len(data):
                    _, _, _, length = struct.unpack_from("iIII", data, offset)
                    name = data[offset + 16:offset + 16 + length].rstrip(b"\0").decode(errors="replace")
                    offset += 16 + length
                    if (match := _RING_NAME.match(name)) is not None:
                        self.is_ours(int(match.group(1)))

        threading.Thread(target=watch, name="shm-leak-watch", daemon=True).start()


SESSION = SessionProcesses()


def _record_children() -> None:
    """Children that pytest starts are the session's, however briefly they live."""
    import subprocess

    execute_child = subprocess.Popen._execute_child
    fork = os.fork

    def recorded_execute_child(self, *args, **kwargs):
        execute_child(self, *args, **kwargs)
        SESSION.add(self.pid)

    def recorded_fork() -> int:
        pid = fork()
        if pid:
            SESSION.add(pid)
        return pid

    subprocess.Popen._execute_child = recorded_execute_child
    os.fork = recorded_fork


_record_children()


def leaked_shm_entries() -> set[str]:
    """Segments in /dev/shm created by this test session's processes (`SESSION`) that are
    this process's or whose creator is gone: what the session left behind.

    Segments of other live processes of the session (an engine still running) are theirs;
    those of other test runs on the same machine are never counted.
    """
    leaked = set()
    me = os.getpid()
    for entry in SHM_DIR.iterdir() if SHM_DIR.exists() else ():
        match = _RING_NAME.match(entry.name)
        if match is None:
            continue
        pid = int(match.group(1))
        if (pid == me or not pid_alive(pid)) and SESSION.is_ours(pid):
            leaked.add(entry.name)
    return leaked


ENGINE_PROGRAM = "shmvllm.engine.core_proc"


def engine_children() -> set[int]:
    """The live engine processes this process started (`python -m shmvllm.engine.core_proc`, or forked)."""
    found = set()
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if stat[0] == "Z" or int(stat[1]) != me:
                continue
            if ENGINE_PROGRAM in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace") or (
                (entry / "comm").read_text().strip() == FORKED_ENGINE_NAME  # SHMVLLM_ENGINE_START=fork
            ):
                found.add(int(entry.name))
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
    return found


@pytest.fixture(scope="session", autouse=True)
def no_shm_left_behind():
    """After the whole suite, nothing of ours may stay in /dev/shm."""
    before = leaked_shm_entries()
    yield
    left = leaked_shm_entries() - before
    assert not left, f"shared memory left in /dev/shm after the tests: {sorted(left)}"


@pytest.fixture(scope="session")
def embedding_texts() -> list[str]:
    """100 texts for embedding tests: empty and blank, short English, non-ASCII scripts, and
    long ones (over 256 tokens, so the reference truncates them)."""
    import random

    rng = random.Random(0)
    words = "the of cat river quantum engine memory ring shared token throughput latency paris".split()
    foreign = ["Grüße aus Köln, schöne Straße", "naïve café déjà vu", "Привет, как дела?", "東京は日本の首都です",
               "مرحبا بالعالم", "emoji 🙂🚀 and ümlauts", "Ελληνικά γράμματα", "한국어 문장입니다"]
    texts = ["", " ", "Hello.", "A"]
    texts += [rng.choice(foreign) + " " + " ".join(rng.choices(words, k=rng.randint(0, 20))) for _ in range(30)]
    texts += [" ".join(rng.choices(words, k=rng.randint(300, 600))) for _ in range(8)]
    while len(texts) < 100:
        texts.append(" ".join(rng.choices(words, k=rng.randint(1, 60))).capitalize() + ".")
    return texts


@pytest.fixture(scope="session")
def byte_fallback_tokenizer():
    """A SentencePiece-style tokenizer: metaspace, byte-fallback tokens <0x00>..<0xFF>, strip decoder."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁", "▁hello", "▁world", "▁the", "中", "文", "▁中", "é", *"abcdefghijklmnopqrstuvwxyz.,"]:
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from shmvllm.model.registry import resolve_model_dir

    return resolve_model_dir("smollm2-135m-instruct")


@functools.lru_cache(maxsize=1)
def hf_causal_lm(model_dir: Path, dtype=None):
    """transformers' model of a directory, eval mode; for a GGUF file's cached directory (no
    weights in it) transformers' own load of the file, which dequantizes its blocks (the last
    one is kept: loading a GGUF file takes transformers seconds)."""
    import torch
    from transformers import AutoModelForCausalLM

    from shmvllm.model.registry import gguf_source

    dtype = dtype or torch.float32
    source = gguf_source(Path(model_dir))
    if source is not None:
        return AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=dtype).eval()
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    from shmvllm.model.registry import resolve_model_dir

    return resolve_model_dir("all-minilm-l6-v2")


def _save_tiny_causal_lm(config, tokenizer_dir: Path, target: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    with torch.no_grad():  # larger weights than the default init, so greedy text is not constant
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model.eval()
    model.save_pretrained(target)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(target)
    return target


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_dir) -> Path:
    """A 2-layer random Llama with SmolLM2's tokenizer (and chat template), GQA, tied embeddings."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )
    return _save_tiny_causal_lm(config, smollm2_dir, tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory, smollm2_dir) -> Path:
    """A 2-layer random Qwen2 (qkv bias, untied lm_head) with SmolLM2's tokenizer."""
    from transformers import Qwen2Config

    config = Qwen2Config(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )
    return _save_tiny_causal_lm(config, smollm2_dir, tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory, minilm_dir) -> Path:
    """A 2-layer random BERT with all-MiniLM-L6-v2's tokenizer and sentence-transformers files."""
    import shutil

    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=30522, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=512,
    )
    target = tmp_path_factory.mktemp("tiny-bert")
    BertModel(config).eval().save_pretrained(target)
    AutoTokenizer.from_pretrained(minilm_dir).save_pretrained(target)
    for name in ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json"):
        shutil.copy(minilm_dir / name, target / name)
    shutil.copytree(minilm_dir / "1_Pooling", target / "1_Pooling")
    (target / "1_Pooling" / "config.json").write_text(
        (minilm_dir / "1_Pooling" / "config.json").read_text().replace("384", "64")
    )
    return target


def wait_until_dead(pid: int, timeout: float) -> float:
    """Seconds until `pid` is gone (zombies count as gone); fails after `timeout`."""
    started = time.monotonic()
    while pid_alive(pid):
        assert time.monotonic() - started < timeout, f"process {pid} still alive after {timeout} s"
        time.sleep(0.01)
    return time.monotonic() - started


@pytest.fixture
def no_engine_left_behind():
    """After the test: no engine process of ours within 5 s, and no new segment in /dev/shm."""
    before = leaked_shm_entries()
    yield
    deadline = time.monotonic() + 5
    while engine_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine_children(), "an engine process outlived its test"
    assert not leaked_shm_entries() - before


@pytest.fixture(params=[pytest.param(False, id="native"), pytest.param(True, id="python")])
def pure_python(request) -> bool:
    """A ring test runs on both backends: the C helper and the pure-Python one."""
    from ipc import native_available

    if not request.param and not native_available():
        pytest.fail("the C helper did not build (cc is expected on this machine)")
    return request.param
