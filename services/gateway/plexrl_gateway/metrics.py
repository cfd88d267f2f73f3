"""The gateway's Prometheus metrics (served on its own port at /metrics)."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import Counter, Gauge, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

REQUESTS = Counter(
    "plexrl_gateway_requests_total", "HTTP requests answered", ["endpoint", "method", "status"]
)
LATENCY = Histogram(
    "plexrl_gateway_request_seconds",
    "Time to answer an HTTP request (retrieve_future includes its long-poll)",
    ["endpoint"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
FUTURES_WAITING = Gauge(
    "plexrl_gateway_futures_waiting", "retrieve_future calls waiting for a result right now"
)
RESULTS_DELIVERED = Counter(
    "plexrl_gateway_results_delivered_total", "Results handed to clients", ["kind", "status"]
)
TRY_AGAIN = Counter(
    "plexrl_gateway_try_again_total", "retrieve_future calls answered 'try again' (timed out)"
)
PUBLISH_LATENCY = Histogram(
    "plexrl_gateway_publish_seconds",
    "Time for Kafka to acknowledge one phase request",
    ["function"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1),
)
SEQUENCER_WAITING = Gauge(
    "plexrl_gateway_sequencer_waiting", "Training calls held until a lower seq_id is published"
)


class ObserveRequests:
    """ASGI middleware: request count and latency per route.

    Metrics are labelled by route template, never by raw path, so ids do not blow up
    the label space. The request's span is the FastAPI instrumentation's (one per
    request), not this middleware's.
    """

    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        status = {"code": 500}

        async def send_observed(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        start = time.perf_counter()
        method = scope["method"]
        try:
            await self._app(scope, receive, send_observed)
        finally:
            endpoint = _route(scope)
            REQUESTS.labels(endpoint, method, str(status["code"])).inc()
            LATENCY.labels(endpoint).observe(time.perf_counter() - start)


def _route(scope: Scope) -> str:
    route: Any = scope.get("route")
    path = getattr(route, "path", None)
    return str(path) if path else "unmatched"
