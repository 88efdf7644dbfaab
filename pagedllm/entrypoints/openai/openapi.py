"""What the served OpenAPI document (/openapi.json, /docs) says each route answers: the
status codes this server really sends, each with the OpenAI error body, and not FastAPI's
default 422, which it never sends (a body that fails validation gets a 400). Clients and
fuzzers (tests/entrypoints/openai/test_fuzz.py) read the document, so it must not lie."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from pagedllm.entrypoints.openai.protocol import ErrorResponse

_ERRORS = {
    400: "Invalid request: malformed JSON, a wrong type, a value out of range, a prompt too long",
    401: "Missing or wrong API key (a server started with --api-key)",
    404: "Unknown model",
    413: "Request body larger than the server's limit",
    503: "The engine is not running",
}

_STREAM = {"text/event-stream": {"schema": {"type": "string"}}}


def responses(
    ok: type | None = None, *errors: int, stream: bool = False, text: bool = False
) -> dict[int | str, dict[str, Any]]:
    """The `responses=` of a route: its success body (JSON, and SSE when it streams, or
    plain text), then its errors. A route whose success body is not JSON also needs
    `response_class=Response`, or FastAPI documents a JSON 200 of its own."""
    out: dict[int | str, dict[str, Any]] = {}
    if text:
        out[200] = {"description": "Successful response", "content": {"text/plain": {"schema": {"type": "string"}}}}
    if ok is not None:
        out[200] = {"model": ok, "description": "Successful response"}
        if stream:
            out[200] |= {"content": _STREAM, "description": "The response, or server-sent events if `stream` is true"}
    for code in errors:
        out[code] = {"model": ErrorResponse, "description": _ERRORS[code]}
    return out


def drop_validation_responses(app: FastAPI) -> None:
    """Generate the document once, without the 422 responses and their schemas."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate()
            for path_item in schema.get("paths", {}).values():
                for operation in path_item.values():
                    if isinstance(operation, dict):
                        operation.get("responses", {}).pop("422", None)
            components = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
