"""Per-request view of the block pool: which blocks a request holds, prefix-cache lookups, and
the prompt blocks the samples of one n > 1 request share.

The samples of one n / best_of request (a group, `Request.group_id`) share their prompt's K/V:
once one of them has computed it, `get_computed_blocks` hands every sibling the blocks of
positions < prompt length - 1, the full ones shared (ref counts), the partial last one copied
(copy-on-write, `take_block_copies`). This needs no prefix caching, so the samples share one
prefill with caching off too. While siblings wait, the group holds references on those blocks,
so they outlive the sample that computed them (it may finish at its first token); the holds are
the first thing dropped when blocks run short.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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


def shares_prompt(request: Request) -> bool:
    """Prompt logprobs need every prompt position's logits, so such a sample computes its own."""
    return (
        request.group_id is not None
        and request.sampling_params.prompt_logprobs is None
        and request.num_prompt_tokens > 1
    )


@dataclass(slots=True, eq=False)
class PromptGroup:
    """The live samples of one n / best_of request, and the prompt blocks held for the waiting ones."""

    members: list[Request] = field(default_factory=list)
    prompt_blocks: list[KVCacheBlock] | None = None


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are already registered in the hash map.
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        self.groups: dict[str, PromptGroup] = {}  # group_id → the samples of one n > 1 request
        self.block_copies: list[tuple[int, int]] = []  # (src, dst) block ids, for the next step

    def add_request(self, request: Request) -> None:
        """Note a sample of an n > 1 request, so that its siblings can share its prompt."""
        if request.group_id is not None:
            self.groups.setdefault(request.group_id, PromptGroup()).members.append(request)

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def _update_block_hashes(self, request: Request) -> None:
        # A salt or an adapter keys the blocks apart: the same prompt under two adapters has other K/V.
        lora_id = request.lora_request.lora_int_id if request.lora_request is not None else None
        extra = (request.cache_salt, lora_id) if request.cache_salt or lora_id else None
        compute_block_hashes(request.all_token_ids, self.block_size, request.block_hashes, extra,
                             request.mm_spans)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached full blocks matching the request's prefix.

        The last prompt token is never served from cache: its logits are needed to
        sample the first output token, so at least one token is always computed.
        """
        if shares_prompt(request):
            prompt_blocks = self._prompt_source(self.groups[request.group_id])
            if prompt_blocks is not None:  # a sibling's prompt (its partial last block is copied)
                return list(prompt_blocks), request.num_prompt_tokens - 1
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
        writes its proposals into); None if the pool cannot, even with the prompt holds dropped.

        Computed blocks are shared; a last one only partly computed (a sibling's prompt) is
        copied into the first new block instead, since this request writes the rest of it.
        Nothing changes when it returns None, so the scheduler may preempt and retry.
        """
        if num_new_tokens <= 0:
            raise ValueError("num_new_tokens must be positive")
        computed = new_computed_blocks or []
        num_shared = min(len(computed), num_new_computed_tokens // self.block_size)
        shared, copied = computed[:num_shared], computed[num_shared:num_shared + 1]
        req_blocks = self.req_to_blocks.get(request.request_id, [])
        num_total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens + num_lookahead_tokens
        num_new_blocks = max(0, -(-num_total // self.block_size) - len(req_blocks) - len(shared))
        if not self._fits(num_new_blocks, shared + copied):
            return None

        self.req_to_blocks[request.request_id] = req_blocks
        # The copy's source is referenced until the new blocks are taken, so none of them is it.
        self.block_pool.touch(shared + copied)
        if shared:
            req_blocks.extend(shared)
            self.num_cached_blocks[request.request_id] = len(req_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks) if num_new_blocks else []
        req_blocks.extend(new_blocks)
        if copied:
            self.block_copies.append((copied[0].block_id, new_blocks[0].block_id))
            self.block_pool.free_blocks(copied)
        if request.group_id is not None:
            self._release_idle_group(request.group_id)
        return new_blocks

    def _fits(self, num_new_blocks: int, computed: list[KVCacheBlock]) -> bool:
        """Room for the new blocks, with the prompt holds dropped if that is what it takes."""
        return self._room_for(num_new_blocks, computed) or (
            self._release_prompt_holds() and self._room_for(num_new_blocks, computed))

    def _room_for(self, num_new_blocks: int, computed: list[KVCacheBlock]) -> bool:
        """Cache hits sitting in the free queue stop being free once touched."""
        num_evictable_hits = sum(1 for b in computed if b.ref_cnt == 0)
        return num_new_blocks <= self.block_pool.get_num_free_blocks() - num_evictable_hits

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
        the request-specific suffixes in the LRU order. A finished sample whose siblings still
        wait first hands its prompt's blocks to the group; a preempted one stays in its group."""
        group = self.groups.get(request.group_id) if request.group_id is not None else None
        if group is not None and request.is_finished():
            group.members.remove(request)
            if (group.prompt_blocks is None and request.num_computed_tokens >= request.num_prompt_tokens
                    and request.request_id in self.req_to_blocks and self._has_waiting_sharer(group)):
                self._hold_prompt_blocks(group, request)
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))
        if group is not None:
            self._release_idle_group(request.group_id)

    def take_block_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) copies the workers make before the next step's forward pass."""
        copies, self.block_copies = self.block_copies, []
        return copies

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    # ---- n > 1: the samples of one prompt ---------------------------------
    def waits_for_sibling(self, request: Request) -> bool:
        """A sibling is computing this sample's prompt and none has computed it yet: waiting for
        it beats computing a copy."""
        if not shares_prompt(request):
            return False
        group = self.groups[request.group_id]
        return self._prompt_source(group) is None and any(
            m.request_id in self.req_to_blocks and m.num_computed_tokens < m.num_prompt_tokens
            for m in group.members)

    def _has_waiting_sharer(self, group: PromptGroup) -> bool:
        return any(not m.is_finished() and m.request_id not in self.req_to_blocks and shares_prompt(m)
                   for m in group.members)

    def _prompt_source(self, group: PromptGroup) -> list[KVCacheBlock] | None:
        """The group's prompt blocks: held already, or taken now from a running sibling whose
        prompt a step has computed, or will have before any step scheduled from now on runs
        (workers run steps in order)."""
        if group.prompt_blocks is None:
            source = next((m for m in group.members if m.request_id in self.req_to_blocks
                           and m.num_computed_tokens >= m.num_prompt_tokens), None)
            if source is not None:
                self._hold_prompt_blocks(group, source)
        return group.prompt_blocks

    def _hold_prompt_blocks(self, group: PromptGroup, source: Request) -> None:
        """Reference the blocks with positions < prompt length - 1 of `source` for the group."""
        num_blocks = -(-(source.num_prompt_tokens - 1) // self.block_size)
        blocks = self.req_to_blocks[source.request_id][:num_blocks]
        self.block_pool.touch(blocks)
        group.prompt_blocks = blocks

    def _release_idle_group(self, group_id: str) -> None:
        group = self.groups.get(group_id)
        if group is None:
            return
        if group.prompt_blocks is not None and not self._has_waiting_sharer(group):
            self.block_pool.free_blocks(reversed(group.prompt_blocks))
            group.prompt_blocks = None
        if not group.members:
            del self.groups[group_id]

    def _release_prompt_holds(self) -> bool:
        """Blocks ran short: drop every group's prompt blocks (their waiting samples will share
        a running sibling's, or recompute). False if there were none."""
        held = [g for g in self.groups.values() if g.prompt_blocks is not None]
        for group in held:
            self.block_pool.free_blocks(reversed(group.prompt_blocks))
            group.prompt_blocks = None
        return bool(held)
