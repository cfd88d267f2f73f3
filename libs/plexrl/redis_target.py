"""Where the services' Redis is, and how long a write waits for its replicas.

On one machine Redis is one URL (`PLEXRL_REDIS_URL`). Across hosts it is a primary and
its replicas watched by Sentinels (`PLEXRL_REDIS_SENTINELS`, `PLEXRL_REDIS_SENTINEL_MASTER`):
every new connection asks the Sentinels which server is the primary now, so after a
failover the clients reconnect to the promoted replica by themselves (a connection to a
demoted primary fails its first write with READONLY and is reopened).

Replication is asynchronous: a write the primary acknowledged can be lost if it dies
before its replica copied it. `ReplicaWait` (Redis `WAIT`) holds the moments where a
write becomes visible outside Redis, so that what a client or another service was told
survives a failover; docs/deploy.md lists which writes wait and why the others need not.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, unquote, urlparse

import redis
import redis.asyncio as aioredis
import redis.exceptions
from prometheus_client import Counter
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import MasterNotFoundError, Sentinel
from redis.backoff import ExponentialWithJitterBackoff, NoBackoff
from redis.retry import Retry as SyncRetry
from redis.sentinel import Sentinel as SyncSentinel

from plexrl.retry import retrieved

if TYPE_CHECKING:
    from plexrl.settings import CommonSettings

log = logging.getLogger(__name__)

UNREPLICATED = Counter(
    "plexrl_redis_unreplicated_writes_total",
    "Writes that waited for Redis replicas (WAIT) and were acknowledged by fewer than asked",
)

_RETRIED = [redis.exceptions.ConnectionError, redis.exceptions.TimeoutError]


def newest_primary(
    states: list[Any], check: Callable[[dict[str, Any], str], bool], master: str
) -> tuple[str, int]:
    """Of what Sentinels answered (each its `SENTINEL MASTERS` state of `master`, or an
    error), the primary of the newest failover (the highest config epoch). A Sentinel
    that was cut off from the others still names the primary it knew: the first answer
    alone could send a client to a demoted primary that has not been told yet, whose
    reads are stale and whose writes are dropped when it resyncs. A majority of the
    Sentinels always includes one that took part in the newest failover."""
    best: dict[str, Any] | None = None
    for state in states:
        if not isinstance(state, dict) or not check(state, master):
            continue
        if best is None or int(state.get("config-epoch", 0)) > int(best.get("config-epoch", 0)):
            best = state
    if best is None:
        raise MasterNotFoundError(f"no Sentinel names a primary for {master!r}: {states}")
    return str(best["ip"]), int(best["port"])


def _majority(sentinels: list[Any]) -> int:
    return len(sentinels) // 2 + 1


class NewestSentinel(Sentinel):
    """Asks every Sentinel at once and, once a majority answered, follows the newest
    failover among their answers (`newest_primary`)."""

    async def discover_master(self, service_name: str) -> tuple[str, int]:
        async def ask(sentinel: Any) -> Any:
            masters = await sentinel.sentinel_masters()
            return masters.get(service_name)

        asks = [asyncio.ensure_future(ask(s)) for s in self.sentinels]
        states: list[Any] = []
        try:
            for answer in asyncio.as_completed(asks):
                try:
                    states.append(await answer)
                except (redis.exceptions.RedisError, OSError) as exc:
                    states.append(exc)
                    continue
                if sum(isinstance(x, dict) for x in states) >= _majority(self.sentinels):
                    break
        finally:
            for pending in asks:
                pending.cancel()
        return newest_primary(states, self.check_master_state, service_name)


class NewestSyncSentinel(SyncSentinel):
    """The blocking client's `NewestSentinel`: Sentinels asked in turn until a majority
    answered, those that answered asked first next time."""

    def discover_master(self, service_name: str) -> tuple[str, int]:
        states: list[Any] = []
        answered: list[Any] = []
        for sentinel in list(self.sentinels):
            try:
                masters: Any = sentinel.sentinel_masters()
            except (redis.exceptions.RedisError, OSError) as exc:
                states.append(exc)
                continue
            states.append(masters.get(service_name))
            answered.append(sentinel)
            if len(answered) >= _majority(self.sentinels):
                break
        self.sentinels = answered + [s for s in self.sentinels if s not in answered]
        return newest_primary(states, self.check_master_state, service_name)


@dataclass(frozen=True)
class RedisTarget:
    """One Redis, or the primary a set of Sentinels names; how clients talk to it."""

    url: str = "redis://127.0.0.1:6379/0"
    """The server (without Sentinels); with them, only its database number, user,
    password and scheme (`rediss://` for TLS) count."""
    sentinels: tuple[tuple[str, int], ...] = ()
    """Sentinels to ask for the primary; empty: `url` is the server."""
    master: str = "plexrl"
    """The name the Sentinels monitor the primary under."""
    wait_replicas: int = 0
    """Replicas a write that must survive a failover waits for (0: none, one machine)."""
    wait_timeout_ms: int = 1000
    """Longest such a write waits for them; past it the write is not confirmed
    (`ReplicaLagError`, counted in plexrl_redis_unreplicated_writes_total and logged)."""
    socket_timeout_s: float | None = 10.0
    """A command unanswered this long fails (and is retried on a new connection): a
    primary whose host vanished is given up on instead of waited for forever."""
    connect_timeout_s: float = 2.0
    """Opening a connection (to Redis or a Sentinel) fails after this long."""

    @classmethod
    def from_settings(cls, settings: CommonSettings) -> RedisTarget:
        return cls(
            url=settings.redis_url,
            sentinels=settings.sentinel_nodes(),
            master=settings.redis_sentinel_master,
            wait_replicas=settings.redis_wait_replicas,
            wait_timeout_ms=settings.redis_wait_timeout_ms,
            socket_timeout_s=settings.redis_socket_timeout_s or None,
            connect_timeout_s=settings.redis_connect_timeout_s,
        )

    def describe(self) -> str:
        """Where it is, for messages."""
        if not self.sentinels:
            return self.url
        nodes = ",".join(f"{h}:{p}" for h, p in self.sentinels)
        return f"primary {self.master!r} of Sentinels {nodes}"

    @property
    def _retries(self) -> int:
        """Attempts of one command on a new connection. One Redis restarting (loading its
        append-only file) is waited out in place; with Sentinels a connection that fails
        is more likely a primary gone, and each attempt's wait is a timeout: fewer, and
        the caller's own retry asks the Sentinels afresh."""
        return 3 if self.sentinels else 8

    def _common(self) -> dict[str, Any]:
        return {
            "socket_timeout": self.socket_timeout_s,
            "socket_connect_timeout": self.connect_timeout_s,
            "socket_keepalive": True,
        }

    def _sentinel_kwargs(self, sync: bool) -> dict[str, Any]:
        """How a Sentinel is asked: once, no retry. A Sentinel that does not answer is
        skipped for the next (redis-py asks them in turn, the last that answered first);
        retrying a dead one would hold every new connection for its timeouts."""
        retry = SyncRetry(NoBackoff(), 0) if sync else Retry(NoBackoff(), 0)
        return {**self._common(), "retry": retry}

    def _server_kwargs(self) -> dict[str, Any]:
        """Database, credentials and TLS from the URL (for a Sentinel-found primary)."""
        parsed = urlparse(self.url)
        db = parsed.path.strip("/") or "0"
        if not db.isdigit():
            raise ValueError(
                f"PLEXRL_REDIS_URL {self.url!r} names database {db!r}; use a number "
                "(redis://host:6379/0)"
            )
        kwargs: dict[str, Any] = {"db": int(db)}
        if parsed.username:
            kwargs["username"] = unquote(parsed.username)
        if parsed.password:
            kwargs["password"] = unquote(parsed.password)
        if parsed.scheme == "rediss":
            kwargs["ssl"] = True
            # The TLS options a plain URL carries as query parameters (redis-py's names:
            # ssl_ca_certs, ssl_certfile, ssl_keyfile, ssl_cert_reqs, ...).
            for name, values in parse_qs(parsed.query).items():
                if name.startswith("ssl_") and values:
                    value: Any = unquote(values[0])
                    if name == "ssl_check_hostname":
                        value = value.lower() in ("1", "true", "yes")
                    kwargs[name] = value
        return kwargs

    def connect(self) -> aioredis.Redis:
        """An asyncio client. A pooled connection that died with its server (a restart,
        a failover) is reopened and the command sent again, with backoff while Redis
        loads its append-only file or the Sentinels promote a replica; without this, the
        first command on each stale connection would fail."""
        retry = Retry(ExponentialWithJitterBackoff(base=0.05, cap=1.0), retries=self._retries)
        options = {**self._common(), "retry": retry, "retry_on_error": list(_RETRIED)}
        if not self.sentinels:
            return aioredis.Redis.from_url(self.url, **options)
        sentinel = NewestSentinel(
            list(self.sentinels), sentinel_kwargs=self._sentinel_kwargs(False)
        )
        client: aioredis.Redis = sentinel.master_for(
            self.master, redis_class=aioredis.Redis, **options, **self._server_kwargs()
        )
        return client

    def connect_sync(self) -> redis.Redis:
        """A blocking client (tools and tests), found the same way."""
        retry = SyncRetry(ExponentialWithJitterBackoff(base=0.05, cap=1.0), retries=self._retries)
        options = {**self._common(), "retry": retry, "retry_on_error": list(_RETRIED)}
        if not self.sentinels:
            return redis.Redis.from_url(self.url, **options)
        sentinel = NewestSyncSentinel(
            list(self.sentinels), sentinel_kwargs=self._sentinel_kwargs(True)
        )
        client: redis.Redis = sentinel.master_for(
            self.master, redis_class=redis.Redis, **options, **self._server_kwargs()
        )
        return client


