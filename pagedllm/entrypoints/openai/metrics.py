"""Prometheus metrics in vLLM's style, with a `pagedllm:` prefix.

Each app gets its own CollectorRegistry (tests start several apps in one process, and the
global registry refuses duplicate names). Request-level numbers (tokens, latencies,
finish reasons) are computed in the front from the RequestOutputs it streams; engine-level
numbers (queue sizes, KV usage, prefix cache, preemptions) are pulled from
`engine.get_engine_stats()` at scrape time, cumulative engine counters turned into deltas; they
carry an `engine` label (the data-parallel rank), as vLLM's do, so `sum by (model_name)` is the total.
With LoRA on, requests per adapter (all engine cores together) come from the same stats.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pagedllm.outputs import RequestOutput

if TYPE_CHECKING:
    from pagedllm.engine.protocol import EngineClient

logger = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0, 1920.0, 7680.0)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        r, lbl, engine_lbl = self.registry, ["model_name"], ["model_name", "engine"]

        def gauge(name: str, doc: str) -> Any:  # an engine-level number, one series per engine core
            return Gauge(name, doc, engine_lbl, registry=r)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, engine_lbl, registry=r)

        def front_counter(name: str, doc: str) -> Any:
            return Counter(name, doc, lbl, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, lbl, buckets=buckets, registry=r).labels(model_name)

        self.num_running = gauge("pagedllm:num_requests_running", "Requests in the running batch.")
        self.num_waiting = gauge("pagedllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("pagedllm:kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.")
        self.prefix_hit_rate = gauge("pagedllm:prefix_cache_hit_rate", "Prefix-cache hit rate over all queries.")
        self.prefix_queries = counter("pagedllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("pagedllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("pagedllm:num_preemptions", "Cumulative number of preemptions.")
        # Speculative decoding (zero when it is off).
        self.spec_drafts = counter("pagedllm:spec_decode_num_drafts", "Verification steps that had draft tokens.")
        self.spec_draft_tokens = counter("pagedllm:spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.spec_accepted = counter("pagedllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.spec_acceptance_rate = gauge("pagedllm:spec_decode_acceptance_rate",
                                          "Accepted over proposed draft tokens, since start.")
        self.spec_acceptance_length = gauge("pagedllm:spec_decode_mean_acceptance_length",
                                            "Tokens per verification step (accepted drafts + 1), since start.")
        self.prompt_tokens = front_counter("pagedllm:prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = front_counter("pagedllm:generation_tokens", "Generation tokens produced.")
        self._success = Counter("pagedllm:request_success", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=r)
        self.ttft = histogram("pagedllm:time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.tpot = histogram("pagedllm:time_per_output_token_seconds", "Time per output token after the first.",
                              _TPOT_BUCKETS)
        self.e2e = histogram("pagedllm:e2e_request_latency_seconds", "Arrival to finish.", _E2E_BUCKETS)
        self._last_engine: dict[tuple[str, str], float] = {}
        self._max_loras: int | None = None  # None: LoRA off, no LoRA metrics
        self._lora_names: Callable[[], Iterable[str]] = list
        self._lora_seen: set[str] = set()

    def enable_lora(self, max_loras: int, adapter_names: Callable[[], Iterable[str]]) -> None:
        """Export the LoRA gauges; `adapter_names` lists the served adapters, which read 0 until used."""
        r = self.registry
        self._max_loras = max_loras
        self._lora_names = adapter_names
        self.lora_info = Gauge("pagedllm:lora_requests_info", "Running and waiting LoRA adapters (comma-separated "
                               "names); the value is the time of the last scrape.",
                               ["max_lora", "running_lora_adapters", "waiting_lora_adapters"], registry=r)
        self.lora_running = Gauge("pagedllm:lora_requests_running", "Running requests per LoRA adapter.",
                                  ["model_name", "lora_name"], registry=r)
        self.lora_waiting = Gauge("pagedllm:lora_requests_waiting", "Waiting requests per LoRA adapter.",
                                  ["model_name", "lora_name"], registry=r)

    def track(self) -> RequestTracker:
        return RequestTracker(self)

    def count_pooled(self, num_prompt_tokens: int) -> None:
        """A pooling request (embedding, score, classification) that finished: its prompt tokens."""
        self.prompt_tokens.inc(num_prompt_tokens)
        self.count_finished("stop")

    def count_finished(self, reason: str) -> None:
        self._success.labels(self.model_name, reason).inc()

    async def refresh(self, engine: EngineClient) -> None:
        """Pull the engine's gauges and counters; a dead engine leaves the last values."""
        try:
            per_engine = await engine.get_engine_stats()
        except Exception:
            logger.debug("engine stats unavailable", exc_info=True)
            return
        for index, stats in enumerate(per_engine):
            self._refresh_engine(str(index), stats)
        if self._max_loras is not None:
            self._refresh_lora(per_engine)

    def _refresh_lora(self, per_engine: list[dict[str, float]]) -> None:
        counts: dict[str, dict[str, float]] = {"lora_running": {}, "lora_waiting": {}}
        for stats in per_engine:
            for key, value in stats.items():
                kind, sep, name = key.partition(":")
                if sep and kind in counts:
                    counts[kind][name] = counts[kind].get(name, 0.0) + float(value)
        # Every name once exported stays, reading 0 when it has no requests, rather than a stale count.
        self._lora_seen.update(self._lora_names(), counts["lora_running"], counts["lora_waiting"])
        for name in self._lora_seen:
            self.lora_running.labels(self.model_name, name).set(counts["lora_running"].get(name, 0.0))
            self.lora_waiting.labels(self.model_name, name).set(counts["lora_waiting"].get(name, 0.0))
        running = ",".join(sorted(n for n, v in counts["lora_running"].items() if v > 0))
        waiting = ",".join(sorted(n for n, v in counts["lora_waiting"].items() if v > 0))
        self.lora_info.clear()  # one series: the label values change with the adapters in use
        self.lora_info.labels(str(self._max_loras), running, waiting).set_to_current_time()

    def _refresh_engine(self, engine: str, stats: dict[str, float]) -> None:
        labels = (self.model_name, engine)
        for key, metric, default in (("num_running", self.num_running, 0), ("num_waiting", self.num_waiting, 0),
                                     ("kv_cache_usage", self.kv_usage, 0.0),
                                     ("prefix_cache_hit_rate", self.prefix_hit_rate, 0.0),
                                     ("spec_decode_acceptance_rate", self.spec_acceptance_rate, 0.0),
                                     ("spec_decode_mean_acceptance_length", self.spec_acceptance_length, 0.0)):
            metric.labels(*labels).set(stats.get(key, default))
        for key, metric in (("prefix_cache_queries", self.prefix_queries), ("prefix_cache_hits", self.prefix_hits),
                            ("num_preemptions", self.preemptions),
                            ("spec_decode_num_drafts", self.spec_drafts),
                            ("spec_decode_num_draft_tokens", self.spec_draft_tokens),
                            ("spec_decode_num_accepted_tokens", self.spec_accepted)):
            value = float(stats.get(key, 0))
            delta = value - self._last_engine.get((engine, key), 0.0)
            child = metric.labels(*labels)
            if delta > 0:  # a reset (engine restart, cache reset) must not go negative
                child.inc(delta)
            self._last_engine[engine, key] = value

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTracker:
    """Counts one request's tokens as its outputs stream in, and its latencies at the end."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self._prompt_counted = False
        self._generated = 0
        self._last: RequestOutput | None = None
        self._done = False

    def update(self, out: RequestOutput) -> None:
        m = self.metrics
        if not self._prompt_counted:
            m.prompt_tokens.inc(len(out.prompt_token_ids))
            self._prompt_counted = True
        generated = sum(len(c.token_ids) for c in out.outputs)
        if generated > self._generated:
            m.generation_tokens.inc(generated - self._generated)
            self._generated = generated
        self._last = out
        if out.finished:
            reason = out.outputs[0].finish_reason if out.outputs else None
            self._finish(reason or "stop")

    def aborted(self) -> None:
        self._finish("abort")

    def _finish(self, reason: str) -> None:
        if self._done:
            return
        self._done = True
        m = self.metrics
        m.count_finished(reason)
        out = self._last
        metrics = out.metrics if out is not None else None
        if metrics is None:
            return
        end = metrics.finished_time or time.time()
        if metrics.first_token_time is not None:
            m.ttft.observe(max(0.0, metrics.first_token_time - metrics.arrival_time))
            num = len(out.outputs[0].token_ids) if out.outputs else 0
            if num > 1 and metrics.last_token_time is not None:
                m.tpot.observe(max(0.0, metrics.last_token_time - metrics.first_token_time) / (num - 1))
        m.e2e.observe(max(0.0, end - metrics.arrival_time))
