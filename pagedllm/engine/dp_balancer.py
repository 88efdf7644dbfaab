"""Data parallel: which of the N engine cores gets a request, and the cores' stats added up.

Each core has its own executor and KV cache. A new request goes to the core with the fewest
unfinished requests (its waiting + running, as the front end counts them: assigned and not yet
finished or aborted); ties go to the lowest index. The samples of one n > 1 request go to one
core together, since they share their prompt's blocks. Aborts go to the core that holds the request.
"""

from __future__ import annotations

from collections import defaultdict

# Stats that are ratios: recomputed from the summed counts, not summed.
_RATIOS = {"kv_cache_usage", "prefix_cache_hit_rate", "spec_decode_acceptance_rate",
           "spec_decode_mean_acceptance_length"}


class DPLoadBalancer:
    def __init__(self, num_engines: int) -> None:
        self.num_unfinished = [0] * num_engines
        self.engine_of: dict[str, int] = {}  # engine-core request id → its core

    def assign(self, core_request_ids: list[str]) -> int:
        """The least loaded core, now holding these requests (the samples of one request)."""
        engine = min(range(len(self.num_unfinished)), key=self.num_unfinished.__getitem__)
        for req_id in core_request_ids:
            self.engine_of[req_id] = engine
        self.num_unfinished[engine] += len(core_request_ids)
        return engine

    def finished(self, core_request_id: str) -> None:
        """The request ended (finished or aborted); a second call for it does nothing."""
        engine = self.engine_of.pop(core_request_id, None)
        if engine is not None:
            self.num_unfinished[engine] -= 1

    def by_engine(self, core_request_ids: list[str]) -> dict[int, list[str]]:
        groups: dict[int, list[str]] = defaultdict(list)
        for req_id in core_request_ids:
            engine = self.engine_of.get(req_id)
            if engine is not None:
                groups[engine].append(req_id)
        return groups


def merge_stats(per_engine: list[dict[str, float]]) -> dict[str, float]:
    """All cores as one: counts summed, ratios recomputed from the sums."""
    if len(per_engine) == 1:
        return dict(per_engine[0])
    total: dict[str, float] = defaultdict(float)
    for stats in per_engine:
        for key, value in stats.items():
            if key not in _RATIOS:
                total[key] += value
    blocks = total.get("num_total_blocks", 0)
    total["kv_cache_usage"] = 1 - total.get("num_free_blocks", 0) / blocks if blocks else 0.0
    queries = total.get("prefix_cache_queries", 0)
    total["prefix_cache_hit_rate"] = total.get("prefix_cache_hits", 0) / queries if queries else 0.0
    if "spec_decode_num_drafts" in total:
        drafts, proposed = total["spec_decode_num_drafts"], total["spec_decode_num_draft_tokens"]
        accepted = total["spec_decode_num_accepted_tokens"]
        total["spec_decode_acceptance_rate"] = accepted / proposed if proposed else 0.0
        total["spec_decode_mean_acceptance_length"] = 1 + accepted / drafts if drafts else 0.0
    return dict(total)
