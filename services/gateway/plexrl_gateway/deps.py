"""FastAPI dependencies: each route names the components it uses, and the caller's tenant.

All are `async def` though none awaits: FastAPI runs a plain `def` dependency in its
thread pool, a thread hop per dependency per request (four on a call's path), which
cost more than the rest of the gateway's own work on an echo."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request

from plexrl.stores import CallStore, PayloadStore, TimelineStore, UsageStore
from plexrl_gateway.catalog import ModelCatalog
from plexrl_gateway.components import Gateway
from plexrl_gateway.futures import FutureWaiter
from plexrl_gateway.placement import Placement
from plexrl_gateway.registry import Registry
from plexrl_gateway.submitter import Submitter


async def _gateway(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


GatewayDep = Annotated[Gateway, Depends(_gateway)]


async def _tenant(gateway: GatewayDep, x_api_key: Annotated[str | None, Header()] = None) -> str:
    return gateway.keys.tenant(x_api_key)


async def _calls(gateway: GatewayDep) -> CallStore:
    return gateway.calls


async def _payloads(gateway: GatewayDep) -> PayloadStore:
    return gateway.payloads


async def _timeline(gateway: GatewayDep) -> TimelineStore:
    return gateway.timeline


async def _usage(gateway: GatewayDep) -> UsageStore:
    return gateway.usage


async def _registry(gateway: GatewayDep) -> Registry:
    return gateway.registry


async def _catalog(gateway: GatewayDep) -> ModelCatalog:
    return gateway.catalog


async def _placement(gateway: GatewayDep) -> Placement:
    return gateway.placement


async def _submitter(gateway: GatewayDep, tenant: Annotated[str, Depends(_tenant)]) -> Submitter:
    """The submitter, for a tenant under its pending-calls quota (429 otherwise)."""
    gateway.pending.admit(tenant)
    return gateway.submitter


async def _futures(gateway: GatewayDep) -> FutureWaiter:
    return gateway.futures


Tenant = Annotated[str, Depends(_tenant)]
Calls = Annotated[CallStore, Depends(_calls)]
Payloads = Annotated[PayloadStore, Depends(_payloads)]
Timeline = Annotated[TimelineStore, Depends(_timeline)]
Usage = Annotated[UsageStore, Depends(_usage)]
Jobs = Annotated[Registry, Depends(_registry)]
Catalog = Annotated[ModelCatalog, Depends(_catalog)]
Placements = Annotated[Placement, Depends(_placement)]
Submit = Annotated[Submitter, Depends(_submitter)]
Futures = Annotated[FutureWaiter, Depends(_futures)]
