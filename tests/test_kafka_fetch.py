"""A consumer's fetch terms change while it runs: held fetches for fuller batches, then
answered at the first record. Real Kafka."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from plexrl.kafka import (
    Delivery,
    FetchTuning,
    MessageConsumer,
    Publisher,
    ensure_topics,
)
from plexrl.messages import PhaseRequest
from plexrl.topics import Topics, core_topics
from tests.test_plumbing import noop

pytestmark = pytest.mark.integration

HELD = FetchTuning(max_wait_ms=2000, min_bytes=1024 * 1024)
"""The broker holds each fetch the whole 2 s: one record never makes a megabyte."""
EAGER = FetchTuning(max_wait_ms=5000, min_bytes=1)
"""Answered at the first record (held 5 s, were its terms not the ones sent)."""


async def test_a_tuned_consumer_fetches_on_its_new_terms_from_its_next_fetch(
    infra: dict[str, str], cluster_id: str
) -> None:
    topics = Topics(cluster_id)
    await ensure_topics(infra["kafka"], core_topics(topics))
    publisher = Publisher(infra["kafka"], "test-fetch")
    await publisher.start()
    arrived: asyncio.Queue[tuple[str, float]] = asyncio.Queue()

    async def handler(message: PhaseRequest, delivery: Delivery) -> None:
        arrived.put_nowait((message.request_id, time.monotonic()))

    consumer: MessageConsumer[PhaseRequest] = MessageConsumer(
        bootstrap=infra["kafka"],
        topics=[topics.requests],
        group=topics.group("fetch-terms"),
        message_type=PhaseRequest,
        handler=handler,
        dlq=(publisher, topics.dlq),
        name="fetch-terms",
        fetch=HELD,
    )
    stop = asyncio.Event()
    await consumer.start()
    await consumer.wait_assigned()
    task = asyncio.create_task(consumer.run(stop))
    try:
        await asyncio.sleep(0.3)  # its first fetch is at the broker, held
        sent = time.monotonic()
        await publisher.publish(topics.requests, "j", noop("r1"))
        rid, at = await asyncio.wait_for(arrived.get(), 10)
        assert rid == "r1"
        assert at - sent >= 1.0, "a held fetch answered at the first record"

        consumer.tune(EAGER)
        assert consumer.fetch == EAGER
        await asyncio.sleep(HELD.max_wait_ms / 1000 + 0.5)  # the fetch sent held has ended
        sent = time.monotonic()
        await publisher.publish(topics.requests, "j", noop("r2"))
        rid, at = await asyncio.wait_for(arrived.get(), 10)
        assert rid == "r2"
        assert at - sent < 1.0, f"tuned to answer at once, it took {at - sent:.2f}s"
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 10)
        await consumer.stop()
        await publisher.stop()
