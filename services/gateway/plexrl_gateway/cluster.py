"""What PlexRL's own API reports: workers, queue depths, per-job residency and accounting."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import httpx
import msgspec

from plexrl.messages import MessageError, WorkerHeartbeat, decode
from plexrl.meta import JobRecord, MetaStore

log = logging.getLogger(__name__)


class ClusterView:
    def __init__(
        self, meta: MetaStore, scheduler_url: str, clock: Callable[[], float] = time.time
    ) -> None:
        self._meta = meta
        self._http = httpx.AsyncClient(base_url=scheduler_url.rstrip("/"), timeout=1.0)
        self._clock = clock

    async def close(self) -> None:
        await self._http.aclose()

    async def workers(self) -> list[dict[str, Any]]:
        """Every worker with a live heartbeat record, as it last described itself."""
        out = []
        for worker_id, raw in (await self._meta.workers()).items():
            try:
                beat: WorkerHeartbeat = decode(raw, WorkerHeartbeat)
            except MessageError as exc:
                out.append({"worker_id": worker_id, "error": f"unreadable heartbeat: {exc}"})
                continue
            view = msgspec.to_builtins(beat)
            view["age_s"] = round(self._clock() - beat.sent_at, 3)
            out.append(view)
        return out

    async def scheduler(self) -> dict[str, Any] | None:
        """The scheduler's own status (pending and in-flight calls), if it answers."""
        try:
            response = await self._http.get("/healthz")
            return dict(response.json()) if response.status_code < 500 else None
        except (httpx.HTTPError, ValueError):
            return None

    async def job(self, job: JobRecord) -> dict[str, Any]:
        """A job's record, home, residency and accounting against a dedicated deployment."""
        home = (await self._meta.homes()).get(job.job_id)
        residency = await self._meta.get_residency(job.job_id)
        usage = await self._meta.usage(job.job_id)
        devices = 1
        if home is not None:
            beat = (await self._meta.workers()).get(home)
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
