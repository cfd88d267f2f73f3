"""Consumers ride out infrastructure errors; only unreadable messages are set aside, and
their callers are answered. Real Kafka and Redis; the handlers are the test's."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import pytest_asyncio
import redis.exceptions
from aiokafka.errors import KafkaConnectionError

from plexrl.dead_letters import DeadLetters, salvage
from plexrl.kafka import ConsumerTuning, Delivery, MessageConsumer, Publisher, ensure_topics
from plexrl.messages import (
    CompletionStatus,
    DeadLetter,
    DeadLetterReason,
    ErrorCode,
    Function,
    NoopInput,
    PhaseRequest,
)
from plexrl.retry import Backoff
from plexrl.settings import GatewaySettings
from plexrl.stores import FutureRecord, Stores
from plexrl.topics import Topics, core_topics
from plexrl_gateway.app import build_app
from plexrl_gateway.components import Gateway
from plexrl_gateway.futures import FutureWaiter

pytestmark = pytest.mark.integration

FAST = ConsumerTuning(backoff=Backoff(first_s=0.01, max_s=0.05), stuck_after_s=30)


@dataclass
class Env:
    kafka: str
    cluster_id: str
    topics: Topics
    stores: Stores
    publisher: Publisher

    def consumer(self, handler: Any, name: str, **kw: Any) -> MessageConsumer[PhaseRequest]:
        return MessageConsumer(
            bootstrap=self.kafka,
            topics=[self.topics.requests],
            group=self.topics.group(name),
            message_type=PhaseRequest,
            handler=handler,
            dlq=(kw.pop("dlq_publisher", self.publisher), self.topics.dlq),
            name=name,
            answer=DeadLetters(
                self.stores.calls, self.stores.keys, self.publisher, self.topics.completions
            ),
            tuning=kw.pop("tuning", FAST),
            **kw,
        )


@pytest_asyncio.fixture
async def env(infra: dict[str, str], cluster_id: str) -> AsyncIterator[Env]:
    topics = Topics(cluster_id)
    await ensure_topics(infra["kafka"], core_topics(topics))
    stores = Stores.from_url(infra["redis"], cluster_id, 3600)
    publisher = Publisher(infra["kafka"], "test")
    await publisher.start()
    try:
        yield Env(infra["kafka"], cluster_id, topics, stores, publisher)
    finally:
        await publisher.stop()
        keys = [k async for k in stores.keys.redis.scan_iter(match=f"{cluster_id}:*", count=1000)]
        if keys:
            await stores.keys.redis.delete(*keys)
        await stores.close()


def call(rid: str, tenant: str = "alice") -> PhaseRequest:
    return PhaseRequest(
        request_id=rid,
        job_id="job-1",
        tenant=tenant,
        function=Function.NOOP,
        payload=NoopInput(),
        arrival_time=time.time(),
    )


async def until(predicate: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def running(consumer: MessageConsumer[Any]) -> AsyncIterator[asyncio.Task[None]]:
    stop = asyncio.Event()
    await consumer.start()
    task = asyncio.create_task(consumer.run(stop))
    try:
        yield task
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 30)
        await consumer.stop()


async def test_a_redis_outage_delays_a_message_it_never_dead_letters_it(env: Env) -> None:
    handled: list[str] = []
    outage = {"left": 3}

    async def handler(request: PhaseRequest, _: Delivery) -> None:
        if outage["left"]:
            outage["left"] -= 1
            raise redis.exceptions.ConnectionError("Connection refused (Redis restarting)")
        handled.append(request.request_id)

    consumer = env.consumer(handler, "outage")
    async with running(consumer):
        for rid in ("a", "b"):
            await env.publisher.publish(env.topics.requests, "job-1", call(rid))
        await until(lambda: len(handled) == 2)
    assert handled == ["a", "b"]  # in order, the first one after three failures
    assert consumer.dead_lettered == 0 and consumer.retries == 3


async def test_an_unreadable_call_is_answered_with_an_error_and_listed_for_its_tenant(
    env: Env, tmp_path: Path
) -> None:
    # What a gateway wrote when it accepted the call.
    await env.stores.calls.put_future(
        FutureRecord(
            request_id="req-bad",
            tenant="alice",
            job_id="job-1",
            function="forward_backward",
            created_at=time.time(),
        )
    )
    # A request whose payload is not one this reader knows: it names its request id.
    raw = msgspec.msgpack.encode(
        {**msgspec.to_builtins(call("req-bad")), "payload": {"type": "from_the_future"}}
    )
    assert [r.request_id for r in salvage(raw)[0]] == ["req-bad"]
    handled: list[str] = []

    async def handler(request: PhaseRequest, _: Delivery) -> None:
        handled.append(request.request_id)

    consumer = env.consumer(handler, "unreadable")
    async with running(consumer):
        await env.publisher.publish_raw(env.topics.requests, b"job-1", raw)
        await env.publisher.publish(env.topics.requests, "job-1", call("after"))
        await until(lambda: handled == ["after"])  # the consumer went on
        done = await FutureWaiter(env.stores.calls).wait("req-bad", timeout_s=10)
    assert consumer.dead_lettered == 1
    assert done is not None and done.status == CompletionStatus.ERROR and done.error
    assert done.error.code == ErrorCode.INTERNAL and "could not be read" in done.error.message
    assert done.function == Function.FORWARD_BACKWARD and done.tenant == "alice"

    settings = GatewaySettings(
        cluster_id=env.cluster_id,
        kafka_bootstrap=env.kafka,
        redis_url="redis://unused",
        api_keys="tml-alice=alice,tml-bob=bob",
        model_registry=tmp_path,
    )
    gateway = Gateway.build(settings, env.stores, env.publisher)
    transport = httpx.ASGITransport(app=build_app(gateway))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
        alice = (await http.get("/plexrl/v1/dlq", headers={"X-API-Key": "tml-alice"})).json()
        bob = (await http.get("/plexrl/v1/dlq", headers={"X-API-Key": "tml-bob"})).json()
    await gateway.close()
    assert [e["request_ids"] for e in alice] == [["req-bad"]]
    assert alice[0]["reason"] == DeadLetterReason.UNDECODABLE and alice[0]["tenant"] == "alice"
    assert bob == []


@dataclass
class FlakyDlq:
    """A dead-letter publisher the broker refuses twice."""

    real: Publisher
    refusals: int = 2

    async def publish(self, topic: str, key: Any, message: Any) -> None:
        if self.refusals:
            self.refusals -= 1
            raise KafkaConnectionError("broker unreachable")
        await self.real.publish(topic, key, message)


async def test_a_dead_letter_that_cannot_be_published_at_first_is_retried(env: Env) -> None:
    letters: list[DeadLetter] = []

    async def on_letter(letter: DeadLetter, _: Delivery) -> None:
        letters.append(letter)

    reader: MessageConsumer[DeadLetter] = MessageConsumer(
        bootstrap=env.kafka,
        topics=[env.topics.dlq],
        group=None,
        message_type=DeadLetter,
        handler=on_letter,
        dlq=(env.publisher, env.topics.dlq),
        name="dlq-reader",
    )
    flaky = FlakyDlq(env.publisher)
    handled: list[str] = []

    async def handler(request: PhaseRequest, _: Delivery) -> None:
        handled.append(request.request_id)

    consumer = env.consumer(handler, "flaky-dlq", dlq_publisher=flaky)
    async with running(reader), running(consumer) as task:
        await reader.wait_assigned()
        await env.publisher.publish_raw(env.topics.requests, b"job-1", b"\x81\xa1?garbage")
        await env.publisher.publish(env.topics.requests, "job-1", call("next"))
        await until(lambda: handled == ["next"] and len(letters) == 1)
        assert not task.done() and consumer.health()["ok"]
    assert flaky.refusals == 0 and letters[0].reason == DeadLetterReason.UNDECODABLE


async def test_health_says_when_a_consumer_is_stuck_or_dead(env: Env) -> None:
    async def handler(request: PhaseRequest, _: Delivery) -> None:
        raise redis.exceptions.ConnectionError("Redis is down")

    tuning = ConsumerTuning(backoff=Backoff(first_s=0.01, max_s=0.05), stuck_after_s=0.2)
    consumer = env.consumer(handler, "stuck", tuning=tuning)
    async with running(consumer) as task:
        assert consumer.health()["ok"]
        await consumer.wait_assigned()
        await env.publisher.publish(env.topics.requests, "job-1", call("x"))
        # A slow group join or a busy machine can leave the loop without a poll for longer
        # than this tiny threshold (also "not ok"): wait for the failing message's report.
        await until(lambda: "failed for" in consumer.health().get("problem", ""))
        assert not consumer.health()["ok"] and consumer.dead_lettered == 0
        task.cancel()  # the loop ends while the service still runs
        await asyncio.gather(task, return_exceptions=True)
        health = consumer.health()
        assert not health["ok"] and "loop ended" in health["problem"]


async def test_a_last_commit_that_never_returns_does_not_keep_the_consumer_in_its_group(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """aiokafka retries a commit while the group's coordinator is away, for minutes; the
    loop gives its last one up after `final_commit_s`, so its owner can stop it and the
    group hands its partitions on."""
    handled: list[str] = []

    async def handler(request: PhaseRequest, _: Delivery) -> None:
        handled.append(request.request_id)

    tuning = ConsumerTuning(backoff=Backoff(first_s=0.01, max_s=0.05), final_commit_s=0.5)
    consumer = env.consumer(handler, "last-commit", tuning=tuning, commit_interval_s=3600)
    stop = asyncio.Event()
    await consumer.start()
    task = asyncio.create_task(consumer.run(stop))
    try:
        await env.publisher.publish(env.topics.requests, "job-1", call("a"))
        await until(lambda: handled == ["a"])
        unanswered: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # The edge: the group's coordinator gone (its host cut off), the commit unanswered.
        monkeypatch.setattr(consumer._consumer, "commit", lambda *_: unanswered)
        started = time.monotonic()
        stop.set()
        await asyncio.wait_for(task, 10)
        assert time.monotonic() - started < 3
    finally:
        stop.set()
        await asyncio.gather(task, return_exceptions=True)
        await consumer.stop()


async def test_a_group_member_reads_on_from_what_the_one_before_committed(env: Env) -> None:
    """The group's committed offsets are where the next member starts: what the first
    handled is not handled again, what it had not reached is, in order (the first's
    last commit goes out even when its stop cuts a periodic one short)."""
    first_seen: list[str] = []

    async def first_handler(message: PhaseRequest, delivery: Delivery) -> None:
        first_seen.append(message.request_id)

    for rid in ("a", "b", "c"):
        await env.publisher.publish(env.topics.requests, "job-1", call(rid))
    first = env.consumer(first_handler, "members")
    await first.start()
    await first.wait_assigned()
    stop = asyncio.Event()
    task = asyncio.create_task(first.run(stop))
    await until(lambda: first_seen == ["a", "b", "c"])
    stop.set()
    await asyncio.wait_for(task, 30)  # its last commit goes out on the way out
    await first.stop()

    later_seen: list[str] = []

    async def later_handler(message: PhaseRequest, delivery: Delivery) -> None:
        later_seen.append(message.request_id)

    for rid in ("d", "e"):
        await env.publisher.publish(env.topics.requests, "job-1", call(rid))
    later = env.consumer(later_handler, "members")
    async with running(later):
        await until(lambda: len(later_seen) >= 2)
        await asyncio.sleep(0.5)
    assert later_seen == ["d", "e"]


async def test_what_the_handlers_queued_is_written_before_each_commit_of_their_offsets(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`before_commit`: effects the handlers queue (the scheduler's usage) are written
    once per commit, before it, so no offset is committed ahead of its message's effect;
    a write that fails holds that commit back, and the next one covers it."""
    queued: list[str] = []
    written: list[str] = []
    committed: list[tuple[int, list[str]]] = []  # (offset, what was written by then)
    failures = [1]

    async def handler(message: PhaseRequest, _: Delivery) -> None:
        queued.append(message.request_id)

    async def write() -> None:
        if failures[0]:
            failures[0] -= 1
            raise redis.exceptions.ConnectionError("Redis went away (injected)")
        written.extend(queued)
        queued.clear()

    consumer = env.consumer(handler, "before-commit", before_commit=write, commit_interval_s=0.05)
    real_commit = consumer._consumer.commit

    async def commit(offsets: Any) -> None:
        committed.extend((offset, list(written)) for offset in offsets.values())
        await real_commit(offsets)

    monkeypatch.setattr(consumer._consumer, "commit", commit)
    rids = [f"r{i}" for i in range(6)]
    async with running(consumer):
        for rid in rids:
            await env.publisher.publish(env.topics.requests, "job-1", call(rid))
            await asyncio.sleep(0.03)
        await until(lambda: written == rids)
    assert committed and committed[-1][0] == len(rids)  # all of them, in the end
    for offset, by_then in committed:  # (one partition: offset n follows message n-1)
        assert set(rids[:offset]) <= set(by_then), (offset, by_then)
    with pytest.raises(ValueError, match="consumer group"):
        MessageConsumer(
            bootstrap=env.kafka,
            topics=[env.topics.events],
            group=None,
            message_type=PhaseRequest,
            handler=handler,
            dlq=(env.publisher, env.topics.dlq),
            name="no-group",
            before_commit=write,
        )
