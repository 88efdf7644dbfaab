"""Data-parallel load balancing and stats: the least loaded core gets a request, the samples of
one request stay together, aborts find their core, and the cores' stats add up."""

from __future__ import annotations

import pytest

from pagedllm.engine.dp_balancer import DPLoadBalancer, merge_stats
from pagedllm.spec_decode.metrics import SpecDecodingStats, accepted_per_pos


def test_least_loaded_core_and_samples_together():
    lb = DPLoadBalancer(2)
    assert lb.assign(["a"]) == 0
    assert lb.assign(["b"]) == 1
    assert lb.assign(["0_c", "1_c", "2_c"]) == 0  # tie: the lowest index; n = 3 on one core
    assert lb.num_unfinished == [4, 1]
    assert lb.assign(["d"]) == 1 and lb.assign(["e"]) == 1
    lb.finished("0_c")
    lb.finished("0_c")  # an abort and its final output: counted once
    assert lb.num_unfinished == [3, 3]
    assert lb.by_engine(["1_c", "d", "unknown"]) == {0: ["1_c"], 1: ["d"]}


def test_stats_add_up_and_ratios_are_recomputed():
    a = {"num_running": 2, "num_waiting": 1, "num_free_blocks": 6, "num_total_blocks": 10, "kv_cache_usage": 0.4,
         "prefix_cache_queries": 100, "prefix_cache_hits": 50, "prefix_cache_hit_rate": 0.5, "num_preemptions": 1}
    b = {"num_running": 1, "num_waiting": 0, "num_free_blocks": 10, "num_total_blocks": 10, "kv_cache_usage": 0.0,
         "prefix_cache_queries": 300, "prefix_cache_hits": 0, "prefix_cache_hit_rate": 0.0, "num_preemptions": 0}
    total = merge_stats([a, b])
    assert (total["num_running"], total["num_waiting"], total["num_preemptions"]) == (3, 1, 1)
    assert total["kv_cache_usage"] == pytest.approx(0.2) and total["prefix_cache_hit_rate"] == pytest.approx(0.125)
    assert merge_stats([a]) == a


def test_speculative_counts_add_up_per_draft_position():
    a, b = SpecDecodingStats(), SpecDecodingStats()
    a.observe(3, 2)
    a.observe(3, 0)
    b.observe(2, 1)
    b.observe(0, 0)  # no draft: not a verification step
    assert (a.accepted_per_pos, b.accepted_per_pos) == ([1, 1], [1])
    total = merge_stats([a.as_dict(), b.as_dict()])
    assert accepted_per_pos(total) == [2, 1] and total["spec_decode_num_accepted_tokens"] == 3
    assert total["spec_decode_num_drafts"] == 3 and total["spec_decode_mean_acceptance_length"] == pytest.approx(2)
