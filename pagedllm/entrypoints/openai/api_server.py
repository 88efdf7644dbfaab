"""The FastAPI app: routes, middleware (middleware.py: request ids, API key, body-size
limit; CORS), and exception handlers that turn every failure into an OpenAI-style error body."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match, Route
from starlette.types import Scope

from pagedllm.engine.exceptions import EngineDeadError
from pagedllm.engine.protocol import EngineClient
from pagedllm.entrypoints.openai.body_checks import MAX_JSON_DEPTH
from pagedllm.entrypoints.openai.conversation_limits import ConversationLimits
from pagedllm.entrypoints.openai.dashboard import add_dashboard_routes
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.metrics import ServerMetrics
from pagedllm.entrypoints.openai.middleware import ApiKeyMiddleware, BodySizeLimitMiddleware, RequestIdMiddleware
from pagedllm.entrypoints.openai.openapi import drop_validation_responses, responses
from pagedllm.entrypoints.openai.pooling_protocol import (
    ClassificationRequest,
    ClassificationResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    PoolingRequest,
    PoolingResponse,
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
)
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfoResponse,
)
from pagedllm.entrypoints.openai.request_logger import RequestLogger
from pagedllm.entrypoints.openai.responses_routes import add_responses_routes
from pagedllm.entrypoints.openai.responses_session import ResponseRegistry
from pagedllm.entrypoints.openai.responses_store import make_response_store
from pagedllm.entrypoints.openai.server_config import DEFAULT_MAX_REQUEST_BODY_BYTES, ServerConfig
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_conversations import OpenAIServingConversations
from pagedllm.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from pagedllm.entrypoints.openai.serving_engine import run_blocking
from pagedllm.entrypoints.openai.serving_models import (
    LoadLoRAAdapterRequest,
    OpenAIServingModels,
    UnloadLoRAAdapterRequest,
    runtime_lora_updating_allowed,
)
from pagedllm.entrypoints.openai.serving_responses import OpenAIServingResponses
from pagedllm.entrypoints.openai.serving_score import OpenAIServingScore
from pagedllm.entrypoints.openai.serving_stored_responses import OpenAIServingStoredResponses
from pagedllm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from pagedllm.entrypoints.openai.stat_logger import StatLogger
from pagedllm.entrypoints.openai.stream_utils import ClientDisconnected
from pagedllm.version import __version__

logger = logging.getLogger(__name__)

# Union members pydantic names in an error's location ("prompt", "list[int]", 0): not fields.
_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _validation_message(exc: RequestValidationError) -> OpenAIError:
    """The first problem, naming its field (never pydantic's raw dump)."""
    errors = exc.errors()
    if not errors:
        return OpenAIError("invalid request body")
    err = errors[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    if err.get("type") == "json_invalid":
        return OpenAIError(f"request body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}")
    if err.get("type") == "pagedllm_invalid_value":  # found anywhere in the body: the message names the place
        return OpenAIError(err.get("msg", "invalid value"), param=err.get("ctx", {}).get("param"))
    field = ".".join(p for p in loc if not _is_type_tag(p))
    msg = err.get("msg", "invalid value")
    k = next((i for i, p in enumerate(loc) if _is_type_tag(p)), None)
    if k is not None:  # a union field fails once per member: say which shapes it accepts
        prefix = loc[:k]
        tags = [str(e["loc"][k + 1]).replace("constrained-", "") for e in errors
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


def build_app(engine: EngineClient, config: ServerConfig) -> FastAPI:
    """The server for one engine (an AsyncLLM), configured by `config`."""
    model_config = engine.model_config
    names = list(config.served_model_names) or [model_config.model or model_config.model_path]
    models = OpenAIServingModels(engine, names, config.lora_modules)
    engine_config = getattr(engine, "config", None)
    metrics = ServerMetrics(names[0], model_config.max_model_len, config.metrics_compat,
                            getattr(engine_config, "cache_config", None))
    lora_config = getattr(engine, "lora_config", None)
    if lora_config is not None:
        metrics.enable_lora(lora_config.max_loras, lambda: list(models.lora_requests))
    chat = OpenAIServingChat(engine, models, metrics, config)
    completion = OpenAIServingCompletion(engine, models, metrics)
    tokenization = OpenAIServingTokenization(chat)
    embedding = OpenAIServingEmbedding(engine, models, metrics)
    scoring = OpenAIServingScore(engine, models, metrics)
    store = None if config.disable_responses_store else make_response_store(
        config.responses_store, config.responses_store_max_entries, config.responses_store_ttl,
        conversation_limits=ConversationLimits(config.max_conversation_items, config.max_conversation_item_bytes))
    created = OpenAIServingResponses(chat, ResponseRegistry(store, config.responses_store_ttl),
                                     store_enabled=store is not None)
    if config.enable_log_requests:
        chat.request_logger = completion.request_logger = RequestLogger(config.max_log_len)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await models.init_static_loras()  # a no-op when `pagedllm serve` did it before binding uvicorn
        stats = None
        if not config.disable_log_stats:
            stats = asyncio.create_task(StatLogger(engine, metrics, config.log_stats_interval).run())
        try:
            yield
        finally:
            if stats is not None:
                stats.cancel()
                await asyncio.gather(stats, return_exceptions=True)

    app = FastAPI(title="pagedllm", version=__version__, lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.models = models
    app.state.response_store = store

    @app.post("/v1/chat/completions", responses=responses(ChatCompletionResponse, 400, 401, 404, 413, 503,
                                                          stream=True))
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
        return await _serve(chat.create(request, raw_request))

    @app.post("/v1/completions", responses=responses(CompletionResponse, 400, 401, 404, 413, 503, stream=True))
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        return await _serve(completion.create(request, raw_request))

    @app.post("/v1/embeddings", responses=responses(EmbeddingResponse, 400, 401, 404, 413, 503))
    async def create_embedding(request: EmbeddingRequest) -> Response:
        async def work() -> Response:
            return JSONResponse((await embedding.create(request)).model_dump())
        return await _serve(work())

    @app.post("/pooling", responses=responses(PoolingResponse, 400, 401, 404, 413, 503))
    async def create_pooling(request: PoolingRequest) -> Response:
        async def work() -> Response:
            return JSONResponse((await embedding.pooling(request)).model_dump())
        return await _serve(work())

    @app.post("/classify", responses=responses(ClassificationResponse, 400, 401, 404, 413, 503))
    async def create_classify(request: ClassificationRequest) -> Response:
        async def work() -> Response:
            return JSONResponse((await embedding.classify(request)).model_dump())
        return await _serve(work())

    async def score(request: ScoreRequest) -> Response:
        async def work() -> Response:
            return JSONResponse((await scoring.score(request)).model_dump())
        return await _serve(work())

    async def rerank(request: RerankRequest) -> Response:
        async def work() -> Response:
            return JSONResponse((await scoring.rerank(request)).model_dump(exclude_none=True))
        return await _serve(work())

    for path in ("/score", "/v1/score"):
        app.post(path, responses=responses(ScoreResponse, 400, 401, 404, 413, 503))(score)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.post(path, responses=responses(RerankResponse, 400, 401, 404, 413, 503))(rerank)

    add_responses_routes(app, created, OpenAIServingStoredResponses(created, config.max_tool_output_bytes),
                         OpenAIServingConversations(store), _serve)

    @app.get("/v1/models", responses=responses(ModelList, 401))
    async def show_models() -> Response:
        return JSONResponse(models.model_cards().model_dump())

    # `:path`: a served name may hold slashes ("org/name"), as the openai SDK sends it.
    @app.get("/v1/models/{model_id:path}", responses=responses(ModelCard, 401, 404))
    async def show_model(model_id: str) -> Response:
        async def work() -> Response:
            return JSONResponse(models.model_card(model_id).model_dump())
        return await _serve(work())

    if lora_config is not None and runtime_lora_updating_allowed():
        @app.post("/v1/load_lora_adapter", response_class=Response,
                  responses=responses(None, 400, 401, 413, 503, text=True))
        async def load_lora_adapter(request: LoadLoRAAdapterRequest) -> Response:
            async def work() -> Response:
                return PlainTextResponse(await models.load_lora_adapter(request))
            return await _serve(work())

        @app.post("/v1/unload_lora_adapter", response_class=Response,
                  responses=responses(None, 400, 401, 404, 413, 503, text=True))
        async def unload_lora_adapter(request: UnloadLoRAAdapterRequest) -> Response:
            async def work() -> Response:
                return PlainTextResponse(await models.unload_lora_adapter(request))
            return await _serve(work())

    if config.enable_tokenizer_info_endpoint:  # off by default, as in vLLM
        @app.get("/tokenizer_info", responses=responses(TokenizerInfoResponse, 401))
        async def tokenizer_info() -> Response:
            return await _serve(run_blocking(lambda: JSONResponse(tokenization.tokenizer_info())))

    @app.post("/tokenize", responses=responses(TokenizeResponse, 400, 401, 404, 413))
    async def tokenize(request: TokenizeRequest) -> Response:
        async def work() -> Response:
            return JSONResponse((await tokenization.tokenize(request)).model_dump(exclude_none=True))
        return await _serve(work())

    @app.post("/detokenize", responses=responses(DetokenizeResponse, 400, 401, 404, 413))
    async def detokenize(request: DetokenizeRequest) -> Response:
        async def work() -> Response:
            return JSONResponse((await tokenization.detokenize(request)).model_dump())
        return await _serve(work())

    @app.get("/health", response_class=Response, responses=responses(None, 503))
    async def health() -> Response:
        try:
            if engine.errored:
                raise EngineDeadError()
            await engine.check_health()
        except EngineDeadError as e:
            return OpenAIError(str(e), 503).to_response()
        return Response(status_code=200)

    # HEAD too: load balancers and orchestrators probe with it (one operation in the OpenAPI document).
    app.head("/health", response_class=Response, include_in_schema=False)(health)

    @app.get("/version", responses=responses(None, 401))
    async def version() -> Response:
        return JSONResponse({"version": __version__})

    @app.get("/metrics", response_class=Response, responses=responses(None, 401, text=True))
    async def show_metrics() -> Response:
        await metrics.refresh(engine)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    dashboard_paths = add_dashboard_routes(app, engine, metrics)
    drop_validation_responses(app)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, exc: RequestValidationError) -> Response:
        return _validation_message(exc).to_response()

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
        message = str(exc.detail)
        headers = dict(exc.headers or {})
        if exc.status_code == 404:
            message = f"Not found: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"Method {request.method} not allowed on {request.url.path}"
            headers["Allow"] = ", ".join(_allowed_methods(app, request.scope))
        elif exc.status_code == 400 and isinstance(exc.__cause__, RecursionError):  # json.loads gave up first
            message = f"body: JSON nested more than {MAX_JSON_DEPTH} levels deep (the most a request may nest)"
        response = OpenAIError(message, exc.status_code).to_response()
        response.headers.update(headers)
        return response

    @app.exception_handler(OpenAIError)
    async def on_openai_error(_: Request, exc: OpenAIError) -> Response:
        return exc.to_response()

    @app.exception_handler(EngineDeadError)
    async def on_engine_dead(_: Request, exc: EngineDeadError) -> Response:
        return OpenAIError(str(exc), 503).to_response()

    # Added inner to outer: the body limit runs after the key check, both before any parsing.
    app.add_middleware(BodySizeLimitMiddleware,
                       max_bytes=config.max_request_body_bytes or DEFAULT_MAX_REQUEST_BODY_BYTES)
    if config.api_key:
        open_paths = {"/health", *dashboard_paths} | ({"/metrics"} if config.metrics_no_auth else set())
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key, open_paths=frozenset(open_paths))
    origins = _origins(config.allowed_origins)
    if origins:
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_credentials=True,
                           allow_methods=["*"], allow_headers=["*"], expose_headers=["x-request-id"])
    app.add_middleware(RequestIdMiddleware)  # added last: outermost, so every response gets the header
    return app


def _allowed_methods(app: FastAPI, scope: Scope) -> list[str]:
    """Every method some route serves at this path: Starlette's 405 names only the first
    route that matched the path, and several routes may share one (GET and DELETE)."""
    methods: set[str] = set()
    for route in app.router.routes:
        if isinstance(route, Route) and route.methods and route.matches(scope)[0] != Match.NONE:
            methods |= route.methods
    return sorted(methods)


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
