"""Metadata in Redis: jobs, futures, results, payload refs, residency, workers, checkpoints.

No tensors live here. Every key starts with the cluster id. Records are msgpack-
encoded msgspec structs, like the Kafka contracts, so a rolling deploy can read
what an older version wrote.
"""

from __future__ import annotations

import enum
import time
import uuid
from collections.abc import Iterable
from typing import Any, TypeVar

import msgspec
import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff

from plexrl.messages import JobSpec, PayloadRef, PhaseCompletion, Tier, decode, encode

T = TypeVar("T")


class JobKind(enum.StrEnum):
    """What kind of client owns a job."""

    TRAINING = "training"
    """A training client's model: trainable state, optimizer."""
    SAMPLING = "sampling"
    """A sampling session over base weights or a sampler checkpoint."""


class JobRecord(msgspec.Struct, frozen=True):
    job_id: str
    tenant: str
    kind: JobKind
    spec: JobSpec
    created_at: float
    session_id: str = ""
    sampler_path: str | None = None
    """For a sampling job: the checkpoint it reads (None: base weights)."""
    owner_job: str | None = None
    """For a sampling job over a training job's checkpoint: that job (same home group)."""
    unloaded: bool = False
    metadata: dict[str, str] = {}


class FutureRecord(msgspec.Struct, frozen=True):
    request_id: str
    tenant: str
    job_id: str
    function: str
    created_at: float
    """Wall-clock seconds when the gateway accepted it."""
    response_kind: str = ""
    """How the gateway renders the result for the client (API-specific)."""
    response_context: dict[str, str] = {}
    traceparent: str = ""
    """W3C traceparent of the API call's span: `retrieve_future` spans link to it."""


class Residency(msgspec.Struct, frozen=True):
    """Where one job's state is; writes are compare-and-set on `version`."""

    worker_id: str
    tier: Tier
    bytes: int
    version: int
    updated_at: float


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


class TimelineEntry(msgspec.Struct, frozen=True):
    """One call as it ran: which job, where, and when (wall-clock seconds)."""

    worker_id: str
    job_id: str
    request_id: str
    function: str
    started_at: float
    swap_s: float
    compute_s: float
    ok: bool
    tail_released_at: float | None = None
    """When the worker let its next dispatch in beside this sample call's straggling
    tail (wall clock); None if it never did."""


class SessionRecord(msgspec.Struct, frozen=True):
    session_id: str
    tenant: str
    created_at: float
    last_heartbeat: float
    tags: list[str] = []
    user_metadata: dict[str, str] = {}


# Compare-and-set of a residency record: ARGV = expected version, new record.
_CAS_SCRIPT = """
local cur = redis.call('GET', KEYS[1])
local expected = tonumber(ARGV[1])
if cur == false then
  if expected ~= 0 then return 0 end
else
  local v = cjson.decode(cur)['version']
  if v ~= expected then return 0 end
end
redis.call('SET', KEYS[1], ARGV[2])
return 1
"""


