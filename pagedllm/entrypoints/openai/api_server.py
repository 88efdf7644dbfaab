"""The FastAPI app: routes, auth / x-request-id / CORS middleware, and exception handlers
that turn every failure into an OpenAI-style error body.

Middleware is plain ASGI (not BaseHTTPMiddleware), which would buffer and re-wrap the
receive channel and so hide client disconnects from streaming responses."""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Awaitable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedllm import __version__
from pagedllm.engine.exceptions import EngineDeadError
from pagedllm.entrypoints.openai.metrics import ServerMetrics
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_engine import OpenAIError, random_id
from pagedllm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from pagedllm.entrypoints.openai.stream_utils import ClientDisconnected

logger = logging.getLogger(__name__)

# Union members pydantic names in an error's location ("prompt", "list[int]", 0): not fields.
_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


class RequestIdMiddleware:
    """Echo the client's x-request-id, or a fresh one, on every response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = Headers(scope=scope).get("x-request-id") or random_id()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)["x-request-id"] = request_id
            await send(message)

        await self.app(scope, receive, send_with_id)


class ApiKeyMiddleware:
    """Bearer-token check on /v1/* only: probes (/health, /metrics, /version) stay open."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and scope["path"].startswith("/v1"):
            given = Headers(scope=scope).get("authorization", "").encode()
            if not secrets.compare_digest(given, self.expected):
                error = OpenAIError("Invalid or missing API key; send it as 'Authorization: Bearer <key>'", 401)
                response = error.to_response()
                response.headers["www-authenticate"] = "Bearer"
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _validation_message(exc: RequestValidationError) -> OpenAIError:
    """The first problem, naming its field (never pydantic's raw dump)."""
    errors = exc.errors()
    if not errors:
        return OpenAIError("invalid request body")
    err = errors[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    if err.get("type") == "json_invalid":
        return OpenAIError(f"request body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}")
    field = ".".join(p for p in loc if not _is_type_tag(p))
    msg = err.get("msg", "invalid value")
    k = next((i for i, p in enumerate(loc) if _is_type_tag(p)), None)
    if k is not None:  # a union field fails once per member: say which shapes it accepts
        prefix = loc[:k]
        tags = [str(e["loc"][k + 1]) for e in errors
                if [str(p) for p in e.get("loc", ())[1:k + 1]] == prefix and len(e["loc"]) > k + 1]
        field, msg = ".".join(prefix), f"must be one of {', '.join(dict.fromkeys(tags))}"
    # A union field fails once per member; count distinct top-level fields instead.
    others = {str(e.get("loc", ("body", "?"))[1:2]) for e in errors[1:]} - {str(err.get("loc", ())[1:2])}
    more = f" (and problems with {len(others)} more fields)" if others else ""
    return OpenAIError(f"{field or 'body'}: {msg}{more}", param=field or None)


def _is_type_tag(part: str) -> bool:
    return "[" in part or part in _TYPE_TAGS


async def _serve(work: Awaitable[Any]) -> Any:
    """Run a handler, mapping every failure to its OpenAI-style response here, inside the
    middleware stack (so error responses carry x-request-id too)."""
    try:
        return await work
    except OpenAIError as e:
        return e.to_response()
    except EngineDeadError as e:
        return OpenAIError(str(e), 503).to_response()
    except ClientDisconnected:
        return Response(status_code=499)  # nobody is listening; for the access log only
    except Exception as e:
        logger.exception("request failed")
        return OpenAIError(f"internal server error: {type(e).__name__}", 500).to_response()


def build_app(engine: Any, args: Any) -> FastAPI:
    """The server for one AsyncLLM. `args` is the serve namespace; missing options take defaults."""
    model_config = engine.model_config
    names = list(getattr(args, "served_model_name", None) or []) or [model_config.model or model_config.model_path]
    metrics = ServerMetrics(names[0])
    chat = OpenAIServingChat(
        engine, names, metrics, getattr(args, "chat_template", None),
        tool_call_parser=getattr(args, "tool_call_parser", None),
        enable_auto_tool_choice=getattr(args, "enable_auto_tool_choice", False),
        reasoning_parser=getattr(args, "reasoning_parser", None),
    )
    completion = OpenAIServingCompletion(engine, names, metrics)
    tokenization = OpenAIServingTokenization(chat)

    app = FastAPI(title="pagedllm", version=__version__)
    app.state.engine = engine
    app.state.metrics = metrics

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
        return await _serve(chat.create(request, raw_request))

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        return await _serve(completion.create(request, raw_request))

    @app.get("/v1/models")
    async def show_models() -> Response:
        cards = [ModelCard(id=name, root=model_config.model_path, max_model_len=model_config.max_model_len)
                 for name in names]
        return JSONResponse(ModelList(data=cards).model_dump())

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> Response:
        async def work() -> Response:
            return JSONResponse(tokenization.tokenize(request).model_dump(exclude_none=True))
        return await _serve(work())

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> Response:
        async def work() -> Response:
            return JSONResponse(tokenization.detokenize(request).model_dump())
        return await _serve(work())

    @app.get("/health")
    async def health() -> Response:
        check = getattr(engine, "check_health", None)
        try:
            if engine.errored:
                raise EngineDeadError()
            if check is not None:
                await check()
        except EngineDeadError as e:
            return OpenAIError(str(e), 503).to_response()
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": __version__})

    @app.get("/metrics")
    async def show_metrics() -> Response:
        await metrics.refresh(engine)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, exc: RequestValidationError) -> Response:
        return _validation_message(exc).to_response()

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
        message = str(exc.detail)
        if exc.status_code == 404:
            message = f"Not found: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"Method {request.method} not allowed on {request.url.path}"
        response = OpenAIError(message, exc.status_code).to_response()
        response.headers.update(exc.headers or {})
        return response

    @app.exception_handler(OpenAIError)
    async def on_openai_error(_: Request, exc: OpenAIError) -> Response:
        return exc.to_response()

    @app.exception_handler(EngineDeadError)
    async def on_engine_dead(_: Request, exc: EngineDeadError) -> Response:
        return OpenAIError(str(exc), 503).to_response()

    api_key = getattr(args, "api_key", None)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    origins = _origins(getattr(args, "allowed_origins", None))
    if origins:
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_credentials=True,
                           allow_methods=["*"], allow_headers=["*"], expose_headers=["x-request-id"])
    app.add_middleware(RequestIdMiddleware)  # added last: outermost, so every response gets the header
    return app


def _origins(value: Any) -> list[str]:
    """--allowed-origins as a list, comma-separated, or vLLM's JSON list ('["*"]')."""
    if not value:
        return []
    origins = []
    for item in value if isinstance(value, (list, tuple)) else [value]:
        item = str(item).strip()
        if item.startswith("["):
            try:
                origins += [str(o) for o in json.loads(item)]
                continue
            except ValueError:
                pass
        origins += [o.strip() for o in item.split(",") if o.strip()]
    return origins
