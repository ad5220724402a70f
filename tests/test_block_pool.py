"""BlockPool: reference counts, the free list (O(1) removal, LRU order), the hash map."""

from __future__ import annotations

import pytest

from shmvllm.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock


def test_free_queue_removes_from_the_middle_and_keeps_order():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[2])
    assert [b.block_id for b in queue] == [0, 1, 3, 4] and len(queue) == 4
    queue.append(blocks[2])
    assert [b.block_id for b in queue] == [0, 1, 3, 4, 2]
    assert queue.popleft() is blocks[0]
    with pytest.raises(ValueError):
        queue.remove(blocks[0])
    with pytest.raises(ValueError):
        queue.append(blocks[1])


def test_popleft_on_empty_queue_raises():
    queue = FreeKVCacheBlockQueue([])
    with pytest.raises(ValueError, match="No free"):
        queue.popleft()


def test_get_and_free_blocks_count_references():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    assert (a.ref_cnt, b.ref_cnt) == (1, 1) and pool.get_num_free_blocks() == 2
    pool.touch([a])
    assert a.ref_cnt == 2
    pool.free_blocks([a, b])
    assert pool.get_num_free_blocks() == 3 and a.ref_cnt == 1
    pool.free_blocks([a])
    assert pool.get_num_free_blocks() == 4 and pool.get_usage() == 0.0
    with pytest.raises(ValueError, match="freed more often"):
        pool.free_blocks([a])
    with pytest.raises(ValueError, match="Cannot get 5 blocks"):
        pool.get_new_blocks(5)


def test_free_cached_block_stays_findable_until_evicted_lru_first():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(3)
    for i, block in enumerate(blocks):
        pool.cache_full_block(block, bytes([i]))
    pool.free_blocks([blocks[1], blocks[0], blocks[2]])  # freed order = eviction order
    assert all(pool.get_cached_block(bytes([i])) is blocks[i] for i in range(3))
    (evicted,) = pool.get_new_blocks(1)
    assert evicted is blocks[1] and evicted.block_hash is None
    assert pool.get_cached_block(bytes([1])) is None
    assert pool.get_cached_block(bytes([0])) is blocks[0]


def test_touch_takes_a_free_cached_block_out_of_the_free_list():
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, b"h")
    pool.free_blocks([a, b])
    pool.touch([pool.get_cached_block(b"h")])
    assert a.ref_cnt == 1 and pool.get_num_free_blocks() == 1
    assert pool.get_new_blocks(1) == [b]


def test_duplicate_hash_keeps_the_first_block():
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, b"same")
    pool.cache_full_block(b, b"same")
    assert pool.get_cached_block(b"same") is a and b.block_hash is None


def test_caching_disabled_caches_nothing():
    pool = BlockPool(1, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_block(a, b"h")
    assert pool.get_cached_block(b"h") is None


def test_reset_prefix_cache_only_when_nothing_is_used():
    pool = BlockPool(2)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_block(a, b"h")
    assert pool.reset_prefix_cache() is False
    pool.free_blocks([a])
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(b"h") is None and a.block_hash is None


def test_pool_needs_a_block():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)
