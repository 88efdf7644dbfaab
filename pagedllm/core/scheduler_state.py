"""A plain-data snapshot of one scheduler for the live dashboard: the KV block map (who holds
which block) and the queues with each request's progress. It is taken between steps, about once
a second, so it is built in one pass over the pool and the queues and stays msgspec-encodable."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from pagedllm.core.block_pool import BlockPool
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus

# Cells of the block map sent at most: a page draws one cell per block, and past this many the
# picture stops being readable anyway. `num_blocks` still says the pool's real size.
MAX_BLOCK_CELLS = 16384

# One character per block: free and never cached, in use (ref count > 0), cached and evictable
# (free, but still holding a prefix-cache entry a later request may revive).
FREE, USED, CACHED = "f", "u", "c"


def block_states(pool: BlockPool, max_cells: int = MAX_BLOCK_CELLS) -> str:
    used = "".join(USED if b.ref_cnt > 0 else CACHED if b.block_hash is not None else FREE
                   for b in pool.blocks[:max_cells])
    return used + FREE * (min(pool.num_blocks, max_cells) - len(used))  # never-used blocks


def queue_of(request: Request, running: bool) -> str:
    """running / waiting / preempted (waiting again after losing its blocks)."""
    if running:
        return "running"
    if request.status == RequestStatus.PREEMPTED or request.num_preemptions > 0:
        return "preempted"
    return "waiting"


def request_state(request: Request, queue: str, block_ids: list[int], max_cells: int) -> dict[str, Any]:
    lora = request.lora_request
    return {
        "id": request.request_id,
        "queue": queue,
        "status": request.status.name.lower(),
        "prompt_tokens": request.num_prompt_tokens,
        "computed_tokens": request.num_computed_tokens,
        "prompt_computed": min(request.num_computed_tokens, request.num_prompt_tokens),
        "output_tokens": request.num_output_tokens,
        "max_tokens": request.sampling_params.max_tokens if request.sampling_params is not None else None,
        "cached_tokens": max(request.num_cached_tokens, 0),
        "num_preemptions": request.num_preemptions,
        "priority": request.priority,
        "arrival_time": request.arrival_time,
        "first_token_time": request.first_token_time,
        "lora": lora.lora_name if lora is not None else None,
        "num_blocks": len(block_ids),
        # Only the blocks drawn on the map; num_blocks counts them all.
        "block_ids": [b for b in block_ids if b < max_cells],
    }


def scheduler_snapshot(kv: KVCacheManager, running: Iterable[Request], waiting: Iterable[Request],
                       max_cells: int = MAX_BLOCK_CELLS) -> dict[str, Any]:
    """The block map (`block_states`, one character per block, then each request's `block_ids`:
    a block shared by a prefix-cache hit or by the samples of one request appears under each
    holder) and the requests, running first, then the waiting queue in its order."""
    pool = kv.block_pool
    requests = [request_state(r, "running", kv.get_block_ids(r.request_id), max_cells) for r in running]
    requests += [request_state(r, queue_of(r, False), kv.get_block_ids(r.request_id), max_cells) for r in waiting]
    num_cells = min(pool.num_blocks, max_cells)
    return {
        "timestamp": time.time(),
        "block_size": kv.block_size,
        "num_blocks": pool.num_blocks,
        "num_free_blocks": pool.get_num_free_blocks(),
        "num_cached_blocks": len(pool.cached_block_hash_to_block),
        "block_states": block_states(pool, num_cells),
        "blocks_truncated": pool.num_blocks > num_cells,
        "requests": requests,
    }
