"""The xgrammar backend: parse a GrammarSpec (frontend validation), compile it for a tokenizer
(engine), and the checks for schema keywords xgrammar would silently drop.

xgrammar is imported on first use, so that an engine (or a frontend) that never sees a
constrained request does not pay for it.
"""

from __future__ import annotations

import re
from typing import Any

from shmvllm.structured_output.spec import GrammarSpec

_XGR_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def import_xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as exc:
        raise ValueError(
            "structured_outputs needs the xgrammar package, which is not installed: "
            "pip install 'shmvllm[structured]'"
        ) from exc
    return xgrammar


def error_text(exc: BaseException) -> str:
    """xgrammar's message without its log-line prefix (time, C++ file and line)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _XGR_LOG_PREFIX.sub("", text)


def parse(spec: GrammarSpec) -> Any:
    """The spec as an (uncompiled) xgrammar Grammar; raises what xgrammar raises."""
    xgr = import_xgrammar()
    if spec.kind == "json":
        return xgr.Grammar.from_json_schema(spec.text, any_whitespace=spec.any_whitespace, strict_mode=True)
    if spec.kind == "regex":
        return xgr.Grammar.from_regex(spec.text)
    if spec.kind == "ebnf":
        return xgr.Grammar.from_ebnf(spec.text)
    if spec.kind == "lark":
        return xgr.Grammar.from_lark(spec.text)
    if spec.kind == "structural_tag":
        return xgr.Grammar.from_structural_tag(spec.text)
    raise ValueError(f"unknown grammar kind {spec.kind!r}.")


def compile_spec(compiler: Any, spec: GrammarSpec) -> Any:
    """The spec compiled by an xgrammar GrammarCompiler (token masks for its tokenizer)."""
    if spec.kind == "json":
        return compiler.compile_json_schema(spec.text, any_whitespace=spec.any_whitespace, strict_mode=True)
    if spec.kind == "regex":
        return compiler.compile_regex(spec.text)
    if spec.kind == "ebnf":
        return compiler.compile_grammar(spec.text)
    if spec.kind == "lark":
        return compiler.compile_lark(spec.text)
    if spec.kind == "structural_tag":
        return compiler.compile_structural_tag(spec.text)
    raise ValueError(f"unknown grammar kind {spec.kind!r}.")


def unsupported_json_features(schema: Any, path: str = "#") -> list[str]:
    """Keywords of the schema that xgrammar's converter drops without an error (so the output
    could break them), as 'keyword at path'."""
    found: list[str] = []
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            found += unsupported_json_features(item, f"{path}/{i}")
        return found
    if not isinstance(schema, dict):
        return found
    for keyword in ("uniqueItems", "dependentRequired", "dependentSchemas", "minContains", "maxContains"):
        if keyword in schema and schema[keyword] not in (False, None):
            found.append(f"{keyword} at {path}")
    if ("pattern" in schema or "format" in schema) and ("minLength" in schema or "maxLength" in schema):
        found.append(f"minLength/maxLength together with pattern/format at {path}")
    for key, value in schema.items():
        if key in ("const", "enum", "default", "examples"):
            continue  # values, not subschemas
        if isinstance(value, (dict, list)):
            found += unsupported_json_features(value, f"{path}/{key}")
    return found
