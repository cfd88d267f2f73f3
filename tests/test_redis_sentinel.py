"""Redis through Sentinel: the services find the primary by asking three Sentinels,
follow a failover to a replica by themselves, a write that waited for a replica (Redis
WAIT) survives the primary's death, and a primary that reaches no replica confirms
nothing.

A primary, two replicas and three Sentinels of the module's own (scripts/infra.sh on
free loopback ports, Debian's redis-sentinel), never the shared Redis. The Sentinels
call a primary down after one second of silence.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from gateway_support import answered_when_recorded, noop_completion, start_waiting
from redis import exceptions as redis_exceptions
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from plexrl.redis_target import UNREPLICATED, RedisTarget, ReplicaLagError, ReplicaWait
from plexrl.settings import CommonSettings, parse_sentinels
from plexrl.stores import Stores
from plexrl_gateway.futures import FutureWaiter
from plexrl_gateway.notices import CompletionNotices
from plexrl_gateway.replicas import WaitForReplicas
from plexrl_tools.private_infra import RedisGroup


def test_sentinels_are_parsed_and_a_bad_entry_is_named() -> None:
    assert parse_sentinels(" 10.0.0.1:26379,10.0.0.2:26380 ") == (
        ("10.0.0.1", 26379),
        ("10.0.0.2", 26380),
    )
    with pytest.raises(ValueError, match=r"'10\.0\.0\.3' is not host:port"):
        parse_sentinels("10.0.0.1:26379,10.0.0.3")
    with pytest.raises(ValueError, match="PLEXRL_REDIS_SENTINELS"):
        CommonSettings(redis_sentinels="nowhere:port")


def test_without_sentinels_the_url_is_the_server_and_nothing_is_waited_for() -> None:
    target = RedisTarget.from_settings(CommonSettings(redis_url="redis://10.0.0.9:6400/3"))
    assert target.sentinels == () and target.describe() == "redis://10.0.0.9:6400/3"
    assert target.wait_replicas == 0


def test_a_request_that_may_write_is_answered_once_the_replicas_hold_it() -> None:
    waited: list[str] = []

    async def replicated() -> int:
        waited.append("wait")
        return 1

    async def echo(request: Request) -> PlainTextResponse:
        return PlainTextResponse(request.method)

    app = Starlette(routes=[Route("/x", echo, methods=["GET", "POST", "DELETE"])])
    client = TestClient(WaitForReplicas(app, replicated))
    assert client.get("/x").text == "GET" and waited == []
    assert client.post("/x").text == "POST" and waited == ["wait"]
    assert client.delete("/x").status_code == 200 and waited == ["wait", "wait"]


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisGroup]:
    redis_group = RedisGroup(tmp_path_factory.mktemp("redis-group"), down_after_ms=1000)
    redis_group.up()
    try:
        yield redis_group
    finally:
        redis_group.down()


def _stores(group: RedisGroup, wait_timeout_ms: int = 1000) -> Stores:
    settings = CommonSettings(
        redis_sentinels=group.sentinels,
        redis_sentinel_master=group.MASTER,
        redis_wait_replicas=1,
        redis_wait_timeout_ms=wait_timeout_ms,
        redis_socket_timeout_s=3.0,
        cluster_id="sentinel",
    )
    return Stores.from_settings(settings)


@pytest.mark.integration
async def test_a_waited_write_survives_the_primary_killed_and_clients_follow_the_failover(
    group: RedisGroup, tmp_path: Path
) -> None:
    stores = _stores(group)
    redis = stores.keys.redis
    try:
        await redis.set("sentinel:before", "kept")
        assert await stores.keys.replicated() >= 1
        old = group.kill_primary()
        started = time.monotonic()
        # The same client writes again as soon as the Sentinels promoted a replica.
        while True:
            try:
                await redis.set("sentinel:after", "written")
                break
            except Exception:
                assert time.monotonic() - started < 30, "no primary within 30 s"
                await asyncio.sleep(0.2)
        assert group.primary() != old
        assert await redis.get("sentinel:before") == b"kept"
        # The Sentinels point the other replica at the promoted one: waits hold again.
        assert await _replicated_within(stores, 30.0) >= 1
        # The old primary comes back as a replica of the new one.
        group.revive(old)
        assert await redis.get("sentinel:after") == b"written"
    finally:
        await stores.close()


@pytest.mark.integration
async def test_completion_notices_wait_for_the_replicas_and_follow_a_failover(
    group: RedisGroup,
) -> None:
    """With a replica asked for, a completion is announced only after the wait (never in
    the same step as its record), and the gateway's listener, subscribed through the
    Sentinels, hears the new primary's notices after a failover."""
    stores = _stores(group)
    futures = FutureWaiter(stores.calls)
    notices = CompletionNotices(
        stores.keys.redis, stores.calls.completed_channel, futures, sweep_s=0.5, retry_s=0.2
    )
    stop = asyncio.Event()
    listening = asyncio.create_task(notices.run(stop))
    try:
        await asyncio.wait_for(notices.wait_subscribed(), 30)
        async with stores.calls.pipeline() as pipe:
            assert not stores.calls.queue_completion(pipe, noop_completion("n0"))
            await pipe.execute()
        assert await answered_when_recorded(stores.calls, futures, "n1", 10) is not None
        heard = notices.notices
        assert heard >= 1
        # A call waited on across the failover (its first read of Redis done before).
        waiter = await start_waiting(futures, "n2")
        await asyncio.sleep(0.1)
        old = group.kill_primary()
        started = time.monotonic()
        while True:  # the recorder retries until the Sentinels promoted a replica
            try:
                await stores.calls.record_completion(noop_completion("n2"))
                break
            except Exception:
                assert time.monotonic() - started < 30, "no primary within 30 s"
                await asyncio.sleep(0.2)
        done = await asyncio.wait_for(waiter, 30)
        assert done is not None and done.request_id == "n2"
        # Later completions are announced on the new primary and heard.
        assert await answered_when_recorded(stores.calls, futures, "n3", 2) is not None
        assert notices.notices > heard
        assert notices.health()["ok"]
        group.revive(old)  # back as a replica, for the module's next tests
    finally:
        stop.set()
        await asyncio.wait_for(listening, 30)
        await stores.close()


