"""Accepting a call is one Redis transaction; publishing it to Kafka follows from Redis.

A call is accepted when one Lua script (atomic in Redis) has written, together: the
future records the client will poll, the claim of the client's retry key, the model's
sequence cursor, and the phase requests themselves in the job's outbox (a Redis list,
in order). Only then are the requests published, oldest first, and each is removed
from the outbox once Kafka acknowledged it.

So a gateway that dies at any point leaves one of two states, both harmless:
nothing written (the client's re-send is a first send), or everything written (the
re-send finds its request id through the retry key, the cursor has moved so later
calls of the model are not held back, and whichever gateway runs next publishes the
outbox). A request published but not yet removed from the outbox is published again;
the request id makes that a no-op downstream (the scheduler and worker answer a
known request id from its record instead of running it twice).

The same script reads the job's direct lease (`plexrl.direct`): while the scheduler
has granted one, it numbers each call in the job's ledger there and then and marks its
outbox entry with the route (the worker, the epoch, the lease, the seq), and the flush
publishes it in a Dispatch to that worker (with the routed entries next to it under
the same lease, a bounded number, in order). An entry keeps its route however
late it is published (by this gateway or, after a crash, by the next one): its seq
and epoch decide at the worker, and the scheduler waits for it before it dispatches
anything of the job after revoking the lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from plexrl.direct import ACCEPT_LUA, LEASED, OutboxEntry, Route, read_element
from plexrl.failpoints import failpoint
from plexrl.ledger import SEQUENCED
from plexrl.messages import PhaseRequest, encode
from plexrl.retry import retrieved
from plexrl.stores import FutureRecord, RedisKeys

log = logging.getLogger(__name__)

# KEYS: outbox list, outbox job set, seq cursor, retry key, ledger head, ledger ids,
#       direct lease, direct calls, future keys (n)
# ARGV: has retry key ("1"/"0"), request id for the retry key, ttl, seq_id (-1: none),
#       job id, n, kinds (one letter per request: see `_kind`), future records (n),
#       request ids (m), outbox entries (m)
# Returns {standing request id} when the retry key was claimed already (nothing written),
# else {'', the outbox's head}: the first entry to publish, read in the same round trip.
_ACCEPT = (
    """
local head, ids, lease, calls = KEYS[5], KEYS[6], KEYS[7], KEYS[8]
"""
    + ACCEPT_LUA
    + """
local ttl = tonumber(ARGV[3])
if ARGV[1] == '1' then
  local standing = redis.call('GET', KEYS[4])
  if standing then return {standing} end
end
local n = tonumber(ARGV[6])
for i = 1, n do
  redis.call('SET', KEYS[8 + i], ARGV[7 + i], 'EX', ttl)
end
if ARGV[1] == '1' then
  redis.call('SET', KEYS[4], ARGV[2], 'EX', ttl)
end
local seq = tonumber(ARGV[4])
if seq >= 0 then
  local cursor = tonumber(redis.call('GET', KEYS[3]) or '-1')
  if seq + 1 > cursor then
    redis.call('SET', KEYS[3], seq + 1, 'EX', ttl)
  end
end
local kinds = ARGV[7]
local m = #kinds
local rids, entries = 7 + n, 7 + n + m
-- One submission takes one path: direct only if every call of it may.
local l = nil
if not string.find(kinds, '[^nu]') then l = lease_live() end
for i = 1, m do
  local kind = string.sub(kinds, i, i)
  local entry = ARGV[entries + i]
  if l then
    entry = route(l, ARGV[rids + i], kind == 'n', entry)
  else
    wait(kind == 'n' or kind == 'N')
  end
  redis.call('RPUSH', KEYS[1], entry)
end
redis.call('SADD', KEYS[2], ARGV[5])
return {'', redis.call('LINDEX', KEYS[1], 0)}
"""
)

# KEYS: outbox list, outbox job set; ARGV: job id, how many to return, the published
# entries. Removes those; returns the next entries to publish, oldest first (none left:
# the job leaves the set).
_DONE = """
for i = 3, #ARGV do
  redis.call('LREM', KEYS[1], 1, ARGV[i])
