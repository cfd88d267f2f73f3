"""A checkpoint's lifecycle after its save: TTL, publication, stored bytes and their quota.

The gateway over real Redis with only Kafka faked (gateway_harness), and the
state-store's expiry sweep over real Redis and a real blob directory. Records stand in
for the worker's saves (they are what it writes through the state-store).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgspec
import tinker
from gateway_harness import ALICE, BOB, Gw, gateway

from plexrl.stores import CheckpointRecord, Stores
from plexrl_state_store.blobs import RECORDS_DIR, BlobDir
from plexrl_state_store.expiry import ExpirySweeper
from plexrl_state_store.records import CheckpointRecords

TINY = "plexrl/tiny-qwen3"


def record(
    job: str, name: str, tenant: str = "alice", size: int = 100, kind: str = "weights"
) -> CheckpointRecord:
    return CheckpointRecord(
        path=f"tinker://{job}/{kind}/{name}",
        tenant=tenant,
        job_id=job,
        kind=kind,
        blob_key=f"ckpt/{tenant}/{job}/{kind}/{name}@e1-{time.time_ns()}",
        size_bytes=size,
        created_at=time.time(),
        base_model=TINY,
        lora_rank=4,
    )


def sample_request(session_id: str, seq_id: int) -> dict[str, Any]:
    request = tinker.types.SampleRequest(
        prompt=tinker.ModelInput.from_ints([1, 2, 3]),
        sampling_params=tinker.SamplingParams(max_tokens=2, seed=1),
        num_samples=1,
        sampling_session_id=session_id,
        seq_id=seq_id,
        prompt_logprobs=False,
    )
    return request.model_dump(mode="json", exclude_none=True)


def route(path: str, suffix: str = "") -> str:
    run, _, checkpoint_id = path.removeprefix("tinker://").partition("/")
    return f"/api/v1/training_runs/{run}/checkpoints/{checkpoint_id}{suffix}"


async def listing(gw: Gw, who: dict[str, str] = ALICE) -> dict[str, dict[str, Any]]:
    response = await gw.http.get("/api/v1/checkpoints", headers=who)
    assert response.status_code == 200, response.text
    return {c["tinker_path"]: c for c in response.json()["checkpoints"]}


async def info(gw: Gw, path: str, who: dict[str, str]) -> int:
    return (await gw.post("weights_info", {"tinker_path": path}, who)).status_code


async def test_a_ttl_is_set_renewed_and_removed_and_an_expired_checkpoint_reads_as_gone(
    infra: dict[str, str], tiny_registry: Path
) -> None:
    async with gateway(infra, tiny_registry, checkpoint_ttl_min_s=60) as gw:
        ckpt = record("run-a", "ttl")
        await gw.stores.checkpoints.put_checkpoint(ckpt)
        before = time.time()
        set_ttl = await gw.http.put(
            route(ckpt.path, "/ttl"), json={"ttl_seconds": 3600}, headers=ALICE
        )
        assert set_ttl.status_code == 200, set_ttl.text
        first = (await gw.stores.checkpoints.get_checkpoint(ckpt.path)).expires_at
        assert first is not None and before + 3600 <= first <= time.time() + 3600
        assert (await listing(gw))[ckpt.path]["expires_at"] is not None
        renew = await gw.http.put(
            route(ckpt.path, "/ttl"), json={"ttl_seconds": 7200}, headers=ALICE
        )
        assert renew.status_code == 200
        renewed = await gw.stores.checkpoints.get_checkpoint(ckpt.path)
        assert renewed is not None and renewed.expires_at is not None
        assert renewed.expires_at >= first + 3600
        remove = await gw.http.put(
            route(ckpt.path, "/ttl"), json={"ttl_seconds": None}, headers=ALICE
        )
        assert remove.status_code == 200
        assert (await listing(gw))[ckpt.path]["expires_at"] is None
        assert await gw.stores.checkpoints.due(time.time() + 1e9) == []

        short = await gw.http.put(route(ckpt.path, "/ttl"), json={"ttl_seconds": 5}, headers=ALICE)
        assert short.status_code == 400 and "PLEXRL_CHECKPOINT_TTL_MIN_S" in short.text
        other = await gw.http.put(route(ckpt.path, "/ttl"), json={"ttl_seconds": 3600}, headers=BOB)
        assert other.status_code == 404  # not revealed to another tenant

        # Past its expiry, not yet swept: gone for every reader and every change.
        await gw.stores.checkpoints.set_expiry(ckpt.path, time.time() - 1)
        assert ckpt.path not in await listing(gw)
        assert await info(gw, ckpt.path, ALICE) == 404
        session = await gw.session(ALICE)
        opened = await gw.post(
            "create_sampling_session",
            {"session_id": session, "sampling_session_seq_id": 0, "model_path": ckpt.path},
        )
        assert opened.status_code == 404
        again = await gw.http.put(
            route(ckpt.path, "/ttl"), json={"ttl_seconds": 3600}, headers=ALICE
        )
        assert again.status_code == 404
        assert (await gw.http.delete(route(ckpt.path), headers=ALICE)).status_code == 404


async def test_a_published_checkpoint_is_read_by_other_tenants_and_changed_by_its_owner_only(
    infra: dict[str, str], tiny_registry: Path
) -> None:
    async with gateway(infra, tiny_registry) as gw:
        ckpt = record("run-p", "pub", kind="sampler_weights")
        await gw.stores.checkpoints.put_checkpoint(ckpt)
        assert await info(gw, ckpt.path, BOB) == 404
        assert (await gw.http.post(route(ckpt.path, "/publish"), headers=BOB)).status_code == 404
        published = await gw.http.post(route(ckpt.path, "/publish"), headers=ALICE)
        assert published.status_code == 200, published.text
        assert (await listing(gw))[ckpt.path]["public"] is True
        assert ckpt.path not in await listing(gw, BOB)  # listed for its owner only

        assert await info(gw, ckpt.path, BOB) == 200
        session = await gw.session(BOB)
        opened = await gw.ok(
            "create_sampling_session",
            {"session_id": session, "sampling_session_seq_id": 0, "model_path": ckpt.path},
            BOB,
        )
        sampler = opened["sampling_session_id"]
        sample = sample_request(sampler, 0)
        assert (await gw.post("asample", sample, BOB)).status_code == 200
        for method, suffix, body in (
            ("DELETE", "/publish", None),
            ("DELETE", "", None),
            ("PUT", "/ttl", {"ttl_seconds": 3600}),
        ):
            answer = await gw.http.request(method, route(ckpt.path, suffix), json=body, headers=BOB)
            assert answer.status_code == 403, (method, suffix, answer.text)
            assert "only its owner" in answer.json()["error"]

        unpublished = await gw.http.delete(route(ckpt.path, "/publish"), headers=ALICE)
        assert unpublished.status_code == 200
        assert (await listing(gw))[ckpt.path]["public"] is False
        assert await info(gw, ckpt.path, BOB) == 404
        refused = await gw.post("asample", sample_request(sampler, 1), BOB)
        assert refused.status_code == 404 and "unpublished" in refused.text
        assert await info(gw, ckpt.path, ALICE) == 200


async def test_stored_bytes_follow_the_records_and_a_save_past_the_quota_is_refused(
    infra: dict[str, str], tiny_registry: Path
) -> None:
    async with gateway(infra, tiny_registry, quota_checkpoint_bytes=250) as gw:
        store = gw.stores.checkpoints
        a, b = record("run-q", "a", size=100), record("run-q", "b", size=100)
        await store.put_checkpoint(a)
        await store.put_checkpoint(b)
        assert await store.stored_bytes("alice") == 200
        saved_over = msgspec.structs.replace(a, blob_key=a.blob_key + "x", size_bytes=150)
        await store.put_checkpoint(saved_over)
        assert await store.stored_bytes("alice") == 250 and await store.stored_bytes("bob") == 0
        usage = await gw.http.get("/api/v1/billing/usage/checkpoints/current", headers=ALICE)
        assert usage.json()["data"][0]["size_bytes"] == 250
        assert usage.json()["data"][0]["checkpoint_count"] == 2

        model = await gw.model(ALICE)
        save = {"model_id": model, "path": "c", "seq_id": 1}
        refused = await gw.post("save_weights", save)
        assert refused.status_code == 400, refused.text
        message = refused.json()["error"]
        assert "PLEXRL_QUOTA_CHECKPOINT_BYTES=250" in message and "stores 250 bytes" in message
        assert "delete" in message
        sampler_save = {"model_id": model, "sampling_session_seq_id": 0, "seq_id": 1}
        assert (await gw.post("save_weights_for_sampler", sampler_save)).status_code == 400

        await store.delete_checkpoint(b)
        assert await store.stored_bytes("alice") == 150
        assert (await gw.post("save_weights", save)).status_code == 200
        assert (await gw.post("save_weights", {**save, "seq_id": 2}, BOB)).status_code == 404


async def test_a_saves_ttl_is_taken_by_its_record(
    infra: dict[str, str], tiny_registry: Path
) -> None:
    async with gateway(infra, tiny_registry) as gw:
        model = await gw.model(ALICE)
        save = {"model_id": model, "path": "t", "seq_id": 1, "ttl_seconds": 7200}
        assert (await gw.post("save_weights", save)).status_code == 200
        too_long = {**save, "seq_id": 2, "path": "u", "ttl_seconds": 11 * 365 * 86400}
        assert (await gw.post("save_weights", too_long)).status_code == 400
        # What the worker records once the save ran takes the TTL the save asked for.
        written = msgspec.structs.replace(record(model, "t"), path=f"tinker://{model}/weights/t")
        await gw.stores.checkpoints.put_checkpoint(written)
        stored = await gw.stores.checkpoints.get_checkpoint(written.path)
        assert stored is not None and stored.expires_at == written.created_at + 7200
        assert written.path in await gw.stores.checkpoints.changed()
        # A save of the same name without a TTL makes a checkpoint kept until deleted.
        plain = {"model_id": model, "path": "t", "seq_id": 3, "overwrite": True}
        assert (await gw.post("save_weights", plain)).status_code == 200
        again = msgspec.structs.replace(written, blob_key=written.blob_key + "2")
        await gw.stores.checkpoints.put_checkpoint(again)
        stored = await gw.stores.checkpoints.get_checkpoint(written.path)
        assert stored is not None and stored.expires_at is None
        assert await gw.stores.checkpoints.due(time.time() + 1e9) == []


async def test_the_sweep_deletes_an_expired_checkpoint_for_good(
    stores: Stores, tmp_path: Path
) -> None:
    blobs = BlobDir(tmp_path)
    records = CheckpointRecords(blobs, stores.checkpoints)
    now = [time.time()]
    sweeper = ExpirySweeper(stores.checkpoints, records, clock=lambda: now[0])
    store = stores.checkpoints

    async def saved(name: str) -> CheckpointRecord:
        ckpt = record("run-s", name, size=4)
        blobs.write(ckpt.blob_key, b"1234")
        records.keep(ckpt)  # what the state-store's put does
        await store.put_checkpoint(ckpt)
        return ckpt

    doomed, kept, renewed = await saved("doomed"), await saved("kept"), await saved("renewed")
    await store.set_expiry(doomed.path, now[0] + 10)
    await store.set_expiry(renewed.path, now[0] + 10)
    await store.set_public(kept.path, True)
    assert await sweeper.copy_changed() == 3  # the copies beside the blobs follow
    copy = msgspec.json.decode(
        (tmp_path / RECORDS_DIR / f"{doomed.blob_key}.json").read_bytes(), type=CheckpointRecord
    )
    assert copy.expires_at == now[0] + 10
    assert await sweeper.sweep() == []
    await store.set_expiry(renewed.path, now[0] + 1000)

    now[0] += 11
    assert await sweeper.sweep() == [doomed.path]
    assert await store.get_checkpoint(doomed.path) is None
    assert blobs.size(doomed.blob_key) is None
    assert not (tmp_path / RECORDS_DIR / f"{doomed.blob_key}.json").exists()
    assert await store.stored_bytes("alice") == 8
    assert await store.get_checkpoint(renewed.path) is not None
    # The tombstone stays until the rebuild's round drops it; the record never returns.
    assert doomed.blob_key in await store.tombstones()
    await records.rebuild()
    await records.rebuild()
    assert await store.get_checkpoint(doomed.path) is None
    assert await store.tombstones() == {}

    # Redis loses its data: the records come back from their copies, expiry and
    # publication included, and the sweep deletes the expired one.
    await sweeper.copy_changed()
    keys = [k async for k in stores.keys.redis.scan_iter(match=stores.keys.key("*"))]
    await stores.keys.redis.delete(*keys)
    assert await records.rebuild() == 2
    restored = await store.get_checkpoint(kept.path)
    assert restored is not None and restored.public
    assert await store.stored_bytes("alice") == 8
    now[0] += 1000
    assert await sweeper.sweep() == [renewed.path]
    assert blobs.size(renewed.blob_key) is None and blobs.size(kept.blob_key) == 4


async def test_copy_weights_is_refused_with_what_to_do_instead(
    infra: dict[str, str], tiny_registry: Path
) -> None:
    async with gateway(infra, tiny_registry) as gw:
        body = {"source_path": "tinker://run-c/weights/a", "destination_project_id": "p"}
        refused = await gw.post("copy_weights", body)
        assert refused.status_code == 400
        message = refused.json()["error"]
        assert "no projects" in message and "publish_checkpoint_from_tinker_path" in message
