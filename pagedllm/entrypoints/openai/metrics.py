"""Prometheus metrics in vLLM's style, with a `pagedllm:` prefix (and, with `--metrics-compat
vllm`, every series again under vLLM's names: metrics_compat.py).

Each app gets its own CollectorRegistry (tests start several apps in one process, and the
global registry refuses duplicate names). Request-level numbers (tokens, latencies, sizes,
finish reasons) are computed in the front from the RequestOutputs it streams (`RequestTracker`);
engine-level numbers (queue sizes, KV usage, prefix cache, preemptions, tokens per step) are pulled
from `engine.get_engine_stats()` at scrape time, cumulative engine counters turned into deltas; they
carry an `engine` label (the data-parallel rank), as vLLM's do, so `sum by (model_name)` is the total.
With LoRA on, requests per adapter (all engine cores together) come from the same stats.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import HistogramMetricFamily, Metric

from pagedllm.engine.step_stats import histogram_of
from pagedllm.entrypoints.openai.metrics_compat import check_compat, with_compat_names
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.spec_decode.metrics import ACCEPTED_AT, accepted_per_pos

if TYPE_CHECKING:
    from pagedllm.config import CacheConfig
    from pagedllm.engine.protocol import EngineClient

logger = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0, 1920.0, 7680.0)
_N_BUCKETS = (1, 2, 5, 10, 20)


def _buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(buckets) or (1,)
            buckets.append(m * scale)
        scale *= 10


class ServerMetrics:
    def __init__(self, model_name: str, max_model_len: int = 0, compat: str | None = None,
                 cache_config: CacheConfig | None = None) -> None:
        """`compat`: None, or "vllm" to expose every series under vLLM's names too. `cache_config`:
        the labels of cache_config_info (None: no such series)."""
        check_compat(compat)
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.compat = compat
        self.cache_config = cache_config
        # Running totals for the periodic stats line (stat_logger.py).
        self.total_prompt_tokens = 0
        self.total_generation_tokens = 0
        r, lbl, engine_lbl = self.registry, ["model_name"], ["model_name", "engine"]
        token_buckets = _buckets_1_2_5(max_model_len or 1 << 20)

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
        self.spec_accepted_per_pos = Counter("pagedllm:spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted, by their position in the draft (0: first).",
                                             ["model_name", "engine", "position"], registry=r)
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
        self.itl = histogram("pagedllm:inter_token_latency_seconds",
                             "Time between engine steps that brought a request tokens.", _TPOT_BUCKETS)
        self.queue_time = histogram("pagedllm:request_queue_time_seconds", "Arrival to first scheduled.",
                                    _E2E_BUCKETS)
        self.prefill_time = histogram("pagedllm:request_prefill_time_seconds", "First scheduled to first token.",
                                      _E2E_BUCKETS)
        self.decode_time = histogram("pagedllm:request_decode_time_seconds", "First token to last token.",
                                     _E2E_BUCKETS)
        self.inference_time = histogram("pagedllm:request_inference_time_seconds",
                                        "First scheduled to last token.", _E2E_BUCKETS)
        self.request_prompt_tokens = histogram("pagedllm:request_prompt_tokens", "Prompt tokens per finished "
                                               "request.", token_buckets)
        self.request_generation_tokens = histogram("pagedllm:request_generation_tokens", "Generated tokens per "
                                                   "finished request, all its samples.", token_buckets)
        self.request_max_generation_tokens = histogram("pagedllm:request_max_num_generation_tokens",
                                                       "The longest sample of a finished request.", token_buckets)
        self.request_params_n = histogram("pagedllm:request_params_n", "The n parameter of finished requests.",
                                          _N_BUCKETS)
        self.request_params_max_tokens = histogram("pagedllm:request_params_max_tokens",
                                                   "The max_tokens parameter of finished requests.", token_buckets)
        self.cache_info: Any = None  # its labels are known once the engine cores sized their caches
        self._cache_info_engines: set[str] = set()
        self._engine_stats: list[dict[str, float]] = []
        r.register(_IterationTokens(self))
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

    def track(self, params: SamplingParams | None = None) -> RequestTracker:
        return RequestTracker(self, params)

    def count_prompt_tokens(self, num: int) -> None:
        self.prompt_tokens.inc(num)
        self.total_prompt_tokens += num

    def count_generation_tokens(self, num: int) -> None:
        self.generation_tokens.inc(num)
        self.total_generation_tokens += num

    def count_pooled(self, num_prompt_tokens: int) -> None:
        """A pooling request (embedding, score, classification) that finished: its prompt tokens."""
        self.count_prompt_tokens(num_prompt_tokens)
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
        self._engine_stats = per_engine
        for index, stats in enumerate(per_engine):
            self._refresh_engine(str(index), stats)
            self._set_cache_info(str(index), stats)
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
        counters = [(key, metric.labels(*labels)) for key, metric in (
            ("prefix_cache_queries", self.prefix_queries), ("prefix_cache_hits", self.prefix_hits),
            ("num_preemptions", self.preemptions), ("spec_decode_num_drafts", self.spec_drafts),
            ("spec_decode_num_draft_tokens", self.spec_draft_tokens),
            ("spec_decode_num_accepted_tokens", self.spec_accepted))]
        counters += [(f"{ACCEPTED_AT}{pos}", self.spec_accepted_per_pos.labels(*labels, str(pos)))
                     for pos in range(len(accepted_per_pos(stats)))]
        for key, child in counters:
            value = float(stats.get(key, 0))
            delta = value - self._last_engine.get((engine, key), 0.0)
            if delta > 0:  # a reset (engine restart, cache reset) must not go negative
                child.inc(delta)
            self._last_engine[engine, key] = value

    def _set_cache_info(self, engine: str, stats: dict[str, float]) -> None:
        """vLLM's cache_config_info: a gauge at 1 whose labels describe an engine core's KV cache."""
        cache = self.cache_config
        if cache is None or engine in self._cache_info_engines or "num_total_blocks" not in stats:
            return
        info = {
            "block_size": cache.block_size,
            "cache_dtype": cache.cache_dtype,
            "enable_prefix_caching": cache.enable_prefix_caching,
            "gpu_memory_utilization": cache.gpu_memory_utilization,
            "kv_cache_memory_bytes": cache.kv_cache_memory,
            "num_gpu_blocks": int(stats["num_total_blocks"]),
            "num_gpu_blocks_override": cache.num_gpu_blocks_override,
            "engine": engine,
        }
        if self.cache_info is None:
            self.cache_info = Gauge("pagedllm:cache_config_info", "The engine cores' KV cache configuration.",
                                    list(info), registry=self.registry)
        self.cache_info.labels(**{k: str(v) for k, v in info.items()}).set(1)
        self._cache_info_engines.add(engine)

    def render(self) -> bytes:
        return generate_latest(with_compat_names(self.registry, self.compat))


class _IterationTokens:
    """pagedllm:iteration_tokens_total, a histogram the engine cores keep (engine/step_stats.py)."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily("pagedllm:iteration_tokens_total", "Tokens scheduled per engine step.",
                                       labels=["model_name", "engine"])
        for index, stats in enumerate(self.metrics._engine_stats):
            found = histogram_of(stats)
            if found is not None:
                family.add_metric([self.metrics.model_name, str(index)], found[0], found[1])
        yield family


