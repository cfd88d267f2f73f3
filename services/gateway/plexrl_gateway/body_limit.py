"""Request bodies larger than the cap are refused with 413 before they are read.

A declared `Content-Length` over the cap is answered at once, without reading a byte;
a body sent without one (chunked) is counted as it streams in and cut off at the cap,
so the gateway never holds more than `max_body_bytes` of one request.
"""

from __future__ import annotations

import json

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from plexrl_gateway.errors import error_body


class BodyTooLargeError(HTTPException):
    """Raised from `receive` while a route reads its body; answered as 413.

    An HTTPException, so FastAPI's body parsing passes it on instead of turning it into
    a 400 "error parsing the body"."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, too_large_message(limit))


def too_large_message(limit: int) -> str:
    return (
        f"request body is larger than {limit} bytes, the most one call may send; split the "
        "data into several calls"
    )


class BodySizeLimit:
    """ASGI middleware capping every HTTP request body at `max_body_bytes`."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self._app = app
        self._max = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self._max:
            await self._refuse(send)
            return
        seen = 0
        started = False

        async def counted_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self._max:
                    raise BodyTooLargeError(self._max)
            return message

        async def watched_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self._app(scope, counted_receive, watched_send)
        except BodyTooLargeError:
            # Read outside a route (no handler turned it into a response): answer here.
            if not started:
                await self._refuse(send)

    async def _refuse(self, send: Send) -> None:
        body = json.dumps(error_body(too_large_message(self._max))).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