class MetaStore:
    """Typed access to the cluster's Redis keys."""

    def __init__(self, redis: aioredis.Redis, cluster_id: str, ttl_s: int) -> None:
        self.redis = redis
        self._p = cluster_id
        self._ttl = ttl_s
        self._cas = redis.register_script(_CAS_SCRIPT)

    @classmethod
    def from_url(cls, url: str, cluster_id: str, ttl_s: int) -> MetaStore:
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

    def _k(self, *parts: str) -> str:
        return ":".join((self._p, *parts))

    def key(self, *parts: str) -> str:
        """The Redis key of a record, for stores that write several records atomically
        (the gateway's outbox): `key("future", request_id)`, `key("seq", job_id)`."""
        return self._k(*parts)

    @property
    def ttl_s(self) -> int:
        """How long futures, results, retry keys and cursors live, seconds."""
        return self._ttl

    async def _get(self, key: str, type_: type[T]) -> T | None:
        raw = await self.redis.get(key)
        return None if raw is None else decode(_raw(raw), type_)

    # Jobs -------------------------------------------------------------------

    async def put_job(self, job: JobRecord) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(self._k("job", job.job_id), encode(job))
            pipe.sadd(self._k("tenant", job.tenant, "jobs"), job.job_id)
            await pipe.execute()

    async def get_job(self, job_id: str) -> JobRecord | None:
        return await self._get(self._k("job", job_id), JobRecord)

    async def tenant_jobs(self, tenant: str) -> list[JobRecord]:
        members = await self.redis.smembers(self._k("tenant", tenant, "jobs"))
        ids = sorted(_text(m) for m in members)
        jobs = [await self.get_job(i) for i in ids]
        return [j for j in jobs if j is not None]

    async def all_jobs(self) -> list[JobRecord]:
        keys = [k async for k in self.redis.scan_iter(match=self._k("job", "*"), count=500)]
        raws = await self.redis.mget(keys) if keys else []
        return [decode(_raw(r), JobRecord) for r in raws if r is not None]

    async def set_home(self, job_id: str, worker_id: str) -> None:
        await self.redis.set(self._k("home", job_id), worker_id)

    async def homes(self) -> dict[str, str]:
        keys = [k async for k in self.redis.scan_iter(match=self._k("home", "*"), count=500)]
        raws = await self.redis.mget(keys) if keys else []
        prefix = len(self._k("home", ""))
        return {
            _text(k)[prefix:]: _text(r) for k, r in zip(keys, raws, strict=True) if r is not None
        }

    # Futures and results ------------------------------------------------------

    async def put_future(self, future: FutureRecord) -> None:
        await self.redis.set(self._k("future", future.request_id), encode(future), ex=self._ttl)

    async def get_future(self, request_id: str) -> FutureRecord | None:
        return await self._get(self._k("future", request_id), FutureRecord)

    async def record_completion(self, completion: PhaseCompletion) -> PhaseCompletion:
        """Record a call's completion once; returns the record that stands (first wins)."""
        key = self._k("done", completion.request_id)
        if await self.redis.set(key, encode(completion), ex=self._ttl, nx=True):
            return completion
        existing = await self.get_completion(completion.request_id)
        return existing if existing is not None else completion

    async def get_completion(self, request_id: str) -> PhaseCompletion | None:
        return await self._get(self._k("done", request_id), PhaseCompletion)

    async def get_completions(self, request_ids: Iterable[str]) -> dict[str, PhaseCompletion]:
        ids = list(request_ids)
        if not ids:
            return {}
        raws = await self.redis.mget([self._k("done", i) for i in ids])
        return {i: decode(_raw(r), PhaseCompletion) for i, r in zip(ids, raws, strict=True) if r}

    # Payloads by reference ---------------------------------------------------

    async def put_payload(self, data: bytes) -> PayloadRef:
        key = uuid.uuid4().hex
        await self.redis.set(self._k("payload", key), data, ex=self._ttl)
        return PayloadRef(key=key, size=len(data))

    async def get_payload(self, ref: PayloadRef) -> bytes:
        data = await self.redis.get(self._k("payload", ref.key))
        if data is None:
            raise KeyError(f"payload {ref.key} expired or never stored")
        return _raw(data)

    # Residency (compare-and-set on version) ------------------------------------

    async def get_residency(self, job_id: str) -> Residency | None:
        raw = await self.redis.get(self._k("residency", job_id))
        return None if raw is None else msgspec.json.decode(raw, type=Residency)

    async def cas_residency(self, job_id: str, expected_version: int, new: Residency) -> bool:
        """Write `new` only if the stored version is `expected_version` (0: absent)."""
        ok = await self._cas(
            keys=[self._k("residency", job_id)],
            args=[expected_version, msgspec.json.encode(new)],
        )
        return bool(ok)

    async def drop_residency(self, job_id: str) -> None:
        await self.redis.delete(self._k("residency", job_id))

    # Workers -----------------------------------------------------------------

    async def put_worker(self, worker_id: str, heartbeat: bytes, ttl_s: int) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(self._k("worker", worker_id), heartbeat, ex=ttl_s)
            pipe.sadd(self._k("workers"), worker_id)
            await pipe.execute()

    async def workers(self) -> dict[str, bytes]:
        ids = sorted(_text(m) for m in await self.redis.smembers(self._k("workers")))
        raws = await self.redis.mget([self._k("worker", i) for i in ids]) if ids else []
        return {i: _raw(r) for i, r in zip(ids, raws, strict=True) if r is not None}

    # Sessions ----------------------------------------------------------------

    async def put_session(self, session: SessionRecord) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(self._k("session", session.session_id), encode(session), ex=self._ttl)
            pipe.sadd(self._k("tenant", session.tenant, "sessions"), session.session_id)
            await pipe.execute()

    async def get_session(self, session_id: str) -> SessionRecord | None:
        return await self._get(self._k("session", session_id), SessionRecord)

    async def tenant_sessions(self, tenant: str) -> list[SessionRecord]:
        """The tenant's sessions that have not expired, oldest first."""
        ids = [_text(m) for m in await self.redis.smembers(self._k("tenant", tenant, "sessions"))]
        raws = await self.redis.mget([self._k("session", i) for i in ids]) if ids else []
        sessions: list[SessionRecord] = [
            decode(_raw(r), SessionRecord) for r in raws if r is not None
        ]
        return sorted(sessions, key=lambda s: (s.created_at, s.session_id))

    # Client retries and per-job call order -----------------------------------

    async def claim_request(self, key: str, request_id: str) -> str:
        """Bind a client's retry key to a request id once; returns the id that stands."""
        k = self._k("idem", key)
        if await self.redis.set(k, request_id, ex=self._ttl, nx=True):
            return request_id
        existing = await self.redis.get(k)
        return request_id if existing is None else _text(existing)

    async def claimed_request(self, key: str) -> str | None:
        raw = await self.redis.get(self._k("idem", key))
        return None if raw is None else _text(raw)

    async def release_request(self, key: str, request_id: str) -> None:
        """Undo a claim that was never published, so a retry can claim the key again."""
        k = self._k("idem", key)
        if await self.claimed_request(key) == request_id:
            await self.redis.delete(k)

    async def get_next_seq(self, job_id: str) -> int | None:
        """The next seq_id the gateway will publish for a job (None: never recorded)."""
        raw = await self.redis.get(self._k("seq", job_id))
        return None if raw is None else int(raw)

    async def set_next_seq(self, job_id: str, next_seq: int) -> None:
        await self.redis.set(self._k("seq", job_id), next_seq, ex=self._ttl)

    # Checkpoints -------------------------------------------------------------

    async def put_checkpoint(self, ckpt: CheckpointRecord) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(self._k("ckpt", ckpt.path), encode(ckpt))
            pipe.sadd(self._k("tenant", ckpt.tenant, "ckpts"), ckpt.path)
            await pipe.execute()

    async def get_checkpoint(self, path: str) -> CheckpointRecord | None:
        return await self._get(self._k("ckpt", path), CheckpointRecord)

    async def tenant_checkpoints(self, tenant: str) -> list[CheckpointRecord]:
        paths = sorted(
            _text(m) for m in await self.redis.smembers(self._k("tenant", tenant, "ckpts"))
        )
        records = [await self.get_checkpoint(p) for p in paths]
        return [r for r in records if r is not None]

    async def delete_checkpoint(self, ckpt: CheckpointRecord) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(self._k("ckpt", ckpt.path))
            pipe.srem(self._k("tenant", ckpt.tenant, "ckpts"), ckpt.path)
            await pipe.execute()

    # Timeline ----------------------------------------------------------------

    async def append_timeline(self, entry: TimelineEntry, max_len: int = 100_000) -> None:
        await self.redis.xadd(
            self._k("timeline"), {"e": encode(entry)}, maxlen=max_len, approximate=True
        )

    async def timeline(self, since: float = 0.0, limit: int = 1000) -> list[TimelineEntry]:
        """Entries whose call started at or after `since`, oldest first."""
        start = f"{int(since * 1000)}-0" if since > 0 else "-"
        rows: Any = await self.redis.xrange(self._k("timeline"), min=start, count=limit)
        return [decode(_raw(fields[b"e"]), TimelineEntry) for _, fields in rows or []]

    # Counters (accounting) ---------------------------------------------------

    async def add_usage(
        self, job_id: str, fields: dict[str, float], active_at: float | None = None
    ) -> None:
        """Add to a job's counters; with `active_at`, also `mark_active` in the same
        round trip (one transaction: a retry after a failure does not count twice)."""
        async with self.redis.pipeline(transaction=active_at is not None) as pipe:
            for name, value in fields.items():
                pipe.hincrbyfloat(self._k("usage", job_id), name, value)
            if active_at is not None:
                pipe.hsetnx(self._k("usage", job_id), "first_at", active_at)
                pipe.hset(self._k("usage", job_id), "last_at", active_at)
            await pipe.execute()

    async def mark_active(self, job_id: str, at: float) -> None:
        """Track a job's first and last activity: its wall time for dedicated accounting."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hsetnx(self._k("usage", job_id), "first_at", at)
            pipe.hset(self._k("usage", job_id), "last_at", at)
            await pipe.execute()

    async def usage(self, job_id: str) -> dict[str, float]:
        raw: dict[Any, Any] = await self.redis.hgetall(self._k("usage", job_id))
        return {k.decode(): float(v) for k, v in raw.items()}


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _raw(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def now() -> float:
    return time.time()
