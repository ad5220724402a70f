"""The package's layering, read from the source: no module-level import circle in shmvllm/ or
ipc/, core/, worker/, model/ and config.py never import engine/, and config.py (plain values) imports
neither engine/ nor model/ (at any level, lazy imports included)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _modules() -> dict[str, Path]:
    found = {}
    for package in ("shmvllm", "ipc"):
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imports(path: Path, module_level: bool) -> set[str]:
    """The modules of ours that `path` imports (`from pkg import sub` counts as `pkg.sub` when sub
    is a module); `if TYPE_CHECKING:` blocks do not count."""
    tree = ast.parse(path.read_text())
    nodes: list[ast.AST] = []
    pending: list[ast.AST] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            pending.extend(node.orelse)
            continue
        nodes.append(node)
        if not module_level:
            pending.extend(ast.iter_child_nodes(node))
        elif isinstance(node, (ast.If, ast.Try)):
            pending.extend(node.body + node.orelse + getattr(node, "finalbody", []))
            for handler in getattr(node, "handlers", []):
                pending.extend(handler.body)
    out = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = [f"{node.module}.{alias.name}" for alias in node.names if f"{node.module}.{alias.name}" in MODULES]
            out.update(subs or [node.module])
    return {name for name in out if name in MODULES}


def _find_circle(graph: dict[str, set[str]]) -> list[str]:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(name: str) -> list[str]:
        state[name] = 1
        stack.append(name)
        for other in sorted(graph[name]):
            if state.get(other) == 1:
                return stack[stack.index(other):] + [other]
            if other not in state and (found := visit(other)):
                return found
        stack.pop()
        state[name] = 2
        return []

    for name in sorted(graph):
        if name not in state and (found := visit(name)):
            return found
    return []


def test_no_module_level_import_circle():
    graph = {name: _imports(path, module_level=True) - {name} for name, path in MODULES.items()}
    assert _find_circle(graph) == []


def test_no_import_circle_even_through_lazy_imports_in_the_engine_stack():
    """Lazy (function-level) imports count too, outside ipc's internals and the compat package
    (whose finder reads the package's version constant)."""
    names = [n for n in MODULES if n.startswith("shmvllm") and not n.startswith("shmvllm.compat")]
    graph = {n: {m for m in _imports(MODULES[n], module_level=False) if m in names} - {n} for n in names}
    assert _find_circle(graph) == []


def test_core_worker_model_and_config_never_import_the_engine():
    lower = [name for name in MODULES if name.split(".")[:2] in (["shmvllm", "core"], ["shmvllm", "worker"], ["shmvllm", "model"])]
    lower.append("shmvllm.config")
    offenders = {name: sorted(m for m in _imports(MODULES[name], module_level=False) if m.startswith("shmvllm.engine"))
                 for name in lower}
    assert {name: found for name, found in offenders.items() if found} == {}


def test_config_is_a_leaf():
    ours = _imports(MODULES["shmvllm.config"], module_level=False)
    assert sorted(m for m in ours if m.startswith(("shmvllm.engine", "shmvllm.model"))) == []
