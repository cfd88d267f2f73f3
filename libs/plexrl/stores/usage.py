"""Accounting: each job's device-time counters and its first and last activity."""

from __future__ import annotations

from typing import Any

from plexrl.stores.redis import RedisStore


class UsageStore(RedisStore):
    """`usage:<job>`, a hash of float counters plus `first_at` / `last_at`."""

    async def add_usage(
        self, job_id: str, fields: dict[str, float], active_at: float | None = None
    ) -> None:
        """Add to a job's counters; with `active_at`, also `mark_active` in the same
        round trip (one transaction: a retry after a failure does not count twice)."""
        key = self._k("usage", job_id)
        async with self._redis.pipeline(transaction=active_at is not None) as pipe:
            for name, value in fields.items():
                pipe.hincrbyfloat(key, name, value)
            if active_at is not None:
                pipe.hsetnx(key, "first_at", active_at)
                pipe.hset(key, "last_at", active_at)
            await pipe.execute()

    async def add_usages(self, usages: dict[str, tuple[dict[str, float], float, float]]) -> None:
        """`add_usage` for several jobs at once (job → counters, earliest and latest
        activity among them): one transaction, one round trip; a retry after a failure
        does not count twice."""
        async with self._redis.pipeline(transaction=True) as pipe:
            for job_id, (fields, first_at, last_at) in usages.items():
                key = self._k("usage", job_id)
                for name, value in fields.items():
                    pipe.hincrbyfloat(key, name, value)
                pipe.hsetnx(key, "first_at", first_at)
                pipe.hset(key, "last_at", last_at)
            await pipe.execute()

    async def mark_active(self, job_id: str, at: float) -> None:
        """Track a job's first and last activity: its wall time for dedicated accounting."""
        key = self._k("usage", job_id)
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.hsetnx(key, "first_at", at)
            pipe.hset(key, "last_at", at)
            await pipe.execute()

    async def usage(self, job_id: str) -> dict[str, float]:
        raw: dict[Any, Any] = await self._redis.hgetall(self._k("usage", job_id))
        return {k.decode(): float(v) for k, v in raw.items()}
