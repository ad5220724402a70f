"""Environment variables: envs.VARIABLES is the one description of each, README.md's table says
the same, and nothing else in shmvllm reads one of ours from the environment."""

from __future__ import annotations

import re
from pathlib import Path

from shmvllm import envs

ROOT = Path(__file__).resolve().parents[1]


def test_the_readme_table_is_envs_variables():
    readme = (ROOT / "README.md").read_text()
    rows = re.findall(r"^\| `([A-Z_0-9]+)` \| (.*?) \| (.*?) \|$", readme, re.MULTILINE)
    assert {name: (default, what) for name, default, what in rows} == envs.VARIABLES


def test_envs_reads_exactly_the_variables_it_describes():
    source = (ROOT / "shmvllm" / "envs.py").read_text()
    read = set(re.findall(r'_(?:raw|flag|int)\("([A-Z_0-9]+)"', source))
    assert read == set(envs.VARIABLES)
    assert "os.environ._data" not in source and "_data" not in source


def test_no_other_module_reads_our_variables():
    pattern = re.compile(r"""(?:os\.environ(?:\.get)?|os\.getenv)\s*[\[(]\s*["'](SHMVLLM_[A-Z_0-9]+|OMP_NUM_THREADS)""")
    readers = {
        str(path.relative_to(ROOT)): pattern.findall(path.read_text())
        for path in (ROOT / "shmvllm").rglob("*.py")
        if path.name != "envs.py"
    }
    assert {path: names for path, names in readers.items() if names} == {}
