"""`--metrics-compat vllm`: every `pagedllm:` series exposed again under vLLM's name, so a Grafana
dashboard or autoscaler written for vLLM reads this server unchanged.

The copies are made at scrape time from the same samples (same labels: `model_name`, `engine`,
`finished_reason`, ...), so the two names never disagree. Where vLLM renamed a series, both of its
names are exposed: dashboards of either generation work.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.metrics_core import Metric

from pagedllm.entrypoints.openai.server_config import METRICS_COMPAT_CHOICES

_PREFIX = "pagedllm:"

# pagedllm name -> vLLM names, where they are not simply "vllm:" + the same suffix.
_VLLM_NAMES = {
    # vllm:gpu_* are the names before vLLM 0.9; older dashboards still query them.
    "kv_cache_usage_perc": ("kv_cache_usage_perc", "gpu_cache_usage_perc"),
    "prefix_cache_queries": ("prefix_cache_queries", "gpu_prefix_cache_queries"),
    "prefix_cache_hits": ("prefix_cache_hits", "gpu_prefix_cache_hits"),
    # Ours is one observation per request (its mean); vLLM's time_per_output_token_seconds was
    # one per step, which is our inter-token latency.
    "time_per_output_token_seconds": ("request_time_per_output_token_seconds",),
    "inter_token_latency_seconds": ("inter_token_latency_seconds", "time_per_output_token_seconds"),
}


def vllm_names(name: str) -> tuple[str, ...]:
    if not name.startswith(_PREFIX):
        return ()
    suffix = name[len(_PREFIX):]
    return tuple(f"vllm:{n}" for n in _VLLM_NAMES.get(suffix, (suffix,)))


class _WithAliases:
    """A registry's families, then each again under its other names."""

    def __init__(self, source: Any) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        families = list(self.source.collect())
        yield from families
        for family in families:
            for alias in vllm_names(family.name):
                copy = Metric(alias, family.documentation, family.type, family.unit)
                copy.samples = [s._replace(name=alias + s.name[len(family.name):]) for s in family.samples]
                yield copy


def check_compat(compat: str | None) -> None:
    if compat is not None and compat not in METRICS_COMPAT_CHOICES:
        raise ValueError(f"metrics compat {compat!r}: expected one of {', '.join(METRICS_COMPAT_CHOICES)}")


def with_compat_names(registry: Any, compat: str | None) -> Any:
    """What to render: the registry alone, or with the aliases of `compat` (checked by check_compat)."""
    return registry if compat is None else _WithAliases(registry)
