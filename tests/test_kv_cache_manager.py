"""KVCacheManager: allocation, chained-hash prefix caching, freeing, stats."""

from __future__ import annotations

import pytest

from shmvllm.core.kv_cache_manager import KVCacheManager, hash_block_tokens
from shmvllm.core.request import Request

BS = 4


def make_request(req_id: str, tokens: list[int]) -> Request:
    return Request(req_id, tokens)


def run_prefill(manager: KVCacheManager, request: Request) -> list[int]:
    """Schedules the whole request (with its hits) as the scheduler would; returns its block ids."""
    hits, num_hit = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - num_hit, hits, num_hit) is not None
    request.num_computed_tokens = request.num_tokens
    return manager.get_block_ids(request.request_id)


def test_allocate_slots_gives_enough_blocks_and_grows_by_block():
    manager = KVCacheManager(num_blocks=8, block_size=BS)
    req = make_request("a", list(range(6)))
    assert len(manager.allocate_slots(req, 6)) == 2
    req.num_computed_tokens = 6
    req.append_output_token_ids(100)
    assert manager.allocate_slots(req, 1) == []  # slot 7 still fits in block 2
    req.num_computed_tokens = 7
    req.append_output_token_ids(101)
    req.append_output_token_ids(102)
    assert len(manager.allocate_slots(req, 2)) == 1
    assert manager.get_num_free_blocks() == 5


def test_allocate_slots_returns_none_and_changes_nothing_when_full():
    manager = KVCacheManager(num_blocks=2, block_size=BS)
    req = make_request("a", list(range(9)))
    assert manager.allocate_slots(req, 9) is None
    assert manager.get_num_free_blocks() == 2 and manager.get_block_ids("a") == []
    with pytest.raises(ValueError, match="num_new_tokens"):
        manager.allocate_slots(req, 0)


def test_shared_prefix_hits_whole_blocks_and_shares_them():
    manager = KVCacheManager(num_blocks=10, block_size=BS)
    first = make_request("a", list(range(10)))
    ids_a = run_prefill(manager, first)
    second = make_request("b", list(range(9)) + [99, 98])
    hits, num_hit = manager.get_computed_blocks(second)
    assert num_hit == 8 and [b.block_id for b in hits] == ids_a[:2]
    ids_b = run_prefill(manager, second)
    assert ids_b[:2] == ids_a[:2] and ids_b[2] != ids_a[2]
    assert [manager.block_pool.blocks[i].ref_cnt for i in ids_a[:2]] == [2, 2]


def test_last_token_is_never_a_hit():
    manager = KVCacheManager(num_blocks=10, block_size=BS)
    run_prefill(manager, make_request("a", list(range(8))))
    _, num_hit = manager.get_computed_blocks(make_request("b", list(range(8))))
    assert num_hit == 4


def test_hash_is_chained_over_the_whole_prefix():
    manager = KVCacheManager(num_blocks=10, block_size=BS)
    run_prefill(manager, make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    _, num_hit = manager.get_computed_blocks(make_request("b", [0, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert num_hit == 0  # second block equal, first not: no hit
    assert hash_block_tokens(None, [5, 6, 7, 8]) != hash_block_tokens(hash_block_tokens(None, [1, 2, 3, 4]), [5, 6, 7, 8])


def test_freed_blocks_stay_cached_until_reused():
    manager = KVCacheManager(num_blocks=4, block_size=BS)
    first = make_request("a", list(range(8)) + [50])
    run_prefill(manager, first)
    manager.free(first)
    assert manager.get_num_free_blocks() == 4
    _, num_hit = manager.get_computed_blocks(make_request("b", list(range(8)) + [60]))
    assert num_hit == 8
    # An unrelated request takes every block: the cached prefix is evicted.
    run_prefill(manager, make_request("c", list(range(100, 116))))
    _, num_hit = manager.get_computed_blocks(make_request("d", list(range(8)) + [60]))
    assert num_hit == 0


def test_free_hits_count_against_free_blocks():
    manager = KVCacheManager(num_blocks=3, block_size=BS)
    first = make_request("a", list(range(8)) + [1])
    run_prefill(manager, first)
    manager.free(first)
    second = make_request("b", list(range(8)) + list(range(8)))
    hits, num_hit = manager.get_computed_blocks(second)
    assert num_hit == 8
    # 16 tokens need 4 blocks: 2 hits + 2 new, but only 3 exist.
    assert manager.allocate_slots(second, 8, hits, num_hit) is None
    assert manager.get_num_free_blocks() == 3 and all(b.ref_cnt == 0 for b in hits)


def test_output_tokens_are_cached_too_for_resumed_requests():
    manager = KVCacheManager(num_blocks=8, block_size=BS)
    req = make_request("a", [1, 2, 3])
    run_prefill(manager, req)
    for t in (4, 5, 6):
        req.append_output_token_ids(t)
        assert manager.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
    manager.free(req)
    req.num_computed_tokens = 0
    _, num_hit = manager.get_computed_blocks(req)
    assert num_hit == 4


def test_free_restores_the_pool_and_frees_tail_first():
    manager = KVCacheManager(num_blocks=6, block_size=BS)
    req = make_request("a", list(range(12)))
    ids = run_prefill(manager, req)
    manager.free(req)
    assert manager.get_num_free_blocks() == 6 and manager.get_block_ids("a") == []
    order = [b.block_id for b in manager.block_pool.free_block_queue]
    assert order[-3:] == ids[::-1]


def test_caching_disabled_never_hits():
    manager = KVCacheManager(num_blocks=6, block_size=BS, enable_caching=False)
    run_prefill(manager, make_request("a", list(range(9))))
    assert manager.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)


def test_prefix_cache_stats_count_tokens_and_reset():
    manager = KVCacheManager(num_blocks=6, block_size=BS)
    run_prefill(manager, make_request("a", list(range(9))))
    run_prefill(manager, make_request("b", list(range(9))))
    stats = manager.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 18, 8)
    assert manager.make_prefix_cache_stats().queries == 0


def test_reset_prefix_cache():
    manager = KVCacheManager(num_blocks=6, block_size=BS)
    req = make_request("a", list(range(9)))
    run_prefill(manager, req)
    assert manager.reset_prefix_cache() is False
    manager.free(req)
    assert manager.reset_prefix_cache() is True
    assert manager.get_computed_blocks(make_request("b", list(range(9))))[1] == 0
