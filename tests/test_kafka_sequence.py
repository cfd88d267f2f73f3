"""A producer that meets a fatal error is replaced, and sending goes on.

librdkafka's idempotent producer ends for good on a fatal error (the brokers no longer
take its sequence numbers, say): every later send fails the same way, and a gateway
stuck so would publish none of its jobs' calls again. Here librdkafka's own test hook
raises one on the publisher's real producer (its `rd_kafka_test_fatal_error`, as the
library does for an out-of-sequence answer), and the real broker gets what follows.
"""

from __future__ import annotations

import asyncio
import ctypes
import time
from pathlib import Path

import confluent_kafka
from aiokafka import AIOKafkaConsumer

from plexrl.kafka import Publisher, ensure_topics
from plexrl.messages import Function, NoopInput, PhaseRequest, decode
from plexrl.retry import is_transient, producer_ended

_OUT_OF_ORDER_SEQUENCE_NUMBER = 45


def _request(request_id: str) -> PhaseRequest:
    return PhaseRequest(
        request_id=request_id,
        job_id="j",
        tenant="t",
        function=Function.NOOP,
        payload=NoopInput(),
        arrival_time=time.time(),
    )


def _librdkafka() -> ctypes.CDLL:
    """The librdkafka the confluent-kafka wheel loaded (the same library, not a copy)."""
    package = Path(confluent_kafka.__file__).parent
    found = sorted((package.parent / "confluent_kafka.libs").glob("librdkafka*.so*"))
    return ctypes.CDLL(str(found[0]) if found else "librdkafka.so.1")


def _end_with_fatal_error(publisher: Publisher) -> None:
    """What librdkafka does when the brokers refuse its sequence: a fatal error."""
    assert publisher._producer is not None
    handle = publisher._producer._producer
    # confluent-kafka's Handle starts with the rd_kafka_t pointer, after the object head.
    rk = ctypes.c_void_p.from_address(id(handle) + object.__basicsize__).value
    lib = _librdkafka()
    lib.rd_kafka_test_fatal_error.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p]
    lib.rd_kafka_test_fatal_error.restype = ctypes.c_int
    assert lib.rd_kafka_test_fatal_error(rk, _OUT_OF_ORDER_SEQUENCE_NUMBER, b"test") == 0


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


async def _renewals_reach(publisher: Publisher, count: int) -> None:
    deadline = time.monotonic() + 10
    while publisher.renewals < count and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert publisher.renewals == count


async def test_a_producer_that_met_a_fatal_error_is_replaced_and_what_follows_is_published(
    infra: dict[str, str], cluster_id: str
) -> None:
    topic = f"{cluster_id}.sequence"
    await ensure_topics(infra["kafka"], {topic: 1})
    publisher = Publisher(infra["kafka"], "test")
    await publisher.start()
    try:
        await publisher.publish(topic, "j", _request("r1"))

        # A send waited on: refused once, as transient, then a new producer runs.
        _end_with_fatal_error(publisher)
        refused = None
        try:
            await publisher.publish(topic, "j", _request("r2"))
        except confluent_kafka.KafkaException as exc:
            refused = exc
        assert producer_ended(refused) and refused is not None and is_transient(refused)
        await _renewals_reach(publisher, 1)
        await publisher.publish(topic, "j", _request("r2"))

        # Queued sends (the gateway's outbox): the refusal renews it as well.
        _end_with_fatal_error(publisher)
        first = await publisher.publish_deferred(topic, "j", _request("r3"))
        second = await publisher.publish_deferred(topic, "j", _request("r4"))
        outcomes = await asyncio.gather(first, second, return_exceptions=True)
        assert all(producer_ended(o) for o in outcomes), outcomes
        await _renewals_reach(publisher, 2)
        for request_id in ("r3", "r4"):  # as the outbox sends them again, in order
            await (await publisher.publish_deferred(topic, "j", _request(request_id)))

        # With retries on (the scheduler's, a worker's), the refusal is not even seen.
        stop = asyncio.Event()
        publisher.retry_until(stop)
        _end_with_fatal_error(publisher)
        await asyncio.wait_for(publisher.publish(topic, "j", _request("r5")), 30)
        assert publisher.renewals == 3
    finally:
        await publisher.stop()

    assert await _read(infra["kafka"], topic, 5) == ["r1", "r2", "r3", "r4", "r5"]
