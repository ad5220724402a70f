"""KVCacheManager: which blocks each request holds, and prefix caching over the BlockPool.

A full block is identified by a chained hash: sha256(parent block's hash + its token ids), so
equal hashes mean equal whole prefixes, not just equal blocks. A request's hashes are kept on
the request (`Request.block_hashes`) and grown as its tokens fill blocks.

Blocks are cached as soon as they are allocated for tokens that fill them, as vLLM does: a
request scheduled later in the same step may hit them. The runner therefore writes each
layer's KV for the whole batch before attention reads the cache (see SchedulerOutput).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional

import numpy as np

from shmvllm.core.block_pool import BlockPool, KVCacheBlock
from shmvllm.core.request import Request

_ROOT_HASH = b"shmvllm-kv-root"


def hash_block_tokens(parent_hash: Optional[bytes], token_ids: list[int]) -> bytes:
    data = np.asarray(token_ids, dtype="<i8").tobytes()
    return hashlib.sha256((parent_hash or _ROOT_HASH) + data).digest()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    """Counted in tokens: queries = tokens looked up, hits = tokens found cached."""

    requests: int = 0
    queries: int = 0
    hits: int = 0


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool = True,
        rope_length_threshold: Optional[int] = None, rope_length_exact: bool = True,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}.")
        self.block_size = block_size
        self.rope_length_threshold, self.rope_length_exact = rope_length_threshold, rope_length_exact
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks of a request already cached
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of the request's known tokens, in whole blocks.

        The last known token is never a hit, even when cached: it must be computed to give the
        logits for the next one.
        """
        if not self.enable_caching or not request.use_prefix_cache:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        self._update_block_hashes(request, max_hit_blocks)
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        num_hit_tokens = len(hits) * self.block_size
        self.prefix_cache_stats.requests += 1
        self.prefix_cache_stats.queries += request.num_tokens
        self.prefix_cache_stats.hits += num_hit_tokens
        return hits, num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Optional[list[KVCacheBlock]] = None,
        num_new_computed_tokens: int = 0,
    ) -> Optional[list[KVCacheBlock]]:
        """Gives the request blocks for num_new_tokens more tokens after its computed ones (and
        after new_computed_blocks, its prefix-cache hits when it is first scheduled).

        Returns the newly allocated blocks (not the hits), or None, changing nothing, when too
        few blocks are free.
        """
        if num_new_tokens < 1:
            raise ValueError(f"num_new_tokens must be at least 1, got {num_new_tokens}.")
        computed = new_computed_blocks or []
        req_blocks = self.req_to_blocks.setdefault(request.request_id, [])
        total_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_needed = cdiv(total_tokens, self.block_size) - len(req_blocks) - len(computed)
        # Hits that are free still sit in the free list: taking them uses up free blocks too.
        num_free_hits = sum(1 for b in computed if b.ref_cnt == 0)
        if num_needed > self.block_pool.get_num_free_blocks() - num_free_hits:
            if not req_blocks:
                del self.req_to_blocks[request.request_id]
            return None
        self.block_pool.touch(computed)
        req_blocks.extend(computed)
        new_blocks = self.block_pool.get_new_blocks(max(num_needed, 0))
        req_blocks.extend(new_blocks)
        if self.enable_caching and request.use_prefix_cache:
            self._cache_full_blocks(request, req_blocks, min(total_tokens, request.num_tokens))
        return new_blocks

    def free(self, request: Request) -> None:
        """Releases the request's blocks, last block first, so that its later blocks (less
        likely to be shared) are evicted before its prefix."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def trim(self, request: Request, num_tokens: int) -> Optional[int]:
        """Frees the request's blocks past those that hold num_tokens tokens (allocated for
        proposals that were rejected), last first; returns how many it keeps, or None if it
        freed nothing."""
        blocks = self.req_to_blocks.get(request.request_id)
        keep = cdiv(num_tokens, self.block_size)
        if blocks is None or len(blocks) <= keep:
            return None
        self.block_pool.free_blocks(reversed(blocks[keep:]))
        del blocks[keep:]
        return keep

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """The stats since the last call (and starts counting afresh)."""
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def _update_block_hashes(self, request: Request, num_full_blocks: int) -> None:
        hashes = request.block_hashes
        bs = self.block_size
        for i in range(len(hashes), num_full_blocks):
            parent = hashes[i - 1] if i else self._root_hash(request)
            hashes.append(hash_block_tokens(parent, request.all_token_ids[i * bs : (i + 1) * bs]))

    def _root_hash(self, request: Request) -> Optional[bytes]:
        """A prompt past the rope's length threshold chains its hashes from a root of its own:
        its keys were rotated by its length (dynamic: only a prompt of that length may reuse
        them) or by the long factors (longrope: every prompt past the threshold)."""
        threshold, length = self.rope_length_threshold, request.num_prompt_tokens
        if threshold is None or length <= threshold:
            return None
        salt = length.to_bytes(8, "little") if self.rope_length_exact else b"long"
        return hashlib.sha256(_ROOT_HASH + b"rope-length" + salt).digest()

    def _cache_full_blocks(self, request: Request, req_blocks: list[KVCacheBlock], num_tokens: int) -> None:
        num_full = min(num_tokens // self.block_size, len(req_blocks))
        start = self.num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        self._update_block_hashes(request, num_full)
        for i in range(start, num_full):
            self.block_pool.cache_full_block(req_blocks[i], request.block_hashes[i])
        self.num_cached_blocks[request.request_id] = num_full
