"""A checkpoint record is confirmed only once a Redis replica holds it: the state-store
answers 503 (retry) when none does, so a record written on a primary cut off from its
replicas is never reported as standing."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from plexrl.redis_target import ReplicaLagError
from plexrl.stores import Stores
from plexrl_state_store.app import build_app
from plexrl_state_store.blobs import BlobDir

pytestmark = pytest.mark.integration


async def test_a_checkpoint_no_replica_confirms_is_answered_503(
    stores: Stores, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def unconfirmed() -> int:
        raise ReplicaLagError("0 of 1 Redis replica(s) hold the write after 1000 ms")

    app = build_app(BlobDir(tmp_path / "blobs"), stores.checkpoints, stores.residency)
    alice = {"x-plexrl-tenant": "alice"}
    key = "ckpt/alice/model-1/weights/step-1"
    record = {
        "path": "tinker://model-1/weights/step-1",
        "tenant": "alice",
        "job_id": "model-1",
        "kind": "weights",
        "blob_key": key,
        "size_bytes": 5,
        "created_at": time.time(),
        "base_model": "plexrl/tiny-qwen3",
        "lora_rank": 4,
    }
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://store"
    ) as http:
        assert (await http.put(f"/v1/blobs/{key}", content=b"bytes", headers=alice)).is_success
        monkeypatch.setattr(stores.checkpoints, "replicated", unconfirmed)
        answer = await http.post("/v1/checkpoints", json=record, headers=alice)
        assert answer.status_code == 503 and "retry" in answer.json()["detail"]
        monkeypatch.undo()
        assert (await http.post("/v1/checkpoints", json=record, headers=alice)).is_success
