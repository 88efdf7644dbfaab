"""BlockPool and its free queue: ref counts, LRU eviction order, lazy eviction of cached blocks."""

from __future__ import annotations

import pytest

from pagedllm.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from pagedllm.core.kv_cache_utils import hash_block_tokens


def _ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def _hash(tag: int) -> bytes:
    return hash_block_tokens(None, [tag, tag, tag, tag])


# ---- FreeKVCacheBlockQueue ------------------------------------------------
def test_free_queue_initial_order_and_count():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    assert q.num_free_blocks == 5
    assert _ids(q.get_all_free_blocks()) == [0, 1, 2, 3, 4]
    assert all(q.contains(b) for b in blocks)


def test_free_queue_popleft_is_fifo_and_raises_when_empty():
    blocks = [KVCacheBlock(i) for i in range(3)]
    q = FreeKVCacheBlockQueue(blocks)
    assert q.popleft() is blocks[0]
    assert q.popleft() is blocks[1]
    assert q.num_free_blocks == 1
    assert not q.contains(blocks[0])
    assert blocks[0].prev_free is None and blocks[0].next_free is None
    assert q.popleft() is blocks[2]
    assert q.num_free_blocks == 0
    assert q.get_all_free_blocks() == []
    with pytest.raises(ValueError):
        q.popleft()


def test_free_queue_remove_from_middle_and_append():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    q.remove(blocks[2])
    assert q.num_free_blocks == 4
    assert _ids(q.get_all_free_blocks()) == [0, 1, 3, 4]
    assert not q.contains(blocks[2])
    # Neighbours are relinked both ways.
    assert blocks[1].next_free is blocks[3] and blocks[3].prev_free is blocks[1]
    q.remove(blocks[0])  # head
    q.remove(blocks[4])  # tail
    assert _ids(q.get_all_free_blocks()) == [1, 3]
    q.append(blocks[2])
    q.append(blocks[0])
    assert _ids(q.get_all_free_blocks()) == [1, 3, 2, 0]
    assert q.num_free_blocks == 4
    assert _ids([q.popleft() for _ in range(4)]) == [1, 3, 2, 0]


def test_free_queue_remove_of_absent_block_raises():
    blocks = [KVCacheBlock(i) for i in range(2)]
    q = FreeKVCacheBlockQueue(blocks)
    q.remove(blocks[0])
    with pytest.raises(RuntimeError):
        q.remove(blocks[0])
    assert q.num_free_blocks == 1


# ---- BlockPool --------------------------------------------------------------
def test_pool_needs_at_least_one_block():
    with pytest.raises(ValueError):
        BlockPool(0)


def test_get_new_blocks_sets_ref_counts_and_takes_from_head():
    pool = BlockPool(6)
    got = pool.get_new_blocks(4)
    assert _ids(got) == [0, 1, 2, 3]
    assert all(b.ref_cnt == 1 for b in got)
    assert pool.get_num_free_blocks() == 2
    assert pool.get_new_blocks(0) == []
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)
    assert pool.get_num_free_blocks() == 2  # a failed request takes nothing


def test_free_order_is_eviction_order():
    pool = BlockPool(4)
    a, b, c, d = pool.get_new_blocks(4)
    pool.free_blocks([c, a, d, b])
    assert _ids(pool.free_block_queue.get_all_free_blocks()) == [2, 0, 3, 1]
    # Least recently freed is handed out first.
    assert _ids(pool.get_new_blocks(2)) == [2, 0]


def test_never_used_blocks_go_out_first_in_id_order_and_are_made_on_demand():
    """As if every block started in the LRU queue in id order: freed blocks (and the prefix-cache
    entries they hold) are taken only once the never-used ones are gone."""
    pool = BlockPool(6)
    assert pool.blocks == [] and pool.get_num_free_blocks() == 6
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [_hash(1)], 0, 1)
    pool.free_blocks([b, a])
    assert len(pool.blocks) == 2 and pool.get_num_free_blocks() == 6
    assert _ids(pool.get_new_blocks(4)) == [2, 3, 4, 5]
    assert pool.get_cached_block(_hash(1)) is a  # still cached: nothing needed its block yet
    assert _ids(pool.get_new_blocks(2)) == [1, 0] and pool.get_cached_block(_hash(1)) is None
    assert _ids(pool.blocks) == list(range(6)) and pool.get_num_free_blocks() == 0


