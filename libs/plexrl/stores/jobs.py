"""Jobs (spec, owner, kind) and each job's home worker group."""

from __future__ import annotations

import enum

import msgspec

from plexrl.messages import JobSpec, decode, encode
from plexrl.stores.redis import RedisKeys, RedisStore, raw_bytes, text
from plexrl.stores.tenant_records import (
    NO_CAPS,
    Caps,
    RecordKind,
    RecordWrite,
    TenantRecords,
    metadata_bytes,
)


class JobKind(enum.StrEnum):
    """What kind of client owns a job."""

    TRAINING = "training"
    """A training client's model: trainable state, optimizer."""
    SAMPLING = "sampling"
    """A sampling session over base weights or a sampler checkpoint."""


class JobRecord(msgspec.Struct, frozen=True):
    job_id: str
    tenant: str
    kind: JobKind
    spec: JobSpec
    created_at: float
    session_id: str = ""
    sampler_path: str | None = None
    """For a sampling job: the checkpoint it reads (None: base weights)."""
    owner_job: str | None = None
    """For a sampling job over a training job's checkpoint: that job (same home group)."""
    unloaded: bool = False
    metadata: dict[str, str] = {}
    staleness: int = 0
    """The job's declared loop (`JobOptions`): 0 synchronous, k asynchronous."""
    steps: int = 0
    """The training steps it declared it runs in all (`JobOptions`); 0: not declared."""


class JobStore(RedisStore):
    """Job records (kept for the job's lifetime) and homes. Keys: `job:<id>`,
    `tenant:<tenant>:jobs` (a set), `home:<id>`; each write moves the tenant's counts
    (plexrl.stores.tenant_records) in the same script."""

    def __init__(self, keys: RedisKeys) -> None:
        super().__init__(keys)
        self._records = TenantRecords(keys)

    async def put_job(self, job: JobRecord, caps: Caps = NO_CAPS) -> None:
        """Write a job; a new one (or more metadata) is checked against `caps` and raises
        `QuotaExceeded` without writing when it would pass them. An unloaded model keeps
        its record (and its metadata counted) but gives back its place."""
        await self._records.write(
            RecordWrite(
                tenant=job.tenant,
                kind=_kind(job),
                record_id=job.job_id,
                record_key=self._k("job", job.job_id),
                id_set_key=self._k("tenant", job.tenant, "jobs"),
                encoded=encode(job),
                holds_slot=not job.unloaded,
                metadata_bytes=metadata_bytes(job.metadata),
                cluster_count=JOB_COUNT,
            ),
            caps,
        )

    async def delete_job(self, job_id: str) -> None:
        """Forget a job (its record, its place in its tenant's set and counts, its home)."""
        job = await self.get_job(job_id)
        if job is None:
            return
        await self._records.forget(
            job.tenant,
            _kind(job),
            job_id,
            self._k("job", job_id),
            self._k("tenant", job.tenant, "jobs"),
            self._k("home", job_id),
            cluster_count=JOB_COUNT,
        )

    async def get_job(self, job_id: str) -> JobRecord | None:
        return await self._get(self._k("job", job_id), JobRecord)

    async def tenant_jobs(self, tenant: str) -> list[JobRecord]:
        ids = sorted(await self.tenant_job_ids(tenant))
        raws = await self._redis.mget([self._k("job", i) for i in ids]) if ids else []
        return [decode(raw_bytes(r), JobRecord) for r in raws if r is not None]

    async def tenant_job_ids(self, tenant: str) -> set[str]:
        """The ids of the tenant's jobs, no record read."""
        return {text(m) for m in await self._redis.smembers(self._k("tenant", tenant, "jobs"))}

    async def tenant_job_count(self, tenant: str) -> int:
        return int(await self._redis.scard(self._k("tenant", tenant, "jobs")))

    async def job_count(self) -> int:
        """Jobs of every tenant, counted as they are written (no record is read)."""
        return await self._records.count(JOB_COUNT, self._k("job", "*"))

    async def all_jobs(self) -> list[JobRecord]:
        """Every tenant's job records: for the scheduler's start, never a request path."""
        keys = [k async for k in self._redis.scan_iter(match=self._k("job", "*"), count=500)]
        raws = await self._redis.mget(keys) if keys else []
        return [decode(raw_bytes(r), JobRecord) for r in raws if r is not None]

    async def set_home(self, job_id: str, worker_id: str) -> None:
        await self._redis.set(self._k("home", job_id), worker_id)

    async def get_home(self, job_id: str) -> str | None:
        raw = await self._redis.get(self._k("home", job_id))
        return None if raw is None else text(raw)

    async def homes(self) -> dict[str, str]:
        """Every job's home, a scan over every tenant's (`get_home` reads one)."""
        keys = [k async for k in self._redis.scan_iter(match=self._k("home", "*"), count=500)]
        raws = await self._redis.mget(keys) if keys else []
        prefix = len(self._k("home", ""))
        return {text(k)[prefix:]: text(r) for k, r in zip(keys, raws, strict=True) if r is not None}


JOB_COUNT = "jobs"
"""The cluster-wide count of job records (`records` hash)."""


def _kind(job: JobRecord) -> RecordKind:
    return RecordKind.TRAINING if job.kind == JobKind.TRAINING else RecordKind.SAMPLING
