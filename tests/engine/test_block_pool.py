"""Block pool and KV-cache manager: exact block ids, eviction order, prefix hits."""

import pytest

from engine.block_pool import BlockPool
from engine.kv_cache_manager import KVCacheManager, hash_block
from engine.request import Request
from engine.sampling_params import SamplingParams


def _req(rid, tokens):
    return Request(rid, tokens, SamplingParams(max_tokens=4))


def test_allocate_in_order_uncached_reused_first_cached_to_back():
    """Blocks holding nothing are handed out again before never-used ones (their memory is
    already committed); blocks holding a cached prefix wait at the back for a hit."""
    pool = BlockPool(5)
    a = pool.allocate(3)
    assert [b.block_id for b in a] == [0, 1, 2]
    pool.cache(a[0], b"prefix")
    pool.free(list(reversed(a)))  # tail first
    # free queue now: 1, 2 (uncached, most recently freed first), 3, 4 (never used), 0 (cached)
    assert [b.block_id for b in pool.allocate(5)] == [1, 2, 3, 4, 0]
    pool.check_invariants()


def test_double_free_raises_and_overallocation_raises():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([b])
    with pytest.raises(RuntimeError):
        pool.allocate(3)


def test_cached_free_blocks_are_evicted_lru():
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks):
        pool.cache(b, bytes([i]))
    pool.free([blocks[1]])
    pool.free([blocks[0]])
    pool.free([blocks[2]])
    assert pool.num_cached_free_blocks == 3
    # A hit on block 0 takes it out of the free queue.
    hit = pool.lookup(bytes([0]))
    assert hit is blocks[0]
    pool.touch([hit])
    assert hit.ref_count == 1 and pool.num_free_blocks == 2
    # The least recently freed of the rest (block 1) is evicted first.
    (new,) = pool.allocate(1)
    assert new.block_id == 1 and pool.lookup(bytes([1])) is None
    assert pool.lookup(bytes([2])) is blocks[2]
    pool.check_invariants()


def test_chain_hash_depends_on_whole_prefix():
    h_a = hash_block(b"root", [1, 2])
    assert hash_block(h_a, [3, 4]) != hash_block(hash_block(b"root", [9, 9]), [3, 4])
    assert hash_block(b"root", [1, 2]) == h_a


def test_prefix_hit_shares_blocks_and_leaves_last_token():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = _req("a", list(range(10)))  # 2 full blocks + 2 tokens
    assert kv.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    kv.cache_computed_blocks(a)
    b = _req("b", list(range(8)) + [99, 98, 97])
    hits = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == kv.block_ids("a")[:2]
    assert kv.allocate_slots(b, 3, hits)
    assert kv.block_ids("b")[:2] == kv.block_ids("a")[:2]
    assert all(h.ref_count == 2 for h in hits)
    # A prompt entirely cached still leaves its last block to compute.
    c = _req("c", list(range(8)))
    assert len(kv.get_computed_blocks(c)) == 1
    kv.forget(a)
    kv.forget(b)
    assert kv.num_free_blocks == 8
    kv.pool.check_invariants()


def test_allocate_fails_without_side_effects():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    a = _req("a", list(range(12)))
    assert not kv.allocate_slots(a, 12)
    assert kv.num_free_blocks == 2 and kv.block_ids("a") == []
