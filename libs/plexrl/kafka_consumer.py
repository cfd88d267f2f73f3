"""librdkafka's consumer (confluent-kafka) for an event loop.

Every call into librdkafka that waits (a poll, the group's join and leave) runs on one
thread of the consumer's own, and only when the loop asks for records: as with any
consumer, one whose handler is stuck stops polling, and its group drops it after
`max.poll.interval.ms`. A poll returns as soon as one record is there, with what else
is already fetched (up to `max_records`); librdkafka fetches ahead in the background.
Commits go out from another thread, beside a poll in progress. Against aiokafka's
consumer it takes about a third off the CPU of each record received and a few tenths
of a millisecond off its latency (`bench/kafka_clients.py`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException
from confluent_kafka import TopicPartition as RdTopicPartition

from plexrl.kafka_security import KafkaSecurity, librdkafka_options

log = logging.getLogger(__name__)
librdkafka_log = logging.getLogger("plexrl.librdkafka")


class TopicPartition(NamedTuple):
    topic: str
    partition: int


@dataclass(frozen=True, slots=True)
class Record:
    """One record as the consumer handed it over."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: Sequence[tuple[str, bytes]]


@dataclass(frozen=True)
class ConsumerSettings:
    """What a consumer asks of the brokers (`plexrl.kafka.MessageConsumer` fills it)."""

    bootstrap: str
    client_id: str
    group: str | None
    from_latest: bool
    fetch_max_wait_ms: int
    fetch_min_bytes: int
    session_timeout_ms: int
    max_poll_interval_ms: int
    request_timeout_ms: int
    metadata_max_age_ms: int
    security: KafkaSecurity

    def config(self) -> dict[str, Any]:
        config: dict[str, Any] = {
            **librdkafka_options(self.security),
            "bootstrap.servers": self.bootstrap,
            "client.id": self.client_id,
            # librdkafka wants a group id even where no group is joined (manual
            # assignment, nothing committed).
            "group.id": self.group or f"{self.client_id}-unjoined",
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "auto.offset.reset": "latest" if self.from_latest else "earliest",
            # The broker answers a fetch as soon as a record arrives (fetch.min.bytes 1):
            # the wait bounds only how often an idle consumer asks again.
            "fetch.wait.max.ms": self.fetch_max_wait_ms,
            "fetch.min.bytes": self.fetch_min_bytes,
            "max.partition.fetch.bytes": 16 * 1024 * 1024,
            "fetch.max.bytes": 64 * 1024 * 1024,
            "session.timeout.ms": self.session_timeout_ms,
            "max.poll.interval.ms": self.max_poll_interval_ms,
            "heartbeat.interval.ms": 1000,
            "socket.timeout.ms": self.request_timeout_ms,
            "metadata.max.age.ms": self.metadata_max_age_ms,
            "topic.metadata.refresh.interval.ms": self.metadata_max_age_ms,
            # What the services' aiokafka consumers took: mixed groups agree on it.
            "partition.assignment.strategy": "roundrobin",
            "logger": librdkafka_log,
        }
        return config


