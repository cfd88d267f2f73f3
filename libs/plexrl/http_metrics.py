"""Request counts and latencies of a service's HTTP API, by route template."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

Observe = Callable[[str, str, int, float], None]
"""(route template, method, status code, seconds): one answered request."""


class ObserveRequests:
    """ASGI middleware: hands every HTTP request's route, method, status and seconds to
    `observe` (a service's own metrics). Labelled by route template, never by raw path,
    so ids and blob keys stay out of the label space. The request's span is the FastAPI
    instrumentation's, not this middleware's."""

    def __init__(self, app: ASGIApp, observe: Observe) -> None:
        self._app = app
        self._observe = observe

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
            self._observe(endpoint, scope["method"], status["code"], time.perf_counter() - start)
