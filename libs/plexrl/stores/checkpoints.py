"""Checkpoint records: which blob a `tinker://` path names, and whose it is; and the
order of each job's ephemeral sampler snapshots, so the oldest can be retired.

Two rules keep a checkpoint from coming back or being overwritten by a late writer:

- A record is written only while the writing call's lease stands: `put_checkpoint`
  with an epoch checks the job's ledger epoch in the same script that writes the
  record (a worker paused past its lease cannot record anything after the job's new
  home did), and takes the blob out of the job's blob book, so no sweep deletes it.
- A delete leaves a tombstone (`ckpt-deleted`: blob key → path) in the same script
  that removes the record. The state-store's rebuild, which puts back records Redis
  lost from the copies it keeps beside the blobs, deletes a tombstoned blob and its
  copy instead of restoring it, then drops the tombstone. Blob keys are unique per
  save, so a tombstone never names a later checkpoint's blob.

A checkpoint's lifecycle after its save lives in its record too: `expires_at` (a TTL,
indexed in `ckpt-expiry` for the state-store's sweep, plexrl_state_store.expiry) and
`public` (readable by every tenant's key). A record read past its expiry is gone for
every reader (`readable`) before the sweep deletes it. Each tenant's stored bytes are
counted in the scripts that write and remove records, so a quota check reads one key.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from plexrl.messages import decode, encode
from plexrl.stores.redis import RedisKeys, RedisStore, raw_bytes, text


class CheckpointFile(msgspec.Struct, frozen=True):
    """One file of an export, stored as a byte range of its checkpoint's one blob."""

    name: str
    """Its path in the exported directory, e.g. `adapter_model.safetensors` (with `.age`
    when encrypted)."""
    offset: int
    size_bytes: int
    sha256: str


class CheckpointRecord(msgspec.Struct, frozen=True):
    path: str
    """`tinker://<job>/<kind>/<name>`."""
    tenant: str
    job_id: str
    kind: str
    """"weights" (state with optimizer), "sampler_weights" or "external_weights"
    (Hugging Face files, listed in `files`)."""
    blob_key: str
    size_bytes: int
    created_at: float
    base_model: str
    lora_rank: int | None = None
    expires_at: float | None = None
    """Unix time after which the checkpoint is deleted (None: kept until deleted)."""
    public: bool = False
    """Published: readable by any tenant's key, not only its owner's."""
    files: tuple[CheckpointFile, ...] = ()
    """External weights: the exported files, in the blob in this order."""

    def expired(self, now: float) -> bool:
        """Past its TTL: gone for every reader, whether or not the sweep deleted it yet."""
        return self.expires_at is not None and self.expires_at <= now

    def readable_by(self, tenant: str, now: float) -> bool:
        """Whether `tenant`'s key may read it (info, load, sample): its owner's, or any
        key while it is published; nobody's once expired."""
        return not self.expired(now) and (self.tenant == tenant or self.public)

    def owned_by(self, tenant: str, now: float) -> bool:
        """Whether `tenant` may change it (delete, publish, TTL): its owner only."""
        return not self.expired(now) and self.tenant == tenant


TTL_MIN_S = 3600
"""The shortest TTL the Tinker API accepts (one hour; PLEXRL_CHECKPOINT_TTL_MIN_S lowers
it, for tests)."""
TTL_MAX_S = 10 * 365 * 86400
"""The longest: ten years."""
SAVE_TTL_KEEP_S = 7 * 86400
"""How long a save's TTL waits for its record (`ckpt-ttl:<path>`): longer than any save
stays queued; a save that never lands leaves nothing behind after it."""


EPHEMERAL_PREFIX = "ephemeral-"
"""The name the server gives a snapshot that `save_weights_and_get_sampling_client` asks
for with no name: `tinker://<job>/sampler_weights/ephemeral-<sampling session seq>`."""


def is_ephemeral(path: str) -> bool:
    """Whether a `tinker://` path names an ephemeral sampler snapshot."""
    return path.rpartition("/")[2].startswith(EPHEMERAL_PREFIX)


