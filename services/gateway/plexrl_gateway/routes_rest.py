"""Tinker API: the RestClient's listings (training runs, checkpoints, sessions), deletes,
and a checkpoint's lifecycle: publication, TTL, the tenant's stored bytes.

Who may do what (plexrl.stores.checkpoints.CheckpointRecord): any key reads a published
checkpoint (its info, load it, sample from it); only its owner's key deletes,
publishes, unpublishes or sets its TTL. A checkpoint past its TTL is gone for everyone.
What each SDK method does here, or why it is refused: docs/checkpoints.md.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel

from plexrl.stores import CheckpointRecord, JobKind, JobRecord
from plexrl_gateway.deps import GatewayDep, Jobs, Tenant, Usage
from plexrl_gateway.errors import ApiError, not_found
from plexrl_gateway.schemas import TinkerPathBody
from plexrl_gateway.translate import TINKER_SCHEME, CheckpointKind, parse_tinker_path

router = APIRouter(prefix="/api/v1")

Limit = Annotated[int, Query(ge=1, le=1000)]
Offset = Annotated[int, Query(ge=0)]

_CHECKPOINT_TYPES = {
    CheckpointKind.WEIGHTS: "training",
    CheckpointKind.SAMPLER_WEIGHTS: "sampler",
    CheckpointKind.EXTERNAL_WEIGHTS: "external",
}


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


def checkpoint_view(record: CheckpointRecord) -> dict[str, Any]:
    path = parse_tinker_path(record.path)
    return {
        "checkpoint_id": path.checkpoint_id,
        "checkpoint_type": _CHECKPOINT_TYPES[path.kind],
        "time": iso(record.created_at),
        "tinker_path": record.path,
        "size_bytes": record.size_bytes,
        "public": record.public,
        "expires_at": None if record.expires_at is None else iso(record.expires_at),
    }


@router.post("/weights_info")
async def weights_info(body: TinkerPathBody, tenant: Tenant, jobs: Jobs) -> dict[str, Any]:
    ckpt = await jobs.checkpoint(tenant, str(parse_tinker_path(body.tinker_path)))
    out: dict[str, Any] = {
        "base_model": ckpt.base_model,
        "is_lora": ckpt.lora_rank is not None,
        "optimizer_config": {"type": "adamw"},
    }
    if ckpt.lora_rank is not None:
        out["lora_rank"] = ckpt.lora_rank
        origin = await jobs.find_job(ckpt.tenant, ckpt.job_id)  # a published one: another's
        if origin is not None and origin.spec.lora is not None:
            out["train_attn"] = origin.spec.lora.train_attn
            out["train_mlp"] = origin.spec.lora.train_mlp
            out["train_unembed"] = origin.spec.lora.train_unembed
    return out


@router.get("/training_runs")
async def training_runs(
    tenant: Tenant, jobs: Jobs, usage: Usage, limit: Limit = 20, offset: Offset = 0
) -> dict[str, Any]:
    runs = [j for j in await jobs.jobs(tenant) if j.kind == JobKind.TRAINING]
    runs.sort(key=lambda j: j.created_at, reverse=True)
    ckpts = await jobs.checkpoints(tenant)
    page = [await _run_view(j, ckpts, usage) for j in runs[offset : offset + limit]]
    cursor = {"offset": offset, "limit": limit, "total_count": len(runs)}
    return {"training_runs": page, "cursor": cursor}


@router.get("/training_runs/{run_id}")
async def training_run(run_id: str, tenant: Tenant, jobs: Jobs, usage: Usage) -> dict[str, Any]:
    return await _run_view(await _run(tenant, run_id, jobs), await jobs.checkpoints(tenant), usage)


@router.get("/training_runs/{run_id}/checkpoints")
async def run_checkpoints(run_id: str, tenant: Tenant, jobs: Jobs) -> dict[str, Any]:
    await _run(tenant, run_id, jobs)
    ckpts = [c for c in await jobs.checkpoints(tenant) if c.job_id == run_id]
    ckpts.sort(key=lambda c: c.created_at)
    return {"checkpoints": [checkpoint_view(c) for c in ckpts]}


@router.get("/checkpoints")
async def user_checkpoints(
    tenant: Tenant, jobs: Jobs, limit: Limit = 100, offset: Offset = 0
) -> dict[str, Any]:
    ckpts = sorted(await jobs.checkpoints(tenant), key=lambda c: c.created_at, reverse=True)
    cursor = {"offset": offset, "limit": limit, "total_count": len(ckpts)}
    page = ckpts[offset : offset + limit]
    return {"checkpoints": [checkpoint_view(c) for c in page], "cursor": cursor}


@router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
async def delete_checkpoint(
    run_id: str, checkpoint_id: str, tenant: Tenant, jobs: Jobs, gateway: GatewayDep
) -> dict[str, Any]:
    if checkpoint_id.count("/") == 2 and checkpoint_id.endswith("/publish"):
        # unpublish_checkpoint_from_tinker_path: DELETE …/checkpoints/<kind>/<name>/publish
        path = _path(run_id, checkpoint_id.removesuffix("/publish"))
        record = await jobs.publish_checkpoint(tenant, path, public=False)
        return {"tinker_path": record.path, "public": record.public}
    ckpt = await jobs.owned_checkpoint(tenant, _path(run_id, checkpoint_id))
    blob_deleted = await gateway.checkpoints.delete(ckpt)
    return {"tinker_path": ckpt.path, "deleted": True, "blob_deleted": blob_deleted}


@router.post("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/publish")
async def publish_checkpoint(
    run_id: str, checkpoint_id: str, tenant: Tenant, jobs: Jobs
) -> dict[str, Any]:
    record = await jobs.publish_checkpoint(tenant, _path(run_id, checkpoint_id), public=True)
    return {"tinker_path": record.path, "public": record.public}


class TtlBody(BaseModel):
    ttl_seconds: int | None = None
    """Seconds from now until the checkpoint is deleted; None keeps it until deleted."""


@router.put("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/ttl")
async def checkpoint_ttl(
    run_id: str, checkpoint_id: str, body: TtlBody, tenant: Tenant, jobs: Jobs
) -> dict[str, Any]:
    path = _path(run_id, checkpoint_id)
    record = await jobs.set_checkpoint_ttl(tenant, path, body.ttl_seconds)
    expires = None if record.expires_at is None else iso(record.expires_at)
    return {"tinker_path": record.path, "expires_at": expires}


@router.get("/billing/usage/checkpoints/current")
async def checkpoint_storage_usage(
    tenant: Tenant, jobs: Jobs, project_id: str | None = None
) -> dict[str, Any]:
    """AdminClient.get_current_checkpoint_storage_usage: the caller's tenant only (a key
    sees nothing of others'), as of now (no lag), with no price. `project_id` is ignored:
    PlexRL has no projects."""
    ckpts = await jobs.checkpoints(tenant)
    size = sum(c.size_bytes for c in ckpts)
    item = {
        "project_id": None,
        "org_user_urn": None,
        "user_email": None,
        "user_name": tenant,
        "checkpoint_count": len(ckpts),
        "size_bytes": size,
        "size_gigabytes": size / 1e9,
        "estimated_monthly_cost_usd": None,
    }
    return {"effective_rate_usd_per_gigabyte_month": None, "data": [item]}


@router.post("/copy_weights")
async def copy_weights(_: Tenant) -> None:
    raise ApiError(
        400,
        "copy_weights is not supported by PlexRL: it copies a checkpoint into another "
        "project, and PlexRL has no projects (a key is one tenant). To let another tenant "
        "use a checkpoint, publish it (RestClient.publish_checkpoint_from_tinker_path): "
        "any key may then load or sample from its tinker:// path",
    )


def _path(run_id: str, checkpoint_id: str) -> str:
    """The tinker:// path a route's run id and `<kind>/<name>` name (400 if malformed)."""
    return str(parse_tinker_path(f"{TINKER_SCHEME}{run_id}/{checkpoint_id}"))


