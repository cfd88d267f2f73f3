"""What every dashboard polls costs the same however much other tenants store.

The gateway runs over real Redis through a connection that counts the replies it reads
(commands and bytes); only Kafka is faked. Alice's dashboard reads are measured while
Bob holds 10 job records, then 500 with 16 KiB of user metadata each: the Redis work of
her requests must not move, and Bob's own `/cluster` must read his ids, not his records.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest_asyncio
import redis.asyncio as aioredis
from gateway_harness import ALICE, BOB
from gateway_support import TINY_MODEL, FakePublisher, drop_cluster_keys, unique_cluster

from plexrl.messages import JobSpec, ResidentState, Tier, WorkerHeartbeat, encode
from plexrl.settings import GatewaySettings
from plexrl.stores import JobKind, JobRecord, RedisKeys, Stores
from plexrl_gateway.app import build_app
from plexrl_gateway.components import Gateway

METADATA = {"notes": "x" * 16 * 1024}
DASHBOARD = ["/plexrl/v1/cluster", "/plexrl/v1/workers", "/plexrl/v1/jobs?details=true"]


def reply_bytes(reply: Any) -> int:
    if isinstance(reply, bytes | str):
        return len(reply)
    if isinstance(reply, list | tuple):
        return sum(reply_bytes(r) for r in reply)
    if isinstance(reply, dict):
        return sum(reply_bytes(k) + reply_bytes(v) for k, v in reply.items())
    return 8


class CountingConnection(aioredis.Connection):
    """A real connection that also counts each reply it reads, and its bytes."""

    read: ClassVar[Counter[str]] = Counter()

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        reply = await super().read_response(*args, **kwargs)
        self.read["replies"] += 1
        self.read["bytes"] += reply_bytes(reply)
        return reply


@pytest_asyncio.fixture
async def served(
    infra: dict[str, str], tiny_registry: Path
) -> AsyncIterator[tuple[httpx.AsyncClient, Stores]]:
    settings = GatewaySettings(
        cluster_id=unique_cluster("cost"),
        redis_url=infra["redis"],
        api_keys="tml-alice=alice,tml-bob=bob",
        model_registry=tiny_registry,
        scheduler_url="http://127.0.0.1:9",
    )
    pool = aioredis.ConnectionPool.from_url(infra["redis"], connection_class=CountingConnection)
    keys = RedisKeys(aioredis.Redis(connection_pool=pool), settings.cluster_id, 3600)
    stores = Stores.over(keys)
    gw = Gateway.build(settings, stores, FakePublisher())
    transport = httpx.ASGITransport(app=build_app(gw))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
            yield http, stores
    finally:
        await gw.close()
        await drop_cluster_keys(stores, settings.cluster_id)
        await stores.close()


async def cost(http: httpx.AsyncClient, url: str, who: dict[str, str]) -> Counter[str]:
    CountingConnection.read.clear()
    response = await http.get(url, headers=who)
    assert response.status_code == 200, response.text
    return Counter(CountingConnection.read)


async def bobs_jobs(stores: Stores, first: int, last: int) -> None:
    for i in range(first, last):
        record = JobRecord(
            f"sess-bob:train:{i}",
            "bob",
            JobKind.TRAINING,
            JobSpec(base_model=TINY_MODEL),
            time.time(),
            "sess-bob",
            metadata=METADATA,
        )
        await stores.jobs.put_job(record)


async def test_dashboard_reads_do_not_grow_with_another_tenants_records(
    served: tuple[httpx.AsyncClient, Stores],
) -> None:
    http, stores = served
    session = (await http.post("/api/v1/create_session", json={}, headers=ALICE)).json()
    for seq in range(2):
        body = {"session_id": session["session_id"], "model_seq_id": seq, "base_model": TINY_MODEL}
        assert (await http.post("/api/v1/create_model", json=body, headers=ALICE)).is_success
    alices = sorted(await stores.jobs.tenant_job_ids("alice"))
    beat = WorkerHeartbeat(
        worker_id="worker-0",
        device="cpu",
        device_bytes=1 << 30,
        host_bytes=1 << 30,
        base_models=[TINY_MODEL],
        resident=[ResidentState(alices[0], Tier.DEVICE, 100, 1)],
        busy=False,
        started_at=time.time(),
        sent_at=time.time(),
    )
    await stores.workers.put_worker("worker-0", encode(beat), ttl_s=600)
    await bobs_jobs(stores, 0, 10)
    await http.get("/plexrl/v1/cluster", headers=ALICE)  # the cluster's count is started
    few = {url: await cost(http, url, ALICE) for url in DASHBOARD}
    bob_few = await cost(http, "/plexrl/v1/cluster", BOB)

    await bobs_jobs(stores, 10, 500)  # 500 records, 8 MiB of metadata
    many = {url: await cost(http, url, ALICE) for url in DASHBOARD}
    for url in DASHBOARD:
        assert many[url]["replies"] == few[url]["replies"], url
        # The job count's digits may grow ("10" → "500"); nothing else read may.
        assert many[url]["bytes"] <= few[url]["bytes"] + 8, (url, few[url], many[url])
    assert (await http.get("/plexrl/v1/cluster", headers=ALICE)).json()["jobs"] == 502

    # Bob's own /cluster reads his 500 ids, never his records' 8 MiB of metadata.
    bob_many = await cost(http, "/plexrl/v1/cluster", BOB)
    assert bob_many["replies"] == bob_few["replies"]
    assert bob_many["bytes"] < 500 * 64, bob_many
