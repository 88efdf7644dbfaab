"""The pool of fixed-size KV blocks: free queue (LRU eviction), ref counts, hash map."""

from __future__ import annotations

from collections.abc import Iterable

from pagedllm.core.kv_cache_utils import BlockHash


class KVCacheBlock:
    """One block of `block_size` token slots in every layer's KV tensor."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        # Links of the doubly linked free list; None while the block is in use.
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hashed={self.block_hash is not None})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks, least recently freed at the head.

    A Python deque cannot drop an element from its middle in O(1), and a prefix
    cache hit must pull a freed-but-cached block out of the queue wherever it is.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinels: no None checks on the hot path
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise RuntimeError(f"{block} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def contains(self, block: KVCacheBlock) -> bool:
        return block.prev_free is not None

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        out, block = [], self._head.next_free
        while block is not self._tail:
            out.append(block)
            block = block.next_free
        return out


class BlockPool:
    """Owns every KVCacheBlock. Freed blocks keep their hash (lazy eviction) until
    they are handed out again, so a later request with the same prefix can revive them.

    A block's object is made the first time it is handed out: never-used blocks go out in id
    order before any freed one (they would head the LRU queue), so `blocks` holds ids
    0..len(blocks)-1 and the rest are free, unhashed and unreferenced. A cache of a few hundred
    thousand blocks then costs nothing to set up."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks: list[KVCacheBlock] = []  # the blocks handed out at least once, by id
        self.free_block_queue = FreeKVCacheBlockQueue([])  # blocks freed after use, LRU first
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def cache_full_blocks(
        self, blocks: list[KVCacheBlock], block_hashes: list[BlockHash], start: int, end: int
    ) -> None:
        """Register blocks[start:end] (now full and computed) under their hashes."""
        if not self.enable_caching:
            return
        for i in range(start, end):
            block = blocks[i]
            if block.block_hash is not None:
                continue  # already cached (a prefix-cache hit)
            block_hash = block_hashes[i]
            # A duplicate of an already cached block stays uncached; it is freed normally.
            if block_hash not in self.cached_block_hash_to_block:
                block.block_hash = block_hash
                self.cached_block_hash_to_block[block_hash] = block

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        num_free = self.get_num_free_blocks()
        if num_blocks > num_free:
            raise ValueError(f"cannot get {num_blocks} blocks, only {num_free} free")
        out = []
        for _ in range(num_blocks):
            if len(self.blocks) < self.num_blocks:  # a never-used block
                block = KVCacheBlock(len(self.blocks))
                self.blocks.append(block)
            else:
                block = self.free_block_queue.popleft()
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached_block_hash_to_block.get(block.block_hash) is block:
                del self.cached_block_hash_to_block[block.block_hash]
            block.block_hash = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cache-hit blocks, pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0 and self.free_block_queue.contains(block):
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference; blocks reaching zero join the queue in the given order,
        so the caller decides which are evicted first."""
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise RuntimeError(f"{block} freed more often than allocated")
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget all cached hashes; only possible while no block is in use."""
        if self.get_num_free_blocks() != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks + self.num_blocks - len(self.blocks)

    def get_usage(self) -> float:
        return 1.0 - self.get_num_free_blocks() / self.num_blocks
