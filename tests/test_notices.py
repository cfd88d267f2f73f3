"""Completion notices wake the gateway's waiters, and Redis answers whatever a notice
missed: a completion recorded before the subscription, while its connection was lost,
or by a recorder that died between its record and its announcement.

Real Redis; the listener and the waiters are the gateway's own.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

import pytest
import pytest_asyncio
import redis.asyncio as aioredis
from gateway_support import answered_when_recorded, start_waiting, wait_until
from gateway_support import noop_completion as completion

from plexrl.limits import DEFAULT_LIMITS
from plexrl.messages import CompletionNotice, PhaseCompletion, encode
from plexrl.stores import FutureRecord, Stores
from plexrl_gateway.admission import PendingCalls
from plexrl_gateway.futures import FutureWaiter
from plexrl_gateway.notices import CompletionNotices

pytestmark = pytest.mark.integration


class CountingReads:
    """The call store, counting the completions read one at a time."""

    def __init__(self, stores: Stores) -> None:
        self._calls = stores.calls
        self.reads = 0

    async def get_completion(self, request_id: str) -> PhaseCompletion | None:
        self.reads += 1
        return await self._calls.get_completion(request_id)

    async def get_completions(self, request_ids: Iterable[str]) -> dict[str, PhaseCompletion]:
        return await self._calls.get_completions(request_ids)


@dataclass
class Listening:
    notices: CompletionNotices
    futures: FutureWaiter
    pending: PendingCalls
    reads: CountingReads


@pytest_asyncio.fixture
async def listening(stores: Stores) -> AsyncIterator[Listening]:
    reads = CountingReads(stores)
    pending = PendingCalls(DEFAULT_LIMITS)
    futures = FutureWaiter(reads, on_answered=pending.done)
    notices = CompletionNotices(
        stores.keys.redis,
        stores.calls.completed_channel,
        futures,
        pending=pending.ids,
        sweep_s=0.3,
        retry_s=0.1,
    )
    stop = asyncio.Event()
    task = asyncio.create_task(notices.run(stop))
    await asyncio.wait_for(notices.wait_subscribed(), 10)
    try:
        yield Listening(notices, futures, pending, reads)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


async def test_a_recorded_completion_wakes_its_waiter_at_once(
    stores: Stores, listening: Listening
) -> None:
    waiter = await start_waiting(listening.futures, "r1")
    started = time.monotonic()
    await stores.calls.record_completion(completion("r1"))
    done = await asyncio.wait_for(waiter, 5)
    assert done is not None and done.request_id == "r1"
    assert time.monotonic() - started < 1.0  # the notice, not the sweep (0.3 s)
    assert listening.notices.notices >= 1


async def test_the_notice_carries_the_record_that_stands(
    stores: Stores, listening: Listening
) -> None:
    await stores.calls.record_completion(completion("r2", worker="first"))
    waiter = asyncio.create_task(listening.futures.wait("r2", timeout_s=30))
    # A late second writer (a replay that ran again) announces the first record.
    assert (await stores.calls.record_completion(completion("r2", worker="second"))).worker_id == (
        "first"
    )
    done = await asyncio.wait_for(waiter, 5)
    assert done is not None and done.worker_id == "first"


async def test_a_completion_recorded_without_a_notice_is_swept(
    stores: Stores, listening: Listening
) -> None:
    """A recorder that died after its record, before its announcement: the waiter is
    answered from Redis within the sweep period."""
    listening.pending.published("alice", "r3")
    waiter = await start_waiting(listening.futures, "r3")
    await stores.keys.redis.set(stores.keys.key("done", "r3"), encode(completion("r3")))
    done = await asyncio.wait_for(waiter, 5)
    assert done is not None and done.request_id == "r3"
    assert listening.pending.count("alice") == 0


async def test_what_was_announced_while_the_connection_was_lost_is_swept(
    stores: Stores, listening: Listening
) -> None:
    """A call counted as pending completes while the listener's connection is lost (its
    notice goes nowhere); the subscription's connection is killed, redis-py subscribes
    again, and the quota lets go of the call from Redis."""
    listening.pending.published("alice", "r4")
    await stores.keys.redis.set(stores.keys.key("done", "r4"), encode(completion("r4")))
    await asyncio.sleep(0.5)  # more than a sweep period: pending alone is not swept
    assert listening.pending.count("alice") == 1
    subscriptions = listening.notices.subscriptions
    await stores.keys.redis.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
    await wait_until(lambda: not listening.pending.count("alice"), 10)
    assert listening.notices.subscriptions > subscriptions
    # And notices flow again on the new connection.
    assert await answered_when_recorded(stores.calls, listening.futures, "r5", 5) is not None
    assert listening.notices.health()["ok"]


async def test_an_unreadable_notice_is_skipped(stores: Stores, listening: Listening) -> None:
    await stores.keys.redis.publish(stores.calls.completed_channel, b"\xc1not msgpack")
    waiter = await start_waiting(listening.futures, "r7")
    notice = CompletionNotice(completion("r7"))
    await stores.keys.redis.publish(stores.calls.completed_channel, encode(notice))
    assert await asyncio.wait_for(waiter, 5) is not None
    assert listening.notices.health()["ok"]


async def test_a_listener_that_fails_recovers_and_says_so(stores: Stores) -> None:
    """A failure that is not Redis's (here the quota's list of pending calls) shows in
    the health until the listener is subscribed again, and notices then flow again."""
    futures = FutureWaiter(stores.calls)
    broken = True

    def pending() -> list[str]:
        if broken:
            raise RuntimeError("the quota is broken")
        return []

    notices = CompletionNotices(
        stores.keys.redis,
        stores.calls.completed_channel,
        futures,
        pending=pending,
        sweep_s=0.3,
        retry_s=0.3,
    )
    stop = asyncio.Event()
    task = asyncio.create_task(notices.run(stop))
    try:
        await wait_until(lambda: not notices.health()["ok"], 5)
        assert "the quota is broken" in notices.health()["error"]
        broken = False
        await wait_until(lambda: notices.health()["ok"] and notices.subscribed, 5)
        assert await answered_when_recorded(stores.calls, futures, "r9", 5) is not None
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


async def test_a_notice_nobody_waits_for_lets_the_quota_go(
    stores: Stores, listening: Listening
) -> None:
    """A call this gateway published and nobody polls yet: its notice (read only as far
    as its id) counts it off the tenant's pending calls, no sweep needed."""
    listening.pending.published("alice", "r10")
    await stores.calls.record_completion(completion("r10"))
    await wait_until(lambda: not listening.pending.count("alice"), 2)
    assert listening.notices.notices >= 1


