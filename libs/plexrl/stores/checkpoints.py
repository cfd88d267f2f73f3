"""Checkpoint records: which blob a `tinker://` path names, and whose it is; and the
order of each job's ephemeral sampler snapshots, so the oldest can be retired."""

from __future__ import annotations

import msgspec

from plexrl.messages import encode
from plexrl.stores.redis import RedisStore, text


class CheckpointRecord(msgspec.Struct, frozen=True):
    path: str
    """`tinker://<job>/<kind>/<name>`."""
    tenant: str
    job_id: str
    kind: str
    """"weights" (state with optimizer) or "sampler_weights"."""
    blob_key: str
    size_bytes: int
    created_at: float
    base_model: str
    lora_rank: int | None = None


EPHEMERAL_PREFIX = "ephemeral-"
"""The name the server gives a snapshot that `save_weights_and_get_sampling_client` asks
for with no name: `tinker://<job>/sampler_weights/ephemeral-<sampling session seq>`."""


def is_ephemeral(path: str) -> bool:
    """Whether a `tinker://` path names an ephemeral sampler snapshot."""
    return path.rpartition("/")[2].startswith(EPHEMERAL_PREFIX)


class CheckpointStore(RedisStore):
    """`ckpt:<path>` (kept until deleted), `tenant:<t>:ckpts`, `ephemeral:<job>` (the
    job's ephemeral sampler snapshots by age: a sorted set scored by creation time) and
    `ephemeral:<job>:sessions` (snapshot path → the sampling session opened over it)."""

    async def put_checkpoint(self, ckpt: CheckpointRecord) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.set(self._k("ckpt", ckpt.path), encode(ckpt))
            pipe.sadd(self._k("tenant", ckpt.tenant, "ckpts"), ckpt.path)
            await pipe.execute()

    async def get_checkpoint(self, path: str) -> CheckpointRecord | None:
        return await self._get(self._k("ckpt", path), CheckpointRecord)

    async def tenant_checkpoints(self, tenant: str) -> list[CheckpointRecord]:
        paths = sorted(
            text(m) for m in await self._redis.smembers(self._k("tenant", tenant, "ckpts"))
        )
        records = [await self.get_checkpoint(p) for p in paths]
        return [r for r in records if r is not None]

    async def delete_checkpoint(self, ckpt: CheckpointRecord) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(self._k("ckpt", ckpt.path))
            pipe.srem(self._k("tenant", ckpt.tenant, "ckpts"), ckpt.path)
            await pipe.execute()

    async def add_ephemeral(self, ckpt: CheckpointRecord, session: str = "") -> None:
        """Rank an ephemeral snapshot (its record is written by the state-store), with the
        sampling session opened over it, if any (`ephemeral:<job>:sessions`, path → id)."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.zadd(self._k("ephemeral", ckpt.job_id), {ckpt.path: ckpt.created_at})
            if session:
                pipe.hset(self._k("ephemeral", ckpt.job_id, "sessions"), ckpt.path, session)
            await pipe.execute()

    async def ephemeral_sessions(self, job_id: str, paths: list[str]) -> list[str]:
        """The sampling sessions opened over these snapshots of the job."""
        if not paths:
            return []
        ids = await self._redis.hmget(self._k("ephemeral", job_id, "sessions"), paths)
        return [text(i) for i in ids if i is not None]

    async def ephemeral_beyond(self, job_id: str, keep: int) -> list[str]:
        """The job's ephemeral snapshots other than its newest `keep` (0: all), oldest first."""
        stop = -keep - 1 if keep else -1
        members = await self._redis.zrange(self._k("ephemeral", job_id), 0, stop)
        return [text(p) for p in members if isinstance(p, bytes | str)]

    async def unrank_ephemeral(self, job_id: str, paths: list[str]) -> None:
        """Drop retired snapshots from the job's ranking (after their records are gone)."""
        if paths:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.zrem(self._k("ephemeral", job_id), *paths)
                pipe.hdel(self._k("ephemeral", job_id, "sessions"), *paths)
                await pipe.execute()
