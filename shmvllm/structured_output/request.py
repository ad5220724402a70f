"""StructuredOutputRequest: one request's grammar, from its compile to its end.

It lives on the scheduler's Request, which keeps its output tokens through preemption, so a
recomputed request goes on with the same matcher state: the tokens it re-reads in its prefill
were all accepted already. One matcher per request, so each child of an n > 1 request (an
engine request of its own) walks the grammar on its own.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Optional

from shmvllm.structured_output import backend
from shmvllm.structured_output.spec import GrammarSpec


class StructuredOutputRequest:
    def __init__(self, spec: GrammarSpec, compiled: "Future[Any]", stop_token_ids: Optional[list[int]]) -> None:
        self.spec = spec
        self._compiled = compiled
        self._stop_token_ids = stop_token_ids
        self.matcher: Any = None  # xgrammar GrammarMatcher, once the grammar is compiled
        self.error: Optional[str] = None
        self.num_accepted = 0

    @property
    def compiled(self) -> "Future[Any]":
        return self._compiled

    def poll(self) -> bool:
        """True once the grammar is compiled (then `matcher` is set) or failed (then `error` is)."""
        if self.matcher is not None or self.error is not None:
            return True
        if not self._compiled.done():
            return False
        try:
            compiled = self._compiled.result()
            xgr = backend.import_xgrammar()
            self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=self._stop_token_ids)
        except Exception as exc:
            self.error = f"structured_outputs.{self.spec.field}: the grammar did not compile: {backend.error_text(exc)}"
        return True

    def accept(self, token_id: int) -> bool:
        """Advances the matcher by one sampled token; False (and `error` set) if the grammar
        does not allow it."""
        if not self.matcher.accept_token(token_id):
            self.error = (
                f"structured_outputs.{self.spec.field}: token {token_id} after {self.num_accepted} accepted "
                "tokens is not allowed by the grammar (min_tokens can forbid the end the grammar requires)"
            )
            return False
        self.num_accepted += 1
        return True

    def allowed_prefix(self, token_ids: list[int]) -> int:
        """How many leading tokens of `token_ids` (proposals) the grammar allows in a row, up to
        and including one that ends it; the matcher's state is left as it was."""
        count = 0
        for token_id in token_ids:
            if self.matcher.is_terminated() or not self.matcher.accept_token(token_id):
                break
            count += 1
        if count:
            self.matcher.rollback(count)
        return count

    @property
    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()
