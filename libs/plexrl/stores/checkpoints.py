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
"""

from __future__ import annotations

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


EPHEMERAL_PREFIX = "ephemeral-"
"""The name the server gives a snapshot that `save_weights_and_get_sampling_client` asks
for with no name: `tinker://<job>/sampler_weights/ephemeral-<sampling session seq>`."""


def is_ephemeral(path: str) -> bool:
    """Whether a `tinker://` path names an ephemeral sampler snapshot."""
    return path.rpartition("/")[2].startswith(EPHEMERAL_PREFIX)


# KEYS: the job's ledger head, its blob book, ckpt:<path>, tenant:<t>:ckpts, tombstones.
# ARGV: epoch ('' for an unfenced write), the encoded record, path, blob key.
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
return {'ok', old}
"""

# KEYS: ckpt:<path>, tenant:<t>:ckpts, tombstones. ARGV: the encoded record as read,
# path, blob key. The record goes only if it is still the one read (a save may have
# replaced it since); the tombstone is written either way: that blob is unwanted.
_DELETE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('SREM', KEYS[2], ARGV[2])
end
redis.call('HSET', KEYS[3], ARGV[3], ARGV[2])
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


class CheckpointStore(RedisStore):
    """`ckpt:<path>` (kept until deleted), `tenant:<t>:ckpts`, `ckpt-deleted` (the
    tombstones: blob key → path), `ephemeral:<job>` (the job's ephemeral sampler
    snapshots by age: a sorted set scored by creation time) and
    `ephemeral:<job>:sessions` (snapshot path → the sampling session opened over it).
    Fenced writes read the job's ledger (`ledger:<job>`, `ledger:<job>:blobs`: the key
    layout of plexrl.ledger)."""

    def __init__(self, keys: RedisKeys) -> None:
        super().__init__(keys)
        self._put = self._redis.register_script(_PUT)
        self._delete = self._redis.register_script(_DELETE)
        self._stands = self._redis.register_script(_EPOCH_STANDS)
        self._writing = self._redis.register_script(_WRITING)

    async def put_checkpoint(
        self, ckpt: CheckpointRecord, epoch: int | None = None
    ) -> CheckpointRecord | None:
        """Write the record and return the one it replaced, if any. With `epoch`, only
        while the job's lease is still that epoch; a record of a tombstoned blob is never
        written again. FencedWriteError (nothing written) in either case."""
        out: Any = await self._put(
            keys=[
                self._k("ledger", ckpt.job_id),
                self._k("ledger", ckpt.job_id, "blobs"),
                self._k("ckpt", ckpt.path),
                self._k("tenant", ckpt.tenant, "ckpts"),
                self._k("ckpt-deleted"),
            ],
            args=["" if epoch is None else epoch, encode(ckpt), ckpt.path, ckpt.blob_key],
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
        return await self._get(self._k("ckpt", path), CheckpointRecord)

    async def tenant_checkpoints(self, tenant: str) -> list[CheckpointRecord]:
        paths = sorted(
            text(m) for m in await self._redis.smembers(self._k("tenant", tenant, "ckpts"))
        )
        records = [await self.get_checkpoint(p) for p in paths]
        return [r for r in records if r is not None]

    async def delete_checkpoint(self, ckpt: CheckpointRecord) -> None:
        """Remove the record (if it is still `ckpt`) and tombstone its blob: the blob and
        the state-store's copy of the record are deleted by whoever holds them next
        (`tombstones`, `buried`), however long the state-store is away."""
        await self._delete(
            keys=[
                self._k("ckpt", ckpt.path),
                self._k("tenant", ckpt.tenant, "ckpts"),
                self._k("ckpt-deleted"),
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
