"""A job's ledger: which of its calls applied, in what order, under which lease.

Exactly-once effects come from a per-job high-water mark, not from keys that expire.
The scheduler numbers a job's state-touching calls 1, 2, 3, ... (`seq`, bound to the
request id the first time it dispatches the call and kept for the job's lifetime, so
a replayed request gets the number it had). A worker applies call `seq` only when the
job's last applied call is `seq - 1`; an older call is answered from the result the
ledger kept (see `verdict`).

Every (re-)homing of a job bumps its `epoch`. A dispatch carries the epoch it was
issued under, and a worker commits a call only while that epoch still stands: a
worker that comes back late, after its jobs were re-homed, cannot apply a stale call
(fencing).

The ledger also holds what recovery needs: the job's latest snapshot (a blob in the
state-store and the seq it covers) and the log of mutating calls applied since, with
their payloads resolved (payload refs expire). Snapshot + log, replayed in seq order,
rebuild the job's state bit for bit on any worker.

Results are kept for the job's lifetime, but not all in Redis: after each snapshot the
worker moves the results it covers into a blob in the state-store (an archive: seq →
encoded PhaseCompletion, payload refs resolved) and drops them from Redis, so a job's
Redis footprint stays a few calls' results however long it runs (`archive_range`,
`record_archive`, `archive_of`).

Calls that go direct under a scheduler-granted lease (`plexrl.direct`) are numbered by
the gateway's acceptance script instead, in the same counter; `waiting` counts the
sequenced calls accepted on the normal path that are not numbered yet (a lease is
granted only when none is).

Redis keys (no TTL: they live as long as the job; `close` trims them at UNLOAD):
`<cluster>:ledger:<job>` a hash (next, epoch, owner, applied, snap_seq, snap_blob,
archived, waiting); `...:ids` request id → seq; `...:log` seq → PhaseRequest; `...:results` seq →
PhaseCompletion (the calls after `archived`); `...:archives` a sorted set of archive
blob keys scored by the last seq each holds.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
import redis.exceptions

from plexrl.lease import FENCE_CHECK, Fence, FencedError
from plexrl.messages import Function, PhaseCompletion, PhaseRequest, decode, encode

SEQUENCED = frozenset(
    {
        Function.CREATE,
        Function.FORWARD,
        Function.FORWARD_BACKWARD,
        Function.OPTIM_STEP,
        Function.SAVE,
        Function.LOAD,
        Function.UNLOAD,
    }
)
"""Calls that read or change a job's training state: they run in seq order, once.
SAMPLE and NOOP are pure functions of their input and run unnumbered."""

MUTATING = frozenset(
    {Function.CREATE, Function.FORWARD_BACKWARD, Function.OPTIM_STEP, Function.LOAD}
)
"""Sequenced calls that change the state: logged, and replayed on restore."""


class Verdict(enum.StrEnum):
    """What a worker does with call `seq` of a job, given the job's last applied call."""

    APPLY = "apply"
    """The next call (`seq == applied + 1`): run it, then commit it."""
    ANSWERED = "answered"
    """Applied before (`seq <= applied`): answer with its stored result, never rerun."""
    AHEAD = "ahead"
    """A lower call has not applied yet (`seq > applied + 1`): do not run it."""


def verdict(seq: int, applied: int) -> Verdict:
    """The high-water-mark rule of exactly-once effects (pure)."""
    if seq < 1:
        raise ValueError(f"seq {seq} is not a call number; sequenced calls count from 1")
    if applied < 0:
        raise ValueError(f"applied {applied} is negative; a fresh job has applied 0")
    if seq <= applied:
        return Verdict.ANSWERED
    if seq == applied + 1:
        return Verdict.APPLY
    return Verdict.AHEAD


class Committed(enum.StrEnum):
    """The outcome of committing a call to the ledger."""

    OK = "ok"
    """The call is the job's last applied one now."""
    FENCED = "fenced"
    """The job was re-homed under a newer epoch: this worker no longer owns it."""
    OUT_OF_ORDER = "out_of_order"
    """The ledger's last applied call is not `seq - 1` (a replay raced this commit)."""