# KEYS: the job's ledger head, its blob book, ckpt:<path>, tenant:<t>:ckpts, tombstones,
# tenant:<t>:ckpt-sizes (path -> bytes), tenant:<t>:ckpt-bytes (their sum), ckpt-expiry,
# ckpt-ttl:<path> (a save's TTL), ckpt-changed.
# ARGV: epoch ('' for an unfenced write), the encoded record, path, blob key, its size,
# its expiry ('' for none), '1' when the record took the save's TTL.
# Returns {'fenced'}, {'deleted'} (the blob is tombstoned: a blob key is unique per
# save, so it can never be recorded again) or {'ok', the record replaced (or '')}.
_PUT = """
if ARGV[1] ~= '' then
  local epoch = tonumber(redis.call('HGET', KEYS[1], 'epoch') or '0')
  if epoch ~= tonumber(ARGV[1]) then return {'fenced'} end
end
if redis.call('HEXISTS', KEYS[5], ARGV[4]) == 1 then return {'deleted'} end
local old = redis.call('GET', KEYS[3]) or ''
redis.call('SET', KEYS[3], ARGV[2])
redis.call('SADD', KEYS[4], ARGV[3])
redis.call('HDEL', KEYS[2], ARGV[4])
local before = tonumber(redis.call('HGET', KEYS[6], ARGV[3]) or '0')
redis.call('HSET', KEYS[6], ARGV[3], ARGV[5])
redis.call('INCRBY', KEYS[7], tonumber(ARGV[5]) - before)
if ARGV[6] ~= '' then
  redis.call('ZADD', KEYS[8], ARGV[6], ARGV[3])
else
  redis.call('ZREM', KEYS[8], ARGV[3])
end
if ARGV[7] == '1' then
  redis.call('DEL', KEYS[9])
  redis.call('SADD', KEYS[10], ARGV[3])
end
return {'ok', old}
"""

# KEYS: ckpt:<path>, tenant:<t>:ckpts, tombstones, tenant:<t>:ckpt-sizes,
# tenant:<t>:ckpt-bytes, ckpt-expiry. ARGV: the encoded record as read, path, blob key.
# The record goes only if it is still the one read (a save may have replaced it since);
# the tombstone is written either way: that blob is unwanted.
_DELETE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('SREM', KEYS[2], ARGV[2])
  local before = tonumber(redis.call('HGET', KEYS[4], ARGV[2]) or '0')
  redis.call('HDEL', KEYS[4], ARGV[2])
  redis.call('DECRBY', KEYS[5], before)
  redis.call('ZREM', KEYS[6], ARGV[2])
end
redis.call('HSET', KEYS[3], ARGV[3], ARGV[2])
return 1
"""

# KEYS: ckpt:<path>, ckpt-expiry, ckpt-changed. ARGV: the encoded record as read, the
# changed record, path, its expiry ('' for none). 0 when the record is no longer the one
# read (saved over, deleted, changed by another call): read it again.
_UPDATE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2])
if ARGV[4] ~= '' then
  redis.call('ZADD', KEYS[2], ARGV[4], ARGV[3])
else
  redis.call('ZREM', KEYS[2], ARGV[3])
end
redis.call('SADD', KEYS[3], ARGV[3])
return 1
"""

# KEYS: the job's ledger head. ARGV: epoch. 1 while the epoch stands.
_EPOCH_STANDS = """
return tonumber(redis.call('HGET', KEYS[1], 'epoch') or '0') == tonumber(ARGV[1]) and 1 or 0
"""

# KEYS: the job's ledger head, its blob book. ARGV: epoch, blob key. While the epoch
# stands, names the blob in the book as being written under it (plexrl.ledger's "w<e>").
_WRITING = """
if tonumber(redis.call('HGET', KEYS[1], 'epoch') or '0') ~= tonumber(ARGV[1]) then return 0 end
redis.call('HSET', KEYS[2], ARGV[2], 'w' .. ARGV[1])
return 1
"""


class FencedWriteError(Exception):
    """A write refused because the call's lease no longer stands (the job was re-homed)."""


class CheckpointGone(Exception):
    """The checkpoint a lifecycle change was for is gone (deleted, expired or saved over
    again and again while the change was retried)."""


