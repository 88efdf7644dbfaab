"""`pagedllm serve` on a tiny model: /metrics after a few requests, parsed as Prometheus does, with
and without `--metrics-compat vllm`; the periodic stats line and the request lines in its log."""

from __future__ import annotations

import re
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.entrypoints.openai.serve_utils import AUTH, MODEL, serve_tiny

REQUESTS = [("Hello, my name is", 5), ("The quick brown fox", 7), ("Once upon a time there was", 9)]
STATS_LINE = re.compile(r"Avg prompt throughput: ([\d.]+) tokens/s, Avg generation throughput: ([\d.]+) tokens/s, "
                        r"Running: \d+ reqs, Waiting: \d+ reqs, Preempted: \d+ reqs, KV cache usage: [\d.]+%, "
                        r"Prefix cache hit rate: [\d.]+%")
TIMINGS = ("request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds")
PER_REQUEST = ("request_prompt_tokens", "request_generation_tokens", "request_params_n", "request_params_max_tokens",
               "request_inference_time_seconds", "time_to_first_token_seconds", "e2e_request_latency_seconds",
               *TIMINGS)


def _server(tiny_llama, tmp_path_factory, *args: str):
    logs: list = []
    for url in serve_tiny(tiny_llama, tmp_path_factory, extra_args=args, logs=logs):
        yield url, logs[0]


@pytest.fixture(scope="module")
def compat_server(tiny_llama, tmp_path_factory):
    yield from _server(tiny_llama, tmp_path_factory, "--metrics-compat", "vllm", "--log-stats-interval", "1",
                       "--enable-log-requests", "--max-log-len", "5")


@pytest.fixture(scope="module")
def plain_server(tiny_llama, tmp_path_factory):
    yield from _server(tiny_llama, tmp_path_factory, "--log-stats-interval", "1", "--disable-log-stats",
                       "--no-enable-prefix-caching")


def _send(url: str) -> tuple[int, int]:
    """The requests, one at a time; (prompt tokens, generated tokens) in all."""
    prompt = generated = 0
    for text, max_tokens in REQUESTS:
        body = {"model": MODEL, "prompt": text, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        usage = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=60).json()["usage"]
        assert usage["completion_tokens"] == max_tokens
        prompt, generated = prompt + usage["prompt_tokens"], generated + max_tokens
    return prompt, generated


def _scrape(url: str) -> dict[str, float]:
    """Every sample, keyed by name and its labels but `engine`, `le` and `model_name`; values added up."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", headers=AUTH).text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("engine", "model_name"))
            key = f"{s.name}{{{labels}}}" if labels else s.name
            values[key] = values.get(key, 0.0) + s.value
    return values


def _check_request_series(m: dict[str, float], prefix: str, prompt: int, generated: int) -> None:
    n = len(REQUESTS)
    assert m[f'{prefix}request_success_total{{finished_reason=length}}'] == n
    for name in PER_REQUEST:
        assert m[f"{prefix}{name}_count"] == n, name
    assert m[f"{prefix}request_prompt_tokens_sum"] == m[f"{prefix}prompt_tokens_total"] == prompt
    assert m[f"{prefix}request_generation_tokens_sum"] == m[f"{prefix}generation_tokens_total"] == generated
    assert m[f"{prefix}request_params_n_sum"] == n
    assert m[f"{prefix}request_params_max_tokens_sum"] == generated
    timings = [m[f"{prefix}{name}_sum"] for name in TIMINGS]
    assert all(t >= 0 for t in timings) and timings[1] > 0 and timings[2] > 0
    assert sum(timings) <= m[f"{prefix}e2e_request_latency_seconds_sum"] + 1e-3
    itl_count, itl_sum = m[f"{prefix}inter_token_latency_seconds_count"], m[f"{prefix}inter_token_latency_seconds_sum"]
    assert 0 < itl_count <= generated - n and 0 < itl_sum <= timings[2] + 1e-6
    assert m[f"{prefix}iteration_tokens_total_count"] >= max(t for _, t in REQUESTS)
    assert m[f"{prefix}num_requests_running"] == m[f"{prefix}num_requests_waiting"] == 0


def test_vllm_names_and_the_new_series(compat_server):
    url, log = compat_server
    prompt, generated = _send(url)
    m = _scrape(url)
    _check_request_series(m, "vllm:", prompt, generated)
    _check_request_series(m, "pagedllm:", prompt, generated)
    # Tokens per step: every prompt token not found in the prefix cache, and every generated token
    # but each request's last (sampled, never fed back).
    hits, queries = m["vllm:prefix_cache_hits_total"], m["vllm:prefix_cache_queries_total"]
    assert queries == prompt and 0 <= hits <= queries
    assert prompt + generated - hits - len(REQUESTS) <= m["vllm:iteration_tokens_total_sum"] <= prompt + generated
    assert m["vllm:kv_cache_usage_perc"] == m["vllm:gpu_cache_usage_perc"] == 0
    assert m["vllm:request_time_per_output_token_seconds_count"] == len(REQUESTS)
    info = next(k for k in m if k.startswith("vllm:cache_config_info{"))
    assert "block_size=16" in info and "enable_prefix_caching=True" in info and m[info] == 1
    assert int(re.search(r"num_gpu_blocks=(\d+)", info).group(1)) > 0

    # The stats line of the interval that saw the requests, and one request line each.
    deadline = time.time() + 10
    while not any(float(g[0]) > 0 and float(g[1]) > 0 for g in STATS_LINE.findall(log.read_text())):
        assert time.time() < deadline, log.read_text()
        time.sleep(0.2)
    requests = [line for line in log.read_text().splitlines() if "Received request" in line]
    assert len(requests) == len(REQUESTS)
    assert re.search(r"Received request cmpl-\S+: prompt length \d+ tokens, params: SamplingParams\(n=1, .*"
                     r"max_tokens=5, .*\), prompt: 'Hello', prompt_token_ids: \[(\d+, ){4}\d+\]", requests[0])


def test_default_names_and_quiet_log(plain_server):
    url, log = plain_server
    prompt, generated = _send(url)
    m = _scrape(url)
    assert not any(k.startswith("vllm:") for k in m)
    _check_request_series(m, "pagedllm:", prompt, generated)
    # No prefix cache: each request computes its whole prompt, then each generated token but the last.
    assert m["pagedllm:iteration_tokens_total_sum"] == prompt + generated - len(REQUESTS)
    time.sleep(2.5)  # more than two stats intervals
    text = log.read_text()
    assert "Avg prompt throughput" not in text and "Received request" not in text