@dataclass(frozen=True)
class LedgerState:
    """One read of a job's ledger head."""

    epoch: int = 0
    owner: str = ""
    applied: int = 0
    snap_seq: int = 0
    snap_blob: str = ""


@dataclass(frozen=True)
class RecoveryPoint:
    """What a worker needs to rebuild a job: its snapshot and the calls logged since."""

    state: LedgerState
    log: list[PhaseRequest]
    """Mutating calls with seq in (snap_seq, applied], in seq order."""


# KEYS: head, ids, the scheduler lease's token key. ARGV: the writer's token ('' for
# none), request ids. Returns their seqs, numbering new ones in order; an error when the
# token is not the lease's latest (a deposed scheduler numbers nothing). Each call
# numbered here waited on the normal path: `waiting` counts it off (never below 0: a
# call accepted by a gateway that did not count it).
_ASSIGN = (
    FENCE_CHECK
    + """
if fenced_by(KEYS[3], ARGV[1]) then return redis.error_reply('FENCED') end
local out = {}
for i = 2, #ARGV do
  local rid = ARGV[i]
  local s = redis.call('HGET', KEYS[2], rid)
  if not s then
    s = redis.call('HINCRBY', KEYS[1], 'next', 1)
    redis.call('HSET', KEYS[2], rid, s)
    if tonumber(redis.call('HGET', KEYS[1], 'waiting') or '0') > 0 then
      redis.call('HINCRBY', KEYS[1], 'waiting', -1)
    end
  end
  out[i - 1] = tonumber(s)
end
return out
"""
)

# KEYS: head, the scheduler lease's token key. ARGV: the writer's token, owner.
_BUMP = (
    FENCE_CHECK
    + """
if fenced_by(KEYS[2], ARGV[1]) then return redis.error_reply('FENCED') end
local epoch = redis.call('HINCRBY', KEYS[1], 'epoch', 1)
redis.call('HSET', KEYS[1], 'owner', ARGV[2])
return epoch
"""
)

# KEYS: head, log, results. ARGV: epoch, seq, completion, log entry ('' for none).
_COMMIT = """
local epoch = tonumber(redis.call('HGET', KEYS[1], 'epoch') or '0')
if epoch ~= tonumber(ARGV[1]) then return 'fenced' end
local applied = tonumber(redis.call('HGET', KEYS[1], 'applied') or '0')
if applied ~= tonumber(ARGV[2]) - 1 then return 'out_of_order' end
redis.call('HSET', KEYS[1], 'applied', ARGV[2])
redis.call('HSET', KEYS[3], ARGV[2], ARGV[3])
if ARGV[4] ~= '' then redis.call('HSET', KEYS[2], ARGV[2], ARGV[4]) end
return 'ok'
"""

# The job's blob book (KEYS "blobs", a hash) names every blob a worker wrote for the
# job that nothing references yet or any more: "w<epoch>" while one is written under that
# epoch, "d" once it is to be deleted. A worker killed between writing a blob and
# recording it leaves "w<old epoch>" behind, which the next owner deletes (`unreferenced`).

# KEYS: head, log, blobs. ARGV: epoch, seq, blob key. Returns the blob key nobody needs
# now (the replaced snapshot, or this one when it is stale) or '', marked "d".
_SNAPSHOT = """
local epoch = tonumber(redis.call('HGET', KEYS[1], 'epoch') or '0')
local current = tonumber(redis.call('HGET', KEYS[1], 'snap_seq') or '0')
local seq = tonumber(ARGV[2])
local closed = redis.call('HGET', KEYS[1], 'closed')
if epoch ~= tonumber(ARGV[1]) or seq <= current or closed then
  redis.call('HSET', KEYS[3], ARGV[3], 'd')
  return ARGV[3]
end
local old = redis.call('HGET', KEYS[1], 'snap_blob') or ''
redis.call('HSET', KEYS[1], 'snap_seq', seq, 'snap_blob', ARGV[3])
redis.call('HDEL', KEYS[3], ARGV[3])
if old ~= '' then redis.call('HSET', KEYS[3], old, 'd') end
for _, s in ipairs(redis.call('HKEYS', KEYS[2])) do
  if tonumber(s) <= seq then redis.call('HDEL', KEYS[2], s) end
end
return old
"""


