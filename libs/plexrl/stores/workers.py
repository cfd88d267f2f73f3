"""Each worker's last heartbeat, kept while the worker is alive."""

from __future__ import annotations

from plexrl.stores.redis import RedisStore, raw_bytes, text


class WorkerStore(RedisStore):
    """`worker:<id>` (the encoded heartbeat, expiring) and the `workers` set."""

    async def put_worker(self, worker_id: str, heartbeat: bytes, ttl_s: int) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.set(self._k("worker", worker_id), heartbeat, ex=ttl_s)
            pipe.sadd(self._k("workers"), worker_id)
            await pipe.execute()

    async def workers(self) -> dict[str, bytes]:
        """Every worker whose heartbeat has not expired: id → encoded heartbeat."""
        ids = sorted(text(m) for m in await self._redis.smembers(self._k("workers")))
        raws = await self._redis.mget([self._k("worker", i) for i in ids]) if ids else []
        return {i: raw_bytes(r) for i, r in zip(ids, raws, strict=True) if r is not None}

    async def worker(self, worker_id: str) -> bytes | None:
        """One worker's heartbeat, if it has not expired."""
        raw = await self._redis.get(self._k("worker", worker_id))
        return None if raw is None else raw_bytes(raw)
