"""POST /v1/chat/completions: render the conversation with the chat template, run it,
and answer with a `chat.completion` body or a stream of `chat.completion.chunk` events."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagedllm.engine.exceptions import EngineDeadError
from pagedllm.engine.protocol import EngineClient
from pagedllm.entrypoints.chat_utils import render_conversations, resolve_chat_template
from pagedllm.entrypoints.openai.chat_tools import (
    AUTO_GRAMMAR_MARKUP,
    ChoiceParser,
    tool_constraint,
    tool_mode,
)
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.metrics import ServerMetrics
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    DeltaMessage,
    UsageInfo,
)
from pagedllm.entrypoints.openai.response_utils import (
    DeltaTracker,
    chat_logprobs,
    output_usage,
    prompt_logprobs_json,
    usage_info,
)
from pagedllm.entrypoints.openai.server_config import ServerConfig
from pagedllm.entrypoints.openai.serving_engine import OpenAIServing, random_id, run_blocking
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels
from pagedllm.entrypoints.openai.stream_utils import (
    SSE_DONE,
    EngineStreamingResponse,
    chunk_json,
    peek_all,
    run_until_disconnected,
    sse,
)
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import MAX_LOGPROBS, RequestOutputKind

logger = logging.getLogger(__name__)


class OpenAIServingChat(OpenAIServing):
    def __init__(
        self, engine: EngineClient, models: OpenAIServingModels | list[str], metrics: ServerMetrics | None,
        config: ServerConfig,
    ) -> None:
        chat_template, tool_call_parser = config.chat_template, config.tool_call_parser
        enable_auto_tool_choice = config.enable_auto_tool_choice
        max_parallel_tool_calls = config.max_parallel_tool_calls
        tool_choice_auto_grammar, reasoning_parser = config.tool_choice_auto_grammar, config.reasoning_parser
        super().__init__(engine, models, metrics)
        self.trust_request_chat_template = config.trust_request_chat_template
        # --chat-template is read once at startup, so a bad path fails there and not per request.
        self.chat_template = resolve_chat_template(self.tokenizer, chat_template) if chat_template else None
        if tool_choice_auto_grammar:  # "auto" by grammar: the parser's markup, hermes unless told
            tool_call_parser = tool_call_parser or "hermes"
            enable_auto_tool_choice = True
            if tool_call_parser not in AUTO_GRAMMAR_MARKUP:
                raise ValueError(f"--tool-choice-auto-grammar works with --tool-call-parser "
                                 f"{', '.join(AUTO_GRAMMAR_MARKUP)}, not {tool_call_parser}")
        if enable_auto_tool_choice and not tool_call_parser:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        if max_parallel_tool_calls < 1:
            raise ValueError("--max-parallel-tool-calls must be at least 1")
        self.auto_grammar = tool_call_parser if tool_choice_auto_grammar else None
        self.max_parallel_tool_calls = max_parallel_tool_calls
        from pagedllm.entrypoints.openai.reasoning import ReasoningParserManager
        from pagedllm.entrypoints.openai.tool_parsers import ToolParserManager

        # Unknown names fail at start-up, listing the known ones.
        self.tool_parser_cls = ToolParserManager.get(tool_call_parser) if tool_call_parser else None
        self.reasoning_parser_cls = ReasoningParserManager.get(reasoning_parser) if reasoning_parser else None
        self.enable_auto_tool_choice = enable_auto_tool_choice
        # A vision-language model: image parts render as its placeholder, and their URLs are
        # fetched under the engine's media rules (entrypoints/media.py).
        self.image_placeholder = self.media = None
        mc = engine.model_config
        if getattr(mc, "is_multimodal", False):
            from pagedllm.entrypoints.media import connector_from_env
            from pagedllm.multimodal.processing import image_placeholder

            self.image_placeholder = image_placeholder(mc.model_path, mc.trust_remote_code)
            self.media = connector_from_env(mc.allowed_local_media_path, mc.allowed_media_domains)

    def load_images(self, sources: list[Any], param: str = "messages") -> list[Any]:
        """The images the messages name, fetched and decoded (blocking: run in a worker thread)."""
        try:
            return [self.media.load_image(src, f"image {i}") for i, src in enumerate(sources)]
        except ValueError as e:
            raise OpenAIError(str(e), param=param) from None

    async def images_for(self, sources: list[Any], param: str = "messages") -> list[Any] | None:
        """The request's images, checked against --limit-mm-per-prompt before any is fetched, then
        fetched and decoded off the event loop; None without images."""
        if not sources:
            return None
        limit = self.model_config.limit_mm_per_prompt.get("image", 1)
        if len(sources) > limit:
            raise OpenAIError(f"{len(sources)} images in one request; at most {limit} are allowed "
                              "(--limit-mm-per-prompt)", param=param)
        return await run_blocking(self.load_images, sources, param)

    def _choice_parser(self, mode: str | None, name: str | None) -> ChoiceParser:
        return ChoiceParser(
            mode, name,
            self.tool_parser_cls(self.tokenizer) if self.tool_parser_cls else None,
            self.reasoning_parser_cls(self.tokenizer) if self.reasoning_parser_cls else None,
        )

    def render_prompt(
        self,
        messages: list[Any],
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        param: str = "messages",
    ) -> tuple[str, list[int], list[Any]]:
        """The prompt text and its token ids, exactly as the engine would tokenize it, and the
        images the messages name (their URLs, in prompt order; each is one placeholder in the
        text). Blocking (template and tokenizer): servers call it through run_blocking. A request's
        own `chat_template` is Jinja text, never a path, and only with --trust-request-chat-template.
        `param`: the request field a message error names (the Responses API's "input")."""
        if chat_template is not None and not self.trust_request_chat_template:
            raise OpenAIError("chat_template in a request is not accepted by this server; start it with "
                              "--trust-request-chat-template to allow it", param="chat_template")
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise OpenAIError("chat_template_kwargs must be an object", param="chat_template_kwargs")
        kwargs = dict(chat_template_kwargs or {})
        if tools:
            kwargs.setdefault("tools", tools)
        dicts = [m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else m for m in messages]
        try:
            [prompt] = render_conversations(
                self.tokenizer, dicts, chat_template=self.chat_template if chat_template is None else chat_template,
                add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                chat_template_kwargs=kwargs, template_is_text=True, max_chars=self.max_prompt_chars,
                image_placeholder=self.image_placeholder,
            )
        except ValueError as e:
            raise OpenAIError(str(e), param=param) from None
        if isinstance(prompt, dict):
            images = prompt.get("multi_modal_data", {}).get("image", [])
            if "prompt_token_ids" in prompt:
                return prompt["prompt"], list(prompt["prompt_token_ids"]), images
            prompt = prompt["prompt"]
            return prompt, self.encode(prompt, param="messages"), images
        return prompt, self.encode(prompt, param="messages"), []

    def _check(self, request: ChatCompletionRequest) -> None:
        self.check_common(request)
        if request.top_logprobs is not None:
            if not 0 <= request.top_logprobs <= MAX_LOGPROBS:
                raise OpenAIError(f"top_logprobs must be in [0, {MAX_LOGPROBS}]", param="top_logprobs")
            if request.top_logprobs > 0 and not request.logprobs:
                raise OpenAIError("top_logprobs requires logprobs to be true", param="top_logprobs")

    async def create(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        self.check_generation_runner()
        self._check(request)
        model = self.model_name(request.model)
        text, ids, image_sources = await run_blocking(
            self.render_prompt, request.messages, chat_template=request.chat_template,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            chat_template_kwargs=request.chat_template_kwargs, tools=request.tools,
        )
        images = await self.images_for(image_sources)
        if request.truncate_prompt_tokens is not None:
            if images and request.truncate_prompt_tokens < len(ids):
                raise OpenAIError("truncate_prompt_tokens cannot cut a prompt with images",
                                  param="truncate_prompt_tokens")
            ids = ids[-request.truncate_prompt_tokens:]
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        self.check_length(len(ids), max_tokens, prompt_param="messages")
        top_n = request.top_logprobs or 0
        mode, tool_name = tool_mode(request, self.enable_auto_tool_choice and self.tool_parser_cls is not None)
        if mode == "auto":
            # e.g. Mistral's [TOOL_CALLS] is a special token: the parser asks to keep it in the text.
            request = self.tool_parser_cls(self.tokenizer).adjust_request(request)
        params = self.sampling_params(
            request, max_tokens=max_tokens, logprobs=top_n if request.logprobs else None,
            prompt_logprobs=request.prompt_logprobs,
            output_kind=RequestOutputKind.DELTA if request.stream else RequestOutputKind.CUMULATIVE,
        )
        # The auto grammar yields to the request's own constraint: "auto" is then plain auto.
        auto_grammar = self.auto_grammar if params.structured_outputs is None else None
        constraint = tool_constraint(request, mode, tool_name, max_calls=self.max_parallel_tool_calls,
                                     auto_grammar=auto_grammar)
        if constraint is not None:
            if params.structured_outputs is not None:
                raise OpenAIError("tool_choice cannot be combined with another structured-output constraint",
                                  param="tool_choice")
            params.structured_outputs = constraint
        parsers = [self._choice_parser(mode, tool_name) for _ in range(request.n or 1)]
        request_id = f"chatcmpl-{request.request_id or random_id()}"
        last = request.messages[-1]
        echo = last.content if request.echo and last.role == "assistant" and isinstance(last.content, str) else ""
        prompt: dict[str, Any] = {"prompt": text, "prompt_token_ids": ids}
        if images:
            prompt["multi_modal_data"] = {"image": images}
        stream = self.generate(prompt, params, request_id, request)
        created = int(time.time())
        if request.stream:
            [stream] = await run_until_disconnected(raw_request, peek_all([stream]))
            body = self._stream(request, stream, request_id, model, created, echo, parsers)
            return EngineStreamingResponse(body, on_close=lambda: self.abort(request_id))
        final = await run_until_disconnected(raw_request, _last(stream))
        return JSONResponse(self._response(request, final, request_id, model, created, echo, parsers).model_dump())

    def _response(
        self, request: ChatCompletionRequest, final: RequestOutput, request_id: str, model: str, created: int,
        echo: str, parsers: list[ChoiceParser],
    ) -> ChatCompletionResponse:
        choices = []
        for c in final.outputs:
            logprobs = None
            if request.logprobs and c.logprobs is not None:
                logprobs = chat_logprobs(c.token_ids, c.logprobs, request.top_logprobs or 0, self.tokenizer)
            reasoning, content, tool_calls = parsers[c.index].final(c.text, truncated=c.finish_reason == "length")
            finish = "tool_calls" if tool_calls and c.finish_reason == "stop" else c.finish_reason
            message = ChatMessage(role="assistant", content=echo + content if content is not None else
                                  (echo or None), reasoning_content=reasoning, tool_calls=tool_calls)
            choices.append(ChatCompletionResponseChoice(
                index=c.index, message=message, logprobs=logprobs, finish_reason=finish, stop_reason=c.stop_reason,
            ))
        prompt_logprobs = prompt_logprobs_json(final.prompt_logprobs) if request.prompt_logprobs is not None else None
        return ChatCompletionResponse(
            id=request_id, created=created, model=model, choices=choices, usage=output_usage([final]),
            prompt_logprobs=prompt_logprobs,
        )

    async def _stream(
        self, request: ChatCompletionRequest, stream: AsyncIterator[RequestOutput], request_id: str, model: str,
        created: int, echo: str, parsers: list[ChoiceParser],
    ) -> AsyncIterator[str]:
        opts = request.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = include_usage and bool(opts.continuous_usage_stats)
        top_n = request.top_logprobs or 0
        tracker = DeltaTracker()
        prompt_tokens = 0

        def chunk(choice: ChatCompletionResponseStreamChoice | None, usage: UsageInfo | None = None) -> str:
            resp = ChatCompletionStreamResponse(
                id=request_id, created=created, model=model, choices=[choice] if choice else [], usage=usage,
            )
            return sse(chunk_json(resp))

        last: RequestOutput | None = None
        try:
            async for out in stream:
                if last is None:
                    prompt_tokens = len(out.prompt_token_ids)
                    for i in range(request.n or 1):
                        role = DeltaMessage(role="assistant", content=echo)
                        yield chunk(ChatCompletionResponseStreamChoice(index=i, delta=role),
                                    usage_info(prompt_tokens, 0) if continuous else None)
                last = out
                for c in out.outputs:
                    d = tracker.delta(c)
                    if d is None:
                        continue
                    wants_logprobs = bool(request.logprobs) and d.logprobs is not None
                    if not d.text and d.finish_reason is None and not (wants_logprobs and d.token_ids):
                        continue  # tokens whose text is held back (a possible stop string)
                    logprobs = chat_logprobs(d.token_ids, d.logprobs, top_n, self.tokenizer) if wants_logprobs else None
                    parser = parsers[c.index]
                    finished = d.finish_reason is not None
                    delta = parser.delta(*tracker.texts(c.index), finished) or DeltaMessage()
                    if delta == DeltaMessage() and not finished and not (wants_logprobs and d.token_ids):
                        continue  # text the parsers hold back (a possible tag or call markup)
                    finish = d.finish_reason
                    if finish == "stop" and parser.called_tools:
                        finish = "tool_calls"
                    usage = usage_info(prompt_tokens, tracker.num_tokens(c.index)) if continuous else None
                    yield chunk(ChatCompletionResponseStreamChoice(
                        index=c.index, delta=delta, logprobs=logprobs, finish_reason=finish,
                        stop_reason=d.stop_reason,
                    ), usage)
            if include_usage and last is not None:
                yield chunk(None, usage_info(prompt_tokens, tracker.total_tokens(), last.num_cached_tokens))
        except OpenAIError as e:
            yield sse(e.to_body())
        except EngineDeadError as e:
            yield sse(OpenAIError(str(e), 503).to_body())
        except Exception as e:  # a 200 is already out: report in-band, as vLLM does
            logger.exception("chat stream %s failed", request_id)
            yield sse(OpenAIError(f"internal error: {type(e).__name__}", 500).to_body())
        yield SSE_DONE


async def _last(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    last = None
    async for out in stream:
        last = out
    if last is None:
        raise OpenAIError("the engine returned no output", 500)
    return last
