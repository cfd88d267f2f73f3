"""The direct path: a scheduler-granted lease under which gateways send a job's calls
straight to its worker's dispatch topic, without the scheduler on the call's path.

For a resident, active job the scheduler grants its home worker a *direct lease*
(epoch-fenced, time-bounded, revocable). While it holds, the gateway's acceptance (one
Lua script, `plexrl_gateway.outbox`) reads it atomically and, for each call it
accepts, numbers the call in the job's ledger (`plexrl.ledger`: sequenced calls get
their seq there and then, not at dispatch) and routes the call: the outbox entry
carries a `Route`, and the flush publishes a `Dispatch` to the worker instead of a
PhaseRequest to `plexrl.requests` (consecutive routed entries of one flush under the
same lease share one, in order). The scheduler still sees every call through
its completion (accounting, its view, the timeline).

Why order and exactly-once hold whichever path a call takes:

- A lease is granted only while nothing of the job is numbered and unapplied, and no
  sequenced call of it waits on the normal path unnumbered (the ledger head's
  `waiting`, counted by the acceptance and uncounted by the scheduler's `assign`):
  every earlier call has applied, so the direct calls come next.
- While it holds, every leasable call of the job is numbered at acceptance, in
  acceptance order (the gateway's sequencer's order), and published in that order
  from the job's outbox to the worker's one-partition topic.
- A sequenced call that cannot go direct (an UNLOAD, say) ends the lease in the same
  script that counts it as waiting, so no direct call can overtake it.
- Revoking is one atomic write (`on` off); after it every new call goes the normal
  way, and the script returns the highest seq handed out under the lease and the
  calls handed out whose completion is not recorded yet. The scheduler dispatches
  nothing of the job, and nothing else to that worker, until those completed, were
  seen as lost (their worker died) or were requeued by it (their worker idle past the
  grace): numbers it gives later are above every direct one, and its dispatches
  follow the direct ones on the worker's topic.
- The ledger's high-water mark (`verdict`) answers any call delivered twice (an
  outbox published again, a requeued call whose direct copy arrives late) from its
  stored result; unnumbered calls (NOOP) are pure and their first record wins.

Redis keys (no TTL; a job's record is small and outlives its leases):
`<cluster>:direct:<job>` a hash: `id` (the last lease number given), `on` ("1" while
live), `worker`, `epoch`, `until` (milliseconds, Redis's clock), `high` (the highest
seq handed out under the lease); `<cluster>:direct:<job>:calls` a hash: request id →
the outbox element of each call handed out under a lease, until its completion is
recorded (then trimmed by the scheduler's renewals and revocations).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
import redis.asyncio as aioredis

from plexrl.lease import FENCE_CHECK, Fence
from plexrl.messages import Function, PhaseRequest, decode

LEASED = frozenset(
    {
        Function.FORWARD,
        Function.FORWARD_BACKWARD,
        Function.OPTIM_STEP,
        Function.SAVE,
        Function.LOAD,
        Function.NOOP,
    }
)
"""Calls that go direct while their job holds a lease. CREATE comes before any lease;
UNLOAD ends the job and goes through the scheduler (it ends the lease); SAMPLE calls
go through the scheduler, which co-batches them across calls and jobs."""

DISPATCH_PREFIX = "direct:"
"""Dispatch ids of direct calls start with this (then the lease number and the request
id): the worker copies the id into the completion, by which the scheduler knows it."""

_ROUTE_MARK = b"D"
_SEP = b"\x00"


@dataclass(frozen=True)
class Route:
    """Where an accepted call goes instead of `plexrl.requests`."""

    worker_id: str
    epoch: int
    lease_id: int
    seq: int
    """Its number in the job's ledger (0: an unnumbered call)."""


class OutboxEntry(msgspec.Struct, frozen=True):
    """A phase request accepted but maybe not yet acknowledged by Kafka (an element of a
    job's outbox in Redis, `plexrl_gateway.outbox`)."""

    request: PhaseRequest
    queued_at: float
    """Wall-clock seconds when it was accepted."""


def read_element(raw: bytes) -> tuple[Route | None, OutboxEntry]:
    """An outbox element as the acceptance script wrote it: its route (None for the
    normal path) and its entry. Raises `MessageError` on bytes that are neither.

    A routed element is `D<worker>\\0<epoch>\\0<lease>\\0<seq>\\0<entry>`; an entry is a
    msgpack map (its first byte 0x80-0x8f or 0xde-0xdf), never "D"."""
    route = None
    if raw.startswith(_ROUTE_MARK):
        worker, epoch, lease, seq, raw = raw[1:].split(_SEP, 4)
        route = Route(worker.decode(), int(epoch), int(lease), int(seq))
    return route, decode(raw, OutboxEntry)


