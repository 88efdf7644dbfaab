"""Chained block hashes: a block's hash stands for the whole prefix up to it."""

from __future__ import annotations

from pagedllm.core.kv_cache_utils import NONE_HASH, compute_block_hashes, hash_block_tokens


def test_same_tokens_same_parent_same_hash():
    parent = hash_block_tokens(None, [1, 2, 3, 4])
    assert hash_block_tokens(parent, [5, 6, 7, 8]) == hash_block_tokens(parent, [5, 6, 7, 8])
    assert isinstance(parent, bytes) and len(parent) == 32


def test_no_parent_equals_none_hash_parent():
    assert hash_block_tokens(None, [1, 2]) == hash_block_tokens(NONE_HASH, [1, 2])


def test_different_tokens_different_hash():
    assert hash_block_tokens(None, [1, 2, 3, 4]) != hash_block_tokens(None, [1, 2, 3, 5])
    assert hash_block_tokens(None, [1, 2, 3, 4]) != hash_block_tokens(None, [4, 3, 2, 1])


def test_different_parent_different_hash():
    p1 = hash_block_tokens(None, [1, 2, 3, 4])
    p2 = hash_block_tokens(None, [9, 2, 3, 4])
    assert hash_block_tokens(p1, [5, 6, 7, 8]) != hash_block_tokens(p2, [5, 6, 7, 8])


def test_extra_keys_change_hash():
    plain = hash_block_tokens(None, [1, 2, 3, 4])
    salted_a = hash_block_tokens(None, [1, 2, 3, 4], ("salt-a",))
    salted_b = hash_block_tokens(None, [1, 2, 3, 4], ("salt-b",))
    assert len({plain, salted_a, salted_b}) == 3
    assert salted_a == hash_block_tokens(None, [1, 2, 3, 4], ("salt-a",))


def test_compute_block_hashes_only_full_blocks():
    hashes: list[bytes] = []
    compute_block_hashes(list(range(11)), 4, hashes)
    assert len(hashes) == 2
    assert hashes[0] == hash_block_tokens(None, [0, 1, 2, 3])
    assert hashes[1] == hash_block_tokens(hashes[0], [4, 5, 6, 7])

    short: list[bytes] = []
    compute_block_hashes([1, 2, 3], 4, short)
    assert short == []


def test_compute_block_hashes_extends_incrementally():
    tokens = list(range(20))
    full: list[bytes] = []
    compute_block_hashes(tokens, 4, full)
    assert len(full) == 5

    inc: list[bytes] = []
    compute_block_hashes(tokens[:6], 4, inc)
    assert len(inc) == 1
    first = inc[0]
    compute_block_hashes(tokens[:8], 4, inc)
    assert len(inc) == 2
    assert inc[0] is first  # existing entries are kept, not recomputed
    compute_block_hashes(tokens, 4, inc)
    assert inc == full
    compute_block_hashes(tokens, 4, inc)  # nothing new: no change
    assert inc == full


def test_compute_block_hashes_does_not_rehash_existing_entries():
    # Extension trusts `existing`: a sentinel at position 0 becomes the parent of block 1.
    sentinel = b"\x01" * 32
    hashes = [sentinel]
    compute_block_hashes(list(range(8)), 4, hashes)
    assert hashes == [sentinel, hash_block_tokens(sentinel, [4, 5, 6, 7])]


def test_compute_block_hashes_extra_keys_first_block_only_but_chain_carries_them():
    tokens = list(range(12))
    plain: list[bytes] = []
    salted: list[bytes] = []
    compute_block_hashes(tokens, 4, plain)
    compute_block_hashes(tokens, 4, salted, ("s",))
    assert salted[0] == hash_block_tokens(None, [0, 1, 2, 3], ("s",))
    assert salted[1] == hash_block_tokens(salted[0], [4, 5, 6, 7])  # no extra key again
    assert all(p != s for p, s in zip(plain, salted))


def test_shared_prefix_shares_leading_hashes():
    a: list[bytes] = []
    b: list[bytes] = []
    compute_block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9], 4, a)
    compute_block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 0], 4, b)
    assert a[:2] == b[:2]
    assert a[2] != b[2]
    # A difference in the first block changes every later hash.
    c: list[bytes] = []
    compute_block_hashes([0, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9], 4, c)
    assert all(x != y for x, y in zip(a, c))
