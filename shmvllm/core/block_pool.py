"""The pool of KV-cache blocks: reference counts, a free list, and the prefix-cache map.

A block with ref_cnt 0 is free. A free block may still hold a cached prefix (block_hash is
set); it stays findable by its hash until it is handed out again, which is when its hash is
evicted. The free list is ordered by eviction priority: blocks are taken from the head and
cached blocks returned to the tail, so the least recently freed cached block is evicted first
(LRU). A freed block that holds no cached prefix goes to the head: it is taken again first, so
that requests reuse memory already mapped and warm instead of first-touching fresh pages of the
cache (a fresh block's zeroing faulted in its pages: 0.2-21 ms a block on a 2-core Zen 4).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Optional[bytes] = None
        # Links of the free list; None when the block is not in it.
        self.prev_free: Optional[KVCacheBlock] = None
        self.next_free: Optional[KVCacheBlock] = None

    def __repr__(self) -> str:
        cached = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={cached})"


class FreeKVCacheBlockQueue:
    """A doubly-linked list of free blocks threaded through the blocks themselves, so that a
    block found by its hash can be taken out of the middle in O(1)."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinels: no None checks in the hot paths
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("No free KV-cache blocks left.")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free list.")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        self._insert(block, last)

    def appendleft(self, block: KVCacheBlock) -> None:
        self._insert(block, self._head)

    def _insert(self, block: KVCacheBlock, after: KVCacheBlock) -> None:
        if block.prev_free is not None:
            raise ValueError(f"{block} is already in the free list.")
        nxt = after.next_free
        assert nxt is not None
        after.next_free = block
        block.prev_free = after
        block.next_free = nxt
        nxt.prev_free = block
        self.num_free_blocks += 1

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail and block is not None:
            yield block
            block = block.next_free

    def __len__(self) -> int:
        return self.num_free_blocks


class BlockPool:
    """All KV-cache blocks of the engine, with the hash -> block map of cached full blocks."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}.")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[bytes, KVCacheBlock] = {}

    def get_num_free_blocks(self) -> int:
        """Free blocks, including those that still hold an evictable cached prefix."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        return 1.0 - self.get_num_free_blocks() / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> Optional[KVCacheBlock]:
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Takes num_blocks from the head of the free list (evicting their cached hashes)."""
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"Cannot get {num_blocks} blocks; only {self.get_num_free_blocks()} are free.")
        blocks = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Takes a reference on prefix-cache hits; a free one leaves the free list."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drops one reference from each block; cached ones reaching 0 go to the tail of the free
        list in the given order (so the first given is evicted first), uncached ones to its head
        (taken next, the last given first)."""
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"{block} freed more often than it was taken.")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_block_queue.appendleft(block)
                else:
                    self.free_block_queue.append(block)

    def cache_full_block(self, block: KVCacheBlock, block_hash: bytes) -> None:
        """Makes a full block findable by its hash. If another block already holds the same
        content, this one stays uncached (the map keeps one block per hash)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached_block_hash_to_block:
            return
        block.block_hash = block_hash
        self.cached_block_hash_to_block[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached hash; refused (False) while any block is in use, since a
        running request's blocks may be half-written."""
        if self.get_num_free_blocks() != self.num_blocks:
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.block_hash = None
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached_block_hash_to_block.get(block.block_hash) is block:
            del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None
