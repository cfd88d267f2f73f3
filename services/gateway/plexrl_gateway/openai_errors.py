"""Errors of the OpenAI-compatible API, shaped as OpenAI's: `{"error": {message, type, param,
code}}`.

The app's handlers answer the Tinker API's shape (`{"error": "...", "category": ...}`), so
the OpenAI router uses its own route class: every failure raised while a request is handled
(its dependencies, body validation, the shared gateway code's `ApiError`s) is turned into
OpenAI's shape there, with the status the OpenAI client maps to its exception classes.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute

from plexrl_gateway.errors import ApiError

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    408: "timeout",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


class OpenAIError(ApiError):
    """An ApiError that also names the request field at fault and an OpenAI error code."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(status, message, headers=headers)
        self.param = param
        self.code = code


def invalid(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    """A 400 about one field of the request."""
    return OpenAIError(400, message, param=param, code=code)


def unsupported(param: str, message: str) -> OpenAIError:
    """A 400 for a parameter PlexRL does not serve (the message says what to send)."""
    return OpenAIError(400, f"{param}: {message}", param=param, code="unsupported_parameter")


def error_body(exc: ApiError) -> dict[str, Any]:
    """`{"error": {message, type, param, code}}` of a failure."""
    param = exc.param if isinstance(exc, OpenAIError) else None
    code = exc.code if isinstance(exc, OpenAIError) else None
    if code is None and exc.status == 401:
        code = "invalid_api_key"
    kind = _TYPES.get(exc.status, "server_error" if exc.status >= 500 else "invalid_request_error")
    return {"error": {"message": exc.message, "type": kind, "param": param, "code": code}}


def error_response(exc: ApiError) -> JSONResponse:
    return JSONResponse(error_body(exc), status_code=exc.status, headers=exc.headers)


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    """A body that does not parse: OpenAI answers 400 naming the field."""
    problems = []
    param = None
    for error in exc.errors():
        where = ".".join(str(p) for p in error.get("loc", ()) if p != "body")
        param = param or where or None
        problems.append(f"{where or 'body'}: {error.get('msg', 'invalid')}")
    return OpenAIError(400, "invalid request: " + "; ".join(problems), param=param)


class OpenAIRoute(APIRoute):
    """A route whose failures are answered in OpenAI's error shape."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            try:
                return await handler(request)
            except ApiError as exc:
                return error_response(exc)
            except RequestValidationError as exc:
                return error_response(_validation_error(exc))

        return handle
