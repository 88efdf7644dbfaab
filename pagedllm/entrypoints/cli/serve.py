"""`pagedllm serve`: start the engine, then the OpenAI-compatible HTTP server on it."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import time

from pagedllm import envs
from pagedllm.entrypoints.cli.engine_args import add_engine_args, engine_args_from_namespace
from pagedllm.entrypoints.openai.server_config import (
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_LOG_STATS_INTERVAL_S,
    DEFAULT_MAX_CONVERSATION_ITEM_BYTES,
    DEFAULT_MAX_CONVERSATION_ITEMS,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    DEFAULT_MAX_TOOL_OUTPUT_BYTES,
    MAX_PARALLEL_TOOL_CALLS,
    METRICS_COMPAT_CHOICES,
    ServerConfig,
    parse_lora_module,
)

logger = logging.getLogger(__name__)

API_KEY_ENV = "PAGEDLLM_API_KEY"


def add_serve_parser(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    add_engine_args(p, model_positional=True)
    p.add_argument("--host", default="0.0.0.0", help="address to bind (default: all interfaces)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer <key>' on every route but /health "
                        f"(default: ${API_KEY_ENV})")
    p.add_argument("--metrics-no-auth", action="store_true",
                   help="with --api-key, leave /metrics open for scrapers (default: it needs the key too)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients use; default: the model argument")
    p.add_argument("--lora-modules", nargs="+", type=parse_lora_module, default=None, metavar="NAME=PATH",
                   help="LoRA adapters (PEFT directories) served from the start, each a model name clients may "
                        "use: name=path or JSON '{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'; "
                        "needs --enable-lora")
    p.add_argument("--chat-template", default=None,
                   help="Jinja chat template, as a file path or inline text (read once at start)")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="accept a `chat_template` (Jinja text, never a path) in requests; default: 400")
    p.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                   help="serve GET /tokenizer_info: the tokenizer's configuration (special tokens, class, "
                        "chat template; never file paths), as clients with a remote tokenizer (lm-eval) read it")
    p.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                   help="larger request bodies get 413 before they are parsed (default: %(default)s)")
    p.add_argument("--limit-concurrency", type=int, default=None,
                   help="open connections (and in-flight requests) beyond which new ones get 503; "
                        "default: the open-file limit (raised to its hard maximum) less 256")
    p.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT_S,
                   help="seconds a connection may take to send a complete request head (default: %(default)s)")
    p.add_argument("--timeout-keep-alive", type=int, default=5,
                   help="seconds an idle keep-alive connection stays open (default: %(default)s)")
    p.add_argument("--allowed-origins", nargs="+", default=None,
                   help="CORS origins to allow (space- or comma-separated); default: no CORS headers")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let the model decide to call tools (tool_choice "auto"); needs --tool-call-parser')
    p.add_argument("--tool-call-parser", default=None, help="hermes, llama3_json, mistral or pythonic")
    p.add_argument("--tool-choice-auto-grammar", action="store_true",
                   help='tool_choice "auto" under a grammar: plain text or one call in the --tool-call-parser\'s '
                        "markup (hermes unless given; not pythonic), so a model never tuned for tools can call "
                        "them; implies --enable-auto-tool-choice")
    p.add_argument("--max-parallel-tool-calls", type=int, default=MAX_PARALLEL_TOOL_CALLS,
                   help='most calls the grammar allows for tool_choice "required" unless parallel_tool_calls is '
                        "false (then one) (default: %(default)s)")
    p.add_argument("--responses-store", default=None,
                   help="where /v1/responses keeps stored responses and conversations: 'memory' (default) or "
                        "'sqlite:///relative.db' / 'sqlite:////absolute/path.db', which survives a restart")
    p.add_argument("--responses-store-max-entries", type=int, default=1000,
                   help="stored responses (and, separately, conversations) kept; the oldest written goes first "
                        "(default: %(default)s)")
    p.add_argument("--responses-store-ttl", type=float, default=None,
                   help="seconds a stored response or conversation lives after its last write; a background "
                        "response still running past it is cancelled (default: no expiry)")
    p.add_argument("--disable-responses-store", action="store_true",
                   help="store nothing: store=true and background responses get 400, conversations are off")
    p.add_argument("--max-conversation-items", type=int, default=DEFAULT_MAX_CONVERSATION_ITEMS,
                   help="most items one conversation holds; adding past it is a 400 (default: %(default)s)")
    p.add_argument("--max-conversation-item-bytes", type=int, default=DEFAULT_MAX_CONVERSATION_ITEM_BYTES,
                   help="largest conversation item (its JSON, in bytes); a larger one is a 400 (default: %(default)s)")
    p.add_argument("--max-tool-output-bytes", type=int, default=DEFAULT_MAX_TOOL_OUTPUT_BYTES,
                   help="largest output one POST /v1/responses/{id}/tool_outputs may carry (default: %(default)s)")
    p.add_argument("--log-stats-interval", type=float, default=DEFAULT_LOG_STATS_INTERVAL_S,
                   help="seconds between the stats lines (throughput, running / waiting requests, KV cache and "
                        "prefix cache use) (default: %(default)s)")
    p.add_argument("--disable-log-stats", action="store_true", help="no periodic stats lines")
    p.add_argument("--enable-log-requests", action="store_true",
                   help="log each generation request as it arrives: id, prompt length, sampling params, prompt")
    p.add_argument("--max-log-len", type=int, default=None,
                   help="with --enable-log-requests, the most prompt characters (and prompt token ids) a line "
                        "shows (default: all)")
    p.add_argument("--metrics-compat", choices=METRICS_COMPAT_CHOICES, default=None,
                   help="vllm: /metrics also exposes every series under vLLM's names (vllm:num_requests_running, "
                        "...), so dashboards written for vLLM work unchanged")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's log level (server events, access log); pagedllm's own lines follow "
                        "$PAGEDLLM_LOGGING_LEVEL (default INFO)")
    p.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    if args.api_key is None:
        args.api_key = envs.PAGEDLLM_API_KEY
    # uvicorn re-raises the signal that stopped it once it has shut down; turning SIGINT and SIGTERM
    # into KeyboardInterrupt lets the engine shut down after it. asyncio.run keeps a SIGINT handler
    # it did not install; its own would only cancel the main task, which the blocking start-up (GGUF
    # conversion, engine-core start) notices minutes later. An ignored SIGINT (a background job)
    # stays ignored.
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _raise_interrupt)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        return asyncio.run(_serve(args))
    except KeyboardInterrupt:
        return 0


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


async def _serve(args: argparse.Namespace) -> int:
    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.entrypoints.openai.api_server import build_app

    start = time.perf_counter()
    config = ServerConfig.from_namespace(args)
    sock = _bind(config.host, config.port)  # before the (slow) engine start: a taken port fails fast
    try:
        # Built inside the running loop: the engine binds its output queues to it.
        engine = AsyncLLM.from_engine_args(engine_args_from_namespace(args))
    except BaseException:
        sock.close()
        raise
    try:
        mc = engine.model_config
        names = ", ".join(config.served_model_names or [mc.model or mc.model_path])
        app = build_app(engine, config)
        await app.state.models.init_static_loras()  # a bad adapter stops the start with its message
        started = await serve_http(app, config, sock, names, start)
        return 0 if started else 1
    finally:
        engine.shutdown()
        sock.close()


async def serve_http(app, config: ServerConfig, sock: socket.socket, names: str, start: float) -> bool:
    """Run uvicorn on a bound socket until it is stopped, with the connection guards of
    openai/connections.py; returns whether it ever started."""
    import uvicorn

    from pagedllm.entrypoints.openai.connections import (
        default_connection_limit,
        guarded_protocol,
        install_accept_error_throttle,
        raise_open_file_limit,
    )

    limit = config.limit_concurrency or default_connection_limit(raise_open_file_limit())
    install_accept_error_throttle(asyncio.get_running_loop())
    server = uvicorn.Server(uvicorn.Config(
        app, log_level=config.uvicorn_log_level, timeout_keep_alive=config.timeout_keep_alive,
        limit_concurrency=limit, http=guarded_protocol(limit, config.header_timeout)))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        host = "localhost" if config.host in ("0.0.0.0", "::", "") else config.host
        logger.info("Serving %s on http://%s:%d (OpenAI API under /v1), started in %.1f s; at most %d connections",
                    names, host, config.port, time.perf_counter() - start, limit)
    await task
    return server.started


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.set_inheritable(False)
    return sock