# KEYS: head, results, archives, blobs. ARGV: epoch, lo, hi, blob key.
_ARCHIVE = """
local epoch = tonumber(redis.call('HGET', KEYS[1], 'epoch') or '0')
local archived = tonumber(redis.call('HGET', KEYS[1], 'archived') or '0')
local lo, hi = tonumber(ARGV[2]), tonumber(ARGV[3])
if epoch ~= tonumber(ARGV[1]) or archived ~= lo - 1 then
  redis.call('HSET', KEYS[4], ARGV[4], 'd')
  return 0
end
redis.call('ZADD', KEYS[3], hi, ARGV[4])
redis.call('HSET', KEYS[1], 'archived', hi)
redis.call('HDEL', KEYS[4], ARGV[4])
for s = lo, hi do redis.call('HDEL', KEYS[2], tostring(s)) end
return 1
"""


# KEYS: head, log, blobs. The job ended: its snapshot is marked to delete, later ones
# are refused (`closed`), its log goes.
_CLOSE = """
local blob = redis.call('HGET', KEYS[1], 'snap_blob')
if blob then redis.call('HSET', KEYS[3], blob, 'd') end
redis.call('HDEL', KEYS[1], 'snap_blob', 'snap_seq')
redis.call('HSET', KEYS[1], 'closed', '1')
redis.call('DEL', KEYS[2])
return 1
"""


# KEYS: blobs. ARGV: key, mark, key, mark, ...: drop each entry still at its mark.
_FORGET_BLOBS = """
for i = 1, #ARGV, 2 do
  if redis.call('HGET', KEYS[1], ARGV[i]) == ARGV[i + 1] then
    redis.call('HDEL', KEYS[1], ARGV[i])
  end
end
return 1
"""


