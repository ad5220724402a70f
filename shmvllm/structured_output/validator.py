"""Frontend validation of constraints: a bad schema, regex or grammar is a ValueError at
generate(), naming the field, before anything is queued.

The check parses the constraint with xgrammar (the same converter the engine's compiler runs),
without building token masks, which needs no tokenizer and takes well under a millisecond for
common schemas. Results are cached by spec, so a batch of requests sharing one schema parses it once.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Optional

from shmvllm.sampling_params import StructuredOutputsParams
from shmvllm.structured_output import backend
from shmvllm.structured_output.spec import GrammarSpec, grammar_spec

_WHAT = {
    "json": "JSON schema",
    "json_object": "JSON object constraint",
    "regex": "regular expression",
    "choice": "choice list",
    "grammar": "grammar",
    "structural_tag": "structural tag",
}


class StructuredOutputValidator:
    def __init__(self, max_entries: int = 1024) -> None:
        self.max_entries = max_entries
        self._results: OrderedDict[GrammarSpec, Optional[str]] = OrderedDict()  # spec -> error or None

    def validate(self, params: StructuredOutputsParams) -> None:
        spec = grammar_spec(params)
        if spec in self._results:
            self._results.move_to_end(spec)
            error = self._results[spec]
        else:
            error = self._check(spec)
            self._results[spec] = error
            if len(self._results) > self.max_entries:
                self._results.popitem(last=False)
        if error is not None:
            value = getattr(params, spec.field)
            shown = repr(value) if len(repr(value)) <= 300 else repr(value)[:300] + "..."
            raise ValueError(f"structured_outputs.{spec.field} is not a valid {_WHAT[spec.field]}: {error}; got {shown}.")

    @staticmethod
    def _check(spec: GrammarSpec) -> Optional[str]:
        if spec.kind == "json":
            dropped = backend.unsupported_json_features(json.loads(spec.text))
            if dropped:
                return f"xgrammar cannot enforce {', '.join(dropped)}"
        backend.import_xgrammar()  # its absence is not the constraint's fault: raised as it is
        try:
            backend.parse(spec)
        except Exception as exc:  # xgrammar reports a bad constraint as RuntimeError (or ValueError)
            return backend.error_text(exc)
        return None
