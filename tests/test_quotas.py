"""Per-tenant quotas on records and their user metadata, through the gateway on real Redis.

A tenant past a quota gets a 400 that names the quota, its value and the setting that
raises it; nothing of the refused record is stored, and other tenants are unaffected.
Only Kafka is faked (gateway_harness); the last test drives the unmodified Tinker SDK.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import pytest
import tinker
from gateway_harness import ALICE, BOB, gateway
from gateway_support import TINY_MODEL, free_port, unique_cluster

from plexrl.health import HttpServer
from plexrl.quotas import RecordQuotas
from plexrl.settings import GatewaySettings
from plexrl.stores import CheckpointRecord
from plexrl_gateway.app import build_app


def model_body(session: str, seq: int = 0, metadata: dict[str, str] | None = None) -> Any:
    return {
        "session_id": session,
        "model_seq_id": seq,
        "base_model": TINY_MODEL,
        "lora_config": {"rank": 4},
        "user_metadata": metadata,
    }


def session_body(metadata: dict[str, str] | None = None, tags: list[str] | None = None) -> Any:
    return {"tags": tags or [], "user_metadata": metadata, "sdk_version": "0.38.0"}


def refused(response: Any, setting: str, value: int) -> str:
    """The refusal's message, checked to name the quota's setting and value."""
    assert response.status_code == 400, response.text
    body = response.json()
    assert f"{setting}={value}" in body["error"] and body["category"] == "user", body
    return str(body["error"])


async def test_a_tenant_at_its_model_quota_is_refused_until_it_unloads_one(
    infra: dict[str, str], tiny_registry: Path
) -> None:
    async with gateway(infra, tiny_registry, quota_training_models=2) as gw:
        session = await gw.session(ALICE)
        first = (await gw.ok("create_model", model_body(session, 0)))["model_id"]
        await gw.ok("create_model", model_body(session, 1))
        third = await gw.post("create_model", model_body(session, 2))
        message = refused(third, "PLEXRL_QUOTA_TRAINING_MODELS", 2)
        assert "holds 2 training models" in message and "unload" in message
        assert await gw.stores.jobs.get_job(f"{session}:train:2") is None
        # Another tenant's place is its own.
        await gw.ok("create_model", model_body(await gw.session(BOB), 0), BOB)
        # Unloading frees a place; the unloaded record stays (and is not refused).
        await gw.ok("unload_model", {"model_id": first})
        await gw.ok("create_model", model_body(session, 3))
        assert len(await gw.gateway.registry.jobs("alice")) == 3


async def test_concurrent_creates_never_take_more_places_than_the_quota(
    infra: dict[str, str], tiny_registry: Path
) -> None:
    async with gateway(infra, tiny_registry, quota_training_models=3) as gw:
        session = await gw.session(ALICE)
        answers = await asyncio.gather(
            *(gw.post("create_model", model_body(session, seq)) for seq in range(10))
        )
        assert sorted(a.status_code for a in answers) == [200] * 3 + [400] * 7
        live = [j for j in await gw.gateway.registry.jobs("alice") if not j.unloaded]
        assert len(live) == 3


async def test_sessions_past_the_quota_are_refused_and_expired_ones_free_their_place(
    infra: dict[str, str], tiny_registry: Path
) -> None:
    async with gateway(infra, tiny_registry, quota_sessions=2, record_ttl_s=1) as gw:
        first = await gw.session(ALICE)
        await gw.session(ALICE)
        refused(await gw.post("create_session", session_body()), "PLEXRL_QUOTA_SESSIONS", 2)
        # A heartbeat of a session it holds is never refused.
        await gw.ok("session_heartbeat", {"session_id": first})
        await gw.session(BOB)
        await asyncio.sleep(1.2)  # both of alice's sessions expire (ttl 1 s)
        await gw.session(ALICE)
        assert len(await gw.gateway.registry.sessions("alice")) == 1


async def test_sampling_sessions_past_the_quota_are_refused(
    infra: dict[str, str], tiny_registry: Path
) -> None:
    async with gateway(infra, tiny_registry, quota_sampling_sessions=1) as gw:
        session = await gw.session(ALICE)

        def body(seq: int) -> Any:
            return {"session_id": session, "sampling_session_seq_id": seq, "base_model": TINY_MODEL}

        await gw.ok("create_sampling_session", body(0))
        await gw.ok("create_sampling_session", body(0))  # the same one again: no new place
        refused(
            await gw.post("create_sampling_session", body(1)), "PLEXRL_QUOTA_SAMPLING_SESSIONS", 1
        )


async def test_metadata_is_capped_per_record_and_per_tenant(
    infra: dict[str, str], tiny_registry: Path
) -> None:
    overrides = {"quota_record_metadata_bytes": 1000, "quota_metadata_bytes": 2500}
    async with gateway(infra, tiny_registry, **overrides) as gw:
        big = {"notes": "x" * 2000}
        refused(
            await gw.post("create_session", session_body(big)),
            "PLEXRL_QUOTA_RECORD_METADATA_BYTES",
            1000,
        )
        refused(
            await gw.post("create_session", session_body(tags=["t" * 600, "u" * 600])),
            "PLEXRL_QUOTA_RECORD_METADATA_BYTES",
            1000,
        )
        session = await gw.session(ALICE)
        refused(
            await gw.post("create_model", model_body(session, 0, big)),
            "PLEXRL_QUOTA_RECORD_METADATA_BYTES",
            1000,
        )
        assert gw.publisher.requests() == []  # nothing published for the refused model
        # 900 + 900 bytes fit the tenant's 2500; a third 900 does not, for either kind.
        fits = {"notes": "y" * 895}
        await gw.ok("create_session", session_body(fits))
        await gw.ok("create_model", model_body(session, 1, fits))
        message = refused(
            await gw.post("create_session", session_body(fits)), "PLEXRL_QUOTA_METADATA_BYTES", 2500
        )
        assert "holds 1800 bytes of user_metadata" in message
        refused(
            await gw.post("create_model", model_body(session, 2, fits)),
            "PLEXRL_QUOTA_METADATA_BYTES",
            2500,
        )
        # Bob's metadata is counted apart.
        await gw.ok("create_session", session_body(fits), BOB)


async def test_lowered_caps_never_refuse_an_unload(
    infra: dict[str, str], tiny_registry: Path
) -> None:
    cluster = unique_cluster("quota")
    async with gateway(infra, tiny_registry, cluster_id=cluster) as before:
        session = await before.session(ALICE)
        model = (await before.ok("create_model", model_body(session, 0, {"n": "x" * 5000})))[
            "model_id"
        ]
        lowered = {"quota_training_models": 1, "quota_record_metadata_bytes": 1000}
        async with gateway(infra, tiny_registry, cluster_id=cluster, **lowered) as after:
            await after.ok("unload_model", {"model_id": model})
            job = await after.stores.jobs.get_job(model)
            assert job is not None and job.unloaded


async def test_checkpoints_past_the_quota_are_refused(
    infra: dict[str, str], tiny_registry: Path
) -> None:
    async with gateway(infra, tiny_registry, quota_checkpoints=2) as gw:
        registry = gw.gateway.registry
        for name in ("a", "b"):
            await registry.admit_checkpoint("alice")
            await gw.stores.checkpoints.put_checkpoint(
                CheckpointRecord(
                    path=f"tinker://m/weights/{name}",
                    tenant="alice",
                    job_id="m",
                    kind="weights",
                    blob_key=f"ckpt/alice/m/weights/{name}",
                    size_bytes=1,
                    created_at=time.time(),
                    base_model=TINY_MODEL,
                )
            )
        with pytest.raises(Exception, match="PLEXRL_QUOTA_CHECKPOINTS=2"):
            await registry.admit_checkpoint("alice")
        await registry.admit_checkpoint("bob")
        # Through the routes: a save that would make a third checkpoint is refused, a
        # save over a standing one (overwrite) takes no new place.
        model = (await gw.ok("create_model", model_body(await gw.session(ALICE))))["model_id"]
        for path, body in (
            ("save_weights", {"model_id": model, "path": "c", "seq_id": 1}),
            ("save_weights_for_sampler", {"model_id": model, "path": "d", "seq_id": 2}),
        ):
            refused(await gw.post(path, body), "PLEXRL_QUOTA_CHECKPOINTS", 2)


def test_quota_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLEXRL_QUOTA_TRAINING_MODELS", "7")
    monkeypatch.setenv("PLEXRL_QUOTA_METADATA_BYTES", "4096")
    quotas = GatewaySettings().quotas()
    assert quotas.training_models == 7 and quotas.metadata_bytes == 4096
    assert quotas.sessions == RecordQuotas().sessions
    with pytest.raises(ValueError, match="PLEXRL_QUOTA_SESSIONS"):
        RecordQuotas(sessions=0)


def sdk_creates(base_url: str) -> list[str]:
    """A user's script: a model with too much metadata, then one past the model quota
    (both refused when created, so no worker needs to answer anything)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    client = tinker.ServiceClient(base_url=base_url, api_key="tml-alice")
    errors = []
    for metadata in ({"notes": "x" * 4000}, None):
        try:
            client.create_lora_training_client(
                base_model=TINY_MODEL, rank=4, user_metadata=metadata
            ).result(timeout=60)
        except tinker.BadRequestError as exc:
            errors.append(str(exc))
    return errors


@pytest.mark.integration
async def test_the_tinker_sdk_shows_the_quota_it_hit(
    infra: dict[str, str], tiny_registry: Path
) -> None:
    overrides = {"quota_training_models": 1, "quota_record_metadata_bytes": 1024}
    async with gateway(infra, tiny_registry, **overrides) as gw:
        await gw.model(ALICE)  # alice's one place is taken
        port = free_port()
        server = HttpServer(build_app(gw.gateway), "127.0.0.1", port)
        await server.start()
        try:
            errors = await asyncio.wait_for(
                asyncio.to_thread(sdk_creates, f"http://127.0.0.1:{port}"), 120
            )
        finally:
            await server.stop()
        assert len(errors) == 2, errors
        assert "PLEXRL_QUOTA_RECORD_METADATA_BYTES=1024" in errors[0]
        assert "PLEXRL_QUOTA_TRAINING_MODELS=1" in errors[1]
