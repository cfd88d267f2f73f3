"""The HTTP server every service runs inside its loop (the gateway's API, the state-store,
the health and metrics endpoints), with limits no client can talk it out of.

Uvicorn alone keeps a connection open as long as its client keeps it half-sent: a
request head trickling in a byte at a time resets the keep-alive timer, and nothing
caps how many connections are open, so a few hundred such clients hold every file
descriptor and the service stops for everyone. `HttpServer` closes a connection whose
head or body has not arrived in time (a deadline per phase that data does not extend),
refuses connections beyond a cap with a 503, and says so in one log line per interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Protocol

import uvicorn
from fastapi import FastAPI, Header, HTTPException, Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from plexrl import tracing
from plexrl.service_auth import bearer_matches
from plexrl.settings import CommonSettings

log = logging.getLogger(__name__)


class Watched(Protocol):
    """A long-running part of a service whose death or stall makes the service unhealthy
    (plexrl.kafka.MessageConsumer)."""

    @property
    def name(self) -> str: ...

    def health(self) -> dict[str, Any]: ...


def consumers_health(consumers: Sequence[Watched]) -> dict[str, Any]:
    """`{"ok": all ok, "consumers": {name: health}}` for a service's status body."""
    each = {c.name: c.health() for c in consumers}
    return {"ok": all(h.get("ok", True) for h in each.values()), "consumers": each}


def service_app(title: str, **options: Any) -> FastAPI:
    """A service's FastAPI app: no interactive docs, and FastAPI's own OpenTelemetry off
    (`tracing.NATIVE_TELEMETRY_OFF`: its one server span is `tracing.instrument_app`'s).
    `options`: FastAPI's others (`openapi_url=None`)."""
    return FastAPI(
        title=title,
        docs_url=None,
        redoc_url=None,
        telemetry=tracing.NATIVE_TELEMETRY_OFF,
        **options,
    )


def health_app(
    name: str,
    status: Callable[[], dict[str, Any]],
    watched: Sequence[Watched] = (),
    detail: Callable[[], dict[str, Any]] | None = None,
    token: str | None = None,
) -> FastAPI:
    """GET /healthz (200 with `status()`, or 503 when it says ok=False or a watched
    consumer is dead or stuck) and GET /metrics, both open and naming no tenant's job;
    with `detail`, GET /status answers `detail()` (what names jobs) to callers holding
    the service `token` (401 otherwise; open when the cluster has none, as on one machine)."""
    app = service_app(f"plexrl {name}")

    if detail is not None:
        read_detail = detail

        @app.get("/status")
        async def private_status(
            authorization: Annotated[str | None, Header()] = None,
        ) -> dict[str, Any]:
            if token and not bearer_matches(token, authorization):
                raise HTTPException(
                    401,
                    f"the {name}'s /status needs the cluster's service token: send "
                    "'Authorization: Bearer <token>' with the token set in PLEXRL_SERVICE_TOKEN",
                )
            return {"service": name, **read_detail()}

    @app.get("/healthz")
    def healthz(response: Response) -> dict[str, Any]:
        body = {"service": name, **status()}
        if watched:
            consumers = consumers_health(watched)
            body["consumers"] = consumers["consumers"]
            body["ok"] = bool(body.get("ok", True)) and consumers["ok"]
        if not body.get("ok", True):
            response.status_code = 503
        return body

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    tracing.instrument_app(app)
    return app


@dataclass(frozen=True)
class HttpLimits:
    """What one HTTP server holds open for its clients (settings `PLEXRL_HTTP_*`)."""

    max_connections: int = 512
    """Open connections at most; a new one beyond them is answered 503 and closed. Keep it
    well under the process's file descriptor limit (`ulimit -n`)."""
    max_connections_per_client: int = 128
    """Open connections from one client address at most, so that one client cannot take
    the whole `max_connections` from the others; beyond it, 503 and closed."""
    head_timeout_s: float = 10.0
    """Seconds for a request's line and headers, counted from when the connection opens
    or its previous response ends; bytes arriving do not extend it."""
    body_timeout_s: float = 60.0
    """Seconds for a request's whole body, counted from the end of its headers, plus the
    time its bytes so far take at `min_body_bytes_per_s`. The app's own time (a long
    poll) is not limited: the deadline stops once the body is in."""
    min_body_bytes_per_s: float = float(1 << 20)
    """A body arriving at least this fast on average keeps going past `body_timeout_s`
    (a large state uploaded to the state-store); one trickling in slower is cut there."""
    keep_alive_s: int = 5
    """Seconds an idle keep-alive connection waits for its next request."""
    max_head_bytes: int = 64 * 1024
    """Largest request line plus headers; a longer head is answered 431 and closed."""
    log_every_s: float = 10.0
    """Refused and timed-out connections are logged as one line per this many seconds."""

    @classmethod
    def from_settings(cls, settings: CommonSettings) -> HttpLimits:
        return cls(
            max_connections=settings.http_max_connections,
            max_connections_per_client=settings.http_max_connections_per_client,
            head_timeout_s=settings.http_head_timeout_s,
            body_timeout_s=settings.http_body_timeout_s,
            min_body_bytes_per_s=settings.http_min_body_bytes_per_s,
            keep_alive_s=settings.http_keep_alive_s,
            max_head_bytes=settings.http_max_head_bytes,
        )


