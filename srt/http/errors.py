"""One error envelope for every route and status.

Every error the HTTP process answers is JSON of the form

    {"error": {"message": str, "type": str, "param": str | null, "code": str}}

whether it comes from a handler (`RequestError`, `ApiError`), from routing (404, 405), from a
middleware (401, 403, 413, 503) or from a bug (500). Never FastAPI's 422 and never an HTML or
plain-text page (malformed HTTP that the server library rejects before the app runs is the one
exception).
"""

from __future__ import annotations

import json
import logging
from typing import Any, Awaitable, Callable

logger = logging.getLogger("srt.http")

# OpenAI's error types by status; any other 4xx is an invalid request.
_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}
_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def error_type(status: int) -> str:
    if status >= 500:
        return "server_error"
    return _TYPES.get(status, "invalid_request_error")


def error_body(status: int, message: str, param: str | None, code: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type(status), "param": param,
                      "code": code}}


class ApiError(Exception):
    """An error answer raised from anywhere in a request's handling (limits, auth, queue)."""

    def __init__(self, status: int, message: str, param: str | None, code: str,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code
        self.headers = headers or {}


def error_event(status: int, message: str, param: str | None, code: str) -> bytes:
    """The envelope as one Server-Sent Event: how a stream that cannot go on ends."""
    return f"data: {json.dumps(error_body(status, message, param, code))}\n\n".encode()


def error_response(status: int, message: str, param: str | None, code: str,
                   headers: dict[str, str] | None = None) -> Any:
    from fastapi.responses import JSONResponse

    return JSONResponse(status_code=status, content=error_body(status, message, param, code),
                        headers=headers)


async def send_error(send: Callable[[dict[str, Any]], Awaitable[None]], status: int,
                     message: str, param: str | None, code: str,
                     headers: dict[str, str] | None = None) -> None:
    """Answer from a raw ASGI middleware (before any route runs)."""
    body = json.dumps(error_body(status, message, param, code)).encode()
    raw_headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode())]
    raw_headers += [(k.lower().encode("latin-1"), v.encode("latin-1"))
                    for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})


def install_error_handlers(app: Any) -> None:
    """Route every exception the app can raise to the envelope."""
    from fastapi import Request
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from srt.managers.request_types import RequestError, ServerFailure

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> Any:
        return error_response(400, str(exc), None, "invalid_request")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Any:
        code = _CODES.get(exc.status_code, "http_error")
        message = str(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        return error_response(exc.status_code, message, None, code,
                              dict(exc.headers) if exc.headers else None)

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, exc: RequestError) -> Any:
        return error_response(exc.status, str(exc), exc.param, exc.code)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> Any:
        return error_response(exc.status, str(exc), exc.param, exc.code, exc.headers)

    @app.exception_handler(ServerFailure)
    async def _server_failure(_: Request, exc: ServerFailure) -> Any:
        return error_response(503, str(exc), None, "server_failed")

    @app.exception_handler(Exception)
    async def _bug(_: Request, exc: Exception) -> Any:
        # Starlette re-raises after this answer, so the traceback reaches the log once.
        return error_response(500, "internal server error", None, "internal_error")