end
local n = tonumber(ARGV[2])
if n < 1 then return {} end
local next = redis.call('LRANGE', KEYS[1], 0, n - 1)
if #next == 0 then
  redis.call('SREM', KEYS[2], ARGV[1])
end
return next
"""


@dataclass(frozen=True)
class Accept:
    """What one submission writes atomically."""

    job_id: str
    futures: list[FutureRecord]
    requests: list[PhaseRequest]
    retry_key: str | None = None
    """Claimed for the last request's id; an earlier claim wins and nothing is written."""
    seq_id: int | None = None
    """Moves the model's cursor past this seq_id (never back)."""


@dataclass(frozen=True)
class Accepted:
    """What `Outbox.accept` found."""

    standing: str | None
    """The request id that stood for the retry key already (then nothing was written)."""
    head: bytes | None = None
    """The job's outbox head as the acceptance left it, when no flush of the job in this
    process could have moved it since: `flush` starts from it without reading it again."""


Send = Callable[[list[PhaseRequest], list[Route] | None], Awaitable[Awaitable[Any]]]
"""Queues one Kafka record on the producer and returns its acknowledgement, which
raises if the broker did not take it: one request to `plexrl.requests` (routes None),
or consecutive calls of a job accepted under one direct lease, with their routes, as
one dispatch straight to their worker (`plexrl.direct`). A job's records are queued in
order and acknowledged together (one producer keeps their order on a partition)."""

MERGED_CALLS = 16
"""Most calls of one job one direct dispatch of the flush carries."""
MERGED_BYTES = 256 * 1024
"""Most bytes of outbox entries one direct dispatch of the flush carries (the broker's
record limit is 1 MiB by default; a payload over the inline limit travels by reference)."""


@dataclass
class _Record:
    """Outbox entries published as one Kafka record."""

    raws: list[bytes]
    requests: list[PhaseRequest]
    routes: list[Route] | None
    size: int

    def takes(self, route: Route | None, size: int) -> bool:
        """Whether an entry with `route` may go in this record, after those in it: a
        direct call under the same worker, epoch and lease, within the bounds."""
        if route is None or self.routes is None:
            return False
        last = self.routes[-1]
        return (
            (route.worker_id, route.epoch, route.lease_id)
            == (last.worker_id, last.epoch, last.lease_id)
            and len(self.raws) < MERGED_CALLS
            and self.size + size <= MERGED_BYTES
        )


def _records(entries: list[tuple[bytes, Route | None, OutboxEntry]]) -> list[_Record]:
    """The entries in order, consecutive direct calls under one lease merged."""
    records: list[_Record] = []
    for raw, route, entry in entries:
        if records and records[-1].takes(route, len(raw)):
            record = records[-1]
            record.raws.append(raw)
            record.requests.append(entry.request)
            if record.routes is not None and route is not None:
                record.routes.append(route)
            record.size += len(raw)
        else:
            routes = None if route is None else [route]
            records.append(_Record([raw], [entry.request], routes, len(raw)))
    return records


def _kind(request: PhaseRequest) -> str:
    """The acceptance script's letter for a request: `n` numbered and may go direct, `u`
    unnumbered and may go direct, `N` numbered but never direct, `-` neither."""
    numbered = request.function in SEQUENCED
    if request.function in LEASED:
        return "n" if numbered else "u"
    return "N" if numbered else "-"


