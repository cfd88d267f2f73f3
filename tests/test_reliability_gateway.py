"""The gateway dies at each step of accepting a call; a fresh gateway finishes the job.

Real Redis and real Kafka: the first gateway's publisher raises a crash (a
BaseException, as a killed process never runs its except-clauses) at the exact step;
the second gateway is built from scratch over the same Redis and topics, delivers
what the first accepted, and the client's re-send and its next calls go through.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
import pytest_asyncio
from aiokafka import AIOKafkaConsumer
from aiokafka.errors import KafkaConnectionError

from plexrl.kafka import Publisher, ensure_topics
from plexrl.messages import (
    AdamParams,
    CompletionStatus,
    CreateInput,
    Function,
    JobSpec,
    NoopOutput,
    OptimStepInput,
    PhaseCompletion,
    PhaseRequest,
    Timings,
    decode,
)
from plexrl.stores import Stores
from plexrl.topics import Topics, core_topics
from plexrl_gateway.futures import FutureWaiter
from plexrl_gateway.outbox import Outbox
from plexrl_gateway.render import ResponseKind
from plexrl_gateway.sequencer import Sequencer
from plexrl_gateway.submitter import Call, Submission, Submitter, ready

pytestmark = pytest.mark.integration

SPEC = JobSpec(base_model="plexrl/tiny-qwen3", lora=None, state_bytes=0)
JOB = "model-1"


class GatewayCrash(BaseException):
    """The process died here (kill -9): nothing after this line runs."""


@dataclass
class CrashingPublisher:
    """The real Kafka publisher, dying once before or after a chosen send."""

    real: Publisher
    crash_before: int | None = None
    """Die instead of sending the n-th request (1-based)."""
    crash_after: int | None = None
    """Die right after Kafka acknowledged the n-th request."""
    sends: int = 0

    async def publish(self, topic: str, key: str | bytes | None, message: Any) -> None:
        await (await self.publish_deferred(topic, key, message))

    async def publish_deferred(self, topic: str, key: str | bytes | None, message: Any) -> Any:
        self.sends += 1
        if self.sends == self.crash_before:
            raise GatewayCrash(f"died before send {self.sends}")
        ack = await self.real.publish_deferred(topic, key, message)
        if self.sends != self.crash_after:
            return ack
        sends = self.sends

        async def acked_then_died() -> None:
            await ack
            raise GatewayCrash(f"died after send {sends}")

        return acked_then_died()

    async def ping(self, timeout_s: float = 2.0) -> bool:
        return await self.real.ping(timeout_s)


@dataclass
class Env:
    stores: Stores
    topics: Topics
    publisher: Publisher
    kafka: str

    def gateway(self, publisher: Any) -> Submitter:
        """A gateway's submitting part, as a fresh process builds it."""
        # A short gap timeout: a call held back by a stale cursor fails fast, not in 30 s.
        sequencer = Sequencer(self.stores.calls, gap_timeout_s=2.0)
        return Submitter(
            self.stores.calls,
            self.stores.payloads,
            Outbox(self.stores.keys),
            publisher,
            self.topics,
            sequencer,
            512 * 1024,
        )

    async def requests_on_kafka(self, at_least: int, timeout_s: float = 30.0) -> list[str]:
        """Request ids on the requests topic, in order (all partitions: one job, one key)."""
        consumer = AIOKafkaConsumer(
            self.topics.requests, bootstrap_servers=self.kafka, auto_offset_reset="earliest"
        )
        await consumer.start()
        ids: list[str] = []
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                batches = await consumer.getmany(timeout_ms=200)
                for records in batches.values():
                    for r in records:
                        ids.append(decode(r.value or b"", PhaseRequest).request_id)
                if len(ids) >= at_least:
                    # One more poll: duplicates beyond the expected count must show too.
                    more = await consumer.getmany(timeout_ms=500)
                    for records in more.values():
                        ids += [decode(r.value or b"", PhaseRequest).request_id for r in records]
                    return ids
        finally:
            await consumer.stop()
        return ids


@pytest_asyncio.fixture
async def env(infra: dict[str, str], cluster_id: str) -> AsyncIterator[Env]:
    topics = Topics(cluster_id)
    await ensure_topics(infra["kafka"], core_topics(topics))
    stores = Stores.from_url(infra["redis"], cluster_id, 3600)
    publisher = Publisher(infra["kafka"], "test-gateway")
    await publisher.start()
    try:
        yield Env(stores, topics, publisher, infra["kafka"])
    finally:
        await publisher.stop()
        keys = [k async for k in stores.keys.redis.scan_iter(match=f"{cluster_id}:*", count=1000)]
        if keys:
            await stores.keys.redis.delete(*keys)
        await stores.close()


def create() -> Call:
    return Call(Function.CREATE, CreateInput(spec=SPEC), ResponseKind.CREATE_MODEL, spec=SPEC)


def step() -> Call:
    return Call(Function.OPTIM_STEP, OptimStepInput(adam=AdamParams()), ResponseKind.OPTIM_STEP)


