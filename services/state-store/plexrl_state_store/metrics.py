"""The state-store's Prometheus metrics (served by its own app at /metrics)."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import Counter, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

BLOB_WRITTEN_BYTES = Counter(
    "plexrl_state_store_blob_written_bytes_total",
    "Bytes of blobs stored (checkpoints and states offloaded to the disk tier)",
)
BLOB_READ_BYTES = Counter(
    "plexrl_state_store_blob_read_bytes_total",
    "Bytes of blobs read back (checkpoint loads, states onloaded from the disk tier)",
)
BLOBS_DELETED = Counter("plexrl_state_store_blobs_deleted_total", "Blobs deleted")
CHECKPOINTS_RECORDED = Counter(
    "plexrl_state_store_checkpoints_recorded_total", "Checkpoint records written"
)
REQUESTS = Counter(
    "plexrl_state_store_requests_total",
    "HTTP requests answered",
    ["endpoint", "method", "status"],
)
LATENCY = Histogram(
    "plexrl_state_store_request_seconds",
    "Time to answer an HTTP request (blob transfers included)",
    ["endpoint", "method"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)


class ObserveRequests:
    """ASGI middleware: count and time each request by route template (keys stay out of
    the labels: there is one blob key per state version)."""

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
        try:
            await self._app(scope, receive, send_observed)
        finally:
            route: Any = scope.get("route")
            endpoint = str(getattr(route, "path", None) or "unmatched")
            REQUESTS.labels(endpoint, scope["method"], str(status["code"])).inc()
            LATENCY.labels(endpoint, scope["method"]).observe(time.perf_counter() - start)