class RequestTracker:
    """Counts one request's tokens as its outputs stream in, and its latencies and sizes at the end.
    Outputs of `RequestOutputKind.DELTA` carry only new tokens: they are added up per choice."""

    def __init__(self, metrics: ServerMetrics, params: SamplingParams | None = None) -> None:
        self.metrics = metrics
        self.params = params
        self._prompt_counted = False
        self._generated = 0
        self._lengths: dict[int, int] = {}  # tokens per choice so far
        self._delta = params is not None and params.output_kind == RequestOutputKind.DELTA
        self._last: RequestOutput | None = None
        self._last_token_time: float | None = None
        self._done = False

    def update(self, out: RequestOutput) -> None:
        m = self.metrics
        if not self._prompt_counted:
            m.count_prompt_tokens(len(out.prompt_token_ids))
            self._prompt_counted = True
        for c in out.outputs:
            before = self._lengths.get(c.index, 0) if self._delta else 0
            self._lengths[c.index] = before + len(c.token_ids)
        generated = sum(self._lengths.values())
        if generated > self._generated:
            m.count_generation_tokens(generated - self._generated)
            self._generated = generated
            self._observe_inter_token(out)
        self._last = out
        if out.finished:
            reason = out.outputs[0].finish_reason if out.outputs else None
            self._finish(reason or "stop")

    def _observe_inter_token(self, out: RequestOutput) -> None:
        """The time between engine steps that brought this request tokens. The metrics object is
        shared by the request's outputs, so a stream read late sees one longer interval, not two."""
        last = out.metrics.last_token_time if out.metrics is not None else None
        if last is None:
            return
        if self._last_token_time is not None and last > self._last_token_time:
            self.metrics.itl.observe(last - self._last_token_time)
        self._last_token_time = last

    def aborted(self) -> None:
        self._finish("abort")

    def _finish(self, reason: str) -> None:
        if self._done:
            return
        self._done = True
        m = self.metrics
        m.count_finished(reason)
        out = self._last
        if out is None:
            return
        m.request_prompt_tokens.observe(len(out.prompt_token_ids))
        lengths = list(self._lengths.values()) or [0]
        m.request_generation_tokens.observe(sum(lengths))
        m.request_max_generation_tokens.observe(max(lengths))
        if self.params is not None:
            m.request_params_n.observe(self.params.n)
            if self.params.max_tokens is not None:
                m.request_params_max_tokens.observe(self.params.max_tokens)
        if out.metrics is not None:
            self._observe_times(out)

    def _observe_times(self, out: RequestOutput) -> None:
        m, t = self.metrics, out.metrics
        end = t.finished_time or time.time()
        m.e2e.observe(max(0.0, end - t.arrival_time))
        scheduled, first, last = t.first_scheduled_time, t.first_token_time, t.last_token_time
        if scheduled is not None:
            m.queue_time.observe(max(0.0, scheduled - t.arrival_time))
        if first is None:
            return
        m.ttft.observe(max(0.0, first - t.arrival_time))
        last = last if last is not None else first
        m.decode_time.observe(max(0.0, last - first))
        if scheduled is not None:
            m.prefill_time.observe(max(0.0, first - scheduled))
            m.inference_time.observe(max(0.0, last - scheduled))
        num = self._lengths.get(0, 0)  # the first choice's tokens
        if num > 1:
            m.tpot.observe(max(0.0, last - first) / (num - 1))