def sent(seq_id: int) -> Submission:
    return Submission(JOB, "alice", seq_id, retry_key=f"{JOB}:{seq_id}")


async def answer_like_a_worker(env: Env, request_ids: list[str]) -> None:
    """Each request id run once and recorded (first record wins, as on a worker)."""
    for request_id in request_ids:
        await env.stores.calls.record_completion(
            PhaseCompletion(
                request_id=request_id,
                job_id=JOB,
                tenant="alice",
                worker_id="w",
                function=Function.NOOP,
                status=CompletionStatus.OK,
                timings=Timings(),
                result=NoopOutput(),
                finished_at=time.time(),
            )
        )


async def test_a_crash_between_claiming_the_retry_key_and_publishing_is_harmless(
    env: Env,
) -> None:
    first = env.gateway(CrashingPublisher(env.publisher, crash_before=2))
    created = await first.submit(sent(0), ready(create()))
    with pytest.raises(GatewayCrash):
        await first.submit(sent(1), ready(step()))
    # The retry key, the future and the cursor were written with the request itself.
    accepted = await env.stores.calls.claimed_request(f"{JOB}:1")
    assert accepted is not None and await env.stores.calls.get_future(accepted) is not None

    second = env.gateway(env.publisher)  # a fresh gateway over the same Redis and Kafka
    assert await second.deliver(min_age_s=0) == 1  # what it does first on start-up
    assert await second.submit(sent(1), ready(step())) == accepted  # the client's re-send
    later = await second.submit(sent(2), ready(step()))  # not held back by the crash

    on_kafka = await env.requests_on_kafka(at_least=3)
    assert on_kafka == [created, accepted, later]
    await answer_like_a_worker(env, on_kafka)
    waiter = FutureWaiter(env.stores.calls)
    done = await waiter.wait(accepted, timeout_s=5)
    assert done is not None and done.status == CompletionStatus.OK


async def test_a_crash_between_publishing_and_moving_the_cursor_is_harmless(env: Env) -> None:
    first = env.gateway(CrashingPublisher(env.publisher, crash_after=2))
    created = await first.submit(sent(0), ready(create()))
    with pytest.raises(GatewayCrash):
        await first.submit(sent(1), ready(step()))  # on Kafka, then the gateway died
    accepted = await env.stores.calls.claimed_request(f"{JOB}:1")
    assert accepted is not None
    assert await env.stores.calls.get_next_seq(JOB) == 2  # the cursor moved with the acceptance

    second = env.gateway(env.publisher)
    await second.deliver(min_age_s=0)  # may publish it again: same request id
    assert await second.submit(sent(1), ready(step())) == accepted
    later = await asyncio.wait_for(second.submit(sent(2), ready(step())), 10)

    on_kafka = await env.requests_on_kafka(at_least=4)
    # Every copy of the call carries its one request id, so it runs (and answers) once.
    assert [i for i in on_kafka if i != accepted] == [created, later]
    assert on_kafka.index(accepted) < on_kafka.index(later)
    await answer_like_a_worker(env, on_kafka)
    assert len(await env.stores.calls.get_completions(set(on_kafka))) == 3


async def test_a_gateway_that_dies_before_its_first_write_leaves_nothing(env: Env) -> None:
    first = env.gateway(CrashingPublisher(env.publisher))
    await first.submit(sent(0), ready(create()))

    async def dies_while_validating() -> list[Call]:
        raise GatewayCrash("died before accepting")

    with pytest.raises(GatewayCrash):
        await first.submit(sent(1), dies_while_validating)
    assert await env.stores.calls.claimed_request(f"{JOB}:1") is None
    assert await env.stores.calls.get_next_seq(JOB) == 1
    second = env.gateway(env.publisher)
    resent = await second.submit(sent(1), ready(step()))  # a first send, in effect
    assert (await env.requests_on_kafka(at_least=2))[1:] == [resent]


@dataclass
class AwayPublisher:
    """The real publisher behind a broker that refuses everything while `away`."""

    real: Publisher
    away: bool = False

    async def publish(self, topic: str, key: str | bytes | None, message: Any) -> None:
        await (await self.publish_deferred(topic, key, message))

    async def publish_deferred(self, topic: str, key: str | bytes | None, message: Any) -> Any:
        if self.away:
            raise KafkaConnectionError("broker unreachable")
        return await self.real.publish_deferred(topic, key, message)

    async def ping(self, timeout_s: float = 2.0) -> bool:
        return not self.away


async def test_calls_accepted_while_kafka_is_away_go_out_in_order_once_it_is_back(
    env: Env,
) -> None:
    publisher = AwayPublisher(env.publisher)
    gateway = env.gateway(publisher)
    created = await gateway.submit(sent(0), ready(create()))
    publisher.away = True
    held = [await gateway.submit(sent(i), ready(step())) for i in (1, 2)]  # accepted
    assert await gateway.deliver(min_age_s=0) == 0  # still away: nothing lost, nothing sent
    publisher.away = False
    last = await gateway.submit(sent(3), ready(step()))  # publishes the job's outbox first
    assert await env.requests_on_kafka(at_least=4) == [created, *held, last]
