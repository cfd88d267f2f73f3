"""A small HTTP server for a service's health check and metrics, run inside its loop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import uvicorn
from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from plexrl import tracing


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


def health_app(
    name: str, status: Callable[[], dict[str, Any]], watched: Sequence[Watched] = ()
) -> FastAPI:
    """GET /healthz (200 with `status()`, or 503 when it says ok=False or a watched
    consumer is dead or stuck) and GET /metrics."""
    app = FastAPI(title=f"plexrl {name}", docs_url=None, redoc_url=None)

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


class HttpServer:
    """Uvicorn serving an app until stopped; never installs signal handlers of its own."""

    def __init__(self, app: Any, host: str, port: int) -> None:
        config = uvicorn.Config(
            tracing.FreshContext(app), host=host, port=port, log_level="warning", lifespan="off"
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