class LoopConsumer:
    """One librdkafka consumer of `topics`: in `settings.group`, or (None) of every
    partition from its end or start, read at once, committing nothing."""

    def __init__(self, settings: ConsumerSettings, topics: Sequence[str]) -> None:
        self._settings = settings
        self._topics = list(topics)
        self._consumer = Consumer(settings.config())
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"{settings.client_id}-kafka")
        self._assigned: list[TopicPartition] = []
        self._held: dict[TopicPartition, list[Record]] = {}
        """Records a wait for the group's assignment polled, for the next `getmany`."""
        self._subscribed = False
        self._closed = False

    async def start(self) -> None:
        """Without a group: every partition, its start resolved now, so that a record
        published once `start` returned is read even when reading from the end. In a
        group: nothing yet; the consumer joins at its first poll (`getmany`,
        `wait_assigned`), so one started and never run holds no partitions."""
        if self._settings.group is None:
            assignment = await self._run(self._positions)
            self._consumer.assign(assignment)
            self._assigned = [TopicPartition(tp.topic, tp.partition) for tp in assignment]

    def _positions(self) -> list[RdTopicPartition]:
        """Each partition of the topics with its first offset to read; a partition
        whose leader is still being elected (a topic just made) is asked again."""
        timeout_s = self._settings.request_timeout_ms / 1000
        deadline = time.monotonic() + 2 * timeout_s
        while True:
            try:
                return [p for topic in self._topics for p in self._topic_positions(topic)]
            except KafkaException as exc:
                err = exc.args[0]
                if not (err.retriable() or err.code() in _NO_LEADER_YET):
                    raise
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def _topic_positions(self, topic: str) -> list[RdTopicPartition]:
        timeout_s = self._settings.request_timeout_ms / 1000
        metadata = self._consumer.list_topics(topic, timeout=timeout_s).topics[topic]
        if metadata.error is not None:
            raise KafkaException(metadata.error)
        positions = []
        for partition in sorted(metadata.partitions):
            if self._settings.from_latest:
                tp = RdTopicPartition(topic, partition)
                _, end = self._consumer.get_watermark_offsets(tp, timeout=timeout_s)
                positions.append(RdTopicPartition(topic, partition, end))
            else:
                positions.append(RdTopicPartition(topic, partition, OFFSET_BEGINNING))
        return positions

    def assignment(self) -> list[TopicPartition]:
        """The partitions this consumer reads now (the group's share, once it has one)."""
        if self._settings.group is None:
            return list(self._assigned)
        return [TopicPartition(tp.topic, tp.partition) for tp in self._consumer.assignment()]

    async def wait_assigned(self, timeout_s: float) -> None:
        """Until the group gave this consumer its partitions (at once without a group).
        librdkafka joins the group within a poll: this polls, and keeps what it read
        for the next `getmany`."""
        deadline = time.monotonic() + timeout_s
        while not self.assignment():
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{self._settings.client_id}: no partitions assigned after {timeout_s}s"
                )
            for tp, records in (await self._run(self._poll, 0.05, 64)).items():
                self._held.setdefault(tp, []).extend(records)

    async def getmany(
        self, timeout_s: float, max_records: int
    ) -> dict[TopicPartition, list[Record]]:
        """The records fetched, by partition in offset order: as soon as one is there,
        with what else is (up to `max_records`); empty after `timeout_s` without one."""
        if self._held:
            held, self._held = self._held, {}
            return held
        return await self._run(self._poll, timeout_s, max_records)

    def _poll(self, timeout_s: float, max_records: int) -> dict[TopicPartition, list[Record]]:
        if not self._subscribed and self._settings.group is not None:
            self._consumer.subscribe(self._topics)
            self._subscribed = True
        first = self._consumer.poll(timeout_s)
        if first is None:
            return {}
        messages = [first]
        if max_records > 1:
            messages += self._consumer.consume(max_records - 1, 0)
        batches: dict[TopicPartition, list[Record]] = {}
        for m in messages:
            err = m.error()
            if err is not None:
                _log_error(self._settings.client_id, err)
                continue
            # A record without an error has its topic, partition and offset, and its
            # headers as a list of (name, bytes) pairs.
            topic, partition, offset = cast(str, m.topic()), cast(int, m.partition()), m.offset()
            headers = cast(list[tuple[str, bytes]], m.headers() or [])
            record = Record(topic, partition, cast(int, offset), m.key(), m.value(), headers)
            batches.setdefault(TopicPartition(topic, partition), []).append(record)
        return batches

    async def commit(self, offsets: dict[TopicPartition, int]) -> None:
        """Commit each partition's next offset to read, and wait for the brokers' answer."""
        listed = [RdTopicPartition(tp.topic, tp.partition, o) for tp, o in offsets.items()]
        answered = await asyncio.to_thread(
            self._consumer.commit, offsets=listed, asynchronous=False
        )
        failed = [tp for tp in answered or () if tp.error is not None]
        if failed:
            raise KafkaException(failed[0].error)

    async def stop(self) -> None:
        """Leave the group (its partitions go to the others at once) and close."""
        if self._closed:
            return
        self._closed = True
        try:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self._thread, self._consumer.close)
        finally:
            self._thread.shutdown(wait=False)

    async def _run(self, work: Any, *args: Any) -> Any:
        if self._closed:
            raise ConsumerClosed(f"{self._settings.client_id}: the consumer is stopped")
        return await asyncio.get_running_loop().run_in_executor(self._thread, work, *args)


_NO_LEADER_YET = frozenset(
    {
        KafkaError.LEADER_NOT_AVAILABLE,
        KafkaError.NOT_LEADER_FOR_PARTITION,
        KafkaError.UNKNOWN_TOPIC_OR_PART,
        KafkaError._UNKNOWN_PARTITION,
        KafkaError._UNKNOWN_TOPIC,
    }
)


class ConsumerClosed(RuntimeError):
    """The consumer was stopped: nothing more comes from it."""


def _log_error(name: str, err: KafkaError) -> None:
    """A consumer error librdkafka handed over as a record: it goes on by itself (a
    broker away, a topic not there yet); a fatal one is raised."""
    if err.fatal():
        raise KafkaException(err)
    log.debug("%s: %s", name, err)
