"""Turns engine-core token outputs into RequestOutputs: detokenize, timestamps."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from pagedllm.engine import EngineCoreOutput
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedllm.sampling_params import SamplingParams


@dataclass(slots=True)
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    metrics: RequestMetrics
    output_token_ids: list[int]


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}

    def add_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
        params: SamplingParams, arrival_time: float,
    ) -> None:
        detok = (
            IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens)
            if params.detokenize and self.tokenizer is not None
            else None
        )
        self.request_states[request_id] = RequestState(
            request_id, prompt, prompt_token_ids, params, detok,
            RequestMetrics(arrival_time=arrival_time), [],
        )

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def process_outputs(self, outputs: list[EngineCoreOutput], now: float | None = None) -> list[RequestOutput]:
        now = now or time.time()
        results = []
        for out in outputs:
            state = self.request_states.get(out.request_id)
            if state is None:
                continue  # aborted on this side already
            m = state.metrics
            if out.new_token_ids and m.first_token_time is None:
                m.first_token_time = now
            if out.new_token_ids:
                m.last_token_time = now
            for tok in out.new_token_ids:
                state.output_token_ids.append(tok)
                if state.detokenizer is not None:
                    state.detokenizer.update(tok)
            finished = out.finish_reason is not None
            if finished:
                if state.detokenizer is not None:
                    state.detokenizer.finalize()
                m.finished_time = now
                del self.request_states[out.request_id]
            results.append(self._make_output(state, out, finished))
        return results

    def _make_output(self, state: RequestState, out: EngineCoreOutput, finished: bool) -> RequestOutput:
        text = state.detokenizer.output_text if state.detokenizer is not None else ""
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=list(state.output_token_ids),
            cumulative_logprob=None,
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
        )
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            metrics=state.metrics,
            num_cached_tokens=out.num_cached_tokens,
        )

    def abort_requests(self, request_ids: list[str]) -> None:
        for req_id in request_ids:
            self.request_states.pop(req_id, None)
