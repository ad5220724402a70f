"""The engine's grammar compiler: one compile per distinct constraint, off the step path.

Compiles run on a worker thread (xgrammar's compiler spreads one compile over its own threads);
the scheduler only looks at the returned futures, so a request waits for its grammar while the
batch goes on decoding. Results are cached by (tokenizer, spec) with the future itself as the
entry, so requests that arrive together with one schema share a single compile. The tokenizer
and xgrammar's TokenizerInfo are built on the worker thread on the first compile, so an engine
that never sees a constraint pays nothing for them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

from shmvllm.structured_output import backend
from shmvllm.structured_output.spec import GrammarSpec

DEFAULT_CACHE_ENTRIES = 512


class GrammarCompilerCache:
    def __init__(self, tokenizer_dir: Path, vocab_size: int, max_entries: int = DEFAULT_CACHE_ENTRIES) -> None:
        """vocab_size: the model's (its lm_head rows), which can differ from the tokenizer's;
        masks cover the model's ids, and ids the tokenizer does not have are never allowed."""
        self.tokenizer_key = (str(tokenizer_dir), vocab_size)
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[tuple[str, int], GrammarSpec], Future] = OrderedDict()
        self._pool: Optional[ThreadPoolExecutor] = None
        self._compiler: Any = None
        self._compiler_lock = threading.Lock()
        self.num_compiles = 0

    def get(self, spec: GrammarSpec) -> "Future[Any]":
        """The compiled grammar of `spec`, as a future (done at once for a cached spec)."""
        key = (self.tokenizer_key, spec)
        future = self._entries.get(key)
        if future is not None and not (future.done() and future.exception() is not None):
            self._entries.move_to_end(key)
            return future
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shmvllm-grammar")
        future = self._pool.submit(self._compile, spec)
        self._entries[key] = future
        if len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return future

    def _compile(self, spec: GrammarSpec) -> Any:
        self.num_compiles += 1
        return backend.compile_spec(self._get_compiler(), spec)

    def _get_compiler(self) -> Any:
        with self._compiler_lock:
            if self._compiler is None:
                from shmvllm.engine.renderer import load_tokenizer

                xgr = backend.import_xgrammar()
                tokenizer = load_tokenizer(self.tokenizer_dir)
                info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)
                self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
            return self._compiler

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
