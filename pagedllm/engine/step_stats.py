"""Tokens per engine step, kept by the engine core as a cumulative histogram.

The front reads it with the rest of `get_stats()` (pulled at scrape time, like every engine
counter), so no step is lost between scrapes and each data-parallel core keeps its own.
"""

from __future__ import annotations

from bisect import bisect_left

# vLLM's buckets for vllm:iteration_tokens_total.
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
BUCKET_KEY = "iteration_tokens_bucket:"  # + upper bound: steps with at most that many tokens (cumulative)
SUM_KEY = "iteration_tokens_sum"
COUNT_KEY = "iteration_tokens_count"


class IterationTokens:
    """Counts steps by their scheduled tokens (prompt chunks, decode tokens and drafts)."""

    def __init__(self) -> None:
        self._counts = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)  # per bucket, not cumulative; last: +Inf
        self._sum = 0

    def observe(self, num_tokens: int) -> None:
        self._counts[bisect_left(ITERATION_TOKEN_BUCKETS, num_tokens)] += 1
        self._sum += num_tokens

    def as_dict(self) -> dict[str, float]:
        stats: dict[str, float] = {SUM_KEY: self._sum, COUNT_KEY: sum(self._counts)}
        running = 0
        for bound, count in zip(ITERATION_TOKEN_BUCKETS, self._counts):
            running += count
            stats[f"{BUCKET_KEY}{bound}"] = running
        return stats


def histogram_of(stats: dict[str, float]) -> tuple[list[tuple[str, float]], float] | None:
    """(cumulative buckets with "+Inf" last, sum) from a core's stats; None if it reports none."""
    if COUNT_KEY not in stats:
        return None
    buckets = [(str(float(b)), float(stats.get(f"{BUCKET_KEY}{b}", 0))) for b in ITERATION_TOKEN_BUCKETS]
    buckets.append(("+Inf", float(stats[COUNT_KEY])))
    return buckets, float(stats.get(SUM_KEY, 0))
