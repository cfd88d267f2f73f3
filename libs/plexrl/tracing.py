"""OpenTelemetry set-up: one trace per API call, through every service.

The gateway's server span (`ServerSpans`) starts the trace. Each Kafka hop carries it
in a W3C `traceparent` header written by a producer span (`record_headers`); each HTTP
hop to the state-store carries it in the request header
written by the httpx instrumentation, and the state-store's own server span continues
it. `retrieve_future` runs in a trace of its own, linked to the call it waits on.

Traces start only where work starts: an API call or a span of our own code. A Kafka
send, a Kafka poll or an HTTP client call with no span around it (heartbeats,
residency announcements, health probes) is background chatter and is not sampled,
and neither are `/healthz` and `/metrics` requests.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import httpx
from fastapi.telemetry import TelemetryConfig
from opentelemetry import baggage, propagate, trace
from opentelemetry import context as otel_context
from opentelemetry.context import Context
from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor
from opentelemetry.propagators.textmap import Getter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import (
    Decision,
    ParentBased,
    Sampler,
    SamplingResult,
)
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    StatusCode,
    TraceFlags,
)
from opentelemetry.util.types import Attributes

_configured = False
# Exporters already attached: a second `setup_tracing` with the same one must not make
# every span arrive twice (tests call it once per service they start in-process).
_exporters: list[SpanExporter] = []

_TRACE_ID_LIMIT = (1 << 64) - 1


class _WorkStartsTraces(Sampler):
    """Root sampler: a trace may start at a server span or one of our own spans, never at
    a bare Kafka send/receive or HTTP client call (those are always part of something
    else when they matter; alone they are heartbeats and polls); and then for `ratio` of
    the trace ids (the low 64 bits, as OpenTelemetry's ratio sampler reads them, so every
    service agrees on a trace)."""

    _PLUMBING = frozenset({SpanKind.PRODUCER, SpanKind.CONSUMER, SpanKind.CLIENT})

    def __init__(self, ratio: float = 1.0):
        self._bound = round(ratio * (_TRACE_ID_LIMIT + 1))

    def should_sample(
        self,
        parent_context: Context | None,
        trace_id: int,
        name: str,
        kind: SpanKind | None = None,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        trace_state: Any = None,
    ) -> SamplingResult:
        if kind in self._PLUMBING or trace_id & _TRACE_ID_LIMIT >= self._bound:
            return SamplingResult(Decision.DROP)
        return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes)

    def get_description(self) -> str:
        return f"WorkStartsTraces{{{self._bound / (_TRACE_ID_LIMIT + 1)}}}"


class _WhileExporting(Sampler):
    """`inner`'s decision while the process's spans go somewhere (`exporting`: an
    exporter is attached); otherwise every span is non-recording, whatever its parent
    says: ids and `traceparent` headers still travel, nothing is built per span."""

    def __init__(self, inner: Sampler, exporting: Callable[[], bool]):
        self._inner = inner
        self._exporting = exporting

    def should_sample(
        self,
        parent_context: Context | None,
        trace_id: int,
        name: str,
        kind: SpanKind | None = None,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        trace_state: Any = None,
    ) -> SamplingResult:
        if not self._exporting():
            return SamplingResult(Decision.DROP)
        return self._inner.should_sample(
            parent_context, trace_id, name, kind, attributes, links, trace_state
        )

    def get_description(self) -> str:
        return f"WhileExporting{{{self._inner.get_description()}}}"


def _exporting() -> bool:
    return bool(_exporters)


def setup_tracing(
    service_name: str, exporter: SpanExporter | None = None, ratio: float = 1.0
) -> TracerProvider:
    """Install a tracer provider for this process.

    Spans go to `exporter` when given (tests pass an in-memory one), and to OTLP over
    HTTP when OTEL_EXPORTER_OTLP_ENDPOINT is set, for `ratio` of the API calls (the
    services' `PLEXRL_TRACE_RATIO`); with neither, no span is recorded (only the trace
    context travels).
    """
    global _configured
    provider = trace.get_tracer_provider()
    if _configured and isinstance(provider, TracerProvider):
        if exporter is not None and not any(e is exporter for e in _exporters):
            provider.add_span_processor(SimpleSpanProcessor(exporter))
            _exporters.append(exporter)
        return provider
    name = os.environ.get("OTEL_SERVICE_NAME", service_name)
    provider = TracerProvider(
        resource=Resource.create({"service.name": name}),
        sampler=_WhileExporting(ParentBased(root=_WorkStartsTraces(ratio)), _exporting),
    )
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        _exporters.append(exporter)
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        otlp = OTLPSpanExporter()
        provider.add_span_processor(BatchSpanProcessor(otlp))
        _exporters.append(otlp)
    trace.set_tracer_provider(provider)
    _configured = True
    return provider


NATIVE_TELEMETRY_OFF = TelemetryConfig(
    tracing=False, metrics=False, logs=False, operation_spans=False
)
"""For every service's `FastAPI(telemetry=...)` (`plexrl.health.service_app`): FastAPI's
own OpenTelemetry (a server span, operation spans, metrics and logs per request, on
whenever a tracer provider is set, as `setup_tracing` does) stays off; `ServerSpans`
makes the one server span."""


def instrument_app(app: Any) -> None:
    """One server span per request of a FastAPI app (`ServerSpans`), outside every
    middleware the app has; none for health checks and scrapes. The app is made with
    `telemetry=NATIVE_TELEMETRY_OFF` (`plexrl.health.service_app` makes it so)."""
    app.add_middleware(ServerSpans)


UNTRACED_PATHS = ("/healthz", "/metrics")
"""Paths (their ends) of requests that never make a span."""


class _ScopeHeaders(Getter[Any]):
    """Reads a trace context's headers from an ASGI scope's raw header list."""

    def get(self, carrier: Any, key: str) -> list[str] | None:
        name = key.encode("latin-1")
        values = [v.decode("latin-1") for k, v in carrier if k.lower() == name]
        return values or None

    def keys(self, carrier: Any) -> list[str]:
        return [k.decode("latin-1") for k, _ in carrier]


_SCOPE_HEADERS = _ScopeHeaders()


class ServerSpans:
    """ASGI middleware: one SERVER span per HTTP request, continuing the caller's
    `traceparent`, named `METHOD /route/template` (the template of the route FastAPI
    matched, which it leaves in the scope: a router's own prefix is in it, a prefix
    given to `include_router` is not, and the services give theirs to their routers)
    with the request's method, target, route and status as attributes; a 5xx or an
    exception marks it an error.

    What `opentelemetry-instrumentation-fastapi` made, for less: its middleware took
    88 µs of a gateway request's 234 µs in process, most of it building attributes and
    wrappers whether or not the span was recorded. Here a span that is not recorded
    (nowhere to export, or outside the trace ratio) costs its ids and the context's
    extraction only."""

    def __init__(self, app: Any) -> None:
        self._app = app
        self._tracer = trace.get_tracer("plexrl.http")

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"].endswith(UNTRACED_PATHS):
            await self._app(scope, receive, send)
            return
        method = scope["method"]
        parent = propagate.extract(scope["headers"], getter=_SCOPE_HEADERS)
        span = self._tracer.start_span(method, context=parent, kind=SpanKind.SERVER)
        token = otel_context.attach(trace.set_span_in_context(span, parent))
        try:
            if not span.is_recording():
                await self._app(scope, receive, send)
                return
            status: list[int] = []

            async def send_status(message: Any) -> None:
                if message["type"] == "http.response.start":
                    status.append(message["status"])
                await send(message)

            failure: Exception | None = None
            try:
                await self._app(scope, receive, send_status)
            except Exception as exc:
                failure = exc
                raise
            finally:
                _describe(span, scope, method, status[0] if status else None, failure)
        finally:
            otel_context.detach(token)
            span.end()


def _describe(
    span: trace.Span, scope: Any, method: str, status: int | None, failure: Exception | None
) -> None:
    route = getattr(scope.get("route"), "path", None)
    if route:
        span.update_name(f"{method} {route}")
        span.set_attribute("http.route", route)
    span.set_attribute("http.method", method)
    span.set_attribute("http.scheme", scope.get("scheme", "http"))
    span.set_attribute("http.target", scope["path"])
    if failure is not None:
        # Starlette's outermost layer, outside this one, answers it with a 500.
        status = status or 500
        span.record_exception(failure)
        span.set_status(StatusCode.ERROR, f"{type(failure).__name__}: {failure}")
    elif status is not None and status >= 500:
        span.set_status(StatusCode.ERROR)
    if status is not None:
        span.set_attribute("http.status_code", status)


class FreshContext:
    """ASGI wrapper (outside the instrumented app): each request starts from an empty
    context.

    uvicorn may run a request in the context of the one before it on the same
    connection (resuming a paused read re-registers the socket's reader in the request
    task's context), and the OpenTelemetry middleware then makes the next request an
    INTERNAL child of the previous one's span instead of a SERVER span continuing the
    caller's `traceparent`. Seen on the state-store, whose blob uploads pause reading.
    """

    def __init__(self, app: Any) -> None:
        self._app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        token = otel_context.attach(Context())
        try:
            await self._app(scope, receive, send)
        finally:
            otel_context.detach(token)


def instrument_client(client: httpx.AsyncClient) -> None:
    """A client span per request, and the trace context in its headers."""
    HTTPXClientInstrumentor.instrument_client(client)


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


_ids = RandomIdGenerator()
_kafka_tracer = trace.get_tracer("plexrl.kafka")


Headers = list[tuple[str, bytes]]
"""A Kafka record's headers, as the producer takes them."""


def record_headers(topic: str) -> Headers:
    """The headers of a Kafka record sent now: the trace context it carries.

    Inside a sampled span a `<topic> send` PRODUCER span is made (ended at once, as a
    mark of the send) and its context goes in the headers. Anywhere else no span would
    be recorded, so none is made: the current context travels as it is (not sampled,
    so its consumers record nothing either), and a send outside any span carries a
    fresh trace that is not sampled, as a bare send's dropped span would (background
    chatter starts no trace downstream). What `opentelemetry-instrumentation-aiokafka`
    did, without its cost on every send: a span, its attributes and a second partition
    lookup per message, recorded or not."""
    current = trace.get_current_span()
    context = current.get_span_context()
    carrier: dict[str, str] = {}
    if context.trace_flags.sampled:
        with _kafka_tracer.start_as_current_span(
            f"{topic} send",
            kind=SpanKind.PRODUCER,
            attributes={
                "messaging.system": "kafka",
                "messaging.destination.name": topic,
                "messaging.operation.type": "send",
            },
        ):
            propagate.inject(carrier)
    elif context.is_valid:
        propagate.inject(carrier)
    else:
        fresh = SpanContext(
            _ids.generate_trace_id(), _ids.generate_span_id(), False, TraceFlags(TraceFlags.DEFAULT)
        )
        propagate.inject(carrier, context=trace.set_span_in_context(NonRecordingSpan(fresh)))
    return [(k, v.encode("latin-1")) for k, v in carrier.items()]


_TRACEPARENT = re.compile(rb"00-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}")
_W3C_FIELDS = frozenset({"traceparent", "tracestate", "baggage"})


def _w3c_propagation() -> bool:
    """Whether the process propagates trace context by W3C `traceparent` (with trace
    state and baggage) alone: OpenTelemetry's default, unless OTEL_PROPAGATORS names
    another format. The shortcuts below apply only then."""
    fields = propagate.get_global_textmap().fields
    return "traceparent" in fields and fields <= _W3C_FIELDS


def unrecorded_child(headers: Sequence[tuple[str, bytes]] | None) -> NonRecordingSpan | None:
    """The span this process's tracer would start under the context a Kafka record's
    `headers` carry, while it exports nothing (`setup_tracing` with no exporter): not
    recorded, in the parent's trace, with a span id of its own, not sampled. Built from
    the header without the propagator's round through a carrier and the sampler: the
    scheduler starts one per dispatched call. None where that shortcut does not apply
    (spans are exported, or the headers carry anything but one plain version-00
    `traceparent`, or the process propagates another format): start the span the usual
    way."""
    if not _configured or _exporters or not headers or len(headers) != 1:
        return None
    if not _w3c_propagation():
        return None
    key, value = headers[0]
    found = _TRACEPARENT.fullmatch(value) if key == "traceparent" else None
    if found is None:
        return None
    trace_id, parent_id = int(found[1], 16), int(found[2], 16)
    if not trace_id or not parent_id:
        return None
    return NonRecordingSpan(
        SpanContext(trace_id, _ids.generate_span_id(), False, TraceFlags(TraceFlags.DEFAULT))
    )


def unrecorded_headers(span: trace.Span) -> Headers | None:
    """The headers `record_headers` writes for a record sent inside `span` where that
    makes no producer span (`span` not sampled) and carries only its `traceparent`
    (no trace state, no baggage, W3C propagation): built from the span's ids directly,
    without making it current and the propagator's round through a carrier. None
    otherwise: send inside `span`."""
    context = span.get_span_context()
    if context.trace_flags.sampled or not context.is_valid or context.trace_state:
        return None
    if baggage.get_all() or not _w3c_propagation():
        return None
    return [("traceparent", span_traceparent(span).encode("ascii"))]


def span_traceparent(span: trace.Span) -> str:
    """The span's W3C traceparent ('' when there is none)."""
    context = span.get_span_context()
    if not context.is_valid:
        return ""
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


def context_of_headers(headers: Sequence[tuple[str, bytes]] | None) -> Context:
    """The trace context a Kafka record carries (what its producer span injected)."""
    carrier = {k: v.decode("latin-1") for k, v in headers or ()}
    return propagate.extract(carrier)


def context_of_traceparent(traceparent: str) -> Context:
    """The context a stored W3C traceparent names (empty when there is none)."""
    return propagate.extract({"traceparent": traceparent} if traceparent else {})


def traceparent_of(context: Context | None = None) -> str | None:
    """The current span (or `context`'s) as a W3C traceparent, to store beside a record."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=context)
    return carrier.get("traceparent")


def link_to(traceparent: str, **attributes: str) -> None:
    """Link the current span to the span `traceparent` names (another trace's call)."""
    context = trace.get_current_span(context_of_traceparent(traceparent)).get_span_context()
    if context.is_valid:
        trace.get_current_span().add_link(context, attributes or None)
