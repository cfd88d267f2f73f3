"""A lease in Redis that one process of a kind holds at a time, with fencing tokens.

Several schedulers run, one leading; several state-stores run, one sweeping. Each
takes the lease named for its kind (`<cluster>:lease:<name>`, a hash of holder, token
and what the holder advertises, with a time to live) while nobody holds it, renews it
well within its life, and leads only while it holds it. Taking it increments the
kind's token (`<cluster>:lease:<name>:token`), so every term has a token higher than
any before it.

A leader that stops renewing (killed, cut off from Redis, paused) loses the lease once
its time to live passes, and another takes it. The old one stops acting by then on its
own clock (it counts the lease's life from before it sent its last renewal, so it gives
up no later than Redis would), but what it sent before that may still land later (a
write held in a TCP buffer during a partition, a Kafka message retried): so each of
its writes that matters carries its token, and Redis refuses those whose token is not
the kind's latest (`Fence.check` in a Lua script; `fenced_by` below). That is what
makes a deposed leader harmless, not the timing.

Why Redis rather than Kafka's group coordination: the writes to fence are Redis writes
(the ledger's call numbers and epochs), and a token checked inside the same Lua script
as the write is atomic with it; a Kafka group generation fences only that group's
offset commits. docs/deploy.md has the handover bounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

log = logging.getLogger(__name__)

SCHEDULER = "scheduler"
"""The lease the leading scheduler holds."""
SEEK_TIMEOUT_S = 5.0
"""Longest one attempt to take a lease may take before it is given up and made again."""
STATE_STORE = "state-store"
"""The lease of the state-store replica that runs the background rounds."""


def lease_key(cluster_key: Callable[..., str], name: str) -> str:
    """A lease's Redis key (`RedisKeys.key` as `cluster_key`); its token is at `:token`."""
    return cluster_key("lease", name)


@dataclass(frozen=True)
class LeaseConfig:
    """How long a lease lasts and how often it is renewed and sought."""

    ttl_s: float = 4.0
    """The lease's life without a renewal: a dead or cut-off holder is replaced after at
    most this (plus `retry_s`). Lower hands over sooner; too low, and a holder slowed
    down by a loaded machine loses the lease while still alive (harmless, but a change
    of leader costs a restart of its work)."""
    renew_s: float = 1.0
    """Between renewals; a few fit in `ttl_s`, so one lost round trip changes nothing."""
    retry_s: float = 0.5
    """Between attempts to take the lease while another holds it."""
    margin_s: float = 0.5
    """A holder stops leading this long before its lease could run out in Redis."""

    def __post_init__(self) -> None:
        if not 0 < self.renew_s < self.ttl_s - self.margin_s:
            raise ValueError(
                f"a lease of {self.ttl_s}s renewed every {self.renew_s}s with a margin of "
                f"{self.margin_s}s would run out between renewals: renew_s must be positive "
                "and below ttl_s - margin_s"
            )
        if self.retry_s <= 0 or self.margin_s < 0:
            raise ValueError("retry_s must be positive and margin_s not negative")


@dataclass(frozen=True)
class Term:
    """One holding of the lease."""

    token: int
    """Higher than every earlier term's; the fence of this holder's writes."""
    holder: str
    sought_at: float = 0.0
    """The holder's clock before it sent the command that took the lease (the lease's
    life in Redis started later)."""


@dataclass(frozen=True)
class Holder:
    """Who holds a lease, as Redis says now."""

    holder: str
    token: int
    advertised: str
    """What the holder tells others (a scheduler: its status URL)."""


