"""Plain ASGI middleware of the API server: request ids, the API key, the body-size limit.

Plain ASGI (not BaseHTTPMiddleware), which would buffer and re-wrap the receive channel
and so hide client disconnects from streaming responses."""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol import MAX_REQUEST_ID_CHARS
from pagedllm.entrypoints.openai.serving_engine import random_id


class RequestIdMiddleware:
    """Echo the client's x-request-id, or a fresh one, on every response; one longer than the
    body's `request_id` may be is refused (400), not echoed."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = Headers(scope=scope).get("x-request-id") or random_id()
        app = self.app
        if len(request_id) > MAX_REQUEST_ID_CHARS:
            request_id = random_id()
            app = OpenAIError(f"x-request-id is longer than {MAX_REQUEST_ID_CHARS} characters").to_response()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)["x-request-id"] = request_id
            await send(message)

        await app(scope, receive, send_with_id)


class ApiKeyMiddleware:
    """Every route needs 'Authorization: Bearer <key>' except the liveness probe (/health),
    and /metrics when the operator opened it (--metrics-no-auth). Any method, OPTIONS too: a
    404 or 405 without the key would tell which routes exist (CORS preflights never get here:
    the CORS middleware, outside this one, answers them). The scheme is case-insensitive
    (RFC 7235); the key is compared in constant time."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: frozenset[str] = frozenset({"/health"})) -> None:
        self.app = app
        self.expected = api_key.encode()
        self.open_paths = open_paths

    def _authorized(self, scope: Scope) -> bool:
        scheme, _, token = Headers(scope=scope).get("authorization", "").strip().partition(" ")
        # compare_digest on both, so a wrong scheme costs the same time as a wrong key
        scheme_ok = hmac.compare_digest(scheme.lower().encode(), b"bearer")
        return hmac.compare_digest(token.strip().encode(), self.expected) and scheme_ok

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths and not self._authorized(scope):
            error = OpenAIError("Invalid or missing API key; send it as 'Authorization: Bearer <key>'", 401)
            response = error.to_response()
            response.headers["www-authenticate"] = "Bearer"
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    """413 for a request body over `max_bytes`: from Content-Length before anything is read,
    or while a chunked body streams in, before it is parsed."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> OpenAIError:
        return OpenAIError(f"request body larger than {self.max_bytes} bytes (--max-request-body-bytes)", 413)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length")
        length = (length or "").strip()
        if length.isascii() and length.isdigit() and (len(length) > 18 or int(length) > self.max_bytes):
            await self._too_large().to_response()(scope, receive, send)
            return
        received = 0
        started = rejected = False

        async def counting_receive() -> Message:
            nonlocal received, rejected
            if rejected:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes and not started:
                    # Answer now; the app sees the client gone, and whatever it sends is dropped.
                    rejected = True
                    await self._too_large().to_response()(scope, receive, send)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if rejected:
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, counting_receive, guarded_send)
