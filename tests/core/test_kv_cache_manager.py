"""KVCacheManager: slot allocation, prefix-cache lookups, freeing order, stats."""

from __future__ import annotations

import pytest

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.sampling_params import SamplingParams

BS = 4


def make_req(req_id: str, tokens: list[int], cache_salt: str | None = None) -> Request:
    return Request(
        request_id=req_id,
        prompt_token_ids=list(tokens),
        sampling_params=SamplingParams(max_tokens=8, temperature=0),
        eos_token_ids=frozenset({0}),
        cache_salt=cache_salt,
    )


def compute(kv: KVCacheManager, req: Request, n: int) -> None:
    """What a step does for `n` scheduled tokens: the forward pass computes them, then the
    scheduler registers the blocks they filled."""
    req.num_computed_tokens += n
    kv.cache_blocks(req, req.num_computed_tokens)


def prefill(kv: KVCacheManager, req: Request) -> None:
    """Admit `req` the way the scheduler does: cache lookup, allocate, compute the rest."""
    blocks, num_computed = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_computed, blocks, num_computed) is not None
    kv.record_prefix_cache_lookup(req.num_tokens, num_computed)
    req.num_computed_tokens = num_computed
    compute(kv, req, req.num_tokens - num_computed)


def test_allocate_slots_across_block_boundaries():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    req = make_req("a", list(range(1, 11)))  # 10 tokens
    new = kv.allocate_slots(req, 3)
    assert len(new) == 1 and len(kv.get_block_ids("a")) == 1
    req.num_computed_tokens = 3
    assert kv.allocate_slots(req, 1) == []  # token 4 still fits in block 0
    req.num_computed_tokens = 4
    new = kv.allocate_slots(req, 1)  # token 5 opens block 1
    assert len(new) == 1 and len(kv.get_block_ids("a")) == 2
    req.num_computed_tokens = 5
    new = kv.allocate_slots(req, 5)  # up to 10 tokens: ceil(10/4) = 3 blocks
    assert len(new) == 1 and len(kv.get_block_ids("a")) == 3
    assert kv.get_num_free_blocks() == 5
    assert len(set(kv.get_block_ids("a"))) == 3
    with pytest.raises(ValueError):
        kv.allocate_slots(req, 0)


def test_allocate_slots_many_blocks_at_once():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    req = make_req("a", list(range(1, 18)))  # 17 tokens -> 5 blocks
    assert len(kv.allocate_slots(req, 17)) == 5
    assert kv.get_num_free_blocks() == 3


def test_allocate_slots_returns_none_without_side_effects():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_req("a", list(range(1, 11)))  # 3 blocks
    prefill(kv, a)
    a_blocks = kv.get_block_ids("a")
    cached = dict(kv.block_pool.cached_block_hash_to_block)
    b = make_req("b", list(range(100, 108)))  # needs 2 blocks, 1 free
    assert kv.allocate_slots(b, 8) is None
    assert kv.get_num_free_blocks() == 1
    assert kv.get_block_ids("b") == []
    assert kv.get_block_ids("a") == a_blocks
    assert kv.block_pool.cached_block_hash_to_block == cached
    assert all(blk.ref_cnt == 1 for blk in kv.req_to_blocks["a"])
    # It can still allocate what does fit.
    assert len(kv.allocate_slots(b, 4)) == 1


def test_allocate_slots_counts_evictable_cache_hits_as_not_free():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_req("a", list(range(1, 13)))  # 12 tokens, 3 full cached blocks
    prefill(kv, a)
    kv.free(a)
    assert kv.get_num_free_blocks() == 4
    # Shares a's first 2 blocks, then 3 blocks of its own: 2 hits (free) + 3 new > 4.
    b = make_req("b", list(range(1, 9)) + list(range(200, 212)))
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8 and len(hits) == 2
    assert kv.allocate_slots(b, b.num_tokens - num_hit, hits, num_hit) is None
    assert kv.get_num_free_blocks() == 4
    assert all(blk.ref_cnt == 0 and kv.block_pool.free_block_queue.contains(blk) for blk in hits)
    assert all(kv.block_pool.get_cached_block(blk.block_hash) is blk for blk in hits)
    # One block shorter fits: 2 touched hits + 2 new blocks.
    c = make_req("c", list(range(1, 9)) + list(range(200, 208)))
    hits, num_hit = kv.get_computed_blocks(c)
    new = kv.allocate_slots(c, c.num_tokens - num_hit, hits, num_hit)
    assert new is not None and len(new) == 2
    assert kv.get_block_ids("c")[:2] == [blk.block_id for blk in hits]
    assert kv.get_num_free_blocks() == 0


