"""N-gram (prompt lookup) proposer: the tokens that followed the latest earlier occurrence of the
sequence's last n tokens, for the longest n in [min_n, max_n] that occurs earlier (vLLM's
NgramProposer's rule), over the prompt and the output so far."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from shmvllm.spec_decode.config import SpeculativeConfig


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, token_ids: np.ndarray, max_tokens: int) -> list[int]:
        """Up to min(k, max_tokens) proposed continuations of `token_ids` (int array); [] when
        no suffix n-gram occurs earlier."""
        k = min(self.k, max_tokens)
        total = len(token_ids)
        if k <= 0 or total <= self.min_n:
            return []
        # Windows of min_n tokens that equal the suffix's: the candidates for every longer n too.
        suffix = token_ids[total - self.min_n :]
        windows = sliding_window_view(token_ids[: total - 1], self.min_n)
        starts = np.flatnonzero((windows == suffix).all(axis=1))
        if len(starts) == 0:
            return []
        # Extend each candidate backwards as far as it keeps matching, up to max_n.
        lengths = np.full(len(starts), self.min_n)
        alive = np.ones(len(starts), dtype=bool)
        for extra in range(self.min_n, min(self.max_n, total - 1)):
            back = starts - (extra - self.min_n) - 1
            ok = alive & (back >= 0)
            ok[ok] = token_ids[back[ok]] == token_ids[total - extra - 1]
            lengths[ok] += 1
            alive = ok
            if not alive.any():
                break
        best = np.flatnonzero(lengths == lengths.max())[-1]  # the longest; the latest among equals
        begin = int(starts[best]) + self.min_n
        return token_ids[begin : begin + k].tolist()


class TokenArrays:
    """Each request's tokens as an int64 numpy array, kept and appended to (a request's tokens
    only grow), so that a proposal does not convert the whole list every step."""

    def __init__(self) -> None:
        self._arrays: dict[str, tuple[np.ndarray, int]] = {}

    def update(self, request_id: str, token_ids: list[int]) -> np.ndarray:
        """A view of `token_ids` as an array (valid until the next update of this request)."""
        buffer, size = self._arrays.get(request_id, (None, 0))
        total = len(token_ids)
        if buffer is None or total > len(buffer):
            grown = np.empty(max(2 * total, 64), dtype=np.int64)
            if buffer is not None:
                grown[:size] = buffer[:size]
            buffer = grown
        if total > size:
            buffer[size:total] = token_ids[size:total]
        self._arrays[request_id] = (buffer, total)
        return buffer[:total]

    def drop(self, request_id: str) -> None:
        self._arrays.pop(request_id, None)
