"""The disk tier on an S3-compatible object store (SeaweedFS, through boto3): the
state-store's API over a bucket, checkpoint records kept beside their blobs in it and
rebuilt from it, an object store that is away answered as "retry", and two state-store
replicas over one bucket (either serves any blob; one at a time runs the background
rounds, the other takes over when it goes)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import httpx
import pytest
import pytest_asyncio

from plexrl.lease import Leadership, Lease, LeaseConfig, Term
from plexrl.retry import is_transient
from plexrl.state_store_client import StateStoreClient, StateStoreError
from plexrl.stores import CheckpointRecord, Stores
from plexrl_state_store.app import build_app
from plexrl_state_store.records import CheckpointRecords
from plexrl_state_store.s3 import S3Blobs, S3Config
from plexrl_tools.cluster import free_port
from plexrl_tools.private_infra import SeaweedFs

pytestmark = pytest.mark.integration

TENANT = "alice"


def bucket_of(seaweedfs: SeaweedFs, prefix: str) -> S3Blobs:
    blobs = S3Blobs(
        S3Config(
            seaweedfs.endpoint,
            bucket="replicas",
            prefix=prefix,
            access_key=seaweedfs.access_key,
            secret_key=seaweedfs.secret_key,
        )
    )
    blobs.ensure_bucket()
    return blobs


def client_of(blobs: S3Blobs, stores: Stores) -> StateStoreClient:
    client = StateStoreClient("http://store")
    app = build_app(blobs, stores.checkpoints, stores.residency)
    client._http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://s")
    return client


@pytest_asyncio.fixture
async def bucket(seaweedfs: SeaweedFs) -> AsyncIterator[S3Blobs]:
    yield bucket_of(seaweedfs, f"t-{uuid.uuid4().hex[:8]}/")


def record(key: str, name: str = "ck") -> CheckpointRecord:
    return CheckpointRecord(
        path=f"tinker://job-1/weights/{name}",
        job_id="job-1",
        tenant=TENANT,
        kind="weights",
        blob_key=key,
        size_bytes=1,
        created_at=1.0,
        base_model="plexrl/tiny-qwen3",
    )


async def test_two_replicas_over_one_bucket_serve_each_others_blobs(
    bucket: S3Blobs, seaweedfs: SeaweedFs, stores: Stores
) -> None:
    # A second replica: another process's client over the same bucket and prefix.
    other = bucket_of(seaweedfs, bucket.config.prefix)
    a, b = client_of(bucket, stores), client_of(other, stores)
    try:
        await a.put_blob("snapshot/job-1/e1-s4.safetensors", b"state" * 1000)
        assert bytes(await b.get_blob("snapshot/job-1/e1-s4.safetensors")) == b"state" * 1000
        await b.delete_blob("snapshot/job-1/e1-s4.safetensors")
        with pytest.raises(StateStoreError, match="404"):
            await a.get_blob("snapshot/job-1/e1-s4.safetensors")
        with pytest.raises(StateStoreError, match="400"):
            await a.put_blob("snapshot/job-1/not a key", b"x")
    finally:
        await a.close()
        await b.close()


async def test_records_kept_in_the_bucket_come_back_and_a_deleted_one_does_not(
    bucket: S3Blobs, stores: Stores
) -> None:
    client = client_of(bucket, stores)
    kept, gone = "ckpt/alice/job-1/weights/kept", "ckpt/alice/job-1/weights/gone"
    try:
        for key, name in ((kept, "kept"), (gone, "gone")):
            await client.put_blob(key, b"w", TENANT)
            await client.put_checkpoint(record(key, name))
        assert await client.delete_checkpoint(record(gone, "gone").path, TENANT)
    finally:
        await client.close()
    # Redis loses the kept one's record: the rebuild finds its copy in the bucket.
    await stores.keys.redis.delete(stores.keys.key("ckpt", record(kept, "kept").path))
    assert await CheckpointRecords(bucket, stores.checkpoints).rebuild() == 1
    assert await stores.checkpoints.get_checkpoint(record(kept, "kept").path) is not None
    assert await stores.checkpoints.get_checkpoint(record(gone, "gone").path) is None
    assert bucket.size(gone) is None and bucket.size(kept) == 1
    assert [name for name, _ in bucket.records()] == [f"{kept}.json"]


async def test_an_object_store_that_is_away_is_answered_as_retry(stores: Stores) -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"
    away = S3Blobs(S3Config(endpoint, access_key="k", secret_key="s", connect_timeout_s=0.5))
    client = client_of(away, stores)
    try:
        with pytest.raises(StateStoreError) as answered:
            await client.put_blob("snapshot/job-1/x", b"x")
    finally:
        await client.close()
    assert answered.value.status_code == 503 and "object store" in str(answered.value)
    assert is_transient(answered.value)


async def test_one_replica_runs_the_rounds_and_another_takes_over_when_it_goes(
    stores: Stores,
) -> None:
    config = LeaseConfig(ttl_s=1.5, renew_s=0.3, retry_s=0.1, margin_s=0.3)
    key = stores.keys.key("lease", "state-store")
    rounds: list[str] = []

    def replica(name: str) -> Leadership:
        return Leadership(Lease(stores.keys.redis, key, name, config=config))

    async def sweep(name: str, term: Term, ended: asyncio.Event) -> None:
        rounds.append(f"{name}:{term.token}")
        await ended.wait()

    a, b = replica("a"), replica("b")
    stop_a, stop_b = asyncio.Event(), asyncio.Event()
    runs = [
        asyncio.create_task(a.run(stop_a, lambda t, e: sweep("a", t, e))),
        asyncio.create_task(b.run(stop_b, lambda t, e: sweep("b", t, e))),
    ]
    try:
        await asyncio.sleep(1.0)
        assert [a.leading, b.leading].count(True) == 1 and len(rounds) == 1
        first, second, stop_first = (a, b, stop_a) if a.leading else (b, a, stop_b)
        stop_first.set()  # the sweeping replica shuts down: it lets go of the lease
        for _ in range(40):
            if second.leading:
                break
            await asyncio.sleep(0.05)
        assert second.leading and not first.leading
        assert len(rounds) == 2 and int(rounds[1].split(":")[1]) > int(rounds[0].split(":")[1])
    finally:
        stop_a.set()
        stop_b.set()
        await asyncio.gather(*runs)
