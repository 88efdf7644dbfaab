"""Chained block hashes for prefix caching."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

BlockHash = bytes

NONE_HASH: BlockHash = b"\x00" * 32


def hash_block_tokens(
    parent_hash: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple | None = None
) -> BlockHash:
    """sha256 over (parent hash, this block's tokens, extra keys).

    Chaining makes a block's hash stand for the whole prefix up to it, so equal
    hashes mean equal KV contents. sha256 rather than Python's hash(): a collision
    would silently serve another prompt's KV.
    """
    h = hashlib.sha256(parent_hash or NONE_HASH)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


def compute_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    existing: list[BlockHash],
    extra_keys: tuple | None = None,
    mm_spans: Sequence[tuple[int, int, str]] = (),
) -> None:
    """Extend `existing` in place with hashes of every newly full block of `token_ids`.
    Extra keys (e.g. the cache salt) enter the first block only; the chain carries them on.
    `mm_spans` (offset, length, content hash) are a prompt's images: a block holding an image's
    placeholder tokens also hashes that image's identity, since its K/V depend on the picture
    and not on the placeholder token ids."""
    num_full = len(token_ids) // block_size
    for i in range(len(existing), num_full):
        parent = existing[-1] if existing else None
        start, end = i * block_size, (i + 1) * block_size
        keys = extra_keys if i == 0 else None
        images = tuple(ident for offset, length, ident in mm_spans if offset < end and offset + length > start)
        if images:
            keys = (keys or ()) + images
        existing.append(hash_block_tokens(parent, token_ids[start:end], keys))
