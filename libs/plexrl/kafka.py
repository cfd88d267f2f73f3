"""Kafka plumbing shared by the services: topic creation, a publisher, a consumer loop.

The consumer is at-least-once: it commits a message's offset only after its
handler returned. A message that does not decode, or whose handler raises, goes
to the dead-letter topic with the reason and the loop goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaConnectionError, TopicAlreadyExistsError
from opentelemetry.context import Context

from plexrl import tracing
from plexrl.messages import DeadLetter, DeadLetterReason, MessageError, decode, encode

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class Delivery:
    """Where a message came from, and the trace context it carried."""

    topic: str
    partition: int
    offset: int
    context: Context

    @property
    def tp(self) -> TopicPartition:
        return TopicPartition(self.topic, self.partition)


Handler = Callable[[T, Delivery], Awaitable[None]]


async def wait_for_kafka(bootstrap: str, timeout_s: float = 60.0) -> None:
    """Retry until the broker answers; raises with a hint when it never does."""
    deadline = time.monotonic() + timeout_s
    while True:
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=5000)
        try:
            await admin.start()
            await admin.list_topics()
            return
        except KafkaConnectionError as exc:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"Kafka at {bootstrap} did not answer within {timeout_s:.0f}s; "
                    "start it with `scripts/infra.sh up` or set PLEXRL_KAFKA_BOOTSTRAP"
                ) from exc
            await asyncio.sleep(0.5)
        finally:
            await admin.close()


async def ensure_topics(bootstrap: str, wanted: dict[str, int]) -> None:
    """Create the topics that do not exist yet (idempotent, safe to race)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        missing = [
            NewTopic(name=name, num_partitions=parts, replication_factor=1)
            for name, parts in wanted.items()
            if name not in existing
        ]
        if missing:
            with contextlib.suppress(TopicAlreadyExistsError):
                await admin.create_topics(missing)
            log.info("created topics %s", [t.name for t in missing])
    finally:
        await admin.close()


def _key_bytes(key: str | bytes | None) -> bytes | None:
    return key.encode() if isinstance(key, str) else key


class Publisher:
    """One producer per service; every message carries the current trace context."""

    def __init__(self, bootstrap: str, client_id: str) -> None:
        self._producer = AIOKafkaProducer(
            bootstrap_servers=bootstrap,
            client_id=client_id,
            acks="all",
            linger_ms=0,
            max_request_size=8 * 1024 * 1024,
        )

    async def start(self) -> None:
        await self._producer.start()

    async def stop(self) -> None:
        await self._producer.stop()

    async def publish(self, topic: str, key: str | bytes | None, message: Any) -> None:
        """Send and wait for the broker's acknowledgement."""
        await self._producer.send_and_wait(
            topic, encode(message), key=_key_bytes(key), headers=tracing.kafka_headers()
        )

    async def publish_soon(self, topic: str, key: str | bytes | None, message: Any) -> None:
        """Queue a message without waiting for the broker: for announcements whose loss
        a later one repairs (heartbeats, residency changes). Failures are logged."""
        delivery = await self._producer.send(
            topic, encode(message), key=_key_bytes(key), headers=tracing.kafka_headers()
        )
        delivery.add_done_callback(_log_failure)

    async def publish_raw(self, topic: str, key: bytes | None, value: bytes) -> None:
        await self._producer.send_and_wait(topic, value, key=key)

    async def ping(self, timeout_s: float = 2.0) -> bool:
        """True when the broker answers a metadata request within `timeout_s` (health checks)."""
        try:
            await asyncio.wait_for(self._producer.client.fetch_all_metadata(), timeout_s)
        except Exception:
            return False
        return True


def _log_failure(delivery: asyncio.Future[Any]) -> None:
    if not delivery.cancelled() and delivery.exception() is not None:
        log.warning("a queued message was not delivered: %s", delivery.exception())