async def _replicated_within(stores: Stores, seconds: float) -> int:
    deadline = time.monotonic() + seconds
    while True:
        try:
            return await stores.keys.replicated()
        except ReplicaLagError:
            assert time.monotonic() < deadline, f"no replica confirmed a write in {seconds} s"
            await asyncio.sleep(0.3)


@pytest.mark.integration
async def test_a_primary_that_reaches_no_replica_confirms_nothing(group: RedisGroup) -> None:
    """What a primary cut off from its replicas holds alone is lost if the Sentinels
    replace it: such a write is not confirmed (the caller retries), and once a replica
    answers again, writes are confirmed again."""
    stores = _stores(group, wait_timeout_ms=300)
    paused = [pid for pid in (group.pid(p) for p in group.replicas()) if pid is not None]
    assert len(paused) == 2
    try:
        await _replicated_within(stores, 30.0)
        for pid in paused:
            os.kill(pid, signal.SIGSTOP)
        before = UNREPLICATED._value.get()
        with pytest.raises(ReplicaLagError, match="0 of 1 Redis replica"):
            await stores.keys.replicated()
        assert UNREPLICATED._value.get() == before + 1
        looked = time.monotonic()  # the next waits only look, and fail fast
        with pytest.raises(ReplicaLagError):
            await stores.keys.replicated()
        assert time.monotonic() - looked < 0.25
    finally:
        for pid in paused:
            os.kill(pid, signal.SIGCONT)
    try:
        assert await _replicated_within(stores, 30.0) >= 1
    finally:
        await stores.close()


def test_an_unconfirmed_request_is_answered_503_and_says_to_send_it_again() -> None:
    async def replicated() -> int:
        raise ReplicaLagError("0 of 1 Redis replica(s) hold the write after 1000 ms")

    async def echo(request: Request) -> PlainTextResponse:
        return PlainTextResponse(request.method)

    app = Starlette(routes=[Route("/x", echo, methods=["GET", "POST"])])
    client = TestClient(WaitForReplicas(app, replicated))
    assert client.get("/x").text == "GET"
    answer = client.post("/x")
    assert answer.status_code == 503
    assert answer.json()["category"] == "server"
    assert "send it again" in answer.json()["error"]


@pytest.mark.integration
def test_the_blocking_client_finds_the_same_primary(group: RedisGroup) -> None:
    target = RedisTarget(sentinels=parse_sentinels(group.sentinels), master=group.MASTER)
    with target.connect_sync() as client:
        client.set("sentinel:sync", "1")
        info = client.info("server")
    assert int(info["tcp_port"]) == group.primary()


@pytest.mark.integration
async def test_concurrent_waits_share_rounds_and_each_covers_every_write_before_it(
    group: RedisGroup,
) -> None:
    stores = _stores(group)
    redis = stores.keys.redis
    try:
        await _replicated_within(stores, 30.0)
        rounds = stores.keys.replica_waits

        async def write_then_wait(i: int) -> int:
            await redis.set(f"sentinel:group:{i}", str(i))
            return await stores.keys.replicated()

        acked = await asyncio.gather(*(write_then_wait(i) for i in range(40)))
        assert all(a >= 1 for a in acked)
        sent = stores.keys.replica_waits - rounds
        assert 1 <= sent < 40, sent  # shared: far fewer rounds than callers
        # Every write a wait confirmed is on a replica (read there, not on the primary):
        # the wait asks for one replica of two, so on one of them, not always the first.
        keys = [f"sentinel:group:{i}" for i in range(40)]
        held: list[list[bytes | str | None]] = []
        for port in group.replicas():
            replica = aioredis.Redis(port=port)
            try:
                held.append(await replica.mget(keys))
            finally:
                await replica.aclose()
        assert [
            next((v for v in found if v is not None), None) for found in zip(*held, strict=True)
        ] == [str(i).encode() for i in range(40)]
    finally:
        await stores.close()


