"""Tenants are isolated below the gateway: the state-store authenticates its callers and
keeps each tenant's checkpoints its own; /plexrl/v1 shows a tenant only its own jobs.

The state-store runs for real (its app over real Redis and a blob directory, and once
as a served HTTP server for the client); only Kafka is faked at the gateway.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import msgspec
import pytest
import pytest_asyncio
from gateway_harness import ALICE, BOB, gateway
from gateway_support import TINY_MODEL, free_port

from plexrl.health import HttpServer, health_app
from plexrl.messages import Function, ResidentState, Tier, WorkerHeartbeat, encode
from plexrl.service_auth import auth_headers, bearer_matches, is_loopback
from plexrl.settings import StateStoreSettings, parse_api_keys
from plexrl.state_store_client import StateStoreClient, StateStoreError
from plexrl.stores import CheckpointRecord, Stores
from plexrl_state_store.app import build_app
from plexrl_state_store.blobs import BlobDir
from plexrl_state_store.main import NoTokenError, check_exposure
from plexrl_tools.cluster import ClusterConfig, LocalCluster

TOKEN = "test-service-token"


@pytest_asyncio.fixture
async def store(stores: Stores, tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    """The state-store's API with a service token, called without credentials."""
    transport = httpx.ASGITransport(
        app=build_app(BlobDir(tmp_path), stores.checkpoints, stores.residency, TOKEN)
    )
    async with httpx.AsyncClient(transport=transport, base_url="http://store") as http:
        yield http


def acting(tenant: str | None) -> dict[str, str]:
    return auth_headers(TOKEN, tenant)


def record(tenant: str, blob_key: str, path: str = "tinker://j/weights/a") -> CheckpointRecord:
    return CheckpointRecord(
        path=path,
        tenant=tenant,
        job_id="j",
        kind="weights",
        blob_key=blob_key,
        size_bytes=3,
        created_at=0.0,
        base_model=TINY_MODEL,
    )


# The service token ----------------------------------------------------------------------


async def test_state_store_refuses_calls_without_the_service_token(
    store: httpx.AsyncClient,
) -> None:
    for method, url in [
        ("PUT", "/v1/blobs/offload/w/j/v1"),
        ("GET", "/v1/blobs/offload/w/j/v1"),
        ("DELETE", "/v1/blobs/offload/w/j/v1"),
        ("POST", "/v1/checkpoints"),
        ("GET", "/v1/checkpoints"),
        ("GET", "/v1/residency/j"),
    ]:
        missing = await store.request(method, url, content=b"x")
        assert missing.status_code == 401, (method, url)
        assert "PLEXRL_SERVICE_TOKEN" in missing.json()["detail"]
        wrong = await store.request(
            method, url, content=b"x", headers={"authorization": "Bearer not-it"}
        )
        assert wrong.status_code == 401
    stored = await store.put("/v1/blobs/offload/w/j/v1", content=b"abc", headers=acting(None))
    assert stored.status_code == 200
    assert (await store.get("/healthz")).status_code == 200  # health stays open


def test_bearer_compare_and_loopback() -> None:
    assert bearer_matches("t0k", "Bearer t0k") and bearer_matches("t0k", "bearer t0k")
    assert not bearer_matches("t0k", "Bearer t0") and not bearer_matches("t0k", None)
    assert not bearer_matches("t0k", "Basic t0k")
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.5")


def test_state_store_without_a_token_serves_loopback_only() -> None:
    check_exposure(StateStoreSettings(state_store_host="127.0.0.1", service_token=None))
    check_exposure(StateStoreSettings(state_store_host="0.0.0.0", service_token="s"))
    with pytest.raises(NoTokenError, match="set PLEXRL_SERVICE_TOKEN"):
        check_exposure(StateStoreSettings(state_store_host="0.0.0.0", service_token=None))


def test_local_cluster_makes_a_token_for_its_services(tmp_path: Path) -> None:
    config = ClusterConfig(model_registry=tmp_path, state_dir=tmp_path)
    one, two = LocalCluster(config), LocalCluster(config)
    assert one.service_token and one.service_token != two.service_token
    assert one._env({})["PLEXRL_SERVICE_TOKEN"] == one.service_token
    fixed = LocalCluster(ClusterConfig(tmp_path, tmp_path, service_token="given"))
    assert fixed._env({})["PLEXRL_SERVICE_TOKEN"] == "given"