class MessageConsumer(Generic[T]):
    """Decode one message type from some topics and hand each to a handler, in order."""

    def __init__(
        self,
        *,
        bootstrap: str,
        topics: list[str],
        group: str | None,
        message_type: Any,
        handler: Handler[T],
        dlq: tuple[Publisher, str],
        name: str,
        from_latest: bool = False,
        commit_after_handler: bool = True,
        commit_interval_s: float = 0.05,
    ) -> None:
        self._topics = topics
        self._message_type = message_type
        self._handler = handler
        self._dlq_publisher, self._dlq_topic = dlq
        self._name = name
        self._group = group
        # False: the owner commits with `commit_upto` once the message's effect is durable.
        self._commit_after_handler = commit_after_handler and group is not None
        self._commit_interval_s = commit_interval_s
        self._to_commit: dict[TopicPartition, int] = {}
        self._consumer = AIOKafkaConsumer(
            *topics,
            bootstrap_servers=bootstrap,
            group_id=group,
            client_id=name,
            enable_auto_commit=False,
            auto_offset_reset="latest" if from_latest else "earliest",
            fetch_max_wait_ms=200,
            max_partition_fetch_bytes=16 * 1024 * 1024,
            fetch_max_bytes=64 * 1024 * 1024,
            session_timeout_ms=10000,
            heartbeat_interval_ms=1000,
        )
        self.handled = 0
        self.dead_lettered = 0

    async def start(self) -> None:
        await self._consumer.start()

    async def stop(self) -> None:
        await self._consumer.stop()

    async def wait_assigned(self, timeout_s: float = 30.0) -> None:
        """Until the group gave this consumer its partitions (or, without a group, at once)."""
        deadline = time.monotonic() + timeout_s
        while not self._consumer.assignment():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self._name}: no partitions assigned after {timeout_s}s")
            await asyncio.sleep(0.05)
        if self._group is None:
            # Resolve the start position now, so that a message published after this
            # returns is seen even though the consumer starts from `latest`.
            for tp in self._consumer.assignment():
                await self._consumer.position(tp)

    async def run(self, stop: asyncio.Event) -> None:
        """Consume until `stop` is set; a message in hand is finished first.

        Offsets are committed in the background (every `commit_interval_s`, and once
        more on the way out), never before their message's handler returned: still
        at-least-once, without a broker round trip between one message and the next.
        """
        committer = asyncio.create_task(self._commit_periodically(stop))
        try:
            while not stop.is_set():
                batches = await self._consumer.getmany(timeout_ms=200, max_records=64)
                for tp, records in batches.items():
                    for record in records:
                        await self._handle(record)
                        if self._commit_after_handler:
                            self._to_commit[tp] = record.offset + 1
        finally:
            committer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await committer
            await self._flush_commits()

    async def commit_upto(self, tp: TopicPartition, next_offset: int) -> None:
        """Every message of `tp` before `next_offset` has had its effect: commit it soon."""
        if self._group is not None:
            self._to_commit[tp] = max(next_offset, self._to_commit.get(tp, 0))

    async def _commit_periodically(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await asyncio.sleep(self._commit_interval_s)
            await self._flush_commits()

    async def _flush_commits(self) -> None:
        if not self._to_commit or self._group is None:
            return
        offsets, self._to_commit = self._to_commit, {}
        try:
            await self._consumer.commit(offsets)
        except Exception:  # a rebalance, say: the next flush (or a replay) covers it
            log.warning("%s: committing %s failed", self._name, offsets, exc_info=True)

    async def _handle(self, record: ConsumerRecord[bytes, bytes]) -> bool:
        """Hand the message on; False when it went to the dead-letter topic instead."""
        try:
            message = decode(record.value or b"", self._message_type)
        except MessageError as exc:
            await self._dead_letter(record, exc.reason, exc.detail)
            return False
        delivery = Delivery(
            record.topic,
            record.partition,
            record.offset,
            tracing.extract_kafka_headers(record.headers),
        )
        try:
            await self._handler(message, delivery)
            self.handled += 1
            return True
        except Exception as exc:  # one bad message must not stop the consumer
            log.exception("%s: handler failed on %s@%s", self._name, record.topic, record.offset)
            await self._dead_letter(record, DeadLetterReason.HANDLER_FAILED, repr(exc))
            return False

    async def _dead_letter(
        self, record: ConsumerRecord[bytes, bytes], reason: DeadLetterReason, detail: str
    ) -> None:
        self.dead_lettered += 1
        log.warning("%s: dead-lettering %s@%s: %s", self._name, record.topic, record.offset, detail)
        letter = DeadLetter(
            source_topic=record.topic,
            partition=record.partition,
            offset=record.offset,
            key=record.key,
            reason=reason,
            detail=detail[:4000],
            value=(record.value or b"")[: 1024 * 1024],
            consumer=self._name,
            at=time.time(),
        )
        await self._dlq_publisher.publish(self._dlq_topic, record.key, letter)


__all__ = [
    "Delivery",
    "MessageConsumer",
    "Publisher",
    "TopicPartition",
    "ensure_topics",
    "wait_for_kafka",
]
