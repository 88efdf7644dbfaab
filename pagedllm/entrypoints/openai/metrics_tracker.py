"""One request's contribution to the server metrics, from the RequestOutputs it streams.

Timings come from the request's RequestMetrics: arrival (front), first scheduled (engine core),
first and last token and finish (front, at the engine step that brought them); all wall clock.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.entrypoints.openai.metrics import ServerMetrics


class RequestTracker:
    """Counts one request's tokens as its outputs stream in, and its latencies and sizes at the end."""

    def __init__(self, metrics: ServerMetrics, params: SamplingParams | None = None) -> None:
        self.metrics = metrics
        self.params = params
        self._prompt_counted = False
        self._generated = 0
        self._last: RequestOutput | None = None
        self._last_token_time: float | None = None
        self._done = False

    def update(self, out: RequestOutput) -> None:
        m = self.metrics
        if not self._prompt_counted:
            m.count_prompt_tokens(len(out.prompt_token_ids))
            self._prompt_counted = True
        generated = sum(len(c.token_ids) for c in out.outputs)
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
        lengths = [len(c.token_ids) for c in out.outputs] or [0]
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
        num = len(out.outputs[0].token_ids) if out.outputs else 0
        if num > 1:
            m.tpot.observe(max(0.0, last - first) / (num - 1))
