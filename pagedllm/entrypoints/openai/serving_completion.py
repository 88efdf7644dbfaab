"""POST /v1/completions: one engine request per prompt (text, texts, token ids or lists of
them), `n` choices each, indexed prompt-major as OpenAI does; echo and the legacy
logprobs format; streamed as `text_completion` chunks. `echo` with `max_tokens` 0 returns
the prompt alone, with its tokens' logprobs (how loglikelihood scorers such as lm-eval use it)."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagedllm.engine.exceptions import EngineDeadError
from pagedllm.engine.protocol import EngineClient
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.fan_out import check_sequences, feed_gradually, scheduler_limits, window
from pagedllm.entrypoints.openai.metrics import ServerMetrics
from pagedllm.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    UsageInfo,
)
from pagedllm.entrypoints.openai.response_utils import (
    DeltaTracker,
    completion_logprobs_with_end,
    output_usage,
    prompt_logprobs_json,
    special_token_ids,
    usage_info,
)
from pagedllm.entrypoints.openai.serving_engine import OpenAIServing, random_id, run_blocking
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels
from pagedllm.entrypoints.openai.stream_utils import (
    SSE_DONE,
    EngineStreamingResponse,
    chunk_json,
    merge_async_iterators,
    peek_all,
    run_until_disconnected,
    sse,
)
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import RequestOutputKind

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Prompt:
    text: str  # for echo: the prompt as given, or the decoded token ids
    token_ids: list[int]
    from_text: bool


def _echo_only(request: CompletionRequest) -> bool:
    """echo with max_tokens 0: the prompt and its logprobs, no completion (vLLM's and
    OpenAI's legacy behaviour). The engine runs one step, whose token is dropped."""
    return request.echo and request.max_tokens == 0


def _raw_prompts(request: CompletionRequest) -> list:
    """The request's prompts, untokenized: a text, token ids, or a list of either."""
    p = request.prompt
    if isinstance(p, str):
        raw: list = [p]
    elif p and all(isinstance(x, int) for x in p):
        raw = [p]  # one prompt of token ids
    else:
        raw = list(p)
    if not raw:
        raise OpenAIError("prompt must not be empty", param="prompt")
    return raw


class OpenAIServingCompletion(OpenAIServing):
    def __init__(
        self, engine: EngineClient, models: OpenAIServingModels | list[str], metrics: ServerMetrics | None = None
    ) -> None:
        super().__init__(engine, models, metrics)
        self.max_sequences, self.max_num_seqs = scheduler_limits(engine)
        self.special_ids = special_token_ids(self.tokenizer)  # see completion_logprobs_with_end

    def _prompts(self, request: CompletionRequest, raw: list) -> list[_Prompt]:
        prompts = []
        for item in raw:
            if isinstance(item, str):
                ids = self.encode(item, request.add_special_tokens)
            else:
                ids = list(item)
                self.check_token_ids(ids)
            if request.truncate_prompt_tokens is not None:
                ids = ids[-request.truncate_prompt_tokens:]
            if not ids:
                raise OpenAIError("prompt must not be empty", param="prompt")
            self.check_length(len(ids), request.max_tokens)
            truncated = request.truncate_prompt_tokens is not None
            from_text = isinstance(item, str)
            text = item if from_text and not truncated else self.tokenizer.decode(ids)
            prompts.append(_Prompt(text, ids, from_text))
        return prompts

    async def create(self, request: CompletionRequest, raw_request: Request) -> Response:
        self.check_generation_runner()
        self.check_common(request)
        if request.suffix is not None:
            raise OpenAIError("suffix is not supported", param="suffix")
        echo_only = _echo_only(request)
        if request.max_tokens == 0 and not request.echo:
            raise OpenAIError("max_tokens must be at least 1 (0 only with echo, to return the prompt alone)",
                              param="max_tokens")
        if echo_only and request.min_tokens:
            raise OpenAIError("min_tokens must be 0 when max_tokens is 0", param="min_tokens")
        model = self.model_name(request.model)
        raw = _raw_prompts(request)
        samples = max(request.n or 1, request.best_of or 1)
        check_sequences(len(raw), samples, self.max_sequences)
        prompts = await run_blocking(self._prompts, request, raw)
        prompt_logprobs = request.prompt_logprobs
        if request.echo and request.logprobs is not None and prompt_logprobs is None:
            prompt_logprobs = request.logprobs  # echoed prompt tokens get logprobs too
        params = self.sampling_params(
            request, max_tokens=1 if echo_only else request.max_tokens,
            logprobs=None if echo_only else request.logprobs,
            prompt_logprobs=prompt_logprobs, best_of=request.best_of,
            output_kind=RequestOutputKind.DELTA if request.stream else RequestOutputKind.CUMULATIVE,
        )
        request_id = f"cmpl-{request.request_id or random_id()}"
        ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        streams = feed_gradually([
            self.generate({"prompt": p.text if p.from_text else None, "prompt_token_ids": p.token_ids},
                          params, rid, request)
            for p, rid in zip(prompts, ids)
        ], samples, self.max_num_seqs)
        created = int(time.time())

        async def abort_all() -> None:
            for rid in ids:
                await self.abort(rid)

        if request.stream:
            first = window(samples, self.max_num_seqs)  # the others wait for these to end
            streams = await run_until_disconnected(raw_request, peek_all(streams[:first])) + streams[first:]
            body = self._stream(request, prompts, streams, request_id, model, created)
            return EngineStreamingResponse(body, on_close=abort_all)
        finals = await run_until_disconnected(raw_request, _collect(streams))
        return JSONResponse(self._response(request, prompts, finals, request_id, model, created).model_dump())

    def _logprobs(
        self, request: CompletionRequest, token_ids: list[int], logprobs: list | None, offset: int, text: str
    ) -> tuple[CompletionLogProbs | None, int]:
        """The legacy logprobs of tokens whose text, `text`, starts at `offset` in the choice's
        text, and the offset that follows them."""
        if request.logprobs is None or logprobs is None:
            return None, offset
        return completion_logprobs_with_end(token_ids, logprobs, request.logprobs, self.tokenizer, offset,
                                            text=text, special_ids=self.special_ids)

    @staticmethod
    def _usage(request: CompletionRequest, outputs: list[RequestOutput], completion_tokens: int | None = None
               ) -> UsageInfo:
        """The prompts' final outputs' usage; echo with max_tokens 0 returns none of the engine's one token."""
        return output_usage(outputs, 0 if _echo_only(request) else completion_tokens)

    def _echo_logprobs(self, request: CompletionRequest, prompt: _Prompt, out: RequestOutput) -> tuple[list, list]:
        """Prompt token ids and their logprobs (None where the engine has none), for echo."""
        ids = list(out.prompt_token_ids) or prompt.token_ids
        lps = list(out.prompt_logprobs) if out.prompt_logprobs is not None else [None] * len(ids)
        return ids, lps

    def _response(
        self, request: CompletionRequest, prompts: list[_Prompt], finals: list[RequestOutput], request_id: str,
        model: str, created: int,
    ) -> CompletionResponse:
        n = request.n or 1
        echo_only = _echo_only(request)
        choices = []
        for i, (prompt, out) in enumerate(zip(prompts, finals)):
            for c in out.outputs:
                text, token_ids, lps = c.text, c.token_ids, c.logprobs
                finish_reason, stop_reason = c.finish_reason, c.stop_reason
                if echo_only:
                    text, (token_ids, lps) = prompt.text, self._echo_logprobs(request, prompt, out)
                    finish_reason, stop_reason = "length", None
                elif request.echo:
                    p_ids, p_lps = self._echo_logprobs(request, prompt, out)
                    text, token_ids = prompt.text + text, p_ids + list(token_ids)
                    lps = p_lps + list(lps) if lps is not None else None
                choices.append(CompletionResponseChoice(
                    index=i * n + c.index, text=text, logprobs=self._logprobs(request, token_ids, lps, 0, text)[0],
                    finish_reason=finish_reason, stop_reason=stop_reason,
                    prompt_logprobs=prompt_logprobs_json(out.prompt_logprobs)
                    if request.prompt_logprobs is not None else None,
                ))
        return CompletionResponse(id=request_id, created=created, model=model, choices=choices,
                                  usage=self._usage(request, finals))

    async def _stream(
        self, request: CompletionRequest, prompts: list[_Prompt], streams: list[AsyncIterator[RequestOutput]],
        request_id: str, model: str, created: int,
    ) -> AsyncIterator[str]:
        n = request.n or 1
        echo_only = _echo_only(request)
        opts = request.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = include_usage and bool(opts.continuous_usage_stats)
        trackers = [DeltaTracker() for _ in prompts]
        last: list[RequestOutput | None] = [None] * len(prompts)
        # Where each choice's next logprob text_offset starts: counted in token strings, as
        # the non-streaming response does, so both agree even where tokens split a character.
        offsets: dict[tuple[int, int], int] = {}

        def chunk(choice: CompletionResponseChoice | None, usage: UsageInfo | None = None) -> str:
            resp = CompletionStreamResponse(id=request_id, created=created, model=model,
                                            choices=[choice] if choice else [], usage=usage)
            return sse(chunk_json(resp))

        try:
            async for i, out in merge_async_iterators(streams):
                num_prompt = len(out.prompt_token_ids)
                if echo_only:  # the prompt alone, once its request is done (one engine step)
                    if out.finished:
                        last[i] = out
                        p_ids, p_lps = self._echo_logprobs(request, prompts[i], out)
                        logprobs = self._logprobs(request, p_ids, p_lps, 0, prompts[i].text)[0]
                        for j in range(n):
                            yield chunk(CompletionResponseChoice(index=i * n + j, text=prompts[i].text,
                                                                 logprobs=logprobs, finish_reason="length"),
                                        usage_info(num_prompt, 0) if continuous else None)
                    continue
                if last[i] is None and request.echo:
                    p_ids, p_lps = self._echo_logprobs(request, prompts[i], out)
                    for j in range(n):
                        logprobs, offsets[i, j] = self._logprobs(request, p_ids, p_lps, 0, prompts[i].text)
                        yield chunk(CompletionResponseChoice(index=i * n + j, text=prompts[i].text, logprobs=logprobs),
                                    usage_info(num_prompt, 0) if continuous else None)
                last[i] = out
                for c in out.outputs:
                    d = trackers[i].delta(c)
                    if d is None:
                        continue
                    wants_logprobs = request.logprobs is not None and d.logprobs is not None
                    if not d.text and d.finish_reason is None and not (wants_logprobs and d.token_ids):
                        continue  # tokens whose text is held back (a possible stop string)
                    start = offsets.get((i, c.index), 0)
                    logprobs, offsets[i, c.index] = self._logprobs(request, d.token_ids, d.logprobs, start, d.text)
                    usage = usage_info(num_prompt, trackers[i].num_tokens(c.index)) if continuous else None
                    yield chunk(CompletionResponseChoice(
                        index=i * n + c.index, text=d.text, logprobs=logprobs, finish_reason=d.finish_reason,
                        stop_reason=d.stop_reason), usage)
            if include_usage:
                done = [(o, t) for o, t in zip(last, trackers) if o is not None]
                yield chunk(None, self._usage(request, [o for o, _ in done], sum(t.total_tokens() for _, t in done)))
        except OpenAIError as e:
            yield sse(e.to_body())
        except EngineDeadError as e:
            yield sse(OpenAIError(str(e), 503).to_body())
        except Exception as e:  # a 200 is already out: report in-band, as vLLM does
            logger.exception("completion stream %s failed", request_id)
            yield sse(OpenAIError(f"internal error: {type(e).__name__}", 500).to_body())
        yield SSE_DONE


async def _collect(streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    finals: list[RequestOutput | None] = [None] * len(streams)
    async for i, out in merge_async_iterators(streams):
        finals[i] = out
    if any(f is None for f in finals):
        raise OpenAIError("the engine returned no output", 500)
    return finals