class Ledger:
    """The Redis store of job ledgers (narrow: the scheduler and workers hold only this)."""

    def __init__(
        self,
        redis: aioredis.Redis,
        cluster_id: str,
        replicated: Callable[[], Awaitable[object]] | None = None,
        fence: Fence | None = None,
    ) -> None:
        """`replicated`: waits until Redis's replicas hold what was written
        (`RedisKeys.replicated`): the scheduler's numbers and epochs wait for it before a
        dispatch carries them, and a snapshot's record before the blobs it replaced are
        deleted (a worker's commit waits with its completion's record). `fence`: the
        leading scheduler's term; its numbers and epochs are written only while no newer
        scheduler took the lease (`FencedError` otherwise)."""
        self._redis = redis
        self._p = cluster_id
        self._replicated = replicated
        self._fence = fence
        self._bump = redis.register_script(_BUMP)
        self._assign = redis.register_script(_ASSIGN)
        self._commit = redis.register_script(_COMMIT)
        self._snapshot = redis.register_script(_SNAPSHOT)
        self._archive = redis.register_script(_ARCHIVE)
        self._forget_blobs = redis.register_script(_FORGET_BLOBS)
        self._close = redis.register_script(_CLOSE)

    def _k(self, job_id: str, part: str = "") -> str:
        key = f"{self._p}:ledger:{job_id}"
        return f"{key}:{part}" if part else key

    # Scheduler ----------------------------------------------------------------

    async def assign(self, job_id: str, request_ids: list[str]) -> list[int]:
        """The seq of each call, numbering the ones seen for the first time in order."""
        if not request_ids:
            return []
        try:
            seqs: Any = await self._assign(
                keys=[self._k(job_id), self._k(job_id, "ids"), self._fence_key],
                args=[self._fence_arg, *request_ids],
            )
        except redis.exceptions.ResponseError as exc:
            raise _fenced(exc, f"numbering calls of {job_id}") from None
        # A number lost in a failover would be handed again to another call, which a
        # worker would then answer with the first one's result.
        await self._wait_replicas()
        return [int(s) for s in seqs]

    async def bump_epoch(self, job_id: str, owner: str) -> int:
        """A new lease on the job for `owner` ('' while it has none): fences the old one."""
        try:
            epoch: Any = await self._bump(
                keys=[self._k(job_id), self._fence_key], args=[self._fence_arg, owner]
            )
        except redis.exceptions.ResponseError as exc:
            raise _fenced(exc, f"giving {job_id} a new lease") from None
        await self._wait_replicas()  # an epoch lost in a failover unfences the old owner
        return int(epoch)

    @property
    def _fence_key(self) -> str:
        # Without a fence the script is handed a key it never reads (and no token).
        return self._fence.token_key if self._fence else f"{self._p}:unfenced"

    @property
    def _fence_arg(self) -> str:
        return self._fence.arg if self._fence else ""

    async def _wait_replicas(self) -> None:
        if self._replicated is not None:
            await self._replicated()

    # Workers ------------------------------------------------------------------

    async def head(self, job_id: str) -> LedgerState:
        raw: dict[Any, Any] = await self._redis.hgetall(self._k(job_id))
        return _head(raw)

    def head_key(self, job_id: str) -> str:
        """The Redis key of the job's head (a hash; `epoch` its current lease's)."""
        return self._k(job_id)

    def queue_head(self, pipe: Any, job_id: str) -> None:
        """`head` on a pipeline of this ledger's Redis client; its reply is read with
        `head_of`."""
        pipe.hgetall(self._k(job_id))

    @staticmethod
    def head_of(reply: dict[Any, Any]) -> LedgerState:
        """The head a reply of `queue_head`'s read holds."""
        return _head(reply)

    async def commit(
        self,
        job_id: str,
        epoch: int,
        seq: int,
        completion: PhaseCompletion,
        logged: PhaseRequest | None,
    ) -> Committed:
        """Make call `seq` the job's last applied one, with its result (and log entry)."""
        outcome: Any = await self._commit(
            keys=[self._k(job_id), self._k(job_id, "log"), self._k(job_id, "results")],
            args=[epoch, seq, encode(completion), b"" if logged is None else encode(logged)],
        )
        return Committed(_text(outcome))

    async def result(self, job_id: str, seq: int) -> PhaseCompletion | None:
        raw = await self._redis.hget(self._k(job_id, "results"), str(seq))
        return None if raw is None else decode(_bytes(raw), PhaseCompletion)

    async def head_and_result(
        self, job_id: str, seq: int
    ) -> tuple[LedgerState, PhaseCompletion | None]:
        """The head and call `seq`'s result in one read of one server (a commit writes
        both at once, so they agree unless the server changed between two reads)."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hgetall(self._k(job_id))
            pipe.hget(self._k(job_id, "results"), str(seq))
            raw_head, raw = await pipe.execute()
        return _head(raw_head), None if raw is None else decode(_bytes(raw), PhaseCompletion)

    async def archive_range(
        self, job_id: str, upto: int, at_least: int = 1
    ) -> tuple[int, dict[int, bytes]]:
        """The results not archived yet up to call `upto`: (the first seq, seq → encoded
        PhaseCompletion), or none if fewer than `at_least` calls are not. Seqs with no
        result (none is missing normally) are left out."""
        raw: Any = await self._redis.hget(self._k(job_id), "archived")
        lo = int(_text(raw)) + 1 if raw is not None else 1
        if upto - lo + 1 < max(at_least, 1):
            return lo, {}
        seqs = list(range(lo, upto + 1))
        values = await self._redis.hmget(self._k(job_id, "results"), [str(s) for s in seqs])
        return lo, {s: _bytes(v) for s, v in zip(seqs, values, strict=True) if v is not None}

    async def record_archive(
        self, job_id: str, epoch: int, lo: int, hi: int, blob_key: str
    ) -> bool:
        """Calls `lo`..`hi`'s results now live in `blob_key`: drop them from Redis. False
        (nothing changed) when the epoch moved on or another archive got there first."""
        done: Any = await self._archive(
            keys=[
                self._k(job_id),
                self._k(job_id, "results"),
                self._k(job_id, "archives"),
                self._k(job_id, "blobs"),
            ],
            args=[epoch, lo, hi, blob_key],
        )
        return bool(int(done))

    async def archive_of(self, job_id: str, seq: int) -> str | None:
        """The blob holding call `seq`'s result, if it was archived."""
        found: Any = await self._redis.zrangebyscore(
            self._k(job_id, "archives"), seq, "+inf", start=0, num=1
        )
        return _text(found[0]) if found else None

    async def recovery_point(self, job_id: str) -> RecoveryPoint:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hgetall(self._k(job_id))
            pipe.hgetall(self._k(job_id, "log"))
            raw_head, raw_log = await pipe.execute()
        state = _head(raw_head)
        entries = sorted((int(s), v) for s, v in raw_log.items())
        log: list[PhaseRequest] = [
            decode(_bytes(v), PhaseRequest)
            for s, v in entries
            if state.snap_seq < s <= state.applied
        ]
        return RecoveryPoint(state, log)

    async def record_snapshot(self, job_id: str, epoch: int, seq: int, blob_key: str) -> str:
        """Make `blob_key` the job's snapshot as of call `seq` and trim the log it covers;
        returns the blob key that is no longer needed ('' if none)."""
        unused: Any = await self._snapshot(
            keys=[self._k(job_id), self._k(job_id, "log"), self._k(job_id, "blobs")],
            args=[epoch, seq, blob_key],
        )
        return _text(unused) if unused else ""

    async def close(self, job_id: str) -> None:
        """The job ended (UNLOAD): drop its log and mark its snapshot for deletion (see
        `unreferenced`), refuse later snapshots, keep its results and numbers (a replayed
        call is still answered)."""
        # One script: a snapshot recorded between reading snap_blob and dropping it
        # would otherwise be referenced by nothing and named nowhere.
        await self._close(keys=[self._k(job_id), self._k(job_id, "log"), self._k(job_id, "blobs")])

    # The blob book --------------------------------------------------------------

    async def writing(self, job_id: str, epoch: int, blob_key: str) -> None:
        """About to write `blob_key` for the job under `epoch` (before the write: a worker
        killed before recording it leaves it named here)."""
        await self._redis.hset(self._k(job_id, "blobs"), blob_key, f"w{epoch}")

    async def abandon(self, job_id: str, blob_key: str) -> None:
        """`blob_key` will not be recorded (its write failed): delete it."""
        await self._redis.hset(self._k(job_id, "blobs"), blob_key, "d")

    async def unreferenced(self, job_id: str) -> dict[str, str]:
        """Blobs of the job to delete, with their book entries: marked so, or written
        under an earlier epoch and never recorded (their writer was fenced or killed).
        Blobs being written under the current epoch are left alone."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hget(self._k(job_id), "epoch")
            pipe.hgetall(self._k(job_id, "blobs"))
            raw_epoch, book = await pipe.execute()
        epoch = int(_text(raw_epoch)) if raw_epoch is not None else 0
        marks = {_text(k): _text(v) for k, v in book.items()}
        doomed = {k: v for k, v in sorted(marks.items()) if blob_unreferenced(v, epoch)}
        if doomed:
            # What replaced them (a newer snapshot, an archive) must outlive a failover
            # before they go: a ledger rolled back to a deleted snapshot loses the job.
            await self._wait_replicas()
        return doomed

    async def deleted(self, job_id: str, entries: dict[str, str]) -> None:
        """The blobs of `entries` (from `unreferenced`) are deleted: out of the book, each
        unless its entry changed meanwhile (a fenced writer finishing late marks it again,
        and the next sweep deletes it again)."""
        if entries:
            await self._forget_blobs(
                keys=[self._k(job_id, "blobs")],
                args=[x for kv in entries.items() for x in kv],
            )


def _fenced(exc: redis.exceptions.ResponseError, doing: str) -> Exception:
    if "FENCED" in str(exc):
        return FencedError(
            f"{doing} refused: this scheduler's term ended, another leads now (a newer "
            "token holds the scheduler lease)"
        )
    return exc


def blob_unreferenced(mark: str, epoch: int) -> bool:
    """Whether a blob with book entry `mark` is to be deleted when the job's epoch is
    `epoch` (pure)."""
    if mark == "d":
        return True
    return mark.startswith("w") and mark[1:].isdigit() and int(mark[1:]) < epoch


def _head(raw: dict[Any, Any]) -> LedgerState:
    fields = {_text(k): _text(v) for k, v in raw.items()}
    return LedgerState(
        epoch=int(fields.get("epoch", 0)),
        owner=fields.get("owner", ""),
        applied=int(fields.get("applied", 0)),
        snap_seq=int(fields.get("snap_seq", 0)),
        snap_blob=fields.get("snap_blob", ""),
    )


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)
