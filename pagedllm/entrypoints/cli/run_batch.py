"""`pagedllm run-batch`: an OpenAI batch file (JSONL) through the engine, as `vllm run-batch`.

Each request goes through the server's own FastAPI app, called in-process over httpx's ASGI
transport: the same validation, defaults and error bodies as `pagedllm serve`, no socket.
A bad line (invalid JSON, unknown url, a 400) gets its error line; it never stops the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from typing import Any

from pagedllm.entrypoints.cli.engine_args import add_engine_args, engine_args_from_namespace
from pagedllm.entrypoints.cli.flags import add_dataclass_flags
from pagedllm.entrypoints.openai.server_config import ServerConfig

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/v1/score", "/v1/rerank")


def add_run_batch_parser(subparsers) -> None:
    p = subparsers.add_parser("run-batch", help="run an OpenAI batch file (JSONL) through the engine")
    p.add_argument("-i", "--input-file", required=True,
                   help="JSONL, one request a line: {custom_id, method: POST, url, body}")
    p.add_argument("-o", "--output-file", required=True, help="JSONL results, one a line, in input order")
    add_engine_args(p, model_positional=True)
    # The options of the served app that apply to a batch: the names requests may use, the chat
    # template, adapters and tool calls.
    add_dataclass_flags(p, ServerConfig, only=("served_model_names", "chat_template", "lora_modules",
                                               "enable_auto_tool_choice", "tool_call_parser"))
    p.add_argument("--max-concurrency", type=int, default=256,
                   help="requests in flight at once; the engine batches them (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_batch)


def run_batch(args: argparse.Namespace) -> int:
    if args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    try:
        with open(args.input_file, encoding="utf-8") as f:
            lines = [line for line in f.read().splitlines() if line.strip()]
    except OSError as e:
        raise ValueError(f"cannot read {args.input_file}: {e.strerror}") from None
    start = time.perf_counter()
    try:
        results = asyncio.run(_run(args, lines))
    except KeyboardInterrupt:
        print("interrupted: no results written", file=sys.stderr)
        return 130
    with open(args.output_file, "w", encoding="utf-8") as f:
        for result in results:
            f.write(json.dumps(result, ensure_ascii=False) + "\n")
    ok = sum(1 for r in results if r["error"] is None and r["response"]["status_code"] == 200)
    print(f"{len(results)} requests in {time.perf_counter() - start:.1f} s: {ok} succeeded, {len(results) - ok} "
          f"failed; results in {args.output_file}", file=sys.stderr)
    return 0


async def _run(args: argparse.Namespace, lines: list[str]) -> list[dict[str, Any]]:
    import httpx
    from tqdm import tqdm

    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.entrypoints.openai.api_server import build_app

    config = ServerConfig.from_namespace(args)
    engine = AsyncLLM.from_engine_args(engine_args_from_namespace(args))  # inside the loop: it binds to it
    try:
        app = build_app(engine, config)
        await app.state.models.init_static_loras()
        sem = asyncio.Semaphore(args.max_concurrency)
        bar = tqdm(total=len(lines), desc="Running batch", unit="req", disable=args.no_progress)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://run-batch", timeout=None) as client:
            async def one(line: str) -> dict[str, Any]:
                async with sem:
                    result = await run_line(client, line)
                bar.update(1)
                return result

            results = await asyncio.gather(*(one(line) for line in lines))
        bar.close()
        return list(results)
    finally:
        engine.shutdown()


async def run_line(client: Any, line: str) -> dict[str, Any]:
    """One input line to its output line (OpenAI's batch output format)."""
    try:
        request = json.loads(line)
    except ValueError as e:
        return _output(None, error=_error("invalid_json", f"line is not valid JSON: {e}"))
    if not isinstance(request, dict):
        return _output(None, error=_error("invalid_request", "line must be a JSON object"))
    custom_id = request.get("custom_id")
    problem = _check(request)
    if problem:
        return _output(custom_id, error=_error("invalid_request", problem))
    try:
        resp = await client.post(request["url"], json=request["body"])
        body = resp.json()
    except Exception as e:  # a response that is not JSON, a failure in the app: this line's error only
        return _output(custom_id, error=_error("internal_error", f"{type(e).__name__}: {e}"))
    request_id = resp.headers.get("x-request-id") or uuid.uuid4().hex
    return _output(custom_id, response={"status_code": resp.status_code, "request_id": request_id, "body": body})


def _check(request: dict[str, Any]) -> str | None:
    if not isinstance(request.get("custom_id"), str):
        return "custom_id must be a string"
    if request.get("method", "POST") != "POST":
        return f"method must be POST, got {request.get('method')!r}"
    if request.get("url") not in URLS:
        return f"url must be one of {', '.join(URLS)}; got {request.get('url')!r}"
    body = request.get("body")
    if not isinstance(body, dict):
        return "body must be a JSON object"
    if body.get("stream"):
        return "stream is not supported in a batch"
    return None


def _error(code: str, message: str) -> dict[str, str]:
    return {"code": code, "message": message}


def _output(custom_id: Any, response: dict[str, Any] | None = None,
            error: dict[str, str] | None = None) -> dict[str, Any]:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": response, "error": error}
