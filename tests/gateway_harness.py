"""A gateway over real Redis with only Kafka faked, for the API, admission, isolation and
fuzz tests.

The publisher stand-in records the phase requests the gateway would send; routes, auth,
validation, quotas and rendering are the real ones.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
from gateway_support import TINY_MODEL, FakePublisher, drop_cluster_keys, unique_cluster

from plexrl.limits import DEFAULT_LIMITS, CallLimits
from plexrl.settings import GatewaySettings
from plexrl.stores import Stores
from plexrl_gateway.app import build_app
from plexrl_gateway.components import Gateway

ALICE = {"X-API-Key": "tml-alice"}
BOB = {"X-API-Key": "tml-bob"}
PROTO = {"content-type": "application/x-protobuf"}


@dataclass
class Gw:
    http: httpx.AsyncClient
    publisher: FakePublisher
    gateway: Gateway
    stores: Stores

    async def post(self, path: str, body: Any, who: dict[str, str] = ALICE) -> httpx.Response:
        return await self.http.post(f"/api/v1/{path}", json=body, headers=who)

    async def ok(self, path: str, body: Any, who: dict[str, str] = ALICE) -> Any:
        response = await self.post(path, body, who)
        assert response.status_code == 200, response.text
        return response.json()

    async def session(self, who: dict[str, str] = ALICE) -> str:
        body = {"tags": [], "user_metadata": {}, "sdk_version": "0.38.0", "type": "create_session"}
        return str((await self.ok("create_session", body, who))["session_id"])

    async def model(self, who: dict[str, str] = ALICE, rank: int = 8) -> str:
        body = {
            "session_id": await self.session(who),
            "model_seq_id": 0,
            "base_model": TINY_MODEL,
            "lora_config": {"rank": rank},
            "type": "create_model",
        }
        return str((await self.ok("create_model", body, who))["model_id"])

    async def sampler(self, who: dict[str, str] = ALICE) -> str:
        body = {
            "session_id": await self.session(who),
            "sampling_session_seq_id": 0,
            "base_model": TINY_MODEL,
        }
        return str((await self.ok("create_sampling_session", body, who))["sampling_session_id"])


_G = TypeVar("_G", bound=Gw)


@contextlib.asynccontextmanager
async def gateway(
    infra: dict[str, str],
    models: Path,
    limits: CallLimits = DEFAULT_LIMITS,
    harness: type[_G] = Gw,  # type: ignore[assignment]
    **overrides: Any,
) -> AsyncIterator[_G]:
    """A gateway of its own cluster id, its keys dropped after; `overrides` are
    GatewaySettings fields, `harness` the class handed back (a `Gw` with more helpers)."""
    options: dict[str, Any] = {
        "cluster_id": unique_cluster("gw"),
        "kafka_bootstrap": infra["kafka"],
        "redis_url": infra["redis"],
        "api_keys": "tml-alice=alice,tml-bob=bob",
        "model_registry": models,
        "future_wait_s": 0.2,
        "sequence_gap_timeout_s": 0.2,
        "scheduler_url": "http://127.0.0.1:9",
        "state_store_url": "http://127.0.0.1:9",
        **overrides,
    }
    settings = GatewaySettings(**options)
    stores = Stores.from_url(settings.redis_url, settings.cluster_id, settings.record_ttl_s)
    publisher = FakePublisher()
    gw = Gateway.build(settings, stores, publisher, limits)
    transport = httpx.ASGITransport(app=build_app(gw))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
            yield harness(http, publisher, gw, stores)
    finally:
        await gw.close()
        await drop_cluster_keys(stores, settings.cluster_id)
        await stores.close()
