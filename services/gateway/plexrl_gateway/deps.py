"""FastAPI dependencies: each route names the components it uses, and the caller's tenant."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request

from plexrl.meta import MetaStore
from plexrl_gateway.catalog import ModelCatalog
from plexrl_gateway.components import Gateway
from plexrl_gateway.futures import FutureWaiter
from plexrl_gateway.registry import Registry
from plexrl_gateway.submitter import Submitter


def _gateway(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


GatewayDep = Annotated[Gateway, Depends(_gateway)]


def _tenant(gateway: GatewayDep, x_api_key: Annotated[str | None, Header()] = None) -> str:
    return gateway.keys.tenant(x_api_key)


def _meta(gateway: GatewayDep) -> MetaStore:
    return gateway.meta


def _registry(gateway: GatewayDep) -> Registry:
    return gateway.registry


def _catalog(gateway: GatewayDep) -> ModelCatalog:
    return gateway.catalog


def _submitter(gateway: GatewayDep, tenant: Annotated[str, Depends(_tenant)]) -> Submitter:
    """The submitter, for a tenant under its pending-calls quota (429 otherwise)."""
    gateway.pending.admit(tenant)
    return gateway.submitter


def _futures(gateway: GatewayDep) -> FutureWaiter:
    return gateway.futures


Tenant = Annotated[str, Depends(_tenant)]
Meta = Annotated[MetaStore, Depends(_meta)]
Jobs = Annotated[Registry, Depends(_registry)]
Catalog = Annotated[ModelCatalog, Depends(_catalog)]
Submit = Annotated[Submitter, Depends(_submitter)]
Futures = Annotated[FutureWaiter, Depends(_futures)]
