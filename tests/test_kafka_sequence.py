"""A producer the brokers refuse as out of sequence is replaced, and sending goes on.

An idempotent producer whose batch failed after its sequence number was spent (a
partition leader that moved mid-send, say) is refused by the broker for every later
batch of that partition (`OutOfOrderSequenceNumber`), forever: a gateway stuck so
published none of its jobs' calls again. Here the producer's number for a partition is
moved ahead of the broker's, as such a lost batch leaves it, and the real broker's
refusal follows.
"""

from __future__ import annotations

import asyncio
import time

from aiokafka import AIOKafkaConsumer, TopicPartition

from plexrl.kafka import Publisher, ensure_topics
from plexrl.messages import Function, NoopInput, PhaseRequest, decode
from plexrl.retry import DESYNCHRONIZED


def _request(request_id: str) -> PhaseRequest:
    return PhaseRequest(
        request_id=request_id,
        job_id="j",
        tenant="t",
        function=Function.NOOP,
        payload=NoopInput(),
        arrival_time=time.time(),
    )


def _skip_ahead(publisher: Publisher, topic: str, by: int) -> None:
    """Spend `by` sequence numbers of partition 0 that the broker never saw."""
    manager = publisher._producer._txn_manager
    manager.increment_sequence_number(TopicPartition(topic, 0), by)


async def _read(bootstrap: str, topic: str, count: int) -> list[str]:
    consumer = AIOKafkaConsumer(
        topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest", enable_auto_commit=False
    )
    await consumer.start()
    try:
        got: list[str] = []
        deadline = time.monotonic() + 30
        while len(got) < count and time.monotonic() < deadline:
            batches = await consumer.getmany(timeout_ms=500)
            for records in batches.values():
                got += [decode(r.value, PhaseRequest).request_id for r in records if r.value]
        return got
    finally:
        await consumer.stop()


async def test_a_producer_out_of_sequence_is_replaced_and_what_follows_is_published(
    infra: dict[str, str], cluster_id: str
) -> None:
    topic = f"{cluster_id}.sequence"
    await ensure_topics(infra["kafka"], {topic: 1})
    publisher = Publisher(infra["kafka"], "test")
    await publisher.start()
    try:
        await publisher.publish(topic, "j", _request("r1"))

        # A send waited on: refused once, then the publisher runs a new producer.
        _skip_ahead(publisher, topic, 3)
        refused = None
        try:
            await publisher.publish(topic, "j", _request("r2"))
        except DESYNCHRONIZED as exc:
            refused = exc
        assert refused is not None, "the broker took a batch out of sequence"
        assert publisher.renewals == 1
        await publisher.publish(topic, "j", _request("r2"))

        # Queued sends (the gateway's outbox): the refusal renews it as well.
        _skip_ahead(publisher, topic, 2)
        first = await publisher.publish_deferred(topic, "j", _request("r3"))
        second = await publisher.publish_deferred(topic, "j", _request("r4"))
        outcomes = await asyncio.gather(first, second, return_exceptions=True)
        assert all(isinstance(o, DESYNCHRONIZED) for o in outcomes), outcomes
        deadline = time.monotonic() + 10
        while publisher.renewals < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert publisher.renewals == 2
        for request_id in ("r3", "r4"):  # as the outbox sends them again, in order
            await (await publisher.publish_deferred(topic, "j", _request(request_id)))

        # With retries on (the scheduler's, a worker's), the refusal is not even seen.
        stop = asyncio.Event()
        publisher.retry_until(stop)
        _skip_ahead(publisher, topic, 4)
        await asyncio.wait_for(publisher.publish(topic, "j", _request("r5")), 30)
        assert publisher.renewals == 3
    finally:
        await publisher.stop()

    assert await _read(infra["kafka"], topic, 5) == ["r1", "r2", "r3", "r4", "r5"]
