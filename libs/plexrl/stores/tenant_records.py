"""What each tenant holds, counted as its records are written: its live records of each
kind and the bytes of their user metadata, and the cluster's job count.

Quotas and cluster-wide views read these counts and never the records, so what one
tenant stores (10,000 records, megabytes of metadata) does not slow what another reads.
A record and its counts change in one Lua script: two gateways admitting records of one
tenant at once cannot both take its last place.

Keys: `tenant:<t>:live:<kind>` (a sorted set of record ids scored by when each record
expires, `+inf` for records kept until deleted), `tenant:<t>:metadata` (`<kind>:<id>` →
metadata bytes, and `total`), `records` (cluster-wide counts; `jobs`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from plexrl.stores.redis import RedisKeys, text


class RecordKind(enum.StrEnum):
    """The records a tenant's quotas count."""

    SESSION = "session"
    """A client session; it lives `ttl_s` after its last heartbeat."""
    TRAINING = "training"
    """A training model, live until it is unloaded (its record stays after)."""
    SAMPLING = "sampling"
    """A sampling session, live until its record is deleted."""


class Held(enum.StrEnum):
    """Which count a refused write found full."""

    RECORDS = "records"
    """The tenant's live records of the kind."""
    METADATA = "metadata"
    """The bytes of user metadata of all the tenant's records."""


class QuotaExceeded(Exception):
    """A new record would take the tenant past a cap; nothing was written."""

    def __init__(self, kind: RecordKind, held: Held, count: int) -> None:
        super().__init__(f"{held} of {kind} full at {count}")
        self.kind = kind
        self.held = held
        self.count = count
        """What the tenant holds now: live records of `kind`, or metadata bytes."""


@dataclass(frozen=True)
class Caps:
    """What a new record is checked against; 0 checks nothing (an internal write)."""

    live: int = 0
    """Live records of its kind the tenant may hold."""
    metadata_bytes: int = 0
    """Bytes of user metadata all the tenant's records may hold together."""


NO_CAPS = Caps()


def metadata_bytes(metadata: dict[str, str], tags: list[str] | None = None) -> int:
    """What a record's free-form user data weighs: keys, values and tags in UTF-8."""
    size = sum(len(k.encode()) + len(v.encode()) for k, v in metadata.items())
    return size + sum(len(t.encode()) for t in tags or ())


# Writes one record and its counts. Expired slots are freed first (a session's record
# expires with its TTL; its slot, metadata bytes and id go here, in the same script).
# A record that already holds its slot (a heartbeat, an unload) is never refused for
# the count; only growing metadata is checked against the total.
_WRITE = """
local id, prefix = ARGV[1], ARGV[9]
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local gone = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now)
for _, old in ipairs(gone) do
  local f = prefix .. ':' .. old
  local b = tonumber(redis.call('HGET', KEYS[4], f) or '0')
  if b ~= 0 then redis.call('HINCRBY', KEYS[4], 'total', -b) end
  redis.call('HDEL', KEYS[4], f)
  redis.call('SREM', KEYS[2], old)
end
if #gone > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now) end
local field = prefix .. ':' .. id
local old = tonumber(redis.call('HGET', KEYS[4], field) or '0')
local new = tonumber(ARGV[5])
local holds = ARGV[4] == '1'
if holds and not redis.call('ZSCORE', KEYS[3], id) then
  local cap = tonumber(ARGV[6])
  local live = redis.call('ZCARD', KEYS[3])
  if cap > 0 and live >= cap then return {'records', live} end
end
local cap = tonumber(ARGV[7])
local total = tonumber(redis.call('HGET', KEYS[4], 'total') or '0')
if cap > 0 and new > old and total - old + new > cap then return {'metadata', total} end
local fresh = redis.call('EXISTS', KEYS[1]) == 0
local ttl = tonumber(ARGV[3])
if ttl > 0 then
  redis.call('SET', KEYS[1], ARGV[2], 'EX', ttl)
  if holds then redis.call('ZADD', KEYS[3], now + ttl, id) end
else
  redis.call('SET', KEYS[1], ARGV[2])
  if holds then redis.call('ZADD', KEYS[3], '+inf', id) end
end
if not holds then redis.call('ZREM', KEYS[3], id) end
redis.call('SADD', KEYS[2], id)
if new ~= old then
  if new > 0 then
    redis.call('HSET', KEYS[4], field, new)
  else
    redis.call('HDEL', KEYS[4], field)
  end
  redis.call('HINCRBY', KEYS[4], 'total', new - old)
end
if fresh and ARGV[8] ~= '' and redis.call('HEXISTS', KEYS[5], ARGV[8]) == 1 then
  redis.call('HINCRBY', KEYS[5], ARGV[8], 1)
end
return {'', 0}
"""

