"""Engine-level metrics carry an `engine` label, one series per data-parallel engine core, and
cumulative engine counters become per-engine deltas."""

from __future__ import annotations

import asyncio

from pagedllm.entrypoints.openai.metrics import ServerMetrics


class _TwoCores:
    def __init__(self) -> None:
        self.stats = [{"num_running": 2, "kv_cache_usage": 0.5, "num_preemptions": 3},
                      {"num_running": 1, "kv_cache_usage": 0.25, "num_preemptions": 0}]

    async def get_engine_stats(self) -> list[dict]:
        return [dict(s) for s in self.stats]


def test_series_per_engine_core():
    metrics, engine = ServerMetrics("m"), _TwoCores()
    asyncio.run(metrics.refresh(engine))
    engine.stats[1]["num_preemptions"] = 2
    asyncio.run(metrics.refresh(engine))
    text = metrics.render().decode()
    for line in ['pagedllm:num_requests_running{engine="0",model_name="m"} 2.0',
                 'pagedllm:num_requests_running{engine="1",model_name="m"} 1.0',
                 'pagedllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25',
                 'pagedllm:num_preemptions_total{engine="0",model_name="m"} 3.0',
                 'pagedllm:num_preemptions_total{engine="1",model_name="m"} 2.0']:
        assert line in text, line