def test_get_computed_blocks_finds_shared_prefix_full_blocks_only():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = make_req("a", list(range(1, 11)))  # 10 tokens: 2 full blocks cached
    prefill(kv, a)
    b = make_req("b", list(range(1, 11)) + [50, 51, 52])
    blocks, num = kv.get_computed_blocks(b)
    assert num == 8  # a's partial third block is never shared
    assert [blk.block_id for blk in blocks] == kv.get_block_ids("a")[:2]
    # Diverging inside block 1: only block 0 matches.
    c = make_req("c", [1, 2, 3, 4, 5, 6, 99, 8, 9, 10])
    blocks, num = kv.get_computed_blocks(c)
    assert num == 4 and [blk.block_id for blk in blocks] == kv.get_block_ids("a")[:1]
    # Diverging in the first token: nothing.
    d = make_req("d", [0] + list(range(2, 11)))
    assert kv.get_computed_blocks(d) == ([], 0)


def test_shared_prefix_blocks_are_reference_counted():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = make_req("a", list(range(1, 11)))
    prefill(kv, a)
    b = make_req("b", list(range(1, 9)) + [70, 71, 72])
    prefill(kv, b)
    assert kv.get_block_ids("b")[:2] == kv.get_block_ids("a")[:2]
    shared = kv.req_to_blocks["a"][:2]
    assert all(blk.ref_cnt == 2 for blk in shared)
    assert kv.get_num_free_blocks() == 16 - 3 - 1  # b has one block of its own
    kv.free(a)
    assert all(blk.ref_cnt == 1 for blk in shared)
    assert kv.get_num_free_blocks() == 16 - 3
    kv.free(b)
    assert kv.get_num_free_blocks() == 16


def test_last_prompt_token_is_never_cached():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    prompt = list(range(1, 13))  # exactly 3 full blocks
    a = make_req("a", prompt)
    prefill(kv, a)
    assert len(kv.block_pool.cached_block_hash_to_block) == 3
    b = make_req("b", prompt)
    blocks, num = kv.get_computed_blocks(b)
    assert num == 8 and len(blocks) == 2  # N-1 blocks, the last token is recomputed
    # One token more and the third block is served too.
    c = make_req("c", prompt + [77])
    blocks, num = kv.get_computed_blocks(c)
    assert num == 12 and len(blocks) == 3


def test_single_block_prompt_gets_no_hit():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    prefill(kv, make_req("a", [1, 2, 3, 4]))
    assert kv.get_computed_blocks(make_req("b", [1, 2, 3, 4])) == ([], 0)


def test_cache_salt_separates_prefixes():
    kv = KVCacheManager(num_blocks=32, block_size=BS)
    prompt = list(range(1, 14))
    prefill(kv, make_req("plain", prompt))
    assert kv.get_computed_blocks(make_req("s1", prompt, cache_salt="alice")) == ([], 0)
    prefill(kv, make_req("s1", prompt, cache_salt="alice"))
    assert kv.get_computed_blocks(make_req("s2", prompt, cache_salt="bob")) == ([], 0)
    blocks, num = kv.get_computed_blocks(make_req("s3", prompt, cache_salt="alice"))
    assert num == 12
    assert [blk.block_id for blk in blocks] == kv.get_block_ids("s1")[:3]
    blocks, num = kv.get_computed_blocks(make_req("p2", prompt))
    assert [blk.block_id for blk in blocks] == kv.get_block_ids("plain")[:3]


def test_free_returns_all_blocks():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    reqs = [make_req("a", list(range(1, 10))), make_req("b", list(range(1, 7)) + [40, 41]),
            make_req("c", [9, 9, 9])]
    for r in reqs:
        prefill(kv, r)
    assert kv.get_num_free_blocks() < 10
    for r in reqs:
        kv.free(r)
    assert kv.get_num_free_blocks() == 10
    assert kv.usage == 0.0
    assert kv.req_to_blocks == {} and kv.num_cached_blocks == {}
    assert all(blk.ref_cnt == 0 for blk in kv.block_pool.blocks)
    kv.free(reqs[0])  # freeing an unknown/already freed request is a no-op
    assert kv.get_num_free_blocks() == 10


def test_prefix_cache_stats():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    assert kv.prefix_cache_stats.hit_rate == 0.0
    prefill(kv, make_req("a", list(range(1, 11))))  # 10 queried, 0 hit
    prefill(kv, make_req("b", list(range(1, 9)) + [60, 61]))  # 10 queried, 8 hit
    stats = kv.prefix_cache_stats
    assert stats.requests == 2
    assert stats.queries == 20
    assert stats.hits == 8
    assert stats.hit_rate == pytest.approx(0.4)


def test_caching_disabled_gets_no_hits():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=False)
    prefill(kv, make_req("a", list(range(1, 11))))
    assert kv.get_computed_blocks(make_req("b", list(range(1, 11)))) == ([], 0)
    assert kv.block_pool.cached_block_hash_to_block == {}


