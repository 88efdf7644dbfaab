"""Per-request view of the block pool: which blocks a request holds, prefix-cache lookups."""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.core.block_pool import BlockPool, KVCacheBlock
from pagedllm.core.kv_cache_utils import compute_block_hashes
from pagedllm.core.request import Request


@dataclass(slots=True)
class PrefixCacheStats:
    requests: int = 0
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens served from the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are already registered in the hash map.
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def _update_block_hashes(self, request: Request) -> None:
        # A salt or an adapter keys the blocks apart: the same prompt under two adapters has other K/V.
        lora_id = request.lora_request.lora_int_id if request.lora_request is not None else None
        extra = (request.cache_salt, lora_id) if request.cache_salt or lora_id else None
        compute_block_hashes(request.all_token_ids, self.block_size, request.block_hashes, extra)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached full blocks matching the request's prefix.

        The last prompt token is never served from cache: its logits are needed to
        sample the first output token, so at least one token is always computed.
        """
        # Prompt logprobs need every prompt position's logits: nothing may be skipped.
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        self._update_block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def record_prefix_cache_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Counted once per admission, not per lookup: a request that waits at the head of
        the queue is looked up every step."""
        stats = self.prefix_cache_stats
        stats.requests += 1
        stats.queries += num_tokens
        stats.hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_new_computed_tokens: int = 0,
        num_lookahead_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens (plus lookahead slots a draft model
        writes its proposals into); None if the pool cannot.

        Nothing changes when it returns None, so the scheduler may preempt and retry.
        """
        if num_new_tokens <= 0:
            raise ValueError("num_new_tokens must be positive")
        new_computed_blocks = new_computed_blocks or []
        req_blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens + num_lookahead_tokens
        num_required = -(-num_total // self.block_size)
        num_new_blocks = max(0, num_required - len(req_blocks) - len(new_computed_blocks))
        # Cache hits sitting in the free queue stop being free once touched.
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.block_pool.get_num_free_blocks() - num_evictable_hits:
            return None

        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
            self.num_cached_blocks[request.request_id] = len(req_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks) if num_new_blocks else []
        req_blocks.extend(new_blocks)

        return new_blocks

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's blocks that are now full of computed tokens.

        Called after the forward pass, not at allocation: a block is findable only
        once its K/V really are in the cache, so a request preempted before its step
        ran can never leave a hash pointing at garbage. (With a step in flight, its
        last position may still be written by that step, which runs before any step
        that could find it.)
        """
        if not self.enable_caching:
            return
        self._update_block_hashes(request)
        num_full = min(num_computed_tokens, request.num_tokens) // self.block_size
        start = self.num_cached_blocks.get(request.request_id, 0)
        if num_full > start:
            blocks = self.req_to_blocks[request.request_id]
            self.block_pool.cache_full_blocks(blocks, request.block_hashes, start, num_full)
            self.num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Return the request's blocks, tail first, so that shared prefixes outlive
        the request-specific suffixes in the LRU order."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()
