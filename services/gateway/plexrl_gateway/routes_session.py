"""Tinker API: client bootstrap, API key checks, sessions, telemetry, capabilities,
health."""

from __future__ import annotations

import hashlib
from typing import Annotated, Any

from fastapi import APIRouter, Header, Response
from fastapi.responses import JSONResponse

from plexrl.health import consumers_health
from plexrl.stores import JobKind
from plexrl_gateway.deps import Calls, Catalog, GatewayDep, Jobs, Submit, Tenant
from plexrl_gateway.errors import ApiError
from plexrl_gateway.schemas import CreateSessionBody, SdkVersionBody, SessionIdBody
from plexrl_gateway.unload import unload_model

router = APIRouter(prefix="/api/v1")

# What the SDK should do: API keys (no JWT), plain httpx, /retrieve_future long-polls,
# losses computed here. Every flag is spelled out so an SDK default change cannot bite.
# `proto_write_fwdbwd` moves SDKs 0.19 to 0.2x, which post JSON by default, to the
# protobuf body newer ones always send (the gateway reads both; docs/sdk.md).
CLIENT_CONFIG: dict[str, Any] = {
    "pjwt_auth_enabled": False,
    "proto_write_fwdbwd": True,
    "credential_default_source": "api_key",
    "use_pyqwest_transport": False,
    "proto_compress_fwdbwd": False,
    "sample_use_retrieve_futures": False,
    "custom_loss_server_side": False,
    "sample_join_sampling_session": False,
    "parallel_fwdbwd_chunks": True,
}


@router.post("/client/config")
async def client_config(_: Tenant, body: SdkVersionBody | None = None) -> dict[str, Any]:
    return CLIENT_CONFIG


@router.post("/client/dynamic_config")
async def dynamic_config(_: Tenant, body: SdkVersionBody | None = None) -> dict[str, Any]:
    return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}


@router.get("/auth/apikey/me")
async def api_key_me(tenant: Tenant, x_api_key: Annotated[str, Header()]) -> dict[str, Any]:
    """`tinker auth login`: the key is valid, and what it stands for. A PlexRL key is one
    tenant (`PLEXRL_API_KEYS`), with no user or organization behind it, so both name the
    tenant; its id is a digest of the key (the key itself is never echoed)."""
    key_id = int.from_bytes(hashlib.sha256(x_api_key.encode()).digest()[:6], "big")
    return {
        "key_id": key_id,
        "name": f"plexrl-{tenant}",
        "note": f"PlexRL API key of tenant {tenant!r}",
        "details": {"org_details": {"name": tenant}, "user_details": {"email": f"tenant {tenant}"}},
    }


@router.delete("/auth/apikey/me")
async def delete_api_key_me(_: Tenant) -> None:
    raise ApiError(
        400,
        "PlexRL's API keys are the operator's: a key is revoked by removing it from "
        "PLEXRL_API_KEYS on every gateway; `tinker auth logout` then only forgets it here",
    )


@router.post("/create_session")
async def create_session(body: CreateSessionBody, tenant: Tenant, jobs: Jobs) -> dict[str, Any]:
    session = await jobs.new_session(tenant, body.tags, body.user_metadata)
    return {"type": "create_session", "session_id": session.session_id}


@router.post("/session_heartbeat")
async def session_heartbeat(body: SessionIdBody, tenant: Tenant, jobs: Jobs) -> dict[str, Any]:
    await jobs.heartbeat(tenant, body.session_id)
    return {"type": "session_heartbeat"}


@router.post("/telemetry")
async def telemetry(_: Tenant) -> dict[str, Any]:
    # The SDK's events are not kept; traces and metrics cover the server side.
    return {"status": "accepted"}


@router.post("/sessions/{session_id}/finish", status_code=204)
async def finish_session(session_id: str, tenant: Tenant, jobs: Jobs, submit: Submit) -> Response:
    """The client is done: its training models are unloaded so their state frees workers
    (their checkpoints stay)."""
    await jobs.session(tenant, session_id)
    for job in await jobs.jobs(tenant):
        if job.session_id == session_id and job.kind == JobKind.TRAINING and not job.unloaded:
            await unload_model(job, jobs, submit)
    return Response(status_code=204)


@router.get("/get_server_capabilities")
async def server_capabilities(_: Tenant, catalog: Catalog) -> dict[str, Any]:
    models = []
    for name in await catalog.names():
        info = await catalog.info(name)
        models.append(
            {
                "model_name": name,
                "max_context_length": info.max_positions,
                "trainable": True,
                "sampleable": True,
            }
        )
    return {"supported_models": models}


@router.get("/healthz")
async def tinker_healthz(gateway: GatewayDep, calls: Calls) -> JSONResponse:
    ok = await _healthy(gateway, calls)
    return JSONResponse({"status": "ok" if ok else "degraded"}, status_code=200 if ok else 503)


health_router = APIRouter()


@health_router.get("/healthz")
async def healthz(gateway: GatewayDep, calls: Calls) -> JSONResponse:
    """Ok when Redis answers, the Kafka broker answers the producer, and the completions
    consumer is alive and not stuck."""
    redis_ok = await _redis_ok(calls)
    kafka_ok = await gateway.publisher.ping()
    consumers = consumers_health(gateway.watched)
    ok = redis_ok and kafka_ok and consumers["ok"]
    body = {
        "service": "gateway",
        "ok": ok,
        "redis": redis_ok,
        "kafka": kafka_ok,
        "consumers": consumers["consumers"],
    }
    return JSONResponse(body, status_code=200 if ok else 503)


async def _healthy(gateway: GatewayDep, calls: Calls) -> bool:
    return await _redis_ok(calls) and await gateway.publisher.ping()


async def _redis_ok(calls: Calls) -> bool:
    try:
        return await calls.ping()
    except Exception:
        return False