class Outbox:
    def __init__(
        self, keys: RedisKeys, clock: Callable[[], float] = time.time, batch: int = 64
    ) -> None:
        """`keys`: the outbox writes the call store's records (future, retry key, seq
        cursor) in its own transaction, so it names their keys itself. `batch`: entries a
        flush publishes before it waits for their acknowledgements."""
        if batch < 1:
            raise ValueError(f"batch is {batch}; a flush publishes at least one entry at a time")
        self._batch = batch
        self._keys = keys
        self._redis = keys.redis
        self._accept = keys.redis.register_script(_ACCEPT)
        self._done = keys.redis.register_script(_DONE)
        self._jobs_key = keys.key("outbox-jobs")
        self._clock = clock
        self._locks: dict[str, asyncio.Lock] = {}
        self._users: dict[str, int] = {}
        self._flushes = 0
        """Flushes (of any job) started in this process: one that started while an
        acceptance was in Redis may have published the head that acceptance read."""

    def _list_key(self, job_id: str) -> str:
        return self._keys.key("outbox", job_id)

    async def accept(self, accept: Accept) -> Accepted:
        """Write everything of one submission at once; says the request id that stood
        for the retry key already (and then nothing was written)."""
        now = self._clock()
        flushes = self._flushes
        idle = accept.job_id not in self._users
        keys = [
            self._list_key(accept.job_id),
            self._jobs_key,
            self._keys.key("seq", accept.job_id),
            self._keys.key("idem", accept.retry_key or ""),
            # The job's ledger and direct lease (layouts: plexrl.ledger, plexrl.direct).
            self._keys.key("ledger", accept.job_id),
            self._keys.key("ledger", accept.job_id, "ids"),
            self._keys.key("direct", accept.job_id),
            self._keys.key("direct", accept.job_id, "calls"),
            *(self._keys.key("future", f.request_id) for f in accept.futures),
        ]
        args: list[Any] = [
            "1" if accept.retry_key is not None else "0",
            accept.requests[-1].request_id,
            self._keys.ttl_s,
            -1 if accept.seq_id is None else accept.seq_id,
            accept.job_id,
            len(accept.futures),
            "".join(_kind(r) for r in accept.requests),
            *(encode(f) for f in accept.futures),
            *(r.request_id for r in accept.requests),
            *(encode(OutboxEntry(r, now)) for r in accept.requests),
        ]
        reply: list[Any] = await self._accept(keys=keys, args=args)
        if reply[0]:
            return Accepted(_raw(reply[0]).decode())
        # A flush of the job that ran meanwhile may have published that head already.
        fresh = idle and flushes == self._flushes and accept.job_id not in self._users
        return Accepted(None, _raw(reply[1]) if fresh and reply[1] else None)

    async def flush(
        self, job_id: str, send: Send, min_age_s: float = 0.0, head: bytes | None = None
    ) -> int:
        """Publish the job's outbox in order; returns how many were published. Raises
        what `send` raised (what is left stays for the next flush). `min_age_s` leaves
        an outbox whose oldest entry is younger alone (its gateway is publishing it);
        once started, a flush goes to the end, so nothing accepted meanwhile waits.
        `head`: the head `accept` just read (`Accepted.head`), saving a round trip.

        Entries go out a batch at a time: all queued on the producer, then their
        acknowledgements awaited, then removed together (one round trip each way,
        however many calls of the job arrived together)."""
        if job_id in self._users:  # a flush of the job runs: it may publish that head
            head = None
        async with self._lock(job_id):
            published = 0
            keys = [self._list_key(job_id), self._jobs_key]
            batch: list[Any] = [head] if head is not None else []
            if not batch:
                batch = await self._done(keys=keys, args=[job_id, self._batch])
            while batch:
                entries = [(_raw(raw), *read_element(_raw(raw))) for raw in batch]
                if published == 0 and self._clock() - entries[0][2].queued_at < min_age_s:
                    return published  # young: the gateway that accepted it is publishing it
                acked = await self._publish(keys, job_id, entries, send)
                published += len(acked)
                # Removed, and the next ones read, in one round trip.
                batch = await self._done(keys=keys, args=[job_id, self._batch, *acked])
            return published

    async def _publish(
        self,
        keys: list[str],
        job_id: str,
        entries: list[tuple[bytes, Route | None, OutboxEntry]],
        send: Send,
    ) -> list[bytes]:
        """Queue every entry (consecutive direct calls under one lease as one dispatch),
        then wait for each record's acknowledgement in order; returns the entries
        acknowledged. If one failed, those before it are removed from the outbox and the
        failure raised (its entries and those after them stay, for the next flush)."""
        # Nothing leaves the outbox before a Redis replica holds it: an entry only a
        # demoted primary holds (accepted on it while it was cut off, never confirmed to
        # the client, who sent the call again elsewhere) would otherwise be published by
        # this gateway's sweeper once the partition heals, and its call run twice. A
        # direct call's number, written at its acceptance, is covered the same way.
        await self._keys.replicated()
        acks = []
        for record in _records(entries):
            if record.routes is not None:
                failpoint("gateway.direct_before_publish")
            acks.append((record, await send(record.requests, record.routes)))
        acked: list[bytes] = []
        done = 0
        try:
            for record, ack in acks:
                await ack
                acked += record.raws
                done += 1
                if record.routes is not None:
                    failpoint("gateway.direct_published")
        except BaseException:
            for _, ack in acks[done + 1 :]:  # never awaited: collect their outcome
                if isinstance(ack, asyncio.Future):
                    ack.add_done_callback(retrieved)
            if acked:
                with contextlib.suppress(Exception):
                    await self._done(keys=keys, args=[job_id, 0, *acked])
            raise
        return acked

    async def pending_jobs(self) -> list[str]:
        members = await self._redis.smembers(self._jobs_key)
        return sorted(m.decode() if isinstance(m, bytes) else str(m) for m in members)

    async def depth(self, job_id: str) -> int:
        return int(await self._redis.llen(self._list_key(job_id)))

    @contextlib.asynccontextmanager
    async def _lock(self, job_id: str) -> AsyncIterator[None]:
        """One flusher per job in this process, so the job's requests go out in order."""
        lock = self._locks.setdefault(job_id, asyncio.Lock())
        self._users[job_id] = self._users.get(job_id, 0) + 1
        self._flushes += 1
        try:
            async with lock:
                yield
        finally:
            self._users[job_id] -= 1
            if self._users[job_id] == 0:
                del self._users[job_id], self._locks[job_id]