class ReplicaLagError(redis.exceptions.ConnectionError):
    """No replica confirmed a write that must survive a failover: the primary may be cut
    off from its replicas (and about to be replaced), so the write is not confirmed to
    anyone. Transient: the caller retries, on the promoted primary if it was replaced."""


class ReplicaWait:
    """Waits until the replicas hold every write this process made so far (`WAIT`).

    `WAIT` counts the replicas that acknowledged the connection's own last write, and
    the pool hands out any connection: so the wait first writes a mark (one `INCR` on the
    cluster's `replicated` key) on the connection it then waits on. Replication is one
    ordered stream, so the replicas holding the mark hold everything written before it,
    by any client.

    With fewer replicas than asked after `timeout_ms`, it raises `ReplicaLagError`: a
    primary that reaches no replica may be one the Sentinels are replacing (its host cut
    off), and what it alone holds is lost when it rejoins as a replica. Then, for
    `recheck_s`, waits only look (a few milliseconds) before raising, until a replica is
    back. Run two replicas (a write waits for one): one host lost then stops nothing.

    Concurrent callers share a wait (group commit): one `INCR` + `WAIT` is in flight at a
    time, and every caller that arrives meanwhile is answered by the next one, which
    starts once it ends, so it follows their writes. Under load a wait costs one round
    trip per round, not per caller.
    """

    def __init__(
        self,
        redis_client: aioredis.Redis,
        mark_key: str,
        replicas: int,
        timeout_ms: int,
        recheck_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._redis = redis_client
        self._mark_key = mark_key
        self._replicas = replicas
        self._timeout_ms = timeout_ms
        self._recheck_s = recheck_s
        self._clock = clock
        self._short_until = 0.0
        self._next: asyncio.Future[int] | None = None
        """The round callers arriving now share; it starts once the one in flight ends."""
        self._rounds: asyncio.Task[None] | None = None
        self.waits = 0
        """Rounds sent (`INCR` + `WAIT`)."""
        self.short = 0

    @property
    def replicas(self) -> int:
        return self._replicas

    async def __call__(self) -> int:
        """The replicas that hold this process's writes now (`replicas` asked; 0 asked:
        nothing is waited for and 0 is returned at once). Raises `ReplicaLagError` when
        fewer than asked hold them."""
        if self._replicas <= 0:
            return 0
        loop = asyncio.get_running_loop()
        if self._next is None or self._next.get_loop() is not loop:
            self._next = loop.create_future()
            self._next.add_done_callback(retrieved)  # its callers may all be cancelled
        shared = self._next
        if self._rounds is None or self._rounds.done() or self._rounds.get_loop() is not loop:
            self._rounds = loop.create_task(self._run_rounds())
        # A caller cancelled leaves the round to the others.
        return await asyncio.shield(shared)

    async def _run_rounds(self) -> None:
        """Send rounds while callers wait for one; each answers those that arrived before
        it started."""
        while self._next is not None:
            round_, self._next = self._next, None
            try:
                round_.set_result(await self._round())
            except asyncio.CancelledError:  # the loop is ending: so are its callers
                round_.cancel()
                if self._next is not None:
                    self._next.cancel()
                    self._next = None
                raise
            except Exception as exc:  # every caller of the round gets it
                round_.set_exception(exc)

    async def _round(self) -> int:
        degraded = self._clock() < self._short_until
        timeout = 10 if degraded else self._timeout_ms
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.incr(self._mark_key)
            pipe.execute_command("WAIT", self._replicas, timeout)
            _, acked = await pipe.execute()
        acked = int(acked)
        self.waits += 1
        if acked >= self._replicas:
            if degraded:
                log.info("Redis replicas acknowledge writes again (%d)", acked)
            self._short_until = 0.0
            return acked
        UNREPLICATED.inc()
        self.short += 1
        if not degraded:
            log.warning(
                "a write waited %d ms for %d Redis replica(s) and got %d: not confirmed "
                "(the primary may be cut off and replaced); the caller retries; checking "
                "again for %.0fs",
                timeout,
                self._replicas,
                acked,
                self._recheck_s,
            )
        self._short_until = self._clock() + self._recheck_s
        raise ReplicaLagError(
            f"{acked} of {self._replicas} Redis replica(s) hold the write after {timeout} ms"
        )
