"""Engine-level metrics carry an `engine` label, one series per data-parallel engine core, and
cumulative engine counters become per-engine deltas; request-level series come from each request's
timestamps; `--metrics-compat vllm` repeats every series under vLLM's names."""

from __future__ import annotations

import asyncio

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.engine.step_stats import IterationTokens
from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.entrypoints.openai.metrics import ServerMetrics
from pagedllm.entrypoints.openai.metrics_compat import vllm_names
from pagedllm.entrypoints.openai.server_config import ServerConfig
from pagedllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams


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


def _families(text: str) -> dict[str, list]:
    """Samples by family name, as a scraper parses them."""
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def _value(samples: list, name: str, **labels: str) -> float:
    return sum(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_iteration_tokens_per_engine_core():
    cores = [IterationTokens(), IterationTokens()]
    for n in (1, 5, 300):
        cores[0].observe(n)
    cores[1].observe(20000)
    engine = _TwoCores()
    engine.stats = [{**s, **c.as_dict()} for s, c in zip(engine.stats, cores)]
    metrics = ServerMetrics("m")
    asyncio.run(metrics.refresh(engine))
    samples = _families(metrics.render().decode())["pagedllm:iteration_tokens_total"]
    bucket = "pagedllm:iteration_tokens_total_bucket"
    assert _value(samples, bucket, engine="0", le="1.0") == 1 and _value(samples, bucket, engine="0", le="8.0") == 2
    assert _value(samples, bucket, engine="0", le="512.0") == 3
    assert _value(samples, bucket, engine="1", le="16384.0") == 0
    assert _value(samples, bucket, engine="1", le="+Inf") == 1
    assert _value(samples, "pagedllm:iteration_tokens_total_sum", engine="0") == 306
    assert _value(samples, "pagedllm:iteration_tokens_total_count", engine="1") == 1


def _output(finished: bool, tokens: list[list[int]] | dict[int, list[int]], times: RequestMetrics) -> RequestOutput:
    reason = "length" if finished else None
    by_index = tokens if isinstance(tokens, dict) else dict(enumerate(tokens))
    outs = [CompletionOutput(i, "", t, None, finish_reason=reason) for i, t in by_index.items()]
    return RequestOutput("r", None, [1, 2, 3, 4], outs, finished, times)


# Three steps of two samples, as each output kind carries them (DELTA: what is new, and only the
# samples that step touched).
STEPS = {
    RequestOutputKind.CUMULATIVE: [[[5], [6]], [[5, 7], [6, 8]], [[5, 7, 9], [6, 8]]],
    RequestOutputKind.DELTA: [[[5], [6]], [[7], [8]], {0: [9]}],
}


@pytest.mark.parametrize("kind", list(STEPS))
def test_request_timings_and_sizes(kind):
    """Queue, prefill, decode and inference times from the request's timestamps; sizes and params."""
    metrics = ServerMetrics("m", max_model_len=100)
    times = RequestMetrics(arrival_time=100.0, first_scheduled_time=101.0, first_token_time=103.0,
                           last_token_time=103.0)
    tracker = metrics.track(SamplingParams(n=2, max_tokens=3, output_kind=kind))
    first, second, third = STEPS[kind]
    tracker.update(_output(False, first, times))
    times.last_token_time = 104.0
    tracker.update(_output(False, second, times))
    times.last_token_time, times.finished_time = 107.0, 107.0
    tracker.update(_output(True, third, times))
    fam = _families(metrics.render().decode())
    expected = {"request_queue_time_seconds": 1, "request_prefill_time_seconds": 2, "request_decode_time_seconds": 4,
                "request_inference_time_seconds": 6, "e2e_request_latency_seconds": 7,
                "time_to_first_token_seconds": 3, "time_per_output_token_seconds": 2, "request_prompt_tokens": 4,
                "request_generation_tokens": 5, "request_max_num_generation_tokens": 3, "request_params_n": 2,
                "request_params_max_tokens": 3}
    for name, value in expected.items():
        samples = fam[f"pagedllm:{name}"]
        assert _value(samples, f"pagedllm:{name}_count") == 1, name
        assert _value(samples, f"pagedllm:{name}_sum") == value, name
    itl = fam["pagedllm:inter_token_latency_seconds"]  # one per step after the first: 1 s, then 3 s
    assert _value(itl, "pagedllm:inter_token_latency_seconds_count") == 2
    assert _value(itl, "pagedllm:inter_token_latency_seconds_sum") == 4
    assert _value(fam["pagedllm:request_prompt_tokens"], "pagedllm:request_prompt_tokens_bucket", le="5.0") == 1
    assert (metrics.total_prompt_tokens, metrics.total_generation_tokens) == (4, 5)


def _scrape(fake_engine, compat: str | None) -> dict[str, list]:
    app = build_app(fake_engine, ServerConfig(served_model_names=("fake-model",), metrics_compat=compat))
    client = TestClient(app)
    assert client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3, "n": 2}).status_code == 200
    assert client.post("/v1/completions", json={"prompt": [5, 6, 7, 8], "max_tokens": 2}).status_code == 200
    return _families(client.get("/metrics").text)


