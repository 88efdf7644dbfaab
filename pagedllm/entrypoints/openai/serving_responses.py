"""POST /v1/responses: the Responses API on the chat machinery.

A request's items (after a previous response's or a conversation's) become chat messages,
rendered by the chat template; tools, tool_choice, text.format and reasoning map onto the
same grammars and parsers as chat completions. A producer task per response runs the engine
and feeds a ResponseBuilder; callers read its session (responses_session.py)."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagedllm.engine.exceptions import EngineDeadError
from pagedllm.entrypoints.openai.chat_tools import tool_constraint, tool_mode
from pagedllm.entrypoints.openai.conversation_limits import ConversationLimitError
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.response_utils import DeltaTracker, chat_logprobs
from pagedllm.entrypoints.openai.responses_builder import ResponseBuilder
from pagedllm.entrypoints.openai.responses_items import (
    chat_tool_choice,
    chat_tools,
    check_metadata,
    items_to_messages,
    new_id,
    normalize_input,
)
from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest
from pagedllm.entrypoints.openai.responses_session import ResponseRegistry, ResponseSession, follow
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_engine import run_blocking
from pagedllm.entrypoints.openai.stream_utils import EngineStreamingResponse, run_until_disconnected
from pagedllm.sampling_params import RequestOutputKind, StructuredOutputsParams
from pagedllm.structured_output.grammar import validate

logger = logging.getLogger(__name__)

INCLUDABLE = ("code_interpreter_call.outputs", "computer_call_output.output.image_url", "file_search_call.results",
              "message.input_image.image_url", "message.output_text.logprobs", "reasoning.encrypted_content",
              "web_search_call.action.sources", "web_search_call.results")


def text_format_constraint(text: dict[str, Any] | None) -> StructuredOutputsParams | None:
    """`text.format`: json_schema or json_object through structured outputs; "text" is free."""
    fmt = (text or {}).get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise OpenAIError("text.format.schema must be a JSON schema object", param="text.format.schema")
        return StructuredOutputsParams(json=schema)
    raise OpenAIError(f"text.format.type must be text, json_object or json_schema, got {kind!r}",
                      param="text.format")


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat, registry: ResponseRegistry, *, store_enabled: bool) -> None:
        self.chat = chat
        self.registry = registry
        self.store_enabled = store_enabled

    # ---- create ---------------------------------------------------------------
    async def create(self, request: ResponsesRequest, raw_request: Request) -> Response:
        session, prompt, params, parser_args = await self.prepare(request)
        self.start(session, prompt, params, parser_args, request)
        on_close = self._cancel_unless_background(session, bool(request.background))
        if request.stream:  # a background stream's reader may leave and come back (GET ?stream=true)
            return EngineStreamingResponse(follow(session), on_close=on_close)
        if request.background:
            return JSONResponse(session.builder.snapshot())
        try:
            await run_until_disconnected(raw_request, session.task)
        finally:
            await on_close()
        return JSONResponse(session.builder.snapshot())

    def _check(self, request: ResponsesRequest) -> bool:
        """Whether to store; 400 on fields that cannot go together."""
        self.chat.check_generation_runner()
        if request.n not in (None, 1):
            raise OpenAIError("n must be 1 for the Responses API", param="n")
        if request.use_beam_search:
            raise OpenAIError("use_beam_search is not supported by this server", param="use_beam_search")
        for name in request.include or []:
            if name not in INCLUDABLE:
                raise OpenAIError(f"include: unknown value {name!r}", param="include")
        check_metadata(request.metadata)
        store = bool(request.store)
        if not self.store_enabled:
            if store and "store" in request.model_fields_set:
                raise OpenAIError("this server runs with --disable-responses-store: store=true is not available",
                                  param="store")
            store = False
        if request.background and not store:
            raise OpenAIError("background responses must be stored: set store=true", param="background")
        if request.previous_response_id and request.conversation is not None:
            raise OpenAIError("give previous_response_id or conversation, not both", param="conversation")
        return store

    def _history(self, request: ResponsesRequest) -> tuple[list[dict[str, Any]], str | None]:
        """The items before this request's input, and the conversation id they come from."""
        store = self.registry.store
        if request.previous_response_id:
            prev = self.registry.get_live(request.previous_response_id)
            if prev is not None:
                raise OpenAIError(f"Previous response '{request.previous_response_id}' is still in progress",
                                  param="previous_response_id")
            record = self.registry.get_stored(request.previous_response_id)
            if record is None:
                raise OpenAIError(f"Previous response with id '{request.previous_response_id}' not found.", 404,
                                  param="previous_response_id")
            return record.history, None
        if request.conversation is not None:
            conv = request.conversation
            conv_id = conv.get("id") if isinstance(conv, dict) else conv
            if not isinstance(conv_id, str) or store is None:
                raise OpenAIError("conversation must be a conversation id (and the store enabled)",
                                  param="conversation")
            items = store.conversation_items(conv_id)
            if items is None:
                raise OpenAIError(f"Conversation with id '{conv_id}' not found.", 404, param="conversation")
            return items, conv_id
        return [], None

    async def prepare(self, request: ResponsesRequest, *, session: ResponseSession | None = None) -> tuple:
        """The session (new, or `session` resumed), the prompt, the sampling params and the
        (mode, tool name) of the chat parser, all checked before anything runs."""
        store = self._check(request)
        model = self.chat.model_name(request.model)
        if session is None:
            history, conv_id = self._history(request)
            new_items = normalize_input(request.input)
            if conv_id is not None and self.registry.store is not None:  # room for the input and an output
                try:
                    self.registry.store.conversation_limits.check(
                        len(history), [json.dumps(item, ensure_ascii=False) for item in new_items] + [""])
                except ConversationLimitError as e:
                    raise OpenAIError(str(e), param="input") from None
        else:
            history, conv_id, new_items = session.history, None, []
        items = history + new_items
        if not items:
            raise OpenAIError("input is empty", param="input")
        tools = chat_tools(request.tools)
        shaped = ChatCompletionRequest.model_construct(
            messages=[], tools=tools, tool_choice=chat_tool_choice(request.tool_choice),
            parallel_tool_calls=request.parallel_tool_calls, skip_special_tokens=request.skip_special_tokens)
        mode, tool_name = tool_mode(shaped, self.chat.enable_auto_tool_choice and self.chat.tool_parser_cls is not None)
        system = [{"role": "system", "content": request.instructions}] if request.instructions else []
        kwargs = dict(request.chat_template_kwargs or {})
        if (request.reasoning or {}).get("effort"):
            kwargs.setdefault("reasoning_effort", request.reasoning["effort"])
        messages = items_to_messages(items)
        render = functools.partial(self.chat.render_prompt, tools=tools, chat_template=request.chat_template,
                                   chat_template_kwargs=kwargs, param="input")
        text, ids, image_sources = await run_blocking(render, system + messages)
        while request.truncation == "auto" and len(messages) > 1 and \
                len(ids) + (request.max_output_tokens or 1) > self.chat.max_model_len:
            messages = messages[1:]  # drop the oldest turns until the prompt fits, as OpenAI's "auto" does
            text, ids, image_sources = await run_blocking(render, system + messages)
        images = await self.chat.images_for(image_sources, param="input")
        self.chat.check_length(len(ids), request.max_output_tokens, prompt_param="input")
        wants_logprobs = "message.output_text.logprobs" in (request.include or [])
        params = self.chat.sampling_params(request, max_tokens=request.max_output_tokens,
                                           logprobs=(request.top_logprobs or 0) if wants_logprobs else None,
                                           prompt_logprobs=None, output_kind=RequestOutputKind.DELTA)
        own, fmt = params.structured_outputs, text_format_constraint(request.text)
        if own is not None and fmt is not None:
            raise OpenAIError("give text.format or structured_outputs, not both", param="text")
        # A forced call (required, named) replaces text.format: that turn has no text. The auto
        # grammar yields to a format, as in chat.
        call_grammar = tool_constraint(shaped, mode, tool_name, max_calls=self.chat.max_parallel_tool_calls,
                                       auto_grammar=self.chat.auto_grammar if own is None and fmt is None else None)
        if call_grammar is not None and own is not None:
            raise OpenAIError("tool_choice cannot be combined with another structured-output constraint",
                              param="tool_choice")
        params.structured_outputs = call_grammar or own or fmt
        await _check_constraint(params.structured_outputs, "tools" if call_grammar is not None
                                else "structured_outputs" if own is not None else "text.format")
        if mode == "auto":  # e.g. Mistral's [TOOL_CALLS] is a special token the text must keep
            params.skip_special_tokens = self.chat.tool_parser_cls(self.chat.tokenizer).adjust_request(
                shaped).skip_special_tokens
        if session is None:
            session = self._new_session(request, model, store, history, new_items, conv_id)
        prompt: dict[str, Any] = {"prompt": text, "prompt_token_ids": ids}
        if images:
            prompt["multi_modal_data"] = {"image": images}
        return session, prompt, params, (mode, tool_name)

    def _new_session(self, request: ResponsesRequest, model: str, store: bool, history: list, new_items: list,
                     conv_id: str | None) -> ResponseSession:
        response = {
            "id": new_id("resp"), "object": "response", "created_at": int(time.time()),
            "status": "queued" if request.background else "in_progress", "background": bool(request.background),
            "completed_at": None, "error": None, "incomplete_details": None, "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens, "max_tool_calls": request.max_tool_calls,
            "metadata": request.metadata or {}, "model": model, "output": [],
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "previous_response_id": request.previous_response_id, "prompt_cache_key": request.prompt_cache_key,
            "reasoning": {"effort": (request.reasoning or {}).get("effort"), "summary": None},
            "service_tier": request.service_tier or "auto", "store": store, "temperature": request.temperature,
            "text": request.text or {"format": {"type": "text"}}, "tool_choice": request.tool_choice or (
                "auto" if request.tools else "none"), "tools": request.tools or [], "top_logprobs":
                request.top_logprobs, "top_p": request.top_p, "truncation": request.truncation or "disabled",
            "usage": None, "user": request.user, "output_text": "",
            "conversation": {"id": conv_id} if conv_id else None,
        }
        builder = ResponseBuilder(response)
        builder.emit("response.created", response=builder.snapshot())
        return ResponseSession(builder, new_items, history + new_items, request.model_dump(exclude_unset=True),
                               store, conversation_id=conv_id)

    def start(self, session: ResponseSession, prompt: dict, params: Any, parser_args: tuple,
              request: ResponsesRequest) -> None:
        if request.prompt_cache_key and request.cache_salt is None:
            request = request.model_copy(update={"cache_salt": request.prompt_cache_key})
        self.registry.add(session)
        session.task = asyncio.ensure_future(self._produce(session, prompt, params, parser_args, request))

    def _cancel_unless_background(self, session: ResponseSession, background: bool):
        async def on_close() -> None:
            if not background and session.task is not None and not session.task.done():
                session.task.cancel()
                await asyncio.gather(session.task, return_exceptions=True)
        return on_close

    # ---- the producer -----------------------------------------------------------
    async def _produce(self, session: ResponseSession, prompt: dict, params: Any, parser_args: tuple,
                       request: ResponsesRequest) -> None:
        builder = session.builder
        builder.set_status("in_progress", "response.in_progress")
        session.notify()
        parser = self.chat._choice_parser(*parser_args)
        tracker = DeltaTracker()
        engine_id = f"{session.id}-{len(builder.events)}"
        last, reasoning_tokens = None, 0
        top_n = request.top_logprobs or 0
        held: list[dict[str, Any]] = []  # logprobs of tokens whose text the parsers still hold back
        try:
            async for out in self.chat.generate(prompt, params, engine_id, request):
                last = out
                for c in out.outputs:
                    d = tracker.delta(c)
                    if d is None:
                        continue
                    delta = parser.delta(*tracker.texts(c.index), d.finish_reason is not None)
                    if d.logprobs is not None:
                        lps = chat_logprobs(d.token_ids, d.logprobs, top_n, self.chat.tokenizer)
                        held += lps.model_dump()["content"]
                    if delta is not None:
                        if delta.reasoning_content and not delta.content and not delta.tool_calls:
                            reasoning_tokens += len(d.token_ids)
                        builder.add(delta, held if delta.content else None)
                        held = []
                session.notify()
            choice = last.outputs[0]
            usage = _usage(builder.response.get("usage"), len(last.prompt_token_ids), tracker.num_tokens(0),
                           last.num_cached_tokens, reasoning_tokens)
            if choice.finish_reason == "length":
                builder.finish("incomplete", incomplete_reason="max_output_tokens", usage=usage)
            else:
                builder.finish("completed", usage=usage)
        except asyncio.CancelledError:
            builder.finish("cancelled")
        except (OpenAIError, EngineDeadError) as e:
            error = OpenAIError(str(e), 503) if isinstance(e, EngineDeadError) else e
            builder.finish("failed", error={"code": error.err_type, "message": error.message})
        except Exception as e:  # the producer must always end its response
            logger.exception("response %s failed", session.id)
            builder.finish("failed", error={"code": "server_error", "message": f"internal error: {type(e).__name__}"})
        finally:
            self._append_to_conversation(session)
            self.registry.finished(session)

    def _append_to_conversation(self, session: ResponseSession) -> None:
        """This turn's input and output join the conversation (a resumed turn: the tool outputs and what follows)."""
        conv_id, store = session.conversation_id, self.registry.store
        if conv_id is None or store is None or session.response["status"] not in ("completed", "incomplete"):
            return
        turn_input = session.input_items if session.turn_input is None else session.turn_input
        try:
            store.add_conversation_items(conv_id, turn_input + session.new_output())
        except KeyError:  # deleted meanwhile
            logger.info("conversation %s is gone; response %s not added to it", conv_id, session.id)
        except ConversationLimitError as e:  # the turn itself outgrew a limit: the response stands alone
            logger.warning("response %s not added to conversation %s: %s", session.id, conv_id, e)


async def _check_constraint(constraint: StructuredOutputsParams | None, param: str) -> None:
    """A schema the grammar compiler refuses is a 400 before the response starts, as in chat
    completions, not a response that fails once it runs."""
    if constraint is None:
        return
    try:
        await run_blocking(validate, constraint)
    except ValueError as e:
        raise OpenAIError(str(e), param=param) from None


def _usage(before: dict | None, prompt: int, output: int, cached: int, reasoning: int) -> dict[str, Any]:
    """OpenAI's usage; a response resumed after tool outputs adds its new turn to the earlier one."""
    usage = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": output,
             "output_tokens_details": {"reasoning_tokens": reasoning}, "total_tokens": prompt + output}
    if before:
        usage["input_tokens"] += before["input_tokens"]
        usage["output_tokens"] += before["output_tokens"]
        usage["total_tokens"] += before["total_tokens"]
        usage["input_tokens_details"]["cached_tokens"] += before["input_tokens_details"]["cached_tokens"]
        usage["output_tokens_details"]["reasoning_tokens"] += before["output_tokens_details"]["reasoning_tokens"]
    return usage
