"""Routes of the live dashboard. The page and its script load without the API key (they hold no
data, and a browser cannot attach a header to a typed-in URL); the page asks for the key and
sends it as a Bearer token to /dashboard/state, which the key middleware guards like any route."""

from __future__ import annotations

import asyncio
import time
from importlib import resources
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse, Response

from pagedllm.entrypoints.openai.openapi import responses

if TYPE_CHECKING:
    from pagedllm.engine.protocol import EngineClient
    from pagedllm.entrypoints.openai.metrics import ServerMetrics

PAGE_PATH = "/dashboard"
SCRIPT_PATH = "/dashboard/dashboard.js"
STATE_PATH = "/dashboard/state"
# What ApiKeyMiddleware lets through without the key: the static files only.
OPEN_PATHS = frozenset({PAGE_PATH, SCRIPT_PATH})

# The page loads only its own script and styles and fetches only this server; no other site may
# frame it (clickjacking the key form) and no response is sniffed into another type.
_CSP = ("default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; connect-src 'self'; "
        "img-src 'self' data:; form-action 'none'; base-uri 'none'; frame-ancestors 'none'")
_HEADERS = {"cache-control": "no-store", "content-security-policy": _CSP, "x-frame-options": "DENY",
            "x-content-type-options": "nosniff", "referrer-policy": "no-referrer"}


def _asset(name: str) -> str:
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


def token_counters(metrics: ServerMetrics) -> dict[str, float]:
    """The cumulative prompt and generation tokens the server's Prometheus counters hold (read, not
    changed): the page turns successive readings into tokens/s."""
    labels = {"model_name": metrics.model_name}
    out = {}
    for key, name in (("prompt_tokens", "pagedllm:prompt_tokens_total"),
                      ("generation_tokens", "pagedllm:generation_tokens_total")):
        out[key] = metrics.registry.get_sample_value(name, labels) or 0.0
    return out


async def dashboard_state(engine: EngineClient, metrics: ServerMetrics) -> dict[str, Any]:
    """One poll's worth: stats of all engine cores together, then each core's scheduler snapshot
    (block map, queues, its own stats), and the token counters with the time they were read."""
    stats, engines = await asyncio.gather(engine.get_stats(), engine.get_scheduler_state())
    return {
        "timestamp": time.time(),
        "model": metrics.model_name,
        **token_counters(metrics),
        "stats": stats,
        "engines": engines,
    }


def add_dashboard_routes(app: FastAPI, engine: EngineClient, metrics: ServerMetrics) -> frozenset[str]:
    """Add the page, its script and its JSON state; returns the paths that need no API key."""
    page, script = _asset("index.html"), _asset("dashboard.js")

    @app.get(PAGE_PATH, include_in_schema=False)
    async def dashboard_page() -> Response:
        return HTMLResponse(page, headers=_HEADERS)

    @app.get(SCRIPT_PATH, include_in_schema=False)
    async def dashboard_script() -> Response:
        return Response(script, media_type="text/javascript", headers=_HEADERS)

    @app.get(STATE_PATH, responses=responses(None, 401, 503))
    async def dashboard_state_json() -> Response:
        """The live dashboard's data: KV block map, queues, token counters, engine stats."""
        return JSONResponse(await dashboard_state(engine, metrics), headers=_HEADERS)

    return OPEN_PATHS
