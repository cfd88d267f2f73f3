"""One Redis connection and the cluster's key namespace, shared by every store.

No tensors live in Redis. Every key starts with the cluster id. Records are msgpack-
encoded msgspec structs, like the Kafka contracts, so a rolling deploy can read what an
older version wrote; key names and encodings are a wire format too, never renamed.
"""

from __future__ import annotations

from typing import Any, TypeVar

import redis.asyncio as aioredis

from plexrl.messages import decode
from plexrl.redis_target import RedisTarget, ReplicaWait

T = TypeVar("T")


class RedisKeys:
    """The client, the cluster's key prefix and how long short-lived records live."""

    def __init__(
        self,
        redis: aioredis.Redis,
        cluster_id: str,
        ttl_s: int,
        replicas: int = 0,
        wait_timeout_ms: int = 1000,
    ) -> None:
        self.redis = redis
        self._prefix = cluster_id
        self._ttl = ttl_s
        self._wait = ReplicaWait(redis, self.key("replicated"), replicas, wait_timeout_ms)

    @classmethod
    def from_url(cls, url: str, cluster_id: str, ttl_s: int) -> RedisKeys:
        """One Redis at `url`, no replica waited for (tools, tests)."""
        return cls.connect(RedisTarget(url=url), cluster_id, ttl_s)

    @classmethod
    def connect(cls, target: RedisTarget, cluster_id: str, ttl_s: int) -> RedisKeys:
        """The services' connection: one URL, or the primary the Sentinels name."""
        return cls(
            target.connect(), cluster_id, ttl_s, target.wait_replicas, target.wait_timeout_ms
        )

    async def close(self) -> None:
        await self.redis.aclose()

    async def ping(self) -> bool:
        return bool(await self.redis.ping())

    async def replicated(self) -> int:
        """Wait until the replicas hold every write this process made so far (none asked:
        returns at once); see plexrl.redis_target.ReplicaWait. Called where a write is
        about to be shown outside Redis, so that a failover cannot take it back."""
        return await self._wait()

    @property
    def waits_for_replicas(self) -> bool:
        """Whether `replicated` waits for any replica (PLEXRL_REDIS_WAIT_REPLICAS > 0)."""
        return self._wait.replicas > 0

    @property
    def replica_waits(self) -> int:
        """Rounds of waiting sent so far (concurrent `replicated` calls share one)."""
        return self._wait.waits

    def key(self, *parts: str) -> str:
        """The Redis key of a record: `key("future", request_id)` is
        `<cluster>:future:<request_id>`. Also for code that writes several records in
        one transaction (the gateway's outbox)."""
        return ":".join((self._prefix, *parts))

    @property
    def ttl_s(self) -> int:
        """How long futures, results, payloads, retry keys and cursors live, seconds."""
        return self._ttl


class RedisStore:
    """A store over the shared connection: the base of every store by concern."""

    def __init__(self, keys: RedisKeys) -> None:
        self._keys = keys
        self._redis = keys.redis

    def _k(self, *parts: str) -> str:
        return self._keys.key(*parts)

    async def ping(self) -> bool:
        """Whether Redis answers (for health checks)."""
        return await self._keys.ping()

    async def replicated(self) -> int:
        """Until the Redis replicas hold every write made so far; see
        `RedisKeys.replicated`."""
        return await self._keys.replicated()

    def pipeline(self) -> Any:
        """A pipeline (no transaction) on the shared connection: several stores' writes
        queued with their `queue_*` methods go out in one round trip."""
        return self._redis.pipeline(transaction=False)

    async def _get(self, key: str, type_: type[T]) -> T | None:
        raw = await self._redis.get(key)
        return None if raw is None else decode(raw_bytes(raw), type_)


def text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def raw_bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)