def test_tenants_that_could_cross_a_blob_directory_are_refused() -> None:
    assert parse_api_keys("k1=team-a,k2=b.c@d") == {"k1": "team-a", "k2": "b.c@d"}
    for bad in ("k=a/b", "k=..", "k=a b"):
        with pytest.raises(ValueError, match="not allowed"):
            parse_api_keys(bad)


# Checkpoints stay their tenant's --------------------------------------------------------


async def test_a_tenant_cannot_read_write_or_delete_another_tenants_blob(
    store: httpx.AsyncClient, tmp_path: Path
) -> None:
    key = "/v1/blobs/ckpt/alice/j/weights/a"
    assert (await store.put(key, content=b"abc", headers=acting("alice"))).status_code == 200
    assert (await store.get(key, headers=acting("alice"))).content == b"abc"
    for who in ("bob", None):
        assert (await store.get(key, headers=acting(who))).status_code == 404
        assert (await store.head(key, headers=acting(who))).status_code == 404
        assert (await store.delete(key, headers=acting(who))).status_code == 404
        overwrite = await store.put(key, content=b"evil", headers=acting(who))
        assert overwrite.status_code == 403 and "ckpt/<tenant>/" in overwrite.json()["detail"]
    assert (tmp_path / "ckpt/alice/j/weights/a").read_bytes() == b"abc"
    # Nobody's blob directly under ckpt/ or ckpt/<tenant>.
    assert (
        await store.put("/v1/blobs/ckpt/x", content=b"x", headers=acting("x"))
    ).status_code == 403


async def test_a_record_cannot_be_forged_to_point_at_another_tenants_blob(
    store: httpx.AsyncClient, stores: Stores
) -> None:
    await store.put("/v1/blobs/ckpt/alice/j/weights/a", content=b"abc", headers=acting("alice"))
    own = record("alice", "ckpt/alice/j/weights/a")
    ok = await store.post(
        "/v1/checkpoints", content=msgspec.json.encode(own), headers=acting("alice")
    )
    assert ok.status_code == 200
    cases = [
        # bob's record naming alice's blob: the forgery of the issue
        (record("bob", "ckpt/alice/j/weights/a", "tinker://j/weights/b"), "bob", 403),
        # a record of alice's, written by a call acting for bob
        (record("alice", "ckpt/alice/j/weights/a", "tinker://j/weights/c"), "bob", 403),
        # bob taking over alice's path with a blob of his own
        (record("bob", "ckpt/bob/j/weights/a"), "bob", 403),
        # a service blob (not a checkpoint's) named by a record
        (record("bob", "offload/w/j/v1", "tinker://j/weights/d"), "bob", 403),
        # a path outside the record's own job
        (record("alice", "ckpt/alice/j/weights/a", "tinker://k/weights/a"), "alice", 400),
    ]
    await store.put("/v1/blobs/ckpt/bob/j/weights/a", content=b"b", headers=acting("bob"))
    await store.put("/v1/blobs/offload/w/j/v1", content=b"o", headers=acting(None))
    for forged, who, status in cases:
        answer = await store.post(
            "/v1/checkpoints", content=msgspec.json.encode(forged), headers=acting(who)
        )
        assert answer.status_code == status, (forged, answer.text)
    standing = await stores.checkpoints.get_checkpoint("tinker://j/weights/a")
    assert standing is not None and standing.tenant == "alice"
    assert await stores.checkpoints.get_checkpoint("tinker://j/weights/b") is None
    listed = await store.get("/v1/checkpoints", headers=acting("bob"))
    assert listed.json() == []
    gone = await store.delete("/v1/checkpoints", params={"path": own.path}, headers=acting("bob"))
    assert gone.status_code == 404


async def test_client_sends_the_token_and_the_tenant(stores: Stores, tmp_path: Path) -> None:
    port = free_port()
    server = HttpServer(
        build_app(BlobDir(tmp_path), stores.checkpoints, stores.residency, TOKEN), "127.0.0.1", port
    )
    await server.start()
    url = f"http://127.0.0.1:{port}"
    client = StateStoreClient(url, token=TOKEN)
    anonymous = StateStoreClient(url)
    try:
        await client.put_blob("ckpt/alice/j/weights/a", b"abc", "alice")
        await client.put_checkpoint(record("alice", "ckpt/alice/j/weights/a"))
        assert await client.get_blob("ckpt/alice/j/weights/a", "alice") == b"abc"
        with pytest.raises(StateStoreError, match="404"):
            await client.get_blob("ckpt/alice/j/weights/a", "bob")
        await client.put_blob("offload/w/j/v1", b"state")
        assert await client.get_blob("offload/w/j/v1") == b"state"
        with pytest.raises(StateStoreError, match="401"):
            await anonymous.get_blob("offload/w/j/v1")
    finally:
        await client.close()
        await anonymous.close()
        await server.stop()


