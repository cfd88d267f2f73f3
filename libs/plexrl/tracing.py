"""OpenTelemetry set-up and W3C trace context in Kafka headers.

One trace per API call: the gateway starts it, each Kafka hop carries it in a
`traceparent` header, and every service continues it with a child span.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter

_configured = False


def setup_tracing(service_name: str, exporter: SpanExporter | None = None) -> TracerProvider:
    """Install a tracer provider for this process.

    Spans go to `exporter` when given (tests pass an in-memory one), and to OTLP over
    HTTP when OTEL_EXPORTER_OTLP_ENDPOINT is set; otherwise they are dropped.
    """
    global _configured
    provider = trace.get_tracer_provider()
    if _configured and isinstance(provider, TracerProvider):
        if exporter is not None:
            provider.add_span_processor(SimpleSpanProcessor(exporter))
        return provider
    name = os.environ.get("OTEL_SERVICE_NAME", service_name)
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    _configured = True
    return provider


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def kafka_headers() -> list[tuple[str, bytes]]:
    """The current trace context as Kafka headers (empty when there is no span)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return [(k, v.encode()) for k, v in carrier.items()]


def extract_kafka_headers(headers: Sequence[tuple[str, bytes]] | None) -> Context:
    carrier = {k: v.decode("latin-1") for k, v in headers or ()}
    return propagate.extract(carrier)


def traceparent_of(context: Context | None = None) -> str | None:
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=context)
    return carrier.get("traceparent")