# KEYS: lease, token. ARGV: holder, ttl ms, advertised. Returns the new token, or 0.
_ACQUIRE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local token = redis.call('INCR', KEYS[2])
redis.call('HSET', KEYS[1], 'holder', ARGV[1], 'token', token, 'advertised', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return token
"""

# KEYS: lease. ARGV: holder, token, ttl ms. Returns 1 if renewed, 0 if not ours any more.
_RENEW = """
local cur = redis.call('HMGET', KEYS[1], 'holder', 'token')
if cur[1] ~= ARGV[1] or cur[2] ~= ARGV[2] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""

# KEYS: lease. ARGV: holder, token.
_RELEASE = """
local cur = redis.call('HMGET', KEYS[1], 'holder', 'token')
if cur[1] == ARGV[1] and cur[2] == ARGV[2] then redis.call('DEL', KEYS[1]) end
return 1
"""

FENCE_CHECK = """
local function fenced_by(token_key, token)
  if token == '' then return false end
  local latest = redis.call('GET', token_key)
  return latest ~= token
end
"""
"""Lua to prepend to a script whose writes a lease fences: `fenced_by(KEYS[i], ARGV[j])`
is true when the token passed is not the kind's latest (a newer holder took over);
an empty token is not fenced (no lease in use: one machine, or a test)."""


@dataclass(frozen=True)
class Fence:
    """The token a term's writes carry, and the key it is checked against."""

    token_key: str
    token: int

    @property
    def arg(self) -> str:
        return str(self.token)


class FencedError(RuntimeError):
    """A write carried a token that is no longer the lease's latest: its writer was
    deposed and another holds the lease now."""


class Lease:
    """The named lease of one cluster, taken and held by one process (`holder`)."""

    def __init__(
        self,
        redis: aioredis.Redis,
        key: str,
        holder: str,
        advertised: str = "",
        config: LeaseConfig | None = None,
        replicated: Callable[[], Awaitable[object]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`key`: the lease's Redis key (`RedisKeys.key("lease", name)`); `replicated`:
        waits for Redis's replicas (a token lost in a failover could be handed out
        twice)."""
        self._redis = redis
        self.key = key
        self.token_key = f"{key}:token"
        self.holder = holder
        self._advertised = advertised
        self.config = config or LeaseConfig()
        self._replicated = replicated
        self._clock = clock
        self._acquire = redis.register_script(_ACQUIRE)
        self._renew = redis.register_script(_RENEW)
        self._release = redis.register_script(_RELEASE)

    def fence(self, term: Term) -> Fence:
        return Fence(self.token_key, term.token)

    async def try_acquire(self) -> Term | None:
        """Take the lease if nobody holds it."""
        ttl_ms = int(self.config.ttl_s * 1000)
        sought_at = self._clock()
        token: Any = await self._acquire(
            keys=[self.key, self.token_key], args=[self.holder, ttl_ms, self._advertised]
        )
        if not int(token):
            return None
        if self._replicated is not None:
            await self._replicated()
        return Term(int(token), self.holder, sought_at)

    async def renew(self, term: Term) -> bool:
        """Extend the lease's life; False when it is not this term's any more. Raises
        (a failed renewal) when no Redis replica confirms it: a holder cut off with its
        Redis primary would otherwise renew on that primary, go on leading its side of
        the partition, and never step down."""
        ttl_ms = int(self.config.ttl_s * 1000)
        done: Any = await self._renew(keys=[self.key], args=[term.holder, term.token, ttl_ms])
        if int(done) and self._replicated is not None:
            await self._replicated()
        return bool(int(done))

    async def release(self, term: Term) -> None:
        """Give the lease up (a clean shutdown): another takes it at its next attempt."""
        await self._release(keys=[self.key], args=[term.holder, term.token])

    async def current(self) -> Holder | None:
        return await holder_of(self._redis, self.key)


async def holder_of(redis: aioredis.Redis, key: str) -> Holder | None:
    """Who holds the lease at `key` now (None: nobody)."""
    raw: dict[Any, Any] = await redis.hgetall(key)
    fields = {_text(k): _text(v) for k, v in raw.items()}
    if "holder" not in fields:
        return None
    return Holder(fields["holder"], int(fields.get("token", 0)), fields.get("advertised", ""))


Lead = Callable[[Term, asyncio.Event], Coroutine[Any, Any, None]]
"""Does a leader's work until the event is set (the term ended, or the service stops)."""


class Leadership:
    """Seeks the lease, leads while holding it, steps down when it is lost.

    `run` waits as a standby until it takes the lease, then runs `lead(term, ended)`
    beside a renewal loop. The term ends when a renewal says the lease is another's, or
    when renewals fail (Redis unreachable) until the lease could have run out; `ended`
    is set, `lead` is given `step_down_s` to return (then cancelled), and the process is
    a standby again. On `stop` it ends the term and releases the lease, so a standby
    takes over at its next attempt instead of after the lease's life."""

    def __init__(
        self, lease: Lease, step_down_s: float = 10.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._lease = lease
        self._step_down_s = step_down_s
        self._clock = clock
        self.term: Term | None = None
        self.terms = 0
        self.seen: Holder | None = None
        """Who held the lease at this process's last attempt to take it."""

    @property
    def leading(self) -> bool:
        return self.term is not None

    async def run(self, stop: asyncio.Event, lead: Lead) -> None:
        while not stop.is_set():
            term = await self._seek(stop)
            if term is None:
                return
            self.term, self.terms = term, self.terms + 1
            log.info("%s leads with token %d", term.holder, term.token)
            try:
                await self._hold(term, stop, lead)
            finally:
                self.term = None

    async def _seek(self, stop: asyncio.Event) -> Term | None:
        while not stop.is_set():
            try:
                # Bounded: during a Redis failover a command can hang on the old primary
                # through all its retries; the next attempt asks the Sentinels afresh.
                term = await asyncio.wait_for(self._lease.try_acquire(), SEEK_TIMEOUT_S)
                if term is None:
                    self.seen = await asyncio.wait_for(self._lease.current(), SEEK_TIMEOUT_S)
            except Exception as exc:  # Redis away: a standby just keeps asking
                log.debug("seeking lease %s failed: %r", self._lease.key, exc)
                term = None
            if term is not None:
                return term
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self._lease.config.retry_s)
        return None

    async def _hold(self, term: Term, stop: asyncio.Event, lead: Lead) -> None:
        ended = asyncio.Event()
        leading = asyncio.create_task(lead(term, ended))
        lost = ""
        try:
            lost = await self._renew_while(term, stop, leading)
        finally:
            ended.set()
            if lost:
                log.warning("%s steps down (token %d): %s", term.holder, term.token, lost)
            await self._step_down(leading)
            if not lost:  # stopping, or the work ended by itself: let a standby in now
                with contextlib.suppress(Exception):
                    await self._lease.release(term)

    async def _renew_while(
        self, term: Term, stop: asyncio.Event, leading: asyncio.Task[None]
    ) -> str:
        """Renew until `stop` or the work ends (returns ''), or until the lease is lost
        (returns why)."""
        config = self._lease.config
        # Counted from before the acquiring command was sent: Redis started the lease's
        # life later than that, so this deadline comes first.
        valid_until = term.sought_at + config.ttl_s - config.margin_s
        while True:
            wait = max(0.0, min(config.renew_s, valid_until - self._clock()))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), wait)
            if stop.is_set() or leading.done():
                return ""
            sent = self._clock()
            try:
                renewed = await asyncio.wait_for(
                    self._lease.renew(term), max(0.1, valid_until - sent)
                )
            except Exception as exc:  # Redis away: hold on until the lease may lapse
                if self._clock() >= valid_until:
                    return f"renewals failed until the lease may have lapsed ({exc!r})"
                continue
            if not renewed:
                return "the lease is another's now"
            valid_until = sent + config.ttl_s - config.margin_s

    async def _step_down(self, leading: asyncio.Task[None]) -> None:
        """Wait for the leader's work to return; whatever it ended with (an error, its own
        cancellation), this process stays and seeks the lease again. Only a cancellation
        of this process's own task goes on up."""
        try:
            await asyncio.wait_for(asyncio.shield(leading), self._step_down_s)
        except TimeoutError:
            leading.cancel()
            with contextlib.suppress(BaseException):
                await leading
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise
            log.warning("the leader's work ended cancelled")
        except Exception:
            log.exception("the leader's work failed")


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
