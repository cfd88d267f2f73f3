"""One Redis connection and the cluster's key namespace, shared by every store.

No tensors live in Redis. Every key starts with the cluster id. Records are msgpack-
encoded msgspec structs, like the Kafka contracts, so a rolling deploy can read what an
older version wrote; key names and encodings are a wire format too, never renamed.
"""

from __future__ import annotations

from typing import Any, TypeVar

import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff

from plexrl.messages import decode

T = TypeVar("T")


class RedisKeys:
    """The client, the cluster's key prefix and how long short-lived records live."""

    def __init__(self, redis: aioredis.Redis, cluster_id: str, ttl_s: int) -> None:
        self.redis = redis
        self._prefix = cluster_id
        self._ttl = ttl_s

    @classmethod
    def from_url(cls, url: str, cluster_id: str, ttl_s: int) -> RedisKeys:
        # A pooled connection that died with its server (Redis restarted) is reopened
        # and the command sent again, with backoff while Redis loads its append-only
        # file; without this, from_url's connections never retry and the first command
        # on each stale connection fails.
        retry = Retry(ExponentialWithJitterBackoff(base=0.05, cap=1.0), retries=8)
        client = aioredis.Redis.from_url(
            url,
            retry=retry,
            retry_on_error=[redis.exceptions.ConnectionError, redis.exceptions.TimeoutError],
        )
        return cls(client, cluster_id, ttl_s)

    async def close(self) -> None:
        await self.redis.aclose()

    async def ping(self) -> bool:
        return bool(await self.redis.ping())

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
