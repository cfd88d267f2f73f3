"""Jobs (spec, owner, kind) and each job's home worker group."""

from __future__ import annotations

import enum

import msgspec

from plexrl.messages import JobSpec, decode, encode
from plexrl.stores.redis import RedisStore, raw_bytes, text


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


class JobStore(RedisStore):
    """Job records (kept for the job's lifetime) and homes. Keys: `job:<id>`,
    `tenant:<tenant>:jobs` (a set), `home:<id>`."""

    async def put_job(self, job: JobRecord) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.set(self._k("job", job.job_id), encode(job))
            pipe.sadd(self._k("tenant", job.tenant, "jobs"), job.job_id)
            await pipe.execute()

    async def delete_job(self, job_id: str) -> None:
        """Forget a job (its record, its place in its tenant's set and its home)."""
        job = await self.get_job(job_id)
        if job is None:
            return
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(self._k("job", job_id), self._k("home", job_id))
            pipe.srem(self._k("tenant", job.tenant, "jobs"), job_id)
            await pipe.execute()

    async def get_job(self, job_id: str) -> JobRecord | None:
        return await self._get(self._k("job", job_id), JobRecord)

    async def tenant_jobs(self, tenant: str) -> list[JobRecord]:
        members = await self._redis.smembers(self._k("tenant", tenant, "jobs"))
        ids = sorted(text(m) for m in members)
        jobs = [await self.get_job(i) for i in ids]
        return [j for j in jobs if j is not None]

    async def all_jobs(self) -> list[JobRecord]:
        keys = [k async for k in self._redis.scan_iter(match=self._k("job", "*"), count=500)]
        raws = await self._redis.mget(keys) if keys else []
        return [decode(raw_bytes(r), JobRecord) for r in raws if r is not None]

    async def set_home(self, job_id: str, worker_id: str) -> None:
        await self._redis.set(self._k("home", job_id), worker_id)

    async def homes(self) -> dict[str, str]:
        keys = [k async for k in self._redis.scan_iter(match=self._k("home", "*"), count=500)]
        raws = await self._redis.mget(keys) if keys else []
        prefix = len(self._k("home", ""))
        return {text(k)[prefix:]: text(r) for k, r in zip(keys, raws, strict=True) if r is not None}