def test_blocks_freed_tail_first():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    a = make_req("a", list(range(1, 13)))  # 3 full blocks
    prefill(kv, a)
    first, second, last = kv.req_to_blocks["a"]
    kv.free(a)
    order = kv.block_pool.free_block_queue.get_all_free_blocks()
    assert order == [last, second, first]
    # The next allocation evicts the request's last block, the shared prefix survives.
    (reused,) = kv.block_pool.get_new_blocks(1)
    assert reused is last
    assert last.block_hash is None
    b = make_req("b", list(range(1, 13)) + [5])
    blocks, num = kv.get_computed_blocks(b)
    assert blocks == [first, second] and num == 8


def test_blocks_are_cached_only_once_computed():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_req("a", list(range(1, 15)))  # 14 tokens
    kv.allocate_slots(a, 6)
    # Allocated but not computed yet: nothing is findable.
    assert kv.block_pool.cached_block_hash_to_block == {}
    assert kv.get_computed_blocks(make_req("x", list(range(1, 15)))) == ([], 0)
    compute(kv, a, 6)  # tokens 0..5: only block 0 is full
    assert kv.num_cached_blocks["a"] == 1
    assert len(kv.block_pool.cached_block_hash_to_block) == 1
    kv.allocate_slots(a, 6)
    compute(kv, a, 6)
    assert kv.num_cached_blocks["a"] == 3
    assert len(kv.block_pool.cached_block_hash_to_block) == 3
    kv.allocate_slots(a, 2)
    compute(kv, a, 2)
    assert len(kv.block_pool.cached_block_hash_to_block) == 3  # block 3 is half full
    assert kv.req_to_blocks["a"][3].block_hash is None
    blocks, num = kv.get_computed_blocks(make_req("y", list(range(1, 15))))
    assert num == 12 and blocks == kv.req_to_blocks["a"][:3]


def test_freed_before_compute_leaves_no_cache_entry():
    """A request dropped (preempted/aborted) between allocation and its forward pass must not
    leave hashes pointing at blocks whose K/V were never written."""
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_req("a", list(range(1, 10)))
    kv.allocate_slots(a, 9)
    kv.free(a)
    assert kv.block_pool.cached_block_hash_to_block == {}
    assert kv.get_computed_blocks(make_req("b", list(range(1, 10)))) == ([], 0)


def sample(req_id: str, tokens: list[int]) -> Request:
    """One sample of an n > 1 request (group "p")."""
    req = make_req(req_id, tokens)
    req.group_id = "p"
    return req


@pytest.mark.parametrize("caching", [True, False])
def test_siblings_share_the_prompt_and_copy_its_partial_block(caching):
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=caching)
    first, second = sample("0_p", range(1, 11)), sample("1_p", range(1, 11))  # 9 shared positions: 2 full + 1
    kv.add_request(first)
    kv.add_request(second)
    assert not kv.waits_for_sibling(first)  # nobody computes it yet: the first one does
    assert kv.allocate_slots(first, 10) is not None
    assert kv.waits_for_sibling(second)  # scheduled, not computed yet
    first.num_computed_tokens = 10  # its step computes the prompt
    blocks, num_computed = kv.get_computed_blocks(second)
    assert num_computed == 9 and blocks == kv.req_to_blocks["0_p"][:3]
    new = kv.allocate_slots(second, 1, blocks, num_computed)
    assert kv.req_to_blocks["1_p"][:2] == blocks[:2] and kv.req_to_blocks["1_p"][2] is new[0]
    assert kv.take_block_copies() == [(blocks[2].block_id, new[0].block_id)] and kv.block_copies == []
    assert [b.ref_cnt for b in blocks] == [2, 2, 1]  # the group's hold went with the last waiting sibling
    for req in (first, second):
        req.status = RequestStatus.FINISHED_STOPPED
        kv.free(req)
    assert kv.groups == {} and kv.get_num_free_blocks() == 10


def test_a_finished_sample_leaves_its_prompt_to_waiting_siblings_until_blocks_run_short():
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_caching=False)
    first, second = sample("0_p", range(1, 10)), sample("1_p", range(1, 10))
    kv.add_request(first)
    kv.add_request(second)
    kv.allocate_slots(first, 9)
    first.num_computed_tokens = 9
    first.status = RequestStatus.FINISHED_STOPPED
    kv.free(first)  # it stopped at its first token; its sibling still waits
    assert kv.get_num_free_blocks() == 2 and kv.groups["p"].prompt_blocks is not None
    other = make_req("x", range(50, 62))
    assert kv.allocate_slots(other, 12) is not None  # 3 blocks: only with the hold dropped
    assert kv.groups["p"].prompt_blocks is None and kv.get_num_free_blocks() == 1
