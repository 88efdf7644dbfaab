"""The periodic stats line (rates over the interval, quiet when idle) and the request log lines."""

from __future__ import annotations

import asyncio

from fastapi.testclient import TestClient

from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.entrypoints.openai.metrics import ServerMetrics
from pagedllm.entrypoints.openai.request_logger import RequestLogger
from pagedllm.entrypoints.openai.server_config import ServerConfig
from pagedllm.entrypoints.openai.stat_logger import StatLogger
from pagedllm.sampling_params import SamplingParams


class _Engine:
    def __init__(self) -> None:
        self.stats = {"num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0, "num_preemptions": 1,
                      "prefix_cache_queries": 10, "prefix_cache_hits": 5}

    async def get_stats(self) -> dict:
        return dict(self.stats)


def _log(stat: StatLogger, capsys, seconds: float = 10.0) -> str:
    stat._time -= seconds  # as if the interval had passed
    asyncio.run(stat.log())
    return capsys.readouterr().err


def test_stats_line_has_the_intervals_rates(capsys):
    engine, metrics = _Engine(), ServerMetrics("m")
    stat = StatLogger(engine, metrics, 10.0)
    assert _log(stat, capsys) == ""  # the first call only takes the baseline
    metrics.count_prompt_tokens(100)
    metrics.count_generation_tokens(50)
    engine.stats.update(num_running=2, num_waiting=1, kv_cache_usage=0.25, num_preemptions=3,
                        prefix_cache_queries=30, prefix_cache_hits=13)
    line = _log(stat, capsys)
    for part in ("Avg prompt throughput: 10.0 tokens/s", "Avg generation throughput: 5.0 tokens/s",
                 "Running: 2 reqs, Waiting: 1 reqs", "Preempted: 2 reqs", "KV cache usage: 25.0%",
                 "Prefix cache hit rate: 40.0%"):
        assert part in line, line
    assert line.startswith("INFO") and "Spec decode" not in line
    engine.stats.update(num_running=0, num_waiting=0)
    assert "Avg prompt throughput: 0.0 tokens/s" in _log(stat, capsys)  # once more after the work ends
    assert _log(stat, capsys) == ""  # then idle: DEBUG only


def test_stats_line_with_speculative_decoding(capsys):
    engine, metrics = _Engine(), ServerMetrics("m")
    engine.stats.update(spec_decode_num_drafts=0, spec_decode_num_draft_tokens=0, spec_decode_num_accepted_tokens=0)
    stat = StatLogger(engine, metrics, 10.0)
    _log(stat, capsys)
    metrics.count_generation_tokens(8)
    engine.stats.update({"spec_decode_num_drafts": 2, "spec_decode_num_draft_tokens": 6,
                         "spec_decode_num_accepted_tokens": 3, "spec_decode_accepted_at:0": 2,
                         "spec_decode_accepted_at:1": 1})
    line = _log(stat, capsys)
    assert "Spec decode acceptance: 50.0% (3/6 draft tokens), mean acceptance length 2.50" in line, line
    assert line.rstrip().endswith("per-position acceptance rate: 1.00, 0.50"), line
    # The next interval: its own rates, and a position first seen in it counted from zero.
    metrics.count_generation_tokens(8)
    engine.stats.update({"spec_decode_num_drafts": 6, "spec_decode_num_draft_tokens": 18,
                         "spec_decode_num_accepted_tokens": 7, "spec_decode_accepted_at:0": 4,
                         "spec_decode_accepted_at:1": 2, "spec_decode_accepted_at:2": 1})
    assert _log(stat, capsys).rstrip().endswith("per-position acceptance rate: 0.50, 0.25, 0.25")


def test_request_log_line_is_cut_to_max_log_len(capsys):
    prompt = {"prompt": "Hello, my name is", "prompt_token_ids": [1, 2, 3, 4, 5, 6, 7, 8]}
    RequestLogger(5).log_inputs("cmpl-1", prompt, SamplingParams(max_tokens=3))
    line = capsys.readouterr().err
    assert "Received request cmpl-1: prompt length 8 tokens" in line
    assert "max_tokens=3" in line and "prompt: 'Hello'," in line and "prompt_token_ids: [1, 2, 3, 4, 5]," in line


def test_requests_are_logged_by_the_serving_layer(fake_engine, capsys):
    client = TestClient(build_app(fake_engine, ServerConfig(served_model_names=("fake-model",),
                                                            enable_log_requests=True, max_log_len=3)))
    assert client.post("/v1/completions", json={"prompt": "abcdef", "max_tokens": 2}).status_code == 200
    request_id = fake_engine.calls[0][2]
    line = next(x for x in capsys.readouterr().err.splitlines() if "Received request" in x)
    assert f"Received request {request_id}: prompt length" in line and "prompt: 'abc'," in line
    client = TestClient(build_app(fake_engine, ServerConfig(served_model_names=("fake-model",))))
    assert client.post("/v1/completions", json={"prompt": "abcdef", "max_tokens": 2}).status_code == 200
    assert "Received request" not in capsys.readouterr().err