class _Rounds:
    """The edge of redis-py a `ReplicaWait` uses: a pipeline whose `WAIT` answers when
    the test says, counting the rounds and the writes each round follows."""

    def __init__(self) -> None:
        self.started: list[int] = []
        self.answers: asyncio.Queue[int | Exception] = asyncio.Queue()
        self.writes = 0

    def pipeline(self, transaction: bool) -> _Rounds:
        return self

    async def __aenter__(self) -> _Rounds:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    def incr(self, key: str) -> None:
        self.started.append(self.writes)

    def execute_command(self, *args: object) -> None:
        return None

    async def execute(self) -> list[int]:
        answer = await self.answers.get()
        if isinstance(answer, Exception):
            raise answer
        return [0, answer]


async def test_a_wait_that_arrives_mid_round_gets_the_next_round() -> None:
    edge = _Rounds()
    wait = ReplicaWait(edge, "k", replicas=1, timeout_ms=10)  # type: ignore[arg-type]
    edge.writes = 1
    first = asyncio.create_task(wait())
    while not edge.started:  # until its round is in flight
        await asyncio.sleep(0)
    edge.writes = 2  # written after that round's mark: the round does not cover it
    late = [asyncio.create_task(wait()) for _ in range(3)]
    await asyncio.sleep(0)
    await edge.answers.put(1)
    assert await first == 1
    assert not any(t.done() for t in late)  # they wait for a round of their own
    await edge.answers.put(2)
    assert await asyncio.gather(*late) == [2, 2, 2]
    assert edge.started == [1, 2] and wait.waits == 2  # the second round after write 2


async def test_a_rounds_failure_reaches_each_of_its_callers_and_a_cancelled_one_leaves_it() -> None:
    edge = _Rounds()
    wait = ReplicaWait(edge, "k", replicas=1, timeout_ms=10)  # type: ignore[arg-type]
    callers = [asyncio.create_task(wait()) for _ in range(3)]
    await asyncio.sleep(0)
    callers[0].cancel()
    await edge.answers.put(0)  # no replica: ReplicaLagError for every caller
    for caller in callers[1:]:
        with pytest.raises(ReplicaLagError):
            await caller
    assert callers[0].cancelled() and wait.short == 1
    next_ = asyncio.create_task(wait())  # the next round goes on as usual
    await asyncio.sleep(0)
    await edge.answers.put(redis_exceptions.ConnectionError("gone"))
    with pytest.raises(redis_exceptions.ConnectionError):
        await next_


async def test_no_replica_asked_sends_nothing() -> None:
    class Unreachable:
        def pipeline(self, transaction: bool) -> None:
            raise AssertionError("nothing may be sent when no replica is asked for")

    wait = ReplicaWait(Unreachable(), "k", replicas=0, timeout_ms=10)  # type: ignore[arg-type]
    assert await wait() == 0


class _Sentinel:
    """The edge of redis-py's Sentinel: one Sentinel's answer, after `delay_s`."""

    def __init__(self, ip: str, epoch: int, delay_s: float = 0.0, down: bool = False) -> None:
        self.state = {
            "ip": ip,
            "port": 6379,
            "config-epoch": epoch,
            "is_master": True,
            "is_sdown": False,
            "is_odown": False,
            "num-other-sentinels": 2,
        }
        self.delay_s = delay_s
        self.down = down

    async def sentinel_masters(self) -> dict[str, Any]:
        await asyncio.sleep(self.delay_s)
        if self.down:
            raise redis_exceptions.TimeoutError("Timeout connecting to server")
        return {"plexrl": self.state}


async def test_a_sentinel_that_missed_the_failover_does_not_name_the_primary() -> None:
    """The Sentinel of a host just healed from a partition answers first and still names
    the old primary (config epoch 1); the majority's newer failover (epoch 2) wins."""
    target = RedisTarget(sentinels=(("10.0.0.1", 1), ("10.0.0.2", 2), ("10.0.0.3", 3)))
    sentinel = target.connect().connection_pool.sentinel_manager  # type: ignore[attr-defined]
    sentinel.sentinels = [
        _Sentinel("10.0.0.1", 1),
        _Sentinel("10.0.0.2", 2, delay_s=0.05),
        _Sentinel("10.0.0.3", 2, delay_s=0.1),
    ]
    assert await sentinel.discover_master("plexrl") == ("10.0.0.2", 6379)
    # One Sentinel down: the two that answer are a majority; nobody waits for the third.
    sentinel.sentinels = [
        _Sentinel("10.0.0.1", 2, delay_s=30, down=True),
        _Sentinel("10.0.0.2", 3),
        _Sentinel("10.0.0.3", 3, delay_s=0.05),
    ]
    started = time.monotonic()
    assert await sentinel.discover_master("plexrl") == ("10.0.0.2", 6379)
    assert time.monotonic() - started < 1.0
