"""vLLM offline programs (tests/vllm_programs: basic, generate, chat, embed, in the shape of vLLM's
examples/offline_inference/basic/, written afresh) run unchanged after install_as_vllm(), each as
`python program.py` in its own interpreter, with the engine in its own process, on the shipped
models. install_as_vllm() runs from a sitecustomize.py on PYTHONPATH (the README's recipe), so it
runs in the engine process too (which never imports the program itself)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PROGRAMS = Path(__file__).resolve().parent / "vllm_programs"

@pytest.fixture(scope="module")
def site_dir(tmp_path_factory) -> Path:
    site = tmp_path_factory.mktemp("site")
    (site / "sitecustomize.py").write_text("import shmvllm\nshmvllm.install_as_vllm()\n")
    return site


def run_program(site_dir: Path, name: str, *args: str) -> str:
    env = {"PYTHONPATH": f"{site_dir}:{REPO}", "PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, str(PROGRAMS / name), *args], capture_output=True,
                            text=True, timeout=600, env=env, cwd=REPO)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "import shmvllm" not in (PROGRAMS / name).read_text()
    return result.stdout


def test_basic_program(site_dir):
    out = run_program(site_dir, "basic.py")
    assert out.count("Prompt:    ") == 4 and out.count("Output:    ") == 4
    assert "'The capital of France is'" in out


def test_generate_program_with_cli_engine_args(site_dir):
    out = run_program(site_dir, "generate.py", "--max-model-len", "512", "--enforce-eager", "--max-tokens", "12",
                      "--temperature", "0", "--max_num_seqs", "8")
    texts = re.findall(r"Generated text: (.*)", out)
    assert len(texts) == 2 and all(ast.literal_eval(t) for t in texts)
    assert "Paris" in ast.literal_eval(texts[1])  # greedy SmolLM2-135M-Instruct knows this one


def test_chat_program(site_dir, tmp_path):
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:")
    out = run_program(site_dir, "chat.py", "--max-tokens", "8", "--temperature", "0", "--chat-template-path", str(template))
    assert out.count("Generated text: ") == 1 + 4 + 4
    assert "Prompt: 'system: You are a helpful assistant\\nuser: Hello\\n" in out


def test_embed_program(site_dir):
    out = run_program(site_dir, "embed.py")
    sizes = re.findall(r"\(size=(\d+)\)", out)
    assert sizes == ["384"] * 4
    first = re.search(r"Embeddings: \[([^\]]*), \.\.\.\]", out).group(1).split(", ")
    assert len(first) == 16 and all(abs(float(v)) < 1 for v in first)
