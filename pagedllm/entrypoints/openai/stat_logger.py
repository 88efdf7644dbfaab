"""The server's periodic stats line (`--log-stats-interval`, off with `--disable-log-stats`), as
vLLM's LoggingStatLogger: throughput over the interval, queue sizes, KV cache and prefix cache,
and speculative decoding when it is on. An idle server logs it at DEBUG only, after one INFO line
of zeros, so a quiet server stays quiet.

Throughput comes from the front's token counts (metrics.py); the rest from `engine.get_stats()`,
all engine cores together, its cumulative counters turned into rates over the interval.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from pagedllm.spec_decode.metrics import ACCEPTED_AT, accepted_per_pos

if TYPE_CHECKING:
    from pagedllm.engine.protocol import EngineClient
    from pagedllm.entrypoints.openai.metrics import ServerMetrics

logger = logging.getLogger(__name__)

_COUNTERS = ("num_preemptions", "prefix_cache_queries", "prefix_cache_hits", "spec_decode_num_drafts",
             "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


class StatLogger:
    def __init__(self, engine: EngineClient, metrics: ServerMetrics, interval: float) -> None:
        self.engine = engine
        self.metrics = metrics
        self.interval = interval
        self._time = time.monotonic()
        self._tokens = (metrics.total_prompt_tokens, metrics.total_generation_tokens)
        self._counters: dict[str, float] = {}
        self._was_busy = False

    async def run(self) -> None:
        """Log every `interval` seconds until cancelled."""
        await self.log()  # sets the baseline of the cumulative engine counters
        while True:
            await asyncio.sleep(self.interval)
            await self.log()

    async def log(self) -> None:
        try:
            stats = await self.engine.get_stats()
        except Exception:  # a dead engine: /health says so; nothing to log
            logger.debug("engine stats unavailable", exc_info=True)
            return
        now = time.monotonic()
        elapsed = max(now - self._time, 1e-9)
        prompt = self.metrics.total_prompt_tokens - self._tokens[0]
        generation = self.metrics.total_generation_tokens - self._tokens[1]
        # A draft position first seen in this interval counted from 0.
        keys = [*_COUNTERS, *(f"{ACCEPTED_AT}{pos}" for pos in range(len(accepted_per_pos(stats))))]
        delta = {k: float(stats.get(k, 0)) - self._counters.get(k, 0.0 if k.startswith(ACCEPTED_AT)
                                                                 else float(stats.get(k, 0))) for k in keys}
        first = not self._counters
        self._time, self._tokens = now, (self.metrics.total_prompt_tokens, self.metrics.total_generation_tokens)
        self._counters = {k: float(stats.get(k, 0)) for k in keys}
        if first:
            return
        busy = bool(prompt or generation or stats.get("num_running") or stats.get("num_waiting"))
        level = logging.INFO if busy or self._was_busy else logging.DEBUG
        self._was_busy = busy
        if not logger.isEnabledFor(level):
            return
        queries = delta["prefix_cache_queries"]
        line = (f"Avg prompt throughput: {prompt / elapsed:.1f} tokens/s, "
                f"Avg generation throughput: {generation / elapsed:.1f} tokens/s, "
                f"Running: {int(stats.get('num_running', 0))} reqs, Waiting: {int(stats.get('num_waiting', 0))} reqs, "
                f"Preempted: {int(delta['num_preemptions'])} reqs, "
                f"KV cache usage: {100 * float(stats.get('kv_cache_usage', 0)):.1f}%, "
                f"Prefix cache hit rate: {100 * delta['prefix_cache_hits'] / queries if queries else 0:.1f}%")
        if "spec_decode_num_drafts" in stats:
            proposed, drafts = delta["spec_decode_num_draft_tokens"], delta["spec_decode_num_drafts"]
            accepted = delta["spec_decode_num_accepted_tokens"]
            line += (f", Spec decode acceptance: {100 * accepted / proposed if proposed else 0:.1f}% "
                     f"({int(accepted)}/{int(proposed)} draft tokens), mean acceptance length "
                     f"{1 + accepted / drafts if drafts else 0:.2f}")
            per_pos = accepted_per_pos({k: v for k, v in delta.items() if k.startswith(ACCEPTED_AT)})
            if drafts and per_pos:
                line += ", per-position acceptance rate: " + ", ".join(f"{n / drafts:.2f}" for n in per_pos)
        logger.log(level, "%s", line)
