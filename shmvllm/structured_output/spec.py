"""StructuredOutputsParams -> GrammarSpec: the one form the validator and the compiler both use.

A spec is plain text (no grammar library needed): its `kind` says which xgrammar entry point
takes it, `text` is what that entry point reads, and the spec itself is the cache key of the
compiled grammar. `choice` becomes an EBNF grammar (an alternation of string literals), and
`json_object` the schema {"type": "object"}, as vLLM does; `disable_additional_properties` is
applied to the schema here, so that two requests that mean the same schema share one entry.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from shmvllm.sampling_params import StructuredOutputsParams


@dataclass(frozen=True)
class GrammarSpec:
    """kind: "json" | "regex" | "ebnf" | "lark" | "structural_tag"; field: the params field it came
    from (for error messages); any_whitespace: JSON only."""

    kind: str
    text: str
    field: str
    any_whitespace: bool = True


def grammar_spec(params: StructuredOutputsParams) -> GrammarSpec:
    field = params.kind
    if field == "json":
        schema: Any = json.loads(params.json) if isinstance(params.json, str) else params.json
        if params.disable_additional_properties:
            schema = _no_additional_properties(schema)
        return GrammarSpec("json", _canonical_json(schema), field, not params.disable_any_whitespace)
    if field == "json_object":
        return GrammarSpec("json", '{"type":"object"}', field, not params.disable_any_whitespace)
    if field == "regex":
        return GrammarSpec("regex", params.regex, field)
    if field == "choice":
        return GrammarSpec("ebnf", choice_as_ebnf(params.choice), field)
    if field == "grammar":
        return GrammarSpec("ebnf" if "::=" in params.grammar else "lark", params.grammar, field)
    tag = params.structural_tag
    return GrammarSpec("structural_tag", _canonical_json(json.loads(tag) if isinstance(tag, str) else tag), field)


def choice_as_ebnf(choices: list[str]) -> str:
    """root ::= "a" | "b" ..., each choice an EBNF string literal (JSON's escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def _canonical_json(value: Any) -> str:
    """Compact JSON text; key order is kept (xgrammar generates properties in schema order)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "unevaluatedProperties")


def _no_additional_properties(schema: Any) -> Any:
    """A copy in which every object schema without an additionalProperties of its own gets false."""
    if not isinstance(schema, dict):
        return schema
    result = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            result[key] = {name: _no_additional_properties(sub) for name, sub in schema[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            result[key] = [_no_additional_properties(sub) for sub in schema[key]]
    for key in _SUBSCHEMAS:
        if key in schema:
            value = schema[key]
            result[key] = [_no_additional_properties(v) for v in value] if isinstance(value, list) else _no_additional_properties(value)
    if (schema.get("type") == "object" or "properties" in schema) and "additionalProperties" not in schema:
        result["additionalProperties"] = False
    return result