class FreezingProxy:
    """A TCP relay to Redis whose connections open so far can be cut off silently:
    nothing more passes either way and nothing is closed, as in a partition."""

    def __init__(self, host: str, port: int) -> None:
        self._target = (host, port)
        self._frozen: list[asyncio.Event] = []
        self._writers: list[asyncio.StreamWriter] = []
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in self._writers:  # the relayed connections too, frozen or not
            writer.close()

    def freeze(self) -> None:
        for frozen in self._frozen:
            frozen.set()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self._target)
        self._writers += [writer, up_writer]
        frozen = asyncio.Event()
        self._frozen.append(frozen)

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            while data := await src.read(65536):
                if not frozen.is_set():
                    dst.write(data)
                    await dst.drain()

        await asyncio.gather(
            pump(reader, up_writer), pump(up_reader, writer), return_exceptions=True
        )


async def test_a_subscription_cut_off_silently_is_replaced(
    infra: dict[str, str], stores: Stores
) -> None:
    """The subscription's connection stops passing anything without being closed: the
    unanswered pings give it away and the listener subscribes on a new connection."""
    host, port = infra["redis"].removeprefix("redis://").split("/")[0].split(":")
    proxy = FreezingProxy(host, int(port))
    await proxy.start()
    client = aioredis.Redis.from_url(f"redis://127.0.0.1:{proxy.port}/0")
    futures = FutureWaiter(stores.calls)
    notices = CompletionNotices(
        client, stores.calls.completed_channel, futures, sweep_s=0.2, retry_s=0.1
    )
    stop = asyncio.Event()
    task = asyncio.create_task(notices.run(stop))
    try:
        await asyncio.wait_for(notices.wait_subscribed(), 10)
        subscriptions = notices.subscriptions
        proxy.freeze()
        await wait_until(
            lambda: not (notices.subscriptions == subscriptions or not notices.subscribed), 10
        )
        assert await answered_when_recorded(stores.calls, futures, "r11", 5) is not None
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await client.aclose()
        await proxy.stop()


def future(request_id: str) -> FutureRecord:
    return FutureRecord(request_id, "alice", "job", "noop", created_at=time.time())


async def test_a_call_accepted_here_is_answered_from_its_notices_alone(
    stores: Stores, listening: Listening
) -> None:
    """Completed before its poll: answered from the notice held; polled before it
    completed: woken by the notice. Redis is not read for either."""
    listening.futures.accepted.note([future("a1"), future("a2")])
    await stores.calls.record_completion(completion("a1"))
    await wait_until(lambda: listening.futures.accepted.completion("a1") is not None, 5)
    done = await listening.futures.wait("a1", timeout_s=5)
    assert done is not None and done.request_id == "a1"
    waiter = await start_waiting(listening.futures, "a2")
    await stores.calls.record_completion(completion("a2"))
    done = await asyncio.wait_for(waiter, 5)
    assert done is not None and done.request_id == "a2"
    assert listening.reads.reads == 0


async def test_a_call_accepted_before_the_subscription_was_lost_is_read_from_redis(
    stores: Stores, listening: Listening
) -> None:
    """Its notice went by while the connection was away: once subscribed again, its
    poll reads Redis at once instead of waiting for a notice that already passed."""
    listening.futures.accepted.note([future("a3")])
    subscriptions = listening.notices.subscriptions
    await stores.keys.redis.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
    await stores.keys.redis.set(stores.keys.key("done", "a3"), encode(completion("a3")))
    await wait_until(lambda: listening.notices.subscriptions > subscriptions, 10)
    started = time.monotonic()
    done = await listening.futures.wait("a3", timeout_s=30)
    assert done is not None and done.request_id == "a3"
    assert time.monotonic() - started < 0.2 and listening.reads.reads == 1