# The gateway -------------------------------------------------------------------------------


async def test_a_tenant_cannot_load_or_sample_another_tenants_checkpoint(
    infra: dict[str, str], tiny_registry: Path
) -> None:
    async with gateway(infra, tiny_registry) as gw:
        bobs = await gw.model(BOB)
        path = f"tinker://{bobs}/weights/mine"
        await gw.stores.checkpoints.put_checkpoint(
            record("bob", f"ckpt/bob/{bobs}/weights/mine", path)
        )
        alices = await gw.model(ALICE)
        load = await gw.post("load_weights", {"model_id": alices, "seq_id": 1, "path": path})
        assert load.status_code == 404 and "no checkpoint" in load.json()["error"]
        session = await gw.session(ALICE)
        sampler = await gw.post(
            "create_sampling_session",
            {"session_id": session, "sampling_session_seq_id": 0, "model_path": path},
        )
        assert sampler.status_code == 404
        assert [r for r in gw.publisher.requests() if r.function == Function.LOAD] == []


async def test_workers_and_cluster_hide_other_tenants_model_ids(
    infra: dict[str, str], tiny_registry: Path
) -> None:
    async with gateway(infra, tiny_registry) as gw:
        alices, bobs = await gw.model(ALICE), await gw.model(BOB)
        beat = WorkerHeartbeat(
            worker_id="worker-0",
            device="cpu",
            device_bytes=1 << 30,
            host_bytes=1 << 30,
            base_models=[TINY_MODEL],
            resident=[
                ResidentState(alices, Tier.DEVICE, 100, 1),
                ResidentState(bobs, Tier.HOST, 200, 1),
            ],
            busy=False,
            started_at=time.time(),
            sent_at=time.time(),
        )
        await gw.stores.workers.put_worker("worker-0", encode(beat), ttl_s=60)
        for url in ("/plexrl/v1/workers", "/plexrl/v1/cluster"):
            text = (await gw.http.get(url, headers=ALICE)).text
            assert alices in text and bobs not in text, url
        (worker,) = (await gw.http.get("/plexrl/v1/workers", headers=ALICE)).json()
        assert [(r["job_id"], r["tier"], r["bytes"]) for r in worker["resident"]] == [
            (alices, "device", 100),
            ("other-tenant", "host", 200),  # counted, not named
        ]
        cluster = (await gw.http.get("/plexrl/v1/cluster", headers=BOB)).json()
        assert cluster["jobs"] == 2 and cluster["tenant_jobs"] == 1
        await asyncio.sleep(0)


async def test_a_tenant_sees_only_its_own_running_job_from_the_schedulers_status(
    infra: dict[str, str], tiny_registry: Path
) -> None:
    port = free_port()
    alices: list[str] = []
    bobs: list[str] = []

    def inflight() -> dict[str, object]:
        return {"pending": 0, "jobs": 2, "inflight": {"w-a": alices[0], "w-b": bobs[0]}}

    # The scheduler's own health app, its state stood in for by `inflight`.
    scheduler = HttpServer(
        health_app("scheduler", lambda: {"ok": True}, detail=inflight, token=TOKEN),
        "127.0.0.1",
        port,
    )
    await scheduler.start()
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient() as http:
            assert (await http.get(f"{url}/status")).status_code == 401
        async with gateway(infra, tiny_registry, scheduler_url=url, service_token=TOKEN) as gw:
            alices.append(await gw.model(ALICE))
            bobs.append(await gw.model(BOB))
            seen = (await gw.http.get("/plexrl/v1/cluster", headers=ALICE)).json()["scheduler"]
            assert seen["reachable"] and seen["inflight"] == {
                "w-a": alices[0],
                "w-b": "other-tenant",
            }
        async with gateway(infra, tiny_registry, scheduler_url=url, service_token="wrong") as gw:
            seen = (await gw.http.get("/plexrl/v1/cluster", headers=ALICE)).json()["scheduler"]
            assert seen == {"reachable": False}
    finally:
        await scheduler.stop()
