"""Checkpoint records: which blob a `tinker://` path names, and whose it is."""

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


class CheckpointStore(RedisStore):
    """`ckpt:<path>` (kept until deleted) and `tenant:<t>:ckpts`."""

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