def dispatch_id(lease_id: int, request_id: str) -> str:
    return f"{DISPATCH_PREFIX}{lease_id}:{request_id}"


def lease_of(dispatch_id: str) -> int | None:
    """The lease number a direct call's dispatch id names (None: not a direct call)."""
    if not dispatch_id.startswith(DISPATCH_PREFIX):
        return None
    number, _, _ = dispatch_id[len(DISPATCH_PREFIX) :].partition(":")
    return int(number) if number.isdigit() else None


# The acceptance's part, inlined by the gateway's acceptance script (one Lua call).
# Needs: KEYS[ledger_head], KEYS[ledger_ids], KEYS[direct], KEYS[direct_calls] as the
# locals `head`, `ids`, `lease`, `calls`. `lease_live()` reads the lease once per
# acceptance; `route(rid, numbered, entry)` numbers a call and returns its element;
# `wait(numbered)` counts a normal-path sequenced call and ends a live lease.
ACCEPT_LUA = """
local function lease_live()
  local l = redis.call('HMGET', lease, 'on', 'until', 'epoch', 'worker', 'id')
  if l[1] ~= '1' then return nil end
  local t = redis.call('TIME')
  if tonumber(l[2]) <= tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) then
    return nil
  end
  local h = redis.call('HMGET', head, 'epoch', 'waiting')
  if (h[1] or '0') ~= l[3] or tonumber(h[2] or '0') > 0 then return nil end
  return l
end
local function route(l, rid, numbered, entry)
  local seq = 0
  if numbered then
    seq = redis.call('HINCRBY', head, 'next', 1)
    redis.call('HSET', ids, rid, seq)
    redis.call('HSET', lease, 'high', seq)
  end
  local element = 'D' .. l[4] .. '\\0' .. l[3] .. '\\0' .. l[5] .. '\\0' .. seq .. '\\0' .. entry
  redis.call('HSET', calls, rid, element)
  return element
end
local function wait(numbered)
  if numbered then
    redis.call('HINCRBY', head, 'waiting', 1)
    redis.call('HSET', lease, 'on', '0')
  end
end
"""

# KEYS: ledger head, direct, the scheduler lease's token key. ARGV: worker, epoch, ttl
# ms, the granting scheduler's token ('' for none). Returns {lease id, until ms} or
# {0, why}; a deposed scheduler grants nothing.
_GRANT = (
    FENCE_CHECK
    + """
if fenced_by(KEYS[3], ARGV[4]) then return {0, 'fenced'} end
local h = redis.call('HMGET', KEYS[1], 'epoch', 'owner', 'next', 'applied', 'waiting')
if tonumber(h[1] or '0') ~= tonumber(ARGV[2]) or (h[2] or '') ~= ARGV[1] then
  return {0, 'epoch'}
end
if tonumber(h[3] or '0') ~= tonumber(h[4] or '0') then return {0, 'unapplied'} end
if tonumber(h[5] or '0') > 0 then return {0, 'waiting'} end
if redis.call('HGET', KEYS[2], 'on') == '1' then return {0, 'held'} end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local id = redis.call('HINCRBY', KEYS[2], 'id', 1)
local until_ms = now + tonumber(ARGV[3])
redis.call('HSET', KEYS[2], 'on', '1', 'worker', ARGV[1], 'epoch', ARGV[2],
  'until', until_ms, 'high', h[3] or '0')
return {id, until_ms}
"""
)

# Trims the calls whose completion is recorded (KEYS calls; ARGV[n] the done-key prefix).
_TRIM = """
local function trim(calls, prefix)
  local left = {}
  for _, rid in ipairs(redis.call('HKEYS', calls)) do
    if redis.call('EXISTS', prefix .. rid) == 1 then
      redis.call('HDEL', calls, rid)
    else
      left[#left + 1] = rid
    end
  end
  return left
end
"""

# KEYS: direct, calls, the scheduler lease's token key. ARGV: lease id, ttl ms, done-key
# prefix, the renewing scheduler's token. Returns 1 if it still holds (until moved on),
# 0 if it lapsed, was revoked or ended by a waiting call, or its renewer was deposed.
_RENEW = (
    _TRIM
    + FENCE_CHECK
    + """
if fenced_by(KEYS[3], ARGV[4]) then return 0 end
local l = redis.call('HMGET', KEYS[1], 'on', 'id', 'until')
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
trim(KEYS[2], ARGV[3])
if l[1] ~= '1' or l[2] ~= ARGV[1] or tonumber(l[3]) <= now then return 0 end
redis.call('HSET', KEYS[1], 'until', now + tonumber(ARGV[2]))
return 1
"""
)