# Deletes one record (and KEYS[6..], e.g. its home) with its place in every count.
_FORGET = """
local id, prefix = ARGV[1], ARGV[2]
local field = prefix .. ':' .. id
local b = tonumber(redis.call('HGET', KEYS[4], field) or '0')
if b ~= 0 then redis.call('HINCRBY', KEYS[4], 'total', -b) end
redis.call('HDEL', KEYS[4], field)
redis.call('ZREM', KEYS[3], id)
redis.call('SREM', KEYS[2], id)
for i = 6, #KEYS do redis.call('DEL', KEYS[i]) end
if redis.call('DEL', KEYS[1]) == 1 and ARGV[3] ~= ''
    and redis.call('HEXISTS', KEYS[5], ARGV[3]) == 1 then
  redis.call('HINCRBY', KEYS[5], ARGV[3], -1)
end
return 1
"""


@dataclass(frozen=True)
class RecordWrite:
    """One record to write with its counts."""

    tenant: str
    kind: RecordKind
    record_id: str
    record_key: str
    """The record's own key (`job:<id>`, `session:<id>`)."""
    id_set_key: str
    """The tenant's set of ids the record joins (`tenant:<t>:jobs`)."""
    encoded: bytes
    ttl_s: int = 0
    """0: kept until deleted."""
    holds_slot: bool = True
    """False: the record stays but no longer takes a place (an unloaded model)."""
    metadata_bytes: int = 0
    cluster_count: str = ""
    """The cluster-wide count a new record adds one to ('' none)."""


class TenantRecords:
    """The counts over the shared connection; the stores of counted records write through
    it, and quotas and cluster views read it."""

    def __init__(self, keys: RedisKeys) -> None:
        self._keys = keys
        self._redis = keys.redis
        self._write = self._redis.register_script(_WRITE)
        self._forget = self._redis.register_script(_FORGET)

    def _live_key(self, tenant: str, kind: RecordKind) -> str:
        return self._keys.key("tenant", tenant, "live", str(kind))

    def _metadata_key(self, tenant: str) -> str:
        return self._keys.key("tenant", tenant, "metadata")

    def _counts_key(self) -> str:
        return self._keys.key("records")

    async def write(self, record: RecordWrite, caps: Caps = NO_CAPS) -> None:
        """Write the record and move its counts; raises `QuotaExceeded` (writing nothing)
        when a new slot or more metadata would pass `caps`."""
        keys = [
            record.record_key,
            record.id_set_key,
            self._live_key(record.tenant, record.kind),
            self._metadata_key(record.tenant),
            self._counts_key(),
        ]
        args: list[Any] = [
            record.record_id,
            record.encoded,
            record.ttl_s,
            "1" if record.holds_slot else "0",
            record.metadata_bytes,
            caps.live,
            caps.metadata_bytes,
            record.cluster_count,
            str(record.kind),
        ]
        held, count = await self._write(keys=keys, args=args)
        if text(held):
            raise QuotaExceeded(record.kind, Held(text(held)), int(count))

    async def forget(
        self,
        tenant: str,
        kind: RecordKind,
        record_id: str,
        record_key: str,
        id_set_key: str,
        *also: str,
        cluster_count: str = "",
    ) -> None:
        """Delete a record (and the keys `also`) and give back its place in every count."""
        keys = [
            record_key,
            id_set_key,
            self._live_key(tenant, kind),
            self._metadata_key(tenant),
            self._counts_key(),
            *also,
        ]
        await self._forget(keys=keys, args=[record_id, str(kind), cluster_count])

    async def live(self, tenant: str, kind: RecordKind) -> int:
        """The tenant's records of `kind` that hold a place and have not expired."""
        now = await self._redis.time()
        return int(await self._redis.zcount(self._live_key(tenant, kind), now[0], "+inf"))

    async def metadata_total(self, tenant: str) -> int:
        """Bytes of user metadata the tenant's records hold (expired sessions' until the
        tenant's next session write frees them)."""
        raw = await self._redis.hget(self._metadata_key(tenant), "total")
        return 0 if raw is None else int(raw)

    async def checkpoints(self, tenant: str) -> int:
        """The tenant's checkpoint records (`tenant:<t>:ckpts`, kept by CheckpointStore)."""
        return int(await self._redis.scard(self._keys.key("tenant", tenant, "ckpts")))

    async def count(self, name: str, pattern: str) -> int:
        """A cluster-wide count; the first read after records were written without it
        (an older version) counts the keys matching `pattern` once, reading no value."""
        raw = await self._redis.hget(self._counts_key(), name)
        if raw is not None:
            return int(raw)
        found = 0
        async for _ in self._redis.scan_iter(match=pattern, count=1000):
            found += 1
        await self._redis.hsetnx(self._counts_key(), name, found)
        return int(await self._redis.hget(self._counts_key(), name) or 0)