def test_new_series_after_requests(fake_engine):
    fam = _scrape(fake_engine, None)
    assert not any(name.startswith("vllm:") for name in fam)
    for name in ("request_prompt_tokens", "request_generation_tokens", "request_params_n", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds", "time_to_first_token_seconds"):
        assert _value(fam[f"pagedllm:{name}"], f"pagedllm:{name}_count") == 2, name
    assert _value(fam["pagedllm:request_prompt_tokens"], "pagedllm:request_prompt_tokens_sum") == 7
    assert _value(fam["pagedllm:request_generation_tokens"], "pagedllm:request_generation_tokens_sum") == 8
    assert _value(fam["pagedllm:request_params_n"], "pagedllm:request_params_n_sum") == 3
    # The scripted engine's steps: its prompt, then one token per sample.
    assert _value(fam["pagedllm:iteration_tokens_total"], "pagedllm:iteration_tokens_total_sum") == 3 + 2 * 2 + 4 + 1
    assert _value(fam["pagedllm:prefix_cache_queries"], "pagedllm:prefix_cache_queries_total") == 10
    (info,) = fam["pagedllm:cache_config_info"]
    assert info.value == 1 and info.labels["block_size"] == "16" and info.labels["num_gpu_blocks"] == "64"
    assert info.labels["enable_prefix_caching"] == "True" and info.labels["engine"] == "0"


def test_vllm_compat_repeats_every_series(fake_engine):
    fam = _scrape(fake_engine, "vllm")
    ours = {name for name in fam if name.startswith("pagedllm:") and not name.endswith("_created")}
    for name in ours:
        for alias in vllm_names(name):
            assert [(s.name.replace(alias, name, 1), s.labels, s.value) for s in fam[alias]] == [
                (s.name, s.labels, s.value) for s in fam[name]], alias
    samples = [s for name in fam if name.startswith("vllm:") for s in fam[name]]
    for name, labels in (("vllm:num_requests_running", {"model_name": "fake-model", "engine": "0"}),
                         ("vllm:kv_cache_usage_perc", {"engine": "0"}), ("vllm:gpu_cache_usage_perc", {"engine": "0"}),
                         ("vllm:prompt_tokens_total", {"model_name": "fake-model"}),
                         ("vllm:generation_tokens_total", {}), ("vllm:prefix_cache_hits_total", {}),
                         ("vllm:request_success_total", {"finished_reason": "length"}),
                         ("vllm:time_to_first_token_seconds_count", {}), ("vllm:e2e_request_latency_seconds_count", {}),
                         ("vllm:request_time_per_output_token_seconds_count", {}),
                         ("vllm:inter_token_latency_seconds_count", {}),
                         ("vllm:time_per_output_token_seconds_count", {}),
                         ("vllm:request_queue_time_seconds_count", {}), ("vllm:request_prefill_time_seconds_sum", {}),
                         ("vllm:request_decode_time_seconds_sum", {}), ("vllm:request_params_n_count", {}),
                         ("vllm:request_max_num_generation_tokens_sum", {}), ("vllm:iteration_tokens_total_count", {}),
                         ("vllm:cache_config_info", {"block_size": "16"}), ("vllm:num_preemptions_total", {})):
        assert any(s.name == name and labels.items() <= s.labels.items() for s in samples), name
    assert _value(samples, "vllm:request_success_total") == 2
    assert _value(samples, "vllm:request_prompt_tokens_count") == 2


def test_unknown_compat_is_refused():
    with pytest.raises(ValueError, match="metrics compat"):
        ServerMetrics("m", compat="tgi")