class CheckpointStore(RedisStore):
    """`ckpt:<path>` (kept until deleted), `tenant:<t>:ckpts`, `ckpt-deleted` (the
    tombstones: blob key → path), `ephemeral:<job>` (the job's ephemeral sampler
    snapshots by age: a sorted set scored by creation time) and
    `ephemeral:<job>:sessions` (snapshot path → the sampling session opened over it).
    Fenced writes read the job's ledger (`ledger:<job>`, `ledger:<job>:blobs`: the key
    layout of plexrl.ledger).

    Lifecycle: `ckpt-expiry` (path → expires_at, a sorted set the state-store sweeps),
    `ckpt-ttl:<path>` (the TTL a save asked for, taken by its record when it lands),
    `ckpt-changed` (paths whose record changed after the state-store kept its copy), and
    per tenant `tenant:<t>:ckpt-sizes` (path → bytes) and `tenant:<t>:ckpt-bytes`."""

    def __init__(self, keys: RedisKeys) -> None:
        super().__init__(keys)
        self._put = self._redis.register_script(_PUT)
        self._delete = self._redis.register_script(_DELETE)
        self._update = self._redis.register_script(_UPDATE)
        self._stands = self._redis.register_script(_EPOCH_STANDS)
        self._writing = self._redis.register_script(_WRITING)

    async def put_checkpoint(
        self, ckpt: CheckpointRecord, epoch: int | None = None
    ) -> CheckpointRecord | None:
        """Write the record and return the one it replaced, if any. With `epoch`, only
        while the job's lease is still that epoch; a record of a tombstoned blob is never
        written again. FencedWriteError (nothing written) in either case.

        A record without an expiry takes the TTL its save asked for (`expire_on_save`),
        counted from its creation; the state-store's copy of it is refreshed by its
        sweep (`changed`)."""
        took_ttl = False
        if ckpt.expires_at is None:
            ttl = await self._redis.get(self._k("ckpt-ttl", ckpt.path))
            if ttl is not None:
                ckpt = msgspec.structs.replace(ckpt, expires_at=ckpt.created_at + float(ttl))
                took_ttl = True
        out: Any = await self._put(
            keys=[
                self._k("ledger", ckpt.job_id),
                self._k("ledger", ckpt.job_id, "blobs"),
                self._k("ckpt", ckpt.path),
                self._k("tenant", ckpt.tenant, "ckpts"),
                self._k("ckpt-deleted"),
                self._k("tenant", ckpt.tenant, "ckpt-sizes"),
                self._k("tenant", ckpt.tenant, "ckpt-bytes"),
                self._k("ckpt-expiry"),
                self._k("ckpt-ttl", ckpt.path),
                self._k("ckpt-changed"),
            ],
            args=[
                "" if epoch is None else epoch,
                encode(ckpt),
                ckpt.path,
                ckpt.blob_key,
                ckpt.size_bytes,
                "" if ckpt.expires_at is None else repr(ckpt.expires_at),
                "1" if took_ttl else "",
            ],
        )
        outcome = text(out[0])
        if outcome == "fenced":
            raise FencedWriteError(
                f"checkpoint {ckpt.path} not recorded: the lease of epoch {epoch} on "
                f"{ckpt.job_id} no longer stands (the job was re-homed)"
            )
        if outcome == "deleted":
            raise FencedWriteError(
                f"checkpoint {ckpt.path} not recorded: its blob {ckpt.blob_key} was deleted"
            )
        old = raw_bytes(out[1]) if len(out) > 1 else b""
        return decode(old, CheckpointRecord) if old else None

    async def writing(self, job_id: str, epoch: int, blob_key: str) -> bool:
        """While the job's lease is `epoch`, name `blob_key` in its blob book as being
        written (its record takes it out; a writer that never records leaves it for the
        job's next owner to delete). False, and nothing named, once the lease is gone."""
        done: Any = await self._writing(
            keys=[self._k("ledger", job_id), self._k("ledger", job_id, "blobs")],
            args=[epoch, blob_key],
        )
        return bool(int(done))

    async def epoch_stands(self, job_id: str, epoch: int) -> bool:
        """Whether the job's lease is still `epoch` (a fenced writer's is not)."""
        return bool(int(await self._stands(keys=[self._k("ledger", job_id)], args=[epoch])))

    async def get_checkpoint(self, path: str) -> CheckpointRecord | None:
        """The record as stored, expired or not (the state-store's own bookkeeping);
        readers of a tenant's checkpoints use `readable`."""
        return await self._get(self._k("ckpt", path), CheckpointRecord)

    async def readable(
        self, path: str, tenant: str, now: float | None = None
    ) -> CheckpointRecord | None:
        """The checkpoint if `tenant`'s key may read it: its own or published, not expired."""
        record = await self.get_checkpoint(path)
        ok = record is not None and record.readable_by(tenant, _now(now))
        return record if ok else None

    async def tenant_checkpoints(
        self, tenant: str, now: float | None = None
    ) -> list[CheckpointRecord]:
        """The tenant's checkpoints, those past their expiry left out."""
        paths = sorted(
            text(m) for m in await self._redis.smembers(self._k("tenant", tenant, "ckpts"))
        )
        records = [await self.get_checkpoint(p) for p in paths]
        at = _now(now)
        return [r for r in records if r is not None and not r.expired(at)]

    async def stored_bytes(self, tenant: str) -> int:
        """The bytes of the tenant's checkpoints (ephemeral and not yet swept ones too)."""
        raw = await self._redis.get(self._k("tenant", tenant, "ckpt-bytes"))
        return int(raw or 0)

    async def expire_on_save(self, path: str, ttl_s: int | None) -> None:
        """The TTL the save of `path` now being sent asked for (None: kept until deleted);
        its record takes it when the worker writes it."""
        key = self._k("ckpt-ttl", path)
        if ttl_s is None:
            await self._redis.delete(key)
        else:
            await self._redis.set(key, ttl_s, ex=SAVE_TTL_KEEP_S)

    async def set_expiry(self, path: str, expires_at: float | None) -> CheckpointRecord:
        """Set (or with None remove) the checkpoint's expiry; returns the record written."""
        return await self._change(path, lambda r: msgspec.structs.replace(r, expires_at=expires_at))

    async def set_public(self, path: str, public: bool) -> CheckpointRecord:
        """Publish or unpublish the checkpoint; returns the record written."""
        return await self._change(path, lambda r: msgspec.structs.replace(r, public=public))

    async def _change(self, path: str, change: Any) -> CheckpointRecord:
        """Read, change and write the record back unless something wrote it meanwhile
        (then again, a few times). CheckpointGone when there is none to change."""
        for _ in range(8):
            raw = await self._redis.get(self._k("ckpt", path))
            if raw is None:
                break
            record: CheckpointRecord = change(decode(raw_bytes(raw), CheckpointRecord))
            done: Any = await self._update(
                keys=[self._k("ckpt", path), self._k("ckpt-expiry"), self._k("ckpt-changed")],
                args=[
                    raw,
                    encode(record),
                    path,
                    "" if record.expires_at is None else repr(record.expires_at),
                ],
            )
            if int(done):
                return record
        raise CheckpointGone(f"no checkpoint at {path!r}")

    async def due(self, now: float, limit: int = 100) -> list[str]:
        """Paths whose expiry has passed (their records may have changed since: re-read)."""
        members = await self._redis.zrangebyscore(
            self._k("ckpt-expiry"), "-inf", now, start=0, num=limit
        )
        return [text(p) for p in members if isinstance(p, bytes | str)]

    async def not_due(self, paths: list[str]) -> None:
        """Drop paths from the expiry index (their record is gone or no longer expires)."""
        if paths:
            await self._redis.zrem(self._k("ckpt-expiry"), *paths)

    async def changed(self, limit: int = 100) -> list[str]:
        """Paths whose record changed since the state-store kept its copy."""
        members: Any = await self._redis.srandmember(self._k("ckpt-changed"), limit)
        return [text(p) for p in members or []]

    async def copied(self, paths: list[str]) -> None:
        """The state-store's copies of these records are up to date."""
        if paths:
            await self._redis.srem(self._k("ckpt-changed"), *paths)

    async def delete_checkpoint(self, ckpt: CheckpointRecord) -> None:
        """Remove the record (if it is still `ckpt`) and tombstone its blob: the blob and
        the state-store's copy of the record are deleted by whoever holds them next
        (`tombstones`, `buried`), however long the state-store is away."""
        await self._delete(
            keys=[
                self._k("ckpt", ckpt.path),
                self._k("tenant", ckpt.tenant, "ckpts"),
                self._k("ckpt-deleted"),
                self._k("tenant", ckpt.tenant, "ckpt-sizes"),
                self._k("tenant", ckpt.tenant, "ckpt-bytes"),
                self._k("ckpt-expiry"),
            ],
            args=[encode(ckpt), ckpt.path, ckpt.blob_key],
        )

    async def tombstones(self) -> dict[str, str]:
        """Deleted checkpoints whose blobs may still be on disk: blob key → path."""
        raw: dict[Any, Any] = await self._redis.hgetall(self._k("ckpt-deleted"))
        return {text(k): text(v) for k, v in raw.items()}

    async def buried(self, blob_keys: list[str]) -> None:
        """These tombstoned blobs (and the copies of their records) are gone from disk."""
        if blob_keys:
            await self._redis.hdel(self._k("ckpt-deleted"), *blob_keys)

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


def _now(now: float | None) -> float:
    return time.time() if now is None else now
