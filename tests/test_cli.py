"""The `shmvllm` command, run as a user runs it: in a subprocess."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from shmvllm.cli import build_parser

REPO = Path(__file__).resolve().parents[1]


def run(args: list[str], stdin: str = "", timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(args, input=stdin, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


def readme_first_command() -> list[str]:
    """The `shmvllm ...` part of the README's first shell command."""
    block = re.search(r"```bash\n(.*?)\n```", (REPO / "README.md").read_text(), re.S).group(1)
    first = block.strip().splitlines()[0]
    command = first.split("&&")[-1].strip()
    assert command.startswith("shmvllm ")
    return shlex.split(command)


def test_readme_first_command_answers_paris():
    result = run(readme_first_command())
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout, (result.stdout, result.stderr)


def subcommand_parsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_help_explains_every_flag():
    result = run([sys.executable, "-m", "shmvllm", "--help"])
    assert result.returncode == 0
    parsers = subcommand_parsers()
    assert {"generate", "chat"} <= set(parsers)
    for name, parser in parsers.items():
        assert name in result.stdout
        text = run([sys.executable, "-m", "shmvllm", name, "--help"]).stdout
        for action in parser._actions:
            assert action.help, f"{name}: {action.option_strings or action.dest} has no help"
            for option in action.option_strings:
                assert option in text, f"{name} --help does not show {option}"


def test_generate_on_tiny_model_equals_llm_generate(tiny_llama_dir):
    """Without --max-tokens: 16 tokens, vLLM's default for a completion."""
    from shmvllm import LLM, SamplingParams

    prompt = "The capital of France is"
    result = run([sys.executable, "-m", "shmvllm", "generate", prompt, "--no-chat-template", "--model", str(tiny_llama_dir),
                  "--inproc"])
    assert result.returncode == 0, result.stderr
    with LLM(model=str(tiny_llama_dir), multiprocess=False, num_kv_blocks=64) as llm:
        expected, shorter, longer = (
            llm.generate(prompt, SamplingParams(temperature=0, max_tokens=n), use_tqdm=False)[0].outputs[0].text
            for n in (16, 15, 17)
        )
    assert shorter != expected != longer
    assert result.stdout == expected + "\n"


def test_chat_repl_streams_the_same_reply_as_llm_chat(tiny_llama_dir):
    from shmvllm import LLM, SamplingParams

    result = run([sys.executable, "-m", "shmvllm", "chat", "--model", str(tiny_llama_dir), "--max-tokens", "10", "--inproc"],
                 stdin="Hello there\nHow are you?\n/exit\n")
    assert result.returncode == 0, result.stderr
    params = SamplingParams(temperature=0, max_tokens=10)
    with LLM(model=str(tiny_llama_dir), multiprocess=False, num_kv_blocks=64) as llm:
        first = llm.chat([{"role": "user", "content": "Hello there"}], params, use_tqdm=False)[0].outputs[0].text
        second = llm.chat(
            [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": first},
             {"role": "user", "content": "How are you?"}], params, use_tqdm=False,
        )[0].outputs[0].text
    assert result.stdout == f"{first}\n{second}\n"


@pytest.mark.parametrize("flag, value, field", [("--temperature", "-1", "temperature"), ("--top-p", "2", "top_p")])
def test_invalid_flag_value_is_a_clear_error(tiny_llama_dir, flag, value, field):
    result = run([sys.executable, "-m", "shmvllm", "generate", "hi", "--model", str(tiny_llama_dir), flag, value, "--inproc"])
    assert result.returncode == 2 and field in result.stderr and "Traceback" not in result.stderr


def test_generate_stream_prints_pieces_as_they_come(tiny_llama_dir):
    """--stream: the same text as without, and the first piece is on stdout before the rest exists."""
    import os
    import subprocess

    args = ["generate", "The capital of France is", "Once upon", "--no-chat-template", "--model", str(tiny_llama_dir),
            "--max-tokens", "300", "--inproc"]
    plain = run([sys.executable, "-m", "shmvllm", *args])
    assert plain.returncode == 0, plain.stderr
    proc = subprocess.Popen([sys.executable, "-m", "shmvllm", *args, "--stream"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        first = os.read(proc.stdout.fileno(), 1 << 20)
        rest, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert (first + rest).decode() == plain.stdout
    assert len(first) < len(plain.stdout.encode()) // 2  # it came in pieces
