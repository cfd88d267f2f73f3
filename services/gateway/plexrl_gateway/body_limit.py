"""What a request body may cost the gateway, checked before any route decodes it.

Every body is capped in size as it streams in: a declared `Content-Length` over the cap
is answered 413 at once, without reading a byte; a body sent without one (chunked) is
counted as it arrives and cut off at the cap, so the gateway never holds more than
`max_body_bytes` of one request, nor more than `max_held_body_bytes` of all requests
together (`BodyBudget`). A JSON body (any route's) is then checked whole by
`codec_json.check_json`, which builds no objects: well-formed, not nested too deeply,
and with at most so many arrays, objects, elements and members. Only then does a route
see it, so whatever decodes it (FastAPI's pydantic models, or `BodyParser` into a
msgspec Struct) makes a bounded number of objects, and a body it cannot take is a 4xx
with a message, never a 500 that drops the connection.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping
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


class BodiesBusyError(HTTPException):
    """The bodies the gateway holds left no room for this one within the wait: 503."""

    def __init__(self, limits: CallLimits) -> None:
        super().__init__(
            503,
            f"the gateway holds {limits.max_held_body_bytes} bytes of request bodies already "
            f"and none made room within {limits.parse_wait_s}s; retry after "
            f"{limits.retry_after_s}s",
            headers={"Retry-After": str(limits.retry_after_s)},
        )


class BodyBudget:
    """Bytes of request bodies held at once, all requests together.

    Taken as the bytes arrive (never by a declared Content-Length, which a client could
    declare and then not send, holding room it never fills) and given back when the
    request is answered, the earliest the app lets go of its body."""

    def __init__(self, limits: CallLimits) -> None:
        self._limits = limits
        self._room = max(limits.max_held_body_bytes, limits.max_body_bytes)
        self._held = 0
        self._freed = asyncio.Condition()

    async def take(self, n: int) -> None:
        """Takes `n` bytes, waiting up to `parse_wait_s` for room; BodiesBusyError if none."""
        if self._held + n <= self._room:
            self._held += n
            return
        try:
            async with asyncio.timeout(self._limits.parse_wait_s), self._freed:
                await self._freed.wait_for(lambda: self._held + n <= self._room)
                self._held += n
        except TimeoutError:
            raise BodiesBusyError(self._limits) from None

    async def give_back(self, n: int) -> None:
        if n:
            self._held -= n
            async with self._freed:
                self._freed.notify_all()

    @property
    def held(self) -> int:
        return self._held


class BodySizeLimit:
    """ASGI middleware capping every HTTP request body at `max_body_bytes` and all bodies
    held at once at `max_held_body_bytes`, and checking every JSON body with `check_json`
    before the app sees it."""

    def __init__(self, app: ASGIApp, limits: CallLimits, budget: BodyBudget) -> None:
        self._app = app
        self._limits = limits
        self._max = limits.max_body_bytes
        self._budget = budget

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self._max:
            await self._answer(send, 413, too_large_message(self._max), close=True)
            return
        seen = 0

        async def counted_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                size = len(message.get("body", b""))
                if seen + size > self._max:
                    raise BodyTooLargeError(self._max)
                await self._budget.take(size)
                seen += size
            return message

        try:
            if _is_json(scope):
                await self._checked_json(scope, counted_receive, send)
            else:
                await self._streamed(scope, counted_receive, send)
        finally:
            await self._budget.give_back(seen)

    async def _streamed(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A body the app reads itself (protobuf), counted as it does."""
        started = False

        async def watched_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self._app(scope, receive, watched_send)
        except (BodyTooLargeError, BodiesBusyError) as exc:
            # Read outside a route (no handler turned it into a response): answer here.
            if not started:
                await self._refuse(send, exc)

    async def _refuse(self, send: Send, exc: HTTPException) -> None:
        # The rest of the body is never read: the connection cannot serve another call.
        await self._answer(send, exc.status_code, str(exc.detail), exc.headers, close=True)

    async def _checked_json(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Reads the whole JSON body (within the cap), checks it, then hands it on."""
        chunks: list[bytes] = []
        while True:
            try:
                message = await receive()
            except (BodyTooLargeError, BodiesBusyError) as exc:
                await self._refuse(send, exc)
                return
            if message["type"] != "http.request":
                return  # the client went away; nobody to answer
            chunks.append(message.get("body", b""))
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

    async def _answer(
        self,
        send: Send,
        status: int,
        message: str,
        extra: Mapping[str, str] | None = None,
        close: bool = False,
    ) -> None:
        body = json.dumps(error_body(message)).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            *((k.lower().encode(), v.encode()) for k, v in (extra or {}).items()),
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