@router.get("/sessions")
async def list_sessions(
    tenant: Tenant, jobs: Jobs, limit: Limit = 20, offset: Offset = 0
) -> dict[str, Any]:
    sessions = await jobs.sessions(tenant)
    return {"sessions": [s.session_id for s in sessions[offset : offset + limit]]}


@router.get("/sessions/{session_id}")
async def get_session(session_id: str, tenant: Tenant, jobs: Jobs) -> dict[str, Any]:
    session = await jobs.session(tenant, session_id)
    mine = [j for j in await jobs.jobs(tenant) if j.session_id == session_id]
    return {
        "training_run_ids": [j.job_id for j in mine if j.kind == JobKind.TRAINING],
        "sampler_ids": [j.job_id for j in mine if j.kind == JobKind.SAMPLING],
        "user_metadata": session.user_metadata or None,
    }


@router.get("/sessions/{session_id}/trace_export")
async def trace_export(
    session_id: str, request: Request, tenant: Tenant, gateway: GatewayDep
) -> dict[str, Any]:
    """RestClient.export_session_trace (`tinker session export-trace`): ready at once, a
    signed URL whose file is built from the timeline when it is read
    (plexrl_gateway.session_trace)."""
    url = await gateway.traces.url(tenant, session_id, str(request.base_url))
    return {"status": "ready", "url": url}


