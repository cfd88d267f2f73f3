"""PlexRL's own API (/plexrl/v1): cluster and workers, jobs with residency and accounting,
the timeline, idle hints, and the echo call the control-plane benchmark measures."""

from __future__ import annotations

import time
from typing import Annotated, Any

import msgspec
from fastapi import APIRouter, Query

from plexrl.limits import LATEST_TIMESTAMP
from plexrl.messages import Function, IdleHint, JobOptions, JobSpec, NoopInput
from plexrl_gateway.cluster import NO_ACTIVITY, activity
from plexrl_gateway.deps import Futures, GatewayDep, Jobs, Submit, Tenant, Timeline
from plexrl_gateway.errors import ApiError, Category, not_found
from plexrl_gateway.render import ResponseKind
from plexrl_gateway.schemas import IdleBody, JobOptionsBody
from plexrl_gateway.submitter import Call, Submission, ready

router = APIRouter(prefix="/plexrl/v1")

# The echo job holds no state and names no model: its NOOP calls measure the control
# plane alone (gateway → Kafka → scheduler → worker → back).
ECHO_SPEC = JobSpec(base_model="", lora=None, state_bytes=0)

# Calls read to work out each job's recent activity; past it the window shows the oldest.
TIMELINE_WINDOW_MAX = 10_000


def echo_job_id(tenant: str) -> str:
    return f"plexrl-echo:{tenant}"


OTHER_TENANT = "other-tenant"
"""What a tenant sees in place of a job id of another tenant."""


async def own_job_ids(tenant: str, jobs: Jobs) -> set[str]:
    """The tenant's job ids (read from its id set: no record, no metadata)."""
    return await jobs.job_ids(tenant) | {echo_job_id(tenant)}


def tenant_view(workers: list[dict[str, Any]], mine: set[str]) -> list[dict[str, Any]]:
    """Workers as one tenant may see them: other tenants' states are counted (tier,
    bytes) but their job ids are hidden."""
    out = []
    for worker in workers:
        resident = [
            r if r.get("job_id") in mine else {**r, "job_id": OTHER_TENANT}
            for r in worker.get("resident", [])
        ]
        out.append({**worker, "resident": resident} if "resident" in worker else worker)
    return out


@router.get("/cluster")
async def cluster(tenant: Tenant, gateway: GatewayDep, jobs: Jobs) -> dict[str, Any]:
    """Every dashboard polls this: it reads counts and ids, never a job record, so it
    costs the same however many records (and however much metadata) tenants hold."""
    mine = await own_job_ids(tenant, jobs)
    workers = tenant_view(await gateway.cluster.workers(), mine)
    scheduler = await gateway.cluster.scheduler()
    inflight = (scheduler or {}).get("inflight") or {}
    return {
        "workers": workers,
        "jobs": await gateway.cluster.job_count(),
        "tenant_jobs": await jobs.job_count(tenant),
        "scheduler": (
            {"reachable": False}
            if scheduler is None
            else {
                "reachable": True,
                "pending": scheduler.get("pending"),
                "inflight": {
                    w: job if job in mine else OTHER_TENANT for w, job in inflight.items()
                },
                "jobs": scheduler.get("jobs"),
                # The costs of sharing its policy predicts with, and those set.
                "sharing": scheduler.get("sharing"),
            }
        ),
    }


@router.get("/workers")
async def workers(tenant: Tenant, gateway: GatewayDep, jobs: Jobs) -> list[dict[str, Any]]:
    return tenant_view(await gateway.cluster.workers(), await own_job_ids(tenant, jobs))


@router.get("/jobs")
async def list_jobs(
    tenant: Tenant,
    jobs: Jobs,
    timeline: Timeline,
    gateway: GatewayDep,
    details: Annotated[bool, Query()] = False,
    window_s: Annotated[float, Query(gt=0, le=86400)] = 300.0,
) -> list[dict[str, Any]]:
    """The tenant's jobs, oldest first. With `details`, each as `/jobs/{id}` shows it plus
    its `activity` (calls, steps and step rate, swaps) over the last `window_s` seconds of
    the timeline: what a dashboard needs in one request."""
    records = sorted(await jobs.jobs(tenant), key=lambda j: j.created_at)
    if not details:
        return [msgspec.to_builtins(j) for j in records]
    recent = activity(await timeline.timeline(time.time() - window_s, TIMELINE_WINDOW_MAX))
    return [
        {**await gateway.cluster.job(r), "activity": recent.get(r.job_id, NO_ACTIVITY)}
        for r in records
    ]


