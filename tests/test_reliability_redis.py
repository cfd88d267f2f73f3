"""Redis restarts: its append-only file keeps the metadata, and what it cannot keep is
rebuilt from its owners (checkpoint records from the state-store's blobs, residency
from the workers).

A private redis-server (started here on a free port, configured as
scripts/infra.sh configures the shared one) is restarted under live clients; the
shared Redis other tests use is never touched.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from plexrl.messages import JobSpec, LoraSpec, Tier
from plexrl.stores import JobKind, JobRecord, SessionRecord, Stores
from plexrl_state_store.app import build_app
from plexrl_state_store.blobs import BlobDir
from plexrl_state_store.records import CheckpointRecords
from plexrl_tools.private_infra import PrivateInfra
from plexrl_worker.residency import StateManager

pytestmark = pytest.mark.integration

SPEC = JobSpec(base_model="plexrl/tiny-qwen3", lora=LoraSpec(rank=4), state_bytes=1000)


@pytest.fixture
def private_redis() -> Iterator[PrivateInfra]:
    """A Redis of its own, run by scripts/infra.sh exactly as the shared one (an fsynced
    append-only file): stopped cleanly, wiped and started again by the test."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (scripts/infra.sh up installs it)")
    server = PrivateInfra(parts=("redis",))
    server.up()
    try:
        yield server
    finally:
        server.down()
        server.remove()


@dataclass
class QuietPublisher:
    """The worker's Kafka edge: residency announcements are not under test here."""

    sent: list[Any] = field(default_factory=list)

    async def publish_soon(self, topic: str, key: Any, message: Any) -> None:
        self.sent.append(message)


async def test_metadata_survives_a_redis_restart_and_lost_records_are_rebuilt(
    private_redis: PrivateInfra, tmp_path: Path
) -> None:
    stores = Stores.from_url(private_redis.redis_url, "c1", 3600)
    now = time.time()
    await stores.sessions.put_session(SessionRecord("sess-1", "alice", now, now))
    await stores.jobs.put_job(JobRecord("model-1", "alice", JobKind.TRAINING, SPEC, now, "sess-1"))
    blobs = BlobDir(tmp_path / "blobs")
    app = build_app(blobs, stores.checkpoints, stores.residency)
    alice = {"x-plexrl-tenant": "alice"}
    key = "ckpt/alice/model-1/weights/step-10"
    path = "tinker://model-1/weights/step-10"
    record = {
        "path": path,
        "tenant": "alice",
        "job_id": "model-1",
        "kind": "weights",
        "blob_key": key,
        "size_bytes": 5,
        "created_at": now,
        "base_model": SPEC.base_model,
        "lora_rank": 4,
    }
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://store"
    ) as http:
        assert (await http.put(f"/v1/blobs/{key}", content=b"bytes", headers=alice)).is_success
        assert (await http.post("/v1/checkpoints", json=record, headers=alice)).is_success
    states = StateManager(
        worker_id="worker-0",
        executor=None,  # type: ignore[arg-type]  # no state moves here, only their records
        residency=stores.residency,
        store=None,  # type: ignore[arg-type]
        publisher=QuietPublisher(),  # type: ignore[arg-type]
        events_topic="events",
    )
    await states.created("model-1", 1000)

    private_redis.down()
    private_redis.up()
    # The same clients, whose pooled connections died with the old server, just work.
    assert (await stores.sessions.get_session("sess-1")) is not None
    job = await stores.jobs.get_job("model-1")
    assert job is not None and job.spec == SPEC and job.tenant == "alice"
    assert [c.path for c in await stores.checkpoints.tenant_checkpoints("alice")] == [path]
    residency = await stores.residency.get_residency("model-1")
    assert residency is not None and residency.worker_id == "worker-0"

    # Now a Redis that comes back empty: the owners of what can be rebuilt rebuild it.
    private_redis.down()
    private_redis.wipe_redis()
    private_redis.up()
    assert await stores.jobs.get_job("model-1") is None
    assert await CheckpointRecords(blobs, stores.checkpoints).rebuild() == 1
    assert await states.reannounce() == 1  # what every heartbeat does
    (ckpt,) = await stores.checkpoints.tenant_checkpoints("alice")
    assert ckpt.blob_key == key and ckpt.lora_rank == 4
    residency = await stores.residency.get_residency("model-1")
    assert residency is not None and residency.tier == Tier.DEVICE and residency.version == 1
    assert await states.reannounce() == 0  # a record that exists is left alone
    # A deleted checkpoint is not brought back.
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://store"
    ) as http:
        deleted = await http.delete("/v1/checkpoints", params={"path": path}, headers=alice)
        assert deleted.is_success
    assert await CheckpointRecords(blobs, stores.checkpoints).rebuild() == 0
    assert await stores.checkpoints.tenant_checkpoints("alice") == []
    await stores.close()
