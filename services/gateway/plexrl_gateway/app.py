"""The HTTP app: routers, error handlers, metrics and tracing around every request."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from plexrl import tracing
from plexrl.health import service_app
from plexrl.http_metrics import ObserveRequests
from plexrl_gateway import (
    dashboard,
    routes_files,
    routes_futures,
    routes_openai,
    routes_plexrl,
    routes_rest,
    routes_sampling,
    routes_session,
    routes_training,
)
from plexrl_gateway.body_limit import BodyBudget, BodyParser, BodySizeLimit
from plexrl_gateway.components import Gateway
from plexrl_gateway.errors import install_error_handlers
from plexrl_gateway.metrics import observe_request
from plexrl_gateway.replicas import WaitForReplicas
from plexrl_gateway.schemas import JSON_BODY_COMPONENTS
from plexrl_gateway.seq_release import ReleaseRefused


def build_app(gateway: Gateway) -> FastAPI:
    app = service_app("PlexRL gateway", openapi_url=None)
    app.state.gateway = gateway
    app.state.body_parser = BodyParser(gateway.limits)
    install_error_handlers(app)
    # A request is matched against every route in turn, in this order (about 1.5 µs
    # each): the routes every call takes come first, the polls first of all. No two
    # routers' routes match one method and path, so the order decides nothing else
    # (tests/test_gateway_routes.py).
    for module in (
        routes_futures,
        routes_training,
        routes_sampling,
        routes_plexrl,
        routes_session,
        routes_files,
        routes_openai,
        routes_rest,
        dashboard,
    ):
        app.include_router(module.router)
    app.include_router(routes_session.health_router)

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    _document_struct_bodies(app)

    # Inside the metrics middleware, so refused bodies are counted (as 413s) too.
    app.add_middleware(BodySizeLimit, limits=gateway.limits, budget=BodyBudget(gateway.limits))
    # Outside the body limits, so the calls they refuse use up their seq_ids too.
    app.add_middleware(ReleaseRefused, gateway=gateway)
    # Outside the seq_id release, whose cursor write is then covered too.
    app.add_middleware(WaitForReplicas, replicated=gateway.replicated)
    app.add_middleware(ObserveRequests, observe=observe_request)
    # The one server span of each request (the root of an API call's trace).
    tracing.instrument_app(app)
    return app


def _document_struct_bodies(app: FastAPI) -> None:
    """The OpenAPI document names the msgspec Structs' schemas (the routes that decode
    into one point at them from `openapi_extra`) beside pydantic's own."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = build()
            document.setdefault("components", {}).setdefault("schemas", {}).update(
                JSON_BODY_COMPONENTS
            )
        return app.openapi_schema or {}

    app.openapi = openapi  # type: ignore[method-assign]