@router.get("/jobs/{job_id}")
async def job(job_id: str, tenant: Tenant, jobs: Jobs, gateway: GatewayDep) -> dict[str, Any]:
    record = await jobs.find_job(tenant, job_id)
    if record is None:
        raise not_found(f"unknown job {job_id!r}")
    return await gateway.cluster.job(record)


@router.get("/timeline")
async def timeline(
    tenant: Tenant,
    jobs: Jobs,
    stream: Timeline,
    # Unix seconds; bounded so a typo (2.2e307) is a 422 naming the field, not a bad
    # stream id deep in Redis.
    since: Annotated[float, Query(ge=0, le=LATEST_TIMESTAMP)] = 0.0,
    limit: Annotated[int, Query(ge=1, le=10000)] = 1000,
) -> list[dict[str, Any]]:
    mine = await own_job_ids(tenant, jobs)
    entries = [e for e in await stream.timeline(since, limit) if e.job_id in mine]
    return [msgspec.to_builtins(e) for e in entries]


@router.get("/dlq")
async def dead_letters(
    tenant: Tenant,
    gateway: GatewayDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> list[dict[str, Any]]:
    """Messages of this tenant's calls that could not be read (newest first); each call
    named there was answered with an error and not run."""
    return [msgspec.to_builtins(e) for e in await gateway.dead_letters.entries(tenant, limit)]


@router.post("/jobs/{job_id}/idle")
async def idle(
    job_id: str, body: IdleBody, tenant: Tenant, jobs: Jobs, gateway: GatewayDep
) -> dict[str, Any]:
    """The job expects no call for about `seconds`: the scheduler may swap it out early."""
    if await jobs.find_job(tenant, job_id) is None:
        raise not_found(f"unknown job {job_id!r}")
    hint = IdleHint(job_id=job_id, tenant=tenant, seconds=body.seconds, at=time.time())
    await gateway.publisher.publish(gateway.topics.events, job_id, hint)
    return {"job_id": job_id, "seconds": body.seconds, "accepted": True}


@router.post("/jobs/{job_id}/options")
async def options(
    job_id: str, body: JobOptionsBody, tenant: Tenant, jobs: Jobs, gateway: GatewayDep
) -> dict[str, Any]:
    """How the job runs: `staleness` k >= 1 declares an asynchronous loop, whose training
    calls may wait about k steps and whose samples of saved sampler weights may run on
    another worker while it trains (docs/scheduling.md, "Asynchronous jobs"); `steps`,
    the training steps it expects to run in all (the plexrl policy admits the longest
    declared work first while jobs wait for a group). An option left out keeps its
    earlier value. Kept in the job's record; the running scheduler hears it at once."""
    job = await jobs.find_job(tenant, job_id)
    if job is None:
        raise not_found(f"unknown job {job_id!r}")
    staleness = job.staleness if body.staleness is None else body.staleness
    steps = job.steps if body.steps is None else body.steps
    await jobs.put_job(msgspec.structs.replace(job, staleness=staleness, steps=steps))
    event = JobOptions(
        job_id=job_id, tenant=tenant, staleness=staleness, at=time.time(), steps=steps
    )
    await gateway.publisher.publish(gateway.topics.events, job_id, event)
    return {"job_id": job_id, "staleness": staleness, "steps": steps}


@router.post("/echo")
async def echo(
    tenant: Tenant, submit: Submit, futures: Futures, gateway: GatewayDep
) -> dict[str, Any]:
    """One NOOP through the whole control plane; answers when its completion is recorded."""
    start = time.perf_counter()
    call = Call(Function.NOOP, NoopInput(), ResponseKind.NOOP, spec=ECHO_SPEC)
    sub = Submission(echo_job_id(tenant), tenant, sequenced=False)
    request_id = await submit.submit(sub, ready(call))
    completion = await futures.wait(request_id, gateway.future_wait_s)
    if completion is None:
        raise ApiError(
            504,
            f"echo {request_id} got no completion in {gateway.future_wait_s:g}s; is a "
            "scheduler and a worker running?",
            Category.SERVER,
        )
    return {
        "request_id": request_id,
        "latency_s": time.perf_counter() - start,
        "status": str(completion.status),
        "worker_id": completion.worker_id,
    }
