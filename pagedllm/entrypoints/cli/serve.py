"""`pagedllm serve`: start the engine, then the OpenAI-compatible HTTP server on it."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket

from pagedllm.entrypoints.cli.engine_args import add_engine_args, engine_args_from_namespace

logger = logging.getLogger(__name__)

API_KEY_ENV = "PAGEDLLM_API_KEY"


def add_serve_parser(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    add_engine_args(p, model_positional=True)
    p.add_argument("--host", default="0.0.0.0", help="address to bind (default: all interfaces)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer <key>' on /v1/* (default: ${API_KEY_ENV})")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients use; default: the model argument")
    p.add_argument("--chat-template", default=None, help="Jinja chat template, as a file path or inline text")
    p.add_argument("--allowed-origins", nargs="+", default=None,
                   help="CORS origins to allow (space- or comma-separated); default: no CORS headers")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let the model decide to call tools (tool_choice "auto"); needs --tool-call-parser')
    p.add_argument("--tool-call-parser", default=None, help="hermes, llama3_json, mistral or pythonic")
    p.add_argument("--reasoning-parser", default=None, help="deepseek_r1 or qwen3")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    p.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    if args.api_key is None:
        args.api_key = os.environ.get(API_KEY_ENV) or None
    # uvicorn re-raises the signal that stopped it once it has shut down; turning SIGTERM
    # into KeyboardInterrupt (as SIGINT already is) lets the engine shut down after it.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        return asyncio.run(_serve(args))
    except KeyboardInterrupt:
        return 0


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


async def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.entrypoints.openai.api_server import build_app

    sock = _bind(args.host, args.port)  # before the (slow) engine start: a taken port fails fast
    # Built inside the running loop: the engine binds its output queues to it.
    engine = AsyncLLM.from_engine_args(engine_args_from_namespace(args))
    try:
        app = build_app(engine, args)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                                timeout_keep_alive=5)
        server = uvicorn.Server(config)
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            host = "localhost" if args.host in ("0.0.0.0", "::", "") else args.host
            mc = engine.model_config
            names = ", ".join(args.served_model_name or [mc.model or mc.model_path])
            print(f"pagedllm: serving {names} at http://{host}:{args.port}/v1", flush=True)
        await task
        return 0 if server.started else 1
    finally:
        engine.shutdown()
        sock.close()


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