class Flushes:
    """One flush of a job's outbox at a time in this process, shared by the requests that
    wait on it: a request whose calls were accepted while the job's flush runs waits
    for the next round of that flush, which starts after its acceptance and so reads
    its entries, instead of taking the job's lock and reading the outbox itself (16
    clients of one job made 2.5 Redis scripts per call, one of them a read that mostly
    found the outbox published already). Each request waits only for the round after
    its own acceptance, never for the end of a stream of them."""

    def __init__(self, outbox: Outbox) -> None:
        self._outbox = outbox
        self._next: dict[str, asyncio.Future[int]] = {}
        """Per job with a flusher running: the round the requests accepted since its
        current round started wait for."""
        self._running: set[str] = set()

    async def flush(self, job_id: str, send: Send, head: bytes | None = None) -> None:
        """Until a round of the job's flush that started after this call has ended;
        raises what that round raised (what is left stays for the next flush).
        `head`: the head the acceptance read (`Accepted.head`), used when this call
        starts the flush.

        With no flush of the job running, this call runs a round itself (no task, no
        wait on another: one request at a time costs what it did alone); the requests
        that came meanwhile get the next rounds from a task of their own."""
        if job_id in self._running:
            round_ = self._next.get(job_id)
            if round_ is None:
                round_ = self._next[job_id] = asyncio.get_running_loop().create_future()
                round_.add_done_callback(retrieved)  # every waiter may have been cancelled
            await asyncio.shield(round_)
            return
        self._running.add(job_id)
        try:
            await self._outbox.flush(job_id, send, head=head)
        finally:
            if job_id in self._next:  # requests came meanwhile: their rounds follow
                task = asyncio.create_task(self._rounds(job_id, send))
                task.add_done_callback(retrieved)
            else:
                self._running.discard(job_id)

    async def _rounds(self, job_id: str, send: Send) -> None:
        try:
            while (round_ := self._next.pop(job_id, None)) is not None:
                try:
                    round_.set_result(await self._outbox.flush(job_id, send))
                except asyncio.CancelledError:  # the gateway stops: so do its waiters
                    round_.cancel()
                    raise
                except BaseException as exc:  # theirs to raise, as if each had flushed
                    round_.set_exception(exc)
                    if not isinstance(exc, Exception):
                        raise
        finally:
            # No await since the loop found no round wanted: a request that comes after
            # this runs a round of its own.
            self._running.discard(job_id)
            left = self._next.pop(job_id, None)
            if left is not None:  # only when stopped with requests waiting
                left.cancel()


def _raw(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)
