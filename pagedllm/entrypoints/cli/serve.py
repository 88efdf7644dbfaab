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
from pagedllm.entrypoints.cli.flags import add_dataclass_flags
from pagedllm.entrypoints.openai.server_config import (
    ServerConfig,
)

logger = logging.getLogger(__name__)

API_KEY_ENV = "PAGEDLLM_API_KEY"


def add_serve_parser(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    add_engine_args(p, model_positional=True)
    add_dataclass_flags(p, ServerConfig)
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
    except Exception:
        if _stop_signals:  # the interrupt, wrapped by a library it went through (pydantic, building a schema)
            return 0
        raise


_stop_signals: list[int] = []  # the signals that stopped the server, as they came


def _raise_interrupt(signum: int, frame: object) -> None:
    _stop_signals.append(signum)
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
