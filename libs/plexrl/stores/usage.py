"""Accounting: each job's device-time counters and its first and last activity."""

from __future__ import annotations

from typing import Any

from plexrl.stores.redis import RedisKeys, RedisStore

_ADD_USAGES = """
-- KEYS: each job's usage hash. ARGV: the number of counters n, their n names, then per
-- key its n values, its first and its last activity.
local n = tonumber(ARGV[1])
local at = n + 2
for i, key in ipairs(KEYS) do
    for c = 1, n do
        redis.call('HINCRBYFLOAT', key, ARGV[1 + c], ARGV[at])
        at = at + 1
    end
    redis.call('HSETNX', key, 'first_at', ARGV[at])
    redis.call('HSET', key, 'last_at', ARGV[at + 1])
    at = at + 2
end
return #KEYS
"""


class UsageStore(RedisStore):
    """`usage:<job>`, a hash of float counters plus `first_at` / `last_at`."""

    def __init__(self, keys: RedisKeys) -> None:
        super().__init__(keys)
        self._add_usages = self._redis.register_script(_ADD_USAGES)

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
        activity among them): one script, one command however many jobs (a poll's
        worth of completions: the scheduler's per-call cost), applied whole or not at
        all, so a retry after a failure does not count twice."""
        if not usages:
            return
        names = list(dict.fromkeys(name for fields, _, _ in usages.values() for name in fields))
        keys: list[str] = []
        args: list[Any] = [len(names), *names]
        for job_id, (fields, first_at, last_at) in usages.items():
            keys.append(self._k("usage", job_id))
            args.extend(fields.get(name, 0.0) for name in names)
            args.extend((first_at, last_at))
        await self._add_usages(keys=keys, args=args)

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