@router.post("/sessions/search")
async def search_sessions(_: Tenant) -> None:
    raise ApiError(
        400,
        "search_sessions is not served by PlexRL: it searches an organization's projects, "
        "and a PlexRL key is one tenant with no projects. List the tenant's sessions with "
        "list_sessions and read each with get_session (its user_metadata included)",
    )


@router.put("/sessions/{session_id}/project")
async def assign_session_project(session_id: str, _: Tenant) -> None:
    raise ApiError(
        400,
        "assign_session_project is not supported by PlexRL: it has no projects (a key is "
        "one tenant, and its sessions are all the tenant's)",
    )


@router.get("/audit")
async def audit_log(_: Tenant) -> None:
    raise ApiError(
        400,
        "PlexRL keeps no audit log of API keys and members (its keys are the operator's, "
        "PLEXRL_API_KEYS). What each call did is in its trace (docs/tracing.md) and the "
        "timeline (GET /plexrl/v1/timeline)",
    )


@router.get("/billing/usage/events")
async def billing_usage(_: Tenant) -> None:
    raise ApiError(
        400,
        "PlexRL keeps no billing or token usage. What it measures per job is device time: "
        "GET /plexrl/v1/jobs/{job_id} (or `plexrl jobs`); checkpoint storage: "
        "`tinker billing checkpoint-storage`",
    )


async def _run(tenant: str, run_id: str, jobs: Jobs) -> JobRecord:
    job = await jobs.find_job(tenant, run_id)
    if job is None or job.kind != JobKind.TRAINING:
        raise not_found(f"unknown training run {run_id!r}")
    return job


async def _run_view(
    job: JobRecord, ckpts: list[CheckpointRecord], counters: Usage
) -> dict[str, Any]:
    usage = await counters.usage(job.job_id)
    mine = sorted((c for c in ckpts if c.job_id == job.job_id), key=lambda c: c.created_at)
    training = [c for c in mine if parse_tinker_path(c.path).kind == CheckpointKind.WEIGHTS]
    sampler = [c for c in mine if parse_tinker_path(c.path).kind == CheckpointKind.SAMPLER_WEIGHTS]
    return {
        "training_run_id": job.job_id,
        "base_model": job.spec.base_model,
        "model_owner": job.tenant,
        "is_lora": job.spec.lora is not None,
        "corrupted": False,
        "lora_rank": job.spec.lora.rank if job.spec.lora else None,
        "last_request_time": iso(usage.get("last_at", job.created_at)),
        "last_checkpoint": checkpoint_view(training[-1]) if training else None,
        "last_sampler_checkpoint": checkpoint_view(sampler[-1]) if sampler else None,
        "user_metadata": job.metadata or None,
    }