class ConnectionReport:
    """Counts what the limits did to connections and logs it at most once per interval,
    so a flood of bad clients costs one line, not one per connection."""

    def __init__(
        self, server: str, every_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._server = server
        self._every_s = every_s
        self._clock = clock
        self._counts: Counter[str] = Counter()
        self._last: float | None = None

    def note(self, what: str) -> None:
        self._counts[what] += 1
        now = self._clock()
        if self._last is not None and now - self._last < self._every_s:
            return
        since = f"in the last {now - self._last:.0f}s" if self._last is not None else "so far"
        self._last = now
        counts = ", ".join(f"{n} {what}" for what, n in sorted(self._counts.items()))
        self._counts.clear()
        log.warning("HTTP server %s: connections %s %s", self._server, counts, since)


_HEAD, _BODY = "head", "body"
"""What a client owes the server: a request's line and headers, or the rest of its body."""


def _refusal(status: bytes, message: str, category: str) -> bytes:
    """A whole response that closes the connection, in the Tinker API's error shape."""
    body = json.dumps({"error": message, "category": category}).encode()
    return (
        b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\n"
        b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )


_BUSY = _refusal(
    b"503 Service Unavailable\r\nretry-after: 1",
    "too many open connections to this server; retry shortly",
    "server",
)


_JOINED_MAX = 64 * 1024
"""Largest body `HeadWithBody` copies to send with its head."""


class HeadWithBody(asyncio.Transport):
    """A connection's transport that sends a response's head together with what follows
    it in the same step of the loop (its body, as uvicorn writes the two apart): one
    send, one segment, instead of two. A head with nothing after it in that step goes
    out at the step's end on its own; anything else is written at once, in order."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        held = self._held
        if held is not None:
            self._held = None
            if len(data) <= _JOINED_MAX:
                self._transport.write(held + bytes(data))
                return
            self._transport.write(held)  # (a large body is not copied to join it)
            self._transport.write(data)
        elif data[:5] == b"HTTP/":
            self._held = bytes(data)
            self._loop.call_soon(self._flush)
        else:
            self._transport.write(data)

    def _flush(self) -> None:
        held, self._held = self._held, None
        if held is not None and not self._transport.is_closing():
            self._transport.write(held)

    def writelines(self, list_of_data: Iterable[bytes | bytearray | memoryview]) -> None:
        self.write(b"".join(list_of_data))

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def abort(self) -> None:
        self._held = None
        self._transport.abort()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._flush()
        self._transport.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._transport.get_protocol()

    def is_reading(self) -> bool:
        return self._transport.is_reading()

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def can_write_eof(self) -> bool:
        return self._transport.can_write_eof()

    def write_eof(self) -> None:
        self._flush()
        self._transport.write_eof()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + len(self._held or b"")

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._transport.get_write_buffer_limits()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._transport.set_write_buffer_limits(high, low)


class LimitedHttpProtocol(HttpToolsProtocol):
    """Uvicorn's httptools protocol (llhttp, in C) with a connection cap, read deadlines
    and a cap on a request's head.

    Invariant: while the client owes the server bytes (a head: from when the connection
    opens or its previous response ends, or a pipelined request begins; a body: from the
    end of its head to its last byte) exactly one deadline is armed, set when that phase
    began; while the app works or the response goes out, none is. One class per server
    (`for_server`) carries that server's limits, report and open connections per client
    address."""

    limits: ClassVar[HttpLimits] = HttpLimits()
    report: ClassVar[ConnectionReport] = ConnectionReport("?", HttpLimits().log_every_s)

    _reading: str | None = None
    """_HEAD between a request's first byte and the end of its head, _BODY from there to
    its last byte, None between requests (the parser's callbacks keep it)."""
    _phase: str | None = None
    """What the armed deadline is for: _HEAD, _BODY or None."""
    _deadline: asyncio.TimerHandle | None = None
    _body_started: float = 0.0
    _body_bytes: int = 0
    """Bytes received since the body's deadline was armed."""
    _head_bytes: int = 0
    """Bytes received since the last head ended (or the connection opened): all of them
    belong to the next head until it ends."""

    per_client: ClassVar[Counter[str]] = Counter()
    """Open connections by client address, of this server."""
    _counted: str | None = None

    @classmethod
    def for_server(cls, name: str, limits: HttpLimits) -> type[LimitedHttpProtocol]:
        state = {
            "limits": limits,
            "report": ConnectionReport(name, limits.log_every_s),
            "per_client": Counter(),
        }
        return type(cls.__name__, (cls,), state)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        client = self.client[0] if self.client else "?"
        if len(self.connections) > self.limits.max_connections:
            self._refuse(transport, f"refused over the cap of {self.limits.max_connections} open")
            return
        if self.per_client[client] >= self.limits.max_connections_per_client:
            cap = self.limits.max_connections_per_client
            self._refuse(transport, f"refused over the cap of {cap} open from one client")
            return
        self.per_client[client] += 1
        self._counted = client
        # What uvicorn writes from here on goes through it (its flow control keeps the
        # socket's own transport, to pause and resume reading).
        self.transport = HeadWithBody(transport, self.loop)
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._counted is not None:
            self.per_client[self._counted] -= 1
            if not self.per_client[self._counted]:
                del self.per_client[self._counted]
            self._counted = None
        super().connection_lost(exc)

    def _refuse(self, transport: asyncio.Transport, why: str, answer: bytes = _BUSY) -> None:
        self.report.note(why)
        transport.write(answer)
        transport.close()

    def data_received(self, data: bytes) -> None:
        if self._phase is _BODY:
            self._body_bytes += len(data)
        else:
            self._head_bytes += len(data)
        super().data_received(data)
        if self._reading is _HEAD and self._head_bytes > self.limits.max_head_bytes:
            # The parser holds a head's partial header in memory until it ends: cut it here.
            cap = self.limits.max_head_bytes
            self._disarm()
            self._refuse(
                self.transport,
                f"closed with a request head over {cap} bytes",
                _refusal(
                    b"431 Request Header Fields Too Large",
                    f"the request line and headers are larger than {cap} bytes; send less "
                    "in the URL and headers (the limit is PLEXRL_HTTP_MAX_HEAD_BYTES)",
                    "user",
                ),
            )
            return
        self._watch()

    def on_message_begin(self) -> None:
        self._reading = _HEAD
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._reading, self._head_bytes = _BODY, 0
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._reading = None
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._watch()

    def _owed(self) -> str | None:
        if self._reading is not None:
            return self._reading
        working = self.cycle is not None and not self.cycle.response_complete
        return None if working or self.pipeline else _HEAD

    def _watch(self) -> None:
        """Arms the deadline of the phase the connection is in, if it changed."""
        phase = self._owed()
        if phase is self._phase:
            return
        self._disarm()
        self._phase = phase
        if phase is _HEAD:
            self._deadline = self.loop.call_later(self.limits.head_timeout_s, self._expire, _HEAD)
        elif phase is _BODY:
            self._body_started, self._body_bytes = self.loop.time(), 0
            self._deadline = self.loop.call_later(self.limits.body_timeout_s, self._expire, _BODY)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self, what: str) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if what is _BODY:
            # Still arriving at the least rate on average: the body keeps going.
            due = (
                self._body_started
                + self.limits.body_timeout_s
                + self._body_bytes / self.limits.min_body_bytes_per_s
            )
            if due > self.loop.time():
                self._deadline = self.loop.call_at(due, self._expire, _BODY)
                return
        timeout = self.limits.head_timeout_s if what is _HEAD else self.limits.body_timeout_s
        kept_alive = self.cycle is not None and self._reading is None
        if what is _BODY or not kept_alive:
            # A used keep-alive connection that sent nothing more is closed quietly, as
            # uvicorn's keep-alive timer does; a connection that never sent a whole
            # request, or stalled in one, is what the report counts.
            self.report.note(f"closed with no complete request {what} after {timeout:g}s")
        self.transport.close()


class HttpServer:
    """Uvicorn serving an app until stopped, within `limits` (by default the environment's
    `PLEXRL_HTTP_*` settings); never installs signal handlers of its own."""

    def __init__(
        self,
        app: Any,
        host: str,
        port: int,
        limits: HttpLimits | None = None,
        settings: CommonSettings | None = None,
    ) -> None:
        """`settings`: where the limits (unless given) and the certificate come from;
        None reads the environment."""
        settings = settings or CommonSettings()
        limits = limits or HttpLimits.from_settings(settings)
        config = uvicorn.Config(
            tracing.FreshContext(app),
            host=host,
            port=port,
            log_level="warning",
            lifespan="off",
            http=LimitedHttpProtocol.for_server(f"{host}:{port}", limits),
            timeout_keep_alive=limits.keep_alive_s,
            # HTTPS where the service has a certificate (PLEXRL_HTTP_TLS_*).
            ssl_certfile=settings.http_tls_certfile,
            ssl_keyfile=settings.http_tls_keyfile,
        )
        self._server = uvicorn.Server(config)
        # The service owns SIGTERM/SIGINT (plexrl.service); uvicorn must neither take
        # them nor re-raise them when it exits.
        self._server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve())
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises the bind error, say
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self._server.should_exit = True
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
