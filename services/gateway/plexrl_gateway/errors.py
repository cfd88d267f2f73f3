"""Every failure the gateway answers is JSON that says what was wrong.

The Tinker SDK takes an empty-bodied 400 for a proxy reset and retries it, and shows
the body of any other error to the user, so no error leaves without a message.
"""

from __future__ import annotations

import enum
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)


class Category(enum.StrEnum):
    """Whose fault a failure is, as the Tinker SDK's `RequestFailedError.category` reads it."""

    USER = "user"
    """The request was wrong; sending it again will fail again."""
    SERVER = "server"
    """Something on our side failed; a retry may work."""


class ApiError(Exception):
    """An HTTP error with a message for the caller."""

    def __init__(
        self,
        status: int,
        message: str,
        category: Category = Category.USER,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.category = category
        self.headers = headers
        """Extra response headers (Retry-After of a 429)."""


def bad_request(message: str) -> ApiError:
    return ApiError(400, message)


def not_found(message: str) -> ApiError:
    """Also the answer for another tenant's object: its existence is not revealed."""
    return ApiError(404, message)


def error_body(message: str, category: Category = Category.USER) -> dict[str, Any]:
    return {"error": message, "category": str(category)}


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(
            error_body(exc.message, exc.category), status_code=exc.status, headers=exc.headers
        )

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = [_describe(e) for e in exc.errors()]
        body = error_body("invalid request: " + "; ".join(problems))
        body["detail"] = problems
        return JSONResponse(body, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(
            error_body(str(exc.detail)), status_code=exc.status_code, headers=exc.headers
        )

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        body = error_body(f"internal error: {type(exc).__name__}: {exc}", Category.SERVER)
        return JSONResponse(body, status_code=500)


def _describe(error: Any) -> str:
    where = ".".join(str(p) for p in error.get("loc", ()) if p != "body") or "body"
    return f"{where}: {error.get('msg', 'invalid')}"