def test_shared_block_freed_only_when_last_ref_dropped():
    pool = BlockPool(2)
    (blk,) = pool.get_new_blocks(1)
    pool.touch([blk])
    assert blk.ref_cnt == 2
    pool.free_blocks([blk])
    assert blk.ref_cnt == 1
    assert pool.get_num_free_blocks() == 1
    assert not pool.free_block_queue.contains(blk)
    pool.free_blocks([blk])
    assert blk.ref_cnt == 0
    assert pool.get_num_free_blocks() == 2
    assert pool.free_block_queue.contains(blk)


def test_over_freeing_raises():
    pool = BlockPool(2)
    (blk,) = pool.get_new_blocks(1)
    pool.free_blocks([blk])
    with pytest.raises(RuntimeError):
        pool.free_blocks([blk])


def test_cache_full_blocks_registers_range_only():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    hashes = [_hash(1), _hash(2), _hash(3)]
    pool.cache_full_blocks(blocks, hashes, 0, 2)
    assert pool.get_cached_block(hashes[0]) is blocks[0]
    assert pool.get_cached_block(hashes[1]) is blocks[1]
    assert pool.get_cached_block(hashes[2]) is None
    assert blocks[0].block_hash == hashes[0]
    assert blocks[2].block_hash is None
    pool.cache_full_blocks(blocks, hashes, 2, 3)
    assert pool.get_cached_block(hashes[2]) is blocks[2]


def test_cache_full_blocks_disabled_caching_is_noop():
    pool = BlockPool(2, enable_caching=False)
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(blocks, [_hash(1)], 0, 1)
    assert pool.get_cached_block(_hash(1)) is None
    assert blocks[0].block_hash is None


def test_duplicate_hash_keeps_first_block_and_duplicate_stays_uncached():
    pool = BlockPool(4)
    first, dup = pool.get_new_blocks(2)
    h = _hash(7)
    pool.cache_full_blocks([first], [h], 0, 1)
    pool.cache_full_blocks([dup], [h], 0, 1)
    assert pool.get_cached_block(h) is first
    assert dup.block_hash is None
    # Freeing and reusing the duplicate does not disturb the original's entry.
    pool.free_blocks([dup])
    assert _ids(pool.get_new_blocks(3))[-1] == dup.block_id
    assert pool.get_cached_block(h) is first
    assert first.block_hash == h


def test_lazy_eviction_freed_cached_block_can_be_revived_with_touch():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    h0, h1 = _hash(0), _hash(1)
    pool.cache_full_blocks(blocks, [h0, h1], 0, 2)
    pool.free_blocks(blocks)
    assert pool.get_num_free_blocks() == 4
    # Freed but still cached.
    assert pool.get_cached_block(h1) is blocks[1]
    assert blocks[1].block_hash == h1
    pool.touch([blocks[1]])
    assert blocks[1].ref_cnt == 1
    assert not pool.free_block_queue.contains(blocks[1])
    assert pool.get_num_free_blocks() == 3
    assert blocks[1] not in pool.free_block_queue.get_all_free_blocks()
    # The revived block keeps its cache entry.
    assert pool.get_cached_block(h1) is blocks[1]
    # The revived block is never handed out while in use.
    assert blocks[1] not in pool.get_new_blocks(3)


def test_handing_out_a_cached_free_block_drops_its_hash():
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    ha, hb = _hash(1), _hash(2)
    pool.cache_full_blocks([a, b], [ha, hb], 0, 2)
    pool.free_blocks([b, a])  # b is evicted first
    (reused,) = pool.get_new_blocks(1)
    assert reused is b
    assert b.block_hash is None
    assert pool.get_cached_block(hb) is None
    assert pool.get_cached_block(ha) is a  # the other one survives
    assert ha in pool.cached_block_hash_to_block and hb not in pool.cached_block_hash_to_block


def test_reset_prefix_cache_only_when_all_free():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(2)
    hashes = [_hash(1), _hash(2)]
    pool.cache_full_blocks(blocks, hashes, 0, 2)
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(hashes[0]) is blocks[0]  # untouched on refusal
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.cached_block_hash_to_block == {}
    assert all(b.block_hash is None for b in pool.blocks)
    assert pool.get_num_free_blocks() == 3


def test_get_usage():
    pool = BlockPool(4)
    assert pool.get_usage() == 0.0
    blocks = pool.get_new_blocks(3)
    assert pool.get_usage() == pytest.approx(0.75)
    pool.free_blocks(blocks[:1])
    assert pool.get_usage() == pytest.approx(0.5)
    pool.free_blocks(blocks[1:])
    assert pool.get_usage() == 0.0
