"""What PlexRL's own API reports: workers, queue depths, per-job residency and accounting."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import msgspec
from redis.exceptions import RedisError

from plexrl.endpoints import failover_client
from plexrl.messages import MessageError, WorkerHeartbeat, decode
from plexrl.service_auth import auth_headers
from plexrl.stores import (
    JobRecord,
    JobStore,
    ResidencyStore,
    TimelineEntry,
    UsageStore,
    WorkerStore,
)

log = logging.getLogger(__name__)


class ClusterView:
    """What every dashboard polls, at a cost that does not grow with what tenants store:
    counts come from Redis counters, a tenant's own job ids from its id set, and no
    request reads another tenant's records (or any record's metadata)."""

    def __init__(
        self,
        *,
        jobs: JobStore,
        workers: WorkerStore,
        residency: ResidencyStore,
        usage: UsageStore,
        scheduler_url: str,
        service_token: str | None = None,
        leader_url: Callable[[], Awaitable[str | None]] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`leader_url`: the URL the leading scheduler advertises in its lease (read from
        Redis), asked before `scheduler_url`: behind one Service name several schedulers
        would answer, only one of them leading."""
        self._jobs = jobs
        self._workers = workers
        self._residency = residency
        self._usage = usage
        # Several schedulers may be listed: a standby answers /status with 503, and the
        # client moves on to the one that leads (plexrl.endpoints).
        self._http = failover_client(
            scheduler_url, timeout=1.0, headers=auth_headers(service_token)
        )
        self._direct = httpx.AsyncClient(timeout=1.0, headers=auth_headers(service_token))
        self._leader_url = leader_url
        self._clock = clock

    async def close(self) -> None:
        await self._http.aclose()
        await self._direct.aclose()

    async def workers(self) -> list[dict[str, Any]]:
        """Every worker with a live heartbeat record, as it last described itself."""
        out = []
        for worker_id, raw in (await self._workers.workers()).items():
            try:
                beat: WorkerHeartbeat = decode(raw, WorkerHeartbeat)
            except MessageError as exc:
                out.append({"worker_id": worker_id, "error": f"unreadable heartbeat: {exc}"})
                continue
            view = msgspec.to_builtins(beat)
            view["age_s"] = round(self._clock() - beat.sent_at, 3)
            out.append(view)
        return out

    async def job_count(self) -> int:
        """Jobs of every tenant (a number only, kept as jobs are written)."""
        return await self._jobs.job_count()

    async def scheduler(self) -> dict[str, Any] | None:
        """The scheduler's status (pending and in-flight calls, which job each worker
        runs), from its token-guarded /status, if it answers."""
        try:
            leader = await self._leader_url() if self._leader_url else None
            if leader:
                response = await self._direct.get(f"{leader.rstrip('/')}/status")
                if response.status_code < 400:
                    return dict(response.json())
            response = await self._http.get("/status")
            return dict(response.json()) if response.status_code < 400 else None
        except (httpx.HTTPError, ValueError, RedisError):
            return None

    async def job(self, job: JobRecord) -> dict[str, Any]:
        """A job's record, home, residency and accounting against a dedicated deployment."""
        home = await self._jobs.get_home(job.job_id)
        residency = await self._residency.get_residency(job.job_id)
        usage = await self._usage.usage(job.job_id)
        devices = 1
        if home is not None:
            beat = await self._workers.worker(home)
            if beat is not None:
                with contextlib.suppress(MessageError):
                    devices = decode(beat, WorkerHeartbeat).devices
        return {
            "job": msgspec.to_builtins(job),
            "home": home,
            "residency": msgspec.to_builtins(residency) if residency else None,
            "accounting": accounting(usage, devices),
        }


def accounting(usage: dict[str, float], devices: int) -> dict[str, Any]:
    """Device-seconds a job used against holding `devices` for its whole active span."""
    used = usage.get("device_s", 0.0)
    first, last = usage.get("first_at"), usage.get("last_at")
    wall = max(0.0, last - first) if first is not None and last is not None else 0.0
    dedicated = wall * devices
    return {
        "calls": int(usage.get("calls", 0)),
        "device_s": used,
        "queue_s": usage.get("queue_s", 0.0),
        "swap_s": usage.get("swap_s", 0.0),
        "compute_s": usage.get("compute_s", 0.0),
        "wall_s": wall,
        "devices": devices,
        "dedicated_device_s": dedicated,
        "savings_fraction": (1.0 - used / dedicated) if dedicated > 0 else None,
    }


def activity(entries: list[TimelineEntry]) -> dict[str, dict[str, Any]]:
    """Per job, what its calls in a window of the timeline show: calls, optimizer steps and
    their rate, and how many calls first had to swap the job's state in.

    The step rate is taken over the span between the first and the last `optim_step` in the
    window (the job's pace while it ran), so a paused job keeps its last pace and a job
    with fewer than two steps in the window has none."""
    by_job: dict[str, list[TimelineEntry]] = {}
    for entry in entries:
        by_job.setdefault(entry.job_id, []).append(entry)
    out: dict[str, dict[str, Any]] = {}
    for job_id, calls in by_job.items():
        steps = sorted(e.started_at for e in calls if e.function == "optim_step")
        span = steps[-1] - steps[0] if len(steps) > 1 else 0.0
        out[job_id] = {
            "calls": len(calls),
            "steps": len(steps),
            "steps_per_min": 60.0 * (len(steps) - 1) / span if span > 0 else None,
            "swaps": sum(1 for e in calls if e.swap_s > 0),
            "last_at": max(e.started_at + e.swap_s + e.compute_s for e in calls),
        }
    return out


NO_ACTIVITY: dict[str, Any] = {
    "calls": 0,
    "steps": 0,
    "steps_per_min": None,
    "swaps": 0,
    "last_at": None,
}
"""What `activity` reports for a job with no call in the window."""