# KEYS: direct, calls. ARGV: done-key prefix. Ends the job's lease (whichever it is);
# returns {lease id, high, rid, element, rid, element, ...}: the calls handed out under
# any lease whose completion is not recorded.
_REVOKE = (
    _TRIM
    + """
local l = redis.call('HMGET', KEYS[1], 'id', 'high')
redis.call('HSET', KEYS[1], 'on', '0')
local out = {tonumber(l[1] or '0'), tonumber(l[2] or '0')}
for _, rid in ipairs(trim(KEYS[2], ARGV[1])) do
  out[#out + 1] = rid
  out[#out + 1] = redis.call('HGET', KEYS[2], rid)
end
return out
"""
)


@dataclass(frozen=True)
class Granted:
    lease_id: int
    until_ms: int
    """When it lapses unless renewed (Redis's clock)."""


@dataclass(frozen=True)
class Revoked:
    """What a revocation found: the lease's number, the highest seq handed out under it,
    and the calls handed out (under it or an earlier one) not recorded as completed."""

    lease_id: int
    high: int
    outstanding: dict[str, bytes]
    """Request id → its outbox element (`read_element` reads it)."""


class DirectLeases:
    """The Redis side of direct leases (the scheduler's; gateways only read them, in
    their acceptance script)."""

    def __init__(self, redis: aioredis.Redis, cluster_id: str, fence: Fence | None = None) -> None:
        """`fence`: the leading scheduler's term; once a newer term began, this one's
        grants and renewals are refused (its revocations stand: they only end a lease)."""
        self._redis = redis
        self._p = cluster_id
        self._fence_key = fence.token_key if fence else f"{cluster_id}:unfenced"
        self._fence_arg = fence.arg if fence else ""
        self._grant = redis.register_script(_GRANT)
        self._renew = redis.register_script(_RENEW)
        self._revoke = redis.register_script(_REVOKE)

    def key(self, job_id: str) -> str:
        return f"{self._p}:direct:{job_id}"

    def calls_key(self, job_id: str) -> str:
        return f"{self._p}:direct:{job_id}:calls"

    @property
    def _done_prefix(self) -> str:
        # The worker's completion record (`CallStore.record_completion`), written before
        # the completion is published: recorded means the call is answered for good.
        return f"{self._p}:done:"

    async def grant(self, job_id: str, worker_id: str, epoch: int, ttl_s: float) -> Granted | str:
        """A lease on `job_id` for its home `worker_id` under `epoch`; or why not: the
        epoch moved on (`epoch`), numbered calls have not all applied (`unapplied`), a
        sequenced call waits unnumbered (`waiting`), a lease stands (`held`), this
        scheduler was deposed (`fenced`)."""
        reply: Any = await self._grant(
            keys=[f"{self._p}:ledger:{job_id}", self.key(job_id), self._fence_key],
            args=[worker_id, epoch, max(1, round(ttl_s * 1000)), self._fence_arg],
        )
        if int(reply[0]) == 0:
            return _text(reply[1])
        return Granted(int(reply[0]), int(reply[1]))

    async def renew(self, leases: dict[str, int], ttl_s: float) -> dict[str, bool]:
        """Extend each job's lease (job → lease id) by `ttl_s` from now, in one round
        trip; job → whether it still held (False: it lapsed or was ended)."""
        if not leases:
            return {}
        ttl_ms = max(1, round(ttl_s * 1000))
        async with self._redis.pipeline(transaction=False) as pipe:
            for job_id, lease_id in leases.items():
                await self._renew(
                    keys=[self.key(job_id), self.calls_key(job_id), self._fence_key],
                    args=[lease_id, ttl_ms, self._done_prefix, self._fence_arg],
                    client=pipe,
                )
            replies = await pipe.execute()
        return {job: bool(int(r)) for job, r in zip(leases, replies, strict=True)}

    async def revoke(self, job_id: str) -> Revoked:
        """End the job's lease (one atomic write: every call accepted after it goes the
        normal way) and read what was handed out under it and is not answered yet."""
        reply: Any = await self._revoke(
            keys=[self.key(job_id), self.calls_key(job_id)], args=[self._done_prefix]
        )
        rest = reply[2:]
        outstanding = {_text(rest[i]): _bytes(rest[i + 1]) for i in range(0, len(rest), 2)}
        return Revoked(int(reply[0]), int(reply[1]), outstanding)

    async def recorded(self, job_ids: list[str]) -> dict[str, tuple[bool, str]]:
        """For each job with a lease record: whether it is marked live, and its worker
        (what a restarted scheduler must revoke and drain before dispatching)."""
        if not job_ids:
            return {}
        async with self._redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hmget(self.key(job_id), "on", "worker")
                pipe.hlen(self.calls_key(job_id))
            replies = await pipe.execute()
        out = {}
        for i, job_id in enumerate(job_ids):
            on, worker = replies[2 * i]
            if on is not None or replies[2 * i + 1]:
                out[job_id] = (_text(on or b"0") == "1", _text(worker or b""))
        return out


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)
