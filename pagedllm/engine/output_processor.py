"""Turns engine-core token outputs into RequestOutputs: detokenize, stop strings,
logprobs, timestamps, and the fan-in of n / best_of child requests.

`SamplingParams.output_kind` says what each output carries: everything so far (CUMULATIVE),
what is new since the last one (DELTA; the server's streams), or the end only (FINAL_ONLY)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.engine.logprobs import PromptLogprobs, SampleLogprobs, make_logprobs_dict
from pagedllm.engine.stop_checker import find_stop_string
from pagedllm.outputs import CompletionOutput, PoolingOutput, PoolingRequestOutput, RequestMetrics, RequestOutput
from pagedllm.protocol import EngineCoreOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams


@dataclass(slots=True)
class ParentRequest:
    """A request with n / best_of > 1: one engine-core request per sample."""

    request_id: str
    params: SamplingParams
    children: list[RequestState] = field(default_factory=list)
    num_finished: int = 0


@dataclass(slots=True)
class RequestState:
    request_id: str
    index: int
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    metrics: RequestMetrics
    parent: ParentRequest | None = None
    output_token_ids: list[int] = field(default_factory=list)
    text_len: int = 0  # visible text (stop strings cut it short)
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: PromptLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # DELTA: how much of the tokens and the visible text earlier outputs carried.
    num_sent_tokens: int = 0
    sent_text_len: int = 0

    def completion(self) -> CompletionOutput:
        """The output so far, or with DELTA what is new since the previous call."""
        text = self.detokenizer.output_text[: self.text_len] if self.detokenizer is not None else ""
        tokens, logprobs = self.output_token_ids, self.logprobs if self.params.logprobs is not None else None
        if self.params.output_kind == RequestOutputKind.DELTA:
            text, start = text[self.sent_text_len:], self.num_sent_tokens
            tokens, logprobs = tokens[start:], logprobs[start:] if logprobs is not None else None
            self.sent_text_len, self.num_sent_tokens = self.text_len, len(self.output_token_ids)
        else:
            tokens = list(tokens)
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=tokens,
            cumulative_logprob=self.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


@dataclass(slots=True)
class OutputProcessorResult:
    request_outputs: list[RequestOutput | PoolingRequestOutput]
    # Requests the output side finished (stop strings): the engine core must drop them.
    reqs_to_abort: list[str]


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}
        self.parents: dict[str, ParentRequest] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        parent: ParentRequest | None = None,
        index: int = 0,
    ) -> None:
        detok = (
            IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens)
            if params.detokenize and self.tokenizer is not None
            else None
        )
        state = RequestState(
            request_id, index, prompt, prompt_token_ids, params, detok,
            RequestMetrics(arrival_time=arrival_time), parent,
        )
        if params.logprobs is not None:
            state.logprobs = []
            state.cumulative_logprob = 0.0
        self.request_states[request_id] = state
        if parent is not None:
            parent.children.append(state)
            self.parents[parent.request_id] = parent

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def process_outputs(self, outputs: list[EngineCoreOutput], now: float | None = None) -> OutputProcessorResult:
        """One RequestOutput per request per call: a parent gets one after all its samples'
        outputs of the step are applied, not one per sample (which is O(n^2) per step)."""
        now = now or time.time()
        results: list[RequestOutput | PoolingRequestOutput] = []
        to_abort: list[str] = []
        parents: dict[str, tuple[ParentRequest, list[RequestState]]] = {}  # touched in this call, in order
        for out in outputs:
            state = self.request_states.get(out.request_id)
            if state is None:
                continue  # aborted on this side already
            if out.pooling_output is not None:
                del self.request_states[out.request_id]
                results.append(PoolingRequestOutput(out.request_id, PoolingOutput(out.pooling_output),
                                                    state.prompt_token_ids))
                continue
            if self._update(state, out, now) and out.finish_reason is None:
                to_abort.append(out.request_id)  # finished here by a stop string
            if state.finish_reason is not None:
                state.metrics.finished_time = now
                del self.request_states[out.request_id]
            finished = state.finish_reason is not None
            if state.parent is None:
                if finished or state.params.output_kind != RequestOutputKind.FINAL_ONLY:
                    results.append(self._request_output(state.request_id, state, [state.completion()], finished))
                continue
            if finished:
                state.parent.num_finished += 1
            parents.setdefault(state.parent.request_id, (state.parent, []))[1].append(state)
        for parent, touched in parents.values():
            result = self._parent_output(parent, touched)
            if result is not None:
                results.append(result)
        return OutputProcessorResult(results, to_abort)

    def _update(self, state: RequestState, out: EngineCoreOutput, now: float) -> bool:
        """Apply one engine-core output; True if a stop string finished the request."""
        m = state.metrics
        if out.scheduled_time is not None and m.first_scheduled_time is None:
            m.first_scheduled_time = out.scheduled_time
        if out.new_token_ids:
            if m.first_token_time is None:
                m.first_token_time = now
            m.last_token_time = now
        state.num_cached_tokens = out.num_cached_tokens
        if out.prompt_logprobs is not None and state.params.prompt_logprobs is not None:
            state.prompt_logprobs = [None] + [make_logprobs_dict(e, self.tokenizer) for e in out.prompt_logprobs]
        new_tokens, new_logprobs = out.new_token_ids, out.new_logprobs
        stopped_here = False
        if state.detokenizer is not None:
            detok, params = state.detokenizer, state.params
            stop = None
            last = len(new_tokens) - 1
            for i, tok in enumerate(new_tokens):
                before = len(detok.output_text)
                detok.update(tok)
                if i == last and out.finish_reason is not None:
                    detok.finalize()
                # Checked token by token: with speculative decoding a step brings several tokens,
                # and those after a stop string are dropped (ids and logprobs too).
                stop = find_stop_string(
                    detok.output_text, len(detok.output_text) - before, params.stop, params.include_stop_str_in_output
                )
                if stop is not None:
                    new_tokens = new_tokens[: i + 1]
                    new_logprobs = new_logprobs[: i + 1] if new_logprobs is not None else None
                    break
            if not new_tokens and out.finish_reason is not None:
                detok.finalize()
            text = detok.output_text
            state.text_len = len(text)
            if stop is None and out.finish_reason is None and params.stop:
                # Hold back what could be the start of a stop string, so streamed text
                # never has to be taken back.
                state.text_len = max(0, len(text) - max(len(s) for s in params.stop) + 1)
            if stop is not None:
                state.stop_reason, state.text_len = stop
                state.finish_reason = "stop"
                stopped_here = True
        if new_logprobs is not None and state.logprobs is not None:
            for entry in new_logprobs:
                state.logprobs.append(make_logprobs_dict(entry, self.tokenizer))
                state.cumulative_logprob += entry[1][0]
        state.output_token_ids.extend(new_tokens)
        if not stopped_here and out.finish_reason is not None:
            state.finish_reason = out.finish_reason
            state.stop_reason = out.stop_reason
        return stopped_here

    def _parent_output(self, parent: ParentRequest, touched: list[RequestState]) -> RequestOutput | None:
        """With DELTA, only the samples this call touched, each with what is new."""
        finished = parent.num_finished == len(parent.children)
        params = parent.params
        if params.output_kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        if params.best_of > params.n:
            if not finished:
                return None  # the best n are known only at the end
            ranked = sorted(parent.children, key=lambda c: c.cumulative_logprob or 0.0, reverse=True)
            completions = []
            for i, child in enumerate(ranked[: params.n]):
                c = child.completion()
                c.index = i
                if params.logprobs is None:
                    c.logprobs = None
                completions.append(c)
        elif params.output_kind == RequestOutputKind.DELTA:
            completions = [c.completion() for c in touched]
        else:
            completions = [c.completion() for c in parent.children]
        if finished:
            del self.parents[parent.request_id]
        return self._request_output(parent.request_id, parent.children[0], completions, finished)

    def _request_output(
        self, request_id: str, state: RequestState, completions: list[CompletionOutput], finished: bool
    ) -> RequestOutput:
        return RequestOutput(
            request_id=request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=completions,
            finished=finished,
            metrics=state.metrics,
            prompt_logprobs=state.prompt_logprobs,
            num_cached_tokens=state.num_cached_tokens,
        )

    def child_ids(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        return [c.request_id for c in parent.children] if parent is not None else [request_id]

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forget requests (parents expand to their children); returns the engine-core ids."""
        core_ids = []
        for req_id in request_ids:
            for child_id in self.child_ids(req_id):
                if self.request_states.pop(child_id, None) is not None:
                    core_ids.append(child_id)
            self.parents.pop(req_id, None)
        return core_ids
