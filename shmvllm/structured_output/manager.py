"""StructuredOutputManager: the scheduler's side of structured outputs.

Per request: a StructuredOutputRequest holding its compile's future, then its matcher. Per step:
the token bitmask of every constrained request that samples in this step, filled in one batch
call (xgrammar's BatchGrammarMatcher) into one buffer allocated once; the runner applies the
rows to the logits. After the step, each sampled token advances its request's matcher
(`StructuredOutputRequest.accept`).

The counters (`fill_s`, `accept_s`, `num_fills`) are what benchmarks/structured.py reports as
the per-step cost of the masks on the scheduler's side.
"""

from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np

from shmvllm.sampling_params import SamplingParams
from shmvllm.structured_output import backend
from shmvllm.structured_output.compiler import GrammarCompilerCache
from shmvllm.structured_output.request import StructuredOutputRequest
from shmvllm.structured_output.spec import grammar_spec


class StructuredOutputManager:
    def __init__(self, tokenizer_dir: Path, vocab_size: int, max_num_seqs: int) -> None:
        self.vocab_size = vocab_size
        self.max_num_seqs = max_num_seqs
        self.compiler = GrammarCompilerCache(tokenizer_dir, vocab_size)
        self._bitmask: Optional[np.ndarray] = None  # [max_num_seqs, ceil(vocab / 32)] int32
        self._batch_matcher: Any = None
        self.fill_s = 0.0
        self.accept_s = 0.0
        self.num_fills = 0

    def new_request(self, params: SamplingParams) -> StructuredOutputRequest:
        """Starts (or finds in the cache) the compile of the request's constraint. The matcher's
        stop tokens are the request's own (EOS and stop_token_ids), allowed only where the
        grammar can end."""
        assert params.structured_outputs is not None
        spec = grammar_spec(params.structured_outputs)
        stop_ids = sorted(params.all_stop_token_ids) or None
        return StructuredOutputRequest(spec, self.compiler.get(spec), stop_ids)

    @staticmethod
    def wait_for_any(requests: list[StructuredOutputRequest], timeout: float) -> None:
        """Blocks until one of the compiles is done, or `timeout` seconds."""
        concurrent.futures.wait([r.compiled for r in requests], timeout, concurrent.futures.FIRST_COMPLETED)

    def grammar_bitmask(self, requests: list[StructuredOutputRequest]) -> np.ndarray:
        """[len(requests), ceil(vocab / 32)] int32: row i is the allowed next tokens of requests[i]
        (bit t % 32 of word t // 32, little-endian). A view of a buffer reused every step."""
        started = time.perf_counter()
        if self._bitmask is None:
            xgr = backend.import_xgrammar()
            self._bitmask = np.empty((self.max_num_seqs, -(-self.vocab_size // 32)), dtype=np.int32)
            # One thread, the caller's: 64 rows take well under a millisecond, and xgrammar's pool
            # threads would contend with torch's for the cores during the forward that follows.
            self._batch_matcher = xgr.BatchGrammarMatcher(max_threads=1)
        rows = self._bitmask[: len(requests)]
        self._batch_matcher.batch_fill_next_token_bitmask([r.matcher for r in requests], rows)
        self.fill_s += time.perf_counter() - started
        self.num_fills += 1
        return rows

    def speculative_bitmask(self, entries: list[tuple[StructuredOutputRequest, list[int]]]) -> np.ndarray:
        """With proposals: for each (request, proposals), 1 + len(proposals) rows, row j the
        allowed tokens after the first j proposals (which the grammar allows: allowed_prefix).
        A fresh array (its rows outnumber the reused buffer's)."""
        started = time.perf_counter()
        rows = np.empty((sum(len(p) + 1 for _, p in entries), -(-self.vocab_size // 32)), dtype=np.int32)
        row = 0
        for request, proposals in entries:
            matcher = request.matcher
            for j in range(len(proposals) + 1):
                matcher.fill_next_token_bitmask(rows, row)
                row += 1
                if j < len(proposals) and not matcher.accept_token(proposals[j]):
                    raise ValueError(f"proposal {proposals[j]} is not allowed by the grammar (allowed_prefix first).")
            if proposals:
                matcher.rollback(len(proposals))
        self.fill_s += time.perf_counter() - started
        self.num_fills += 1
        return rows

    def accept(self, request: StructuredOutputRequest, token_id: int) -> bool:
        started = time.perf_counter()
        accepted = request.accept(token_id)
        self.accept_s += time.perf_counter() - started
        return accepted

    def stats(self) -> dict[str, float]:
        return {
            "fill_s": self.fill_s,
            "accept_s": self.accept_s,
            "num_fills": self.num_fills,
            "num_compiles": self.compiler.num_compiles,
        }

    def shutdown(self) -> None:
        self.compiler.shutdown()
