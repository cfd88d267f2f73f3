"""What a request body may cost the gateway, checked before any route decodes it.

Every body is capped in size as it streams in: a declared `Content-Length` over the cap
is answered 413 at once, without reading a byte; a body sent without one (chunked) is
counted as it arrives and cut off at the cap, so the gateway never holds more than
`max_body_bytes` of one request. A JSON body (any route's) is then checked whole by
`codec_json.check_json`, which builds no objects: well-formed, not nested too deeply,
and with at most so many arrays, objects, elements and members. Only then does a route
see it, so whatever decodes it (FastAPI's pydantic models, or `BodyParser` into a
msgspec Struct) makes a bounded number of objects, and a body it cannot take is a 4xx
with a message, never a 500 that drops the connection.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Annotated, TypeVar

from fastapi import Depends, HTTPException, Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from plexrl.limits import CallLimits
from plexrl_gateway.codec import CodecError
from plexrl_gateway.codec_json import check_json
from plexrl_gateway.errors import error_body

T = TypeVar("T")

INLINE_DECODE_BYTES = 64 * 1024
"""Bodies up to this size decode on the event loop; a larger one decodes in a thread, so
a 30 MB body does not hold up every other request for the time it takes."""


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
    """ASGI middleware capping every HTTP request body at `max_body_bytes`, and checking
    every JSON body with `check_json` before the app sees it."""

    def __init__(self, app: ASGIApp, limits: CallLimits) -> None:
        self._app = app
        self._limits = limits
        self._max = limits.max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self._max:
            await self._answer(send, 413, too_large_message(self._max), close=True)
            return
        if _is_json(scope):
            await self._checked_json(scope, receive, send)
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
                await self._answer(send, 413, too_large_message(self._max), close=True)

    async def _checked_json(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Reads the whole JSON body (within the cap), checks it, then hands it on."""
        chunks: list[bytes] = []
        seen = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away; nobody to answer
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > self._max:
                await self._answer(send, 413, too_large_message(self._max), close=True)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        del chunks
        try:
            if body:  # an empty body is the route's to refuse or accept
                check_json(body, self._limits)
        except CodecError as exc:
            # The body was read to its end: the connection stays good for the next call.
            await self._answer(send, 400, str(exc))
            return
        await self._app(scope, _replay(body, receive), send)

    async def _answer(self, send: Send, status: int, message: str, close: bool = False) -> None:
        body = json.dumps(error_body(message)).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        if close:  # the rest of the body was never read
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body read once, then the connection's own messages (a disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _is_json(scope: Scope) -> bool:
    for name, value in scope.get("headers", ()):
        if name == b"content-type":
            return is_json_media(value.decode("latin-1"))
    return False


def is_json_media(content_type: str) -> bool:
    """What FastAPI (and the forward routes) decode as JSON: `application/json` or a
    `+json` type."""
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


class ParsingBusyError(HTTPException):
    """Every decoding slot stayed taken for the wait: 503, try again after Retry-After."""

    def __init__(self, limits: CallLimits) -> None:
        super().__init__(
            503,
            f"the gateway is decoding {limits.max_parsing_bodies} request bodies already and "
            f"none finished within {limits.parse_wait_s}s; retry after {limits.retry_after_s}s",
            headers={"Retry-After": str(limits.retry_after_s)},
        )


class BodyParser:
    """Decodes the large bodies (forward / forward_backward), at most
    `max_parsing_bodies` at once, those over `INLINE_DECODE_BYTES` in a thread.

    What decoding builds lives only inside `parse`: the caller's `decode` turns it into
    the compact form it keeps (a protobuf with packed arrays), so the slots bound the
    memory decoding holds at any moment, whatever the number of requests in flight."""

    def __init__(self, limits: CallLimits) -> None:
        self.limits = limits
        self._slots = asyncio.Semaphore(limits.max_parsing_bodies)

    async def parse(self, body: bytes, decode: Callable[[bytes], T]) -> T:
        """`decode(body)` in a slot; a CodecError it raises is a 400 that says why."""
        try:
            async with asyncio.timeout(self.limits.parse_wait_s):
                await self._slots.acquire()
        except TimeoutError:
            raise ParsingBusyError(self.limits) from None
        try:
            if len(body) <= INLINE_DECODE_BYTES:
                return decode(body)
            return await asyncio.to_thread(decode, body)
        except CodecError as exc:
            raise HTTPException(400, str(exc)) from None
        finally:
            self._slots.release()


async def _body_parser(request: Request) -> BodyParser:
    parser: BodyParser = request.app.state.body_parser
    return parser


Parser = Annotated[BodyParser, Depends(_body_parser)]
"""The app's BodyParser (plexrl_gateway.app puts one on `app.state`)."""
