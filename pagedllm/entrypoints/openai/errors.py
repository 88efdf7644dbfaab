"""The error every route raises while serving, and its OpenAI-style body (`{"error": {...}}`),
apart from the serving classes so that any module of the server can raise one."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from pagedllm.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class OpenAIError(Exception):
    """Raised anywhere while serving; the app turns it into an OpenAI error body."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, err_type: str | None = None):
        super().__init__(message)
        # Messages may quote the request (a field name, a value): a lone surrogate from it
        # would make the UTF-8 encoding of the error body itself fail.
        self.message = _printable(message)
        self.status = status
        self.param = _printable(param) if param is not None else None
        self.err_type = err_type or ERROR_TYPES.get(status, "invalid_request_error")

    def to_body(self) -> dict[str, Any]:
        info = ErrorInfo(message=self.message, type=self.err_type, param=self.param, code=self.status)
        return ErrorResponse(error=info).model_dump()

    def to_response(self) -> JSONResponse:
        return JSONResponse(self.to_body(), status_code=self.status)


def _printable(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")
