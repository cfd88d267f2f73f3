"""Kafka plumbing shared by the services: topic creation, a publisher, a consumer loop.

The consumer is at-least-once: it commits a message's offset only after its
handler returned. A handler that meets a transient error (Redis, Kafka or the
state-store away for a while) gets the same message again, with backoff, until it
goes through: an outage delays calls, it never drops them. Only a message that
cannot be read (it does not decode, or its schema is newer than ours), or whose
handler keeps failing for other reasons, goes to the dead-letter topic; then the
calls it names are answered with an error (`answer`), and the loop goes on. Nothing
that happens to one message ends the loop while the process lives; `health()`
says when it is dead or stuck.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import ConsumerStoppedError, KafkaConnectionError, TopicAlreadyExistsError
from aiokafka.protocol.metadata import MetadataRequest
from opentelemetry.context import Context
from prometheus_client import Counter

from plexrl import tracing
from plexrl.kafka_replication import TopicReplication
from plexrl.kafka_security import PLAINTEXT, KafkaSecurity
from plexrl.messages import DeadLetter, DeadLetterReason, MessageError, decode, encode
from plexrl.retry import DESYNCHRONIZED, Backoff, is_transient, retrieved, retrying

log = logging.getLogger(__name__)

DLQ_MESSAGES = Counter(
    "plexrl_dlq_messages_total",
    "Messages sent to the dead-letter topic, by reason and by the consumer that gave up",
    ["reason", "consumer"],
)

T = TypeVar("T")

HANDLER_RETRIES = Counter(
    "plexrl_consumer_retries_total",
    "Messages handed to a handler again after a transient error",
    ["consumer"],
)


@dataclass(frozen=True)
class Delivery:
    """Where a message came from, and the trace context it carried."""

    topic: str
    partition: int
    offset: int
    headers: Sequence[tuple[str, bytes]] = ()

    @functools.cached_property
    def context(self) -> Context:
        """The trace context of the record's headers, read when first asked for: most
        handlers (the scheduler's completions and events, heartbeats) never ask."""
        return tracing.context_of_headers(self.headers)

    @property
    def tp(self) -> TopicPartition:
        return TopicPartition(self.topic, self.partition)


Handler = Callable[[T, Delivery], Awaitable[None]]
Answer = Callable[[DeadLetter], Awaitable[None]]
"""Answers the calls a dead letter names (plexrl.dead_letters.DeadLetters)."""
Skipped = Callable[[Delivery], Awaitable[None]]
AfterBatch = Callable[[], Awaitable[None]]
"""Called once a poll's messages are all handled, before their offsets count as done."""
BeforeBatch = Callable[[list[Any]], Awaitable[None]]
"""Called with a poll's messages (those that decoded) before the first is handled."""


async def wait_for_kafka(
    bootstrap: str, timeout_s: float = 60.0, security: KafkaSecurity = PLAINTEXT
) -> None:
    """Retry until the broker answers; raises with a hint when it never does."""
    deadline = time.monotonic() + timeout_s
    while True:
        admin = AIOKafkaAdminClient(
            bootstrap_servers=bootstrap, request_timeout_ms=5000, **security.client_options()
        )
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


_TOPIC_EXISTS = 36
"""Kafka's TOPIC_ALREADY_EXISTS error code: another service created it first."""


async def ensure_topics(
    bootstrap: str,
    wanted: dict[str, int],
    replication: TopicReplication | None = None,
    security: KafkaSecurity = PLAINTEXT,
) -> None:
    """Create the topics that do not exist yet (idempotent, safe to race), replicated as
    `replication` says; raises saying what to change when the brokers refuse them."""
    replication = replication or TopicReplication()
    # A broker whose host vanished must not hold the caller for aiokafka's 40 s default
    # (the scheduler creates a joining worker's topics in its control loop).
    admin = AIOKafkaAdminClient(
        bootstrap_servers=bootstrap,
        request_timeout_ms=REQUEST_TIMEOUT_MS,
        **security.client_options(),
    )
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        missing = [
            NewTopic(
                name=name,
                num_partitions=parts,
                replication_factor=replication.factor,
                topic_configs={"min.insync.replicas": str(replication.min_insync)},
            )
            for name, parts in wanted.items()
            if name not in existing
        ]
        if missing:
            with contextlib.suppress(TopicAlreadyExistsError):
                response = await admin.create_topics(missing)
                refused = [
                    (name, code, message)
                    for name, code, message in _topic_errors(response)
                    if code not in (0, _TOPIC_EXISTS)
                ]
                if refused:
                    brokers = len((await admin.describe_cluster()).get("brokers", []))
                    raise RuntimeError(
                        f"Kafka at {bootstrap} ({brokers} brokers) refused to create topics "
                        f"with replication factor {replication.factor} and "
                        f"min.insync.replicas {replication.min_insync}: {refused}; the factor "
                        "must not exceed the brokers (PLEXRL_KAFKA_REPLICATION_FACTOR)"
                    )
            log.info("created topics %s", [t.name for t in missing])
        if replication.factor > 1:
            await _warn_underreplicated(admin, sorted(set(wanted) & existing), replication)
    finally:
        await admin.close()


def _topic_errors(response: Any) -> list[tuple[str, int, str]]:
    """(topic, error code, message) of a CreateTopics response, whatever its version."""
    out = []
    for entry in getattr(response, "topic_errors", None) or getattr(response, "topics", []):
        name, code = entry[0], entry[1]
        message = entry[2] if len(entry) > 2 and isinstance(entry[2], str) else ""
        out.append((str(name), int(code), message or ""))
    return out


async def _warn_underreplicated(
    admin: AIOKafkaAdminClient, names: list[str], replication: TopicReplication
) -> None:
    """Topics made before replication was raised keep their old factor: say so, since a
    broker lost then loses their messages."""
    if not names:
        return
    for topic in await admin.describe_topics(names):
        factors = {len(p["replicas"]) for p in topic.get("partitions", [])}
        if factors and min(factors) < replication.factor:
            log.warning(
                "topic %s has %d replicas, fewer than PLEXRL_KAFKA_REPLICATION_FACTOR=%d: it "
                "was created before; reassign its partitions (kafka-reassign-partitions) "
                "or recreate it",
                topic["topic"],
                min(factors),
                replication.factor,
            )


def _key_bytes(key: str | bytes | None) -> bytes | None:
    return key.encode() if isinstance(key, str) else key


METADATA_MAX_AGE_MS = 5000
"""Every client refreshes its view of the brokers this often (aiokafka's default is five
minutes): a client that sent nothing for a while still knows which brokers are gone and
who leads each partition now, instead of finding out by a request timeout each."""
REQUEST_TIMEOUT_MS = 5000
"""A request to a broker (or a connection to it) unanswered this long fails and is tried
again, on the partition's new leader if it moved. aiokafka's 40 s default would hold
every send and fetch for that long when a broker's host vanishes (no reset, only
silence), while the brokers elect new leaders in a few seconds."""


PRODUCER_RENEWALS = Counter(
    "plexrl_producer_renewals_total",
    "Producers replaced after the brokers refused their sequence numbers",
)


class Publisher:
    """One producer per service; every message carries the current trace context.

    A producer the brokers refuse as out of sequence (`DESYNCHRONIZED`) is replaced by a
    new one, and the send that met it fails as transient: its caller sends again
    (`retry_until`, the gateway's outbox), on the new producer. What the old one had
    written stays written; a message it wrote whose acknowledgement was lost may be
    written again by the new one, which the consumers already take once (they dedupe
    by request id and the job's ledger, as after any republish)."""

    def __init__(
        self,
        bootstrap: str,
        client_id: str,
        request_timeout_ms: int = REQUEST_TIMEOUT_MS,
        security: KafkaSecurity = PLAINTEXT,
    ) -> None:
        self._settings: dict[str, Any] = dict(
            security.client_options(),
            bootstrap_servers=bootstrap,
            client_id=client_id,
            request_timeout_ms=request_timeout_ms,
            metadata_max_age_ms=METADATA_MAX_AGE_MS,
            # Idempotent: a send the producer retries after a lost acknowledgement is
            # written once, in order (acks=all is what idempotence requires).
            acks="all",
            enable_idempotence=True,
            linger_ms=0,
            max_request_size=8 * 1024 * 1024,
        )
        self._producer = AIOKafkaProducer(**self._settings)
        self._renewing = asyncio.Lock()
        self._background: set[asyncio.Future[None]] = set()
        self._retry: tuple[asyncio.Event, Backoff] | None = None
        self._stamp: Callable[[Any], Any] | None = None
        self.renewals = 0

    async def start(self) -> None:
        await self._producer.start()

    def stamp_with(self, stamp: Callable[[Any], Any] | None) -> None:
        """From now on every message passes through `stamp` before it is encoded (the
        leading scheduler puts its term's token on its dispatches); None: no stamp."""
        self._stamp = stamp

    def _encoded(self, message: Any) -> bytes:
        return encode(message if self._stamp is None else self._stamp(message))

    async def stop(self) -> None:
        await self._producer.stop()
        for task in list(self._background):
            task.cancel()

    def retry_until(self, stop: asyncio.Event, backoff: Backoff | None = None) -> None:
        """From now on `publish` waits out a broker that is away (transient errors are
        retried with backoff) until `stop` is set, instead of raising at the first one.
        For services whose messages must go out (the scheduler's dispatches, a worker's
        completions); the gateway fails fast instead and lets its outbox retry."""
        self._retry = (stop, backoff or Backoff(first_s=0.05, max_s=2.0))

    async def publish(
        self,
        topic: str,
        key: str | bytes | None,
        message: Any,
        headers: tracing.Headers | None = None,
    ) -> None:
        """Send and wait for the broker's acknowledgement (retrying, after `retry_until`).
        `headers`: the record's trace context where the caller has it already (see
        `tracing.unrecorded_headers`); by default the current span's (`record_headers`)."""
        if self._retry is None:
            await self._send(topic, key, message, headers)
            return
        stop, backoff = self._retry
        await retrying(
            lambda: self._send(topic, key, message, headers),
            what=f"publishing to {topic}",
            stop=stop,
            backoff=backoff,
        )

    async def _send(
        self,
        topic: str,
        key: str | bytes | None,
        message: Any,
        headers: tracing.Headers | None = None,
    ) -> None:
        await self.publish_raw(topic, _key_bytes(key), self._encoded(message), headers)

    async def publish_soon(self, topic: str, key: str | bytes | None, message: Any) -> None:
        """Queue a message without waiting for the broker: for announcements whose loss
        a later one repairs (heartbeats, residency changes). Failures are logged."""
        delivery = await self.publish_deferred(topic, key, message)
        delivery.add_done_callback(_log_failure)

    async def publish_deferred(
        self, topic: str, key: str | bytes | None, message: Any
    ) -> asyncio.Future[Any]:
        """Queue a message now and return the broker's acknowledgement, to await later.

        Messages queued one after another on one partition go out in that order (the
        producer is idempotent), so a caller with several messages to send queues them
        all and waits once, instead of one broker round trip each. Awaiting the result
        raises what the send met; the caller decides how to retry (see `publish`)."""
        producer = self._producer
        delivery: asyncio.Future[Any] = await producer.send(
            topic,
            self._encoded(message),
            key=_key_bytes(key),
            headers=tracing.record_headers(topic),
        )
        delivery.add_done_callback(lambda done: self._check(producer, done))
        return delivery

    async def publish_raw(
        self,
        topic: str,
        key: bytes | None,
        value: bytes,
        headers: tracing.Headers | None = None,
    ) -> None:
        producer = self._producer
        if headers is None:
            headers = tracing.record_headers(topic)
        try:
            await producer.send_and_wait(topic, value, key=key, headers=headers)
        except DESYNCHRONIZED as exc:
            await self._renew(producer, exc)
            raise

    def _check(self, producer: AIOKafkaProducer, delivery: asyncio.Future[Any]) -> None:
        """A queued send's outcome: a refused sequence renews the producer."""
        if delivery.cancelled():
            return
        exc = delivery.exception()
        if isinstance(exc, DESYNCHRONIZED):
            self._in_background(self._renew(producer, exc))

    async def _renew(self, broken: AIOKafkaProducer, exc: BaseException) -> None:
        """Replace `broken` (once, however many sends met it) with a fresh producer."""
        async with self._renewing:
            if self._producer is not broken:
                return  # another send renewed it already
            fresh = AIOKafkaProducer(**self._settings)
            await fresh.start()
            self._producer = fresh
            self.renewals += 1
            PRODUCER_RENEWALS.inc()
        log.warning("the brokers refused this producer's sequence (%r): a new producer", exc)
        self._in_background(_stop_quietly(broken))

    def _in_background(self, work: Awaitable[None]) -> None:
        """Run `work` as a task held until it ends (cancelled by `stop`)."""
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def ping(self, timeout_s: float = 2.0) -> bool:
        """True when a broker answers a metadata request within `timeout_s` (health checks).

        Every broker the producer knows is asked at once and the first answer counts: one
        broker's host lost (the cluster still serves, its partitions led elsewhere) must
        not make every service look unhealthy while a request to it times out."""
        client = self._producer.client
        nodes = [b.nodeId for b in client.cluster.brokers()]
        if not nodes:  # no metadata yet: ask the bootstrap servers
            try:
                await asyncio.wait_for(client.fetch_all_metadata(), timeout_s)
            except Exception:
                return False
            return True
        asks = [asyncio.ensure_future(client.send(n, MetadataRequest([]))) for n in nodes]
        try:
            for answer in asyncio.as_completed(asks, timeout=timeout_s):
                with contextlib.suppress(Exception):
                    await answer
                    return True
            return False
        except TimeoutError:
            return False
        finally:
            for ask in asks:
                ask.cancel()
                ask.add_done_callback(retrieved)


async def _stop_quietly(producer: AIOKafkaProducer, timeout_s: float = 10.0) -> None:
    """Stop a replaced producer: what it still holds fails (its senders retry on the new
    one); a stop that hangs on an unreachable broker is given up."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(producer.stop(), timeout_s)


def _log_failure(delivery: asyncio.Future[Any]) -> None:
    if not delivery.cancelled() and delivery.exception() is not None:
        log.warning("a queued message was not delivered: %s", delivery.exception())


class _Outcome(enum.Enum):
    HANDLED = "handled"
    DEAD_LETTERED = "dead_lettered"
    ABANDONED = "abandoned"
    """The service stops while the message still fails: left for a replay, not committed."""


@dataclass(frozen=True)
class ConsumerTuning:
    """How a consumer waits out failures."""

    backoff: Backoff = field(default_factory=lambda: Backoff(first_s=0.1, max_s=5.0))
    """Between attempts at a message whose handler failed, and between failed polls."""
    handler_attempts: int = 3
    """Attempts at a message whose handler fails with a non-transient error before it is
    dead-lettered (transient errors are retried without limit)."""
    stuck_after_s: float = 30.0
    """`health()` reports the consumer stuck once one message has failed transiently for
    this long, or the loop has not polled Kafka for this long outside a handler."""
    request_timeout_ms: int = REQUEST_TIMEOUT_MS
    """A fetch, heartbeat or commit unanswered this long fails and is retried (on a new
    leader or coordinator once the brokers moved them); see REQUEST_TIMEOUT_MS."""
    session_timeout_ms: int = 10000
    """A group member silent this long is dropped and its partitions go to the others
    (brokers accept 6000 at least, by default)."""
    max_poll_interval_ms: int = 300000
    """A member that has not polled for this long leaves its group (aiokafka's default).
    A consumer whose stop was cut short keeps heartbeating, rejoins at the next
    rebalance and takes partitions it never reads: this bounds how long they wait."""
    final_commit_s: float = 5.0
    """On the way out, the last commit is given up after this long (its messages are
    handled again by the partition's next owner, as after a crash). aiokafka retries a
    commit while the group's coordinator is away, for minutes, and a consumer not yet
    stopped stays in its group meanwhile, holding partitions nobody reads."""

    def __post_init__(self) -> None:
        if self.handler_attempts < 1:
            raise ValueError(f"handler_attempts is {self.handler_attempts}; it must be >= 1")
        if self.stuck_after_s <= 0:
            raise ValueError(f"stuck_after_s is {self.stuck_after_s}; it must be positive")
        if self.final_commit_s <= 0:
            raise ValueError(f"final_commit_s is {self.final_commit_s}; it must be positive")


@dataclass(frozen=True)
class FetchTuning:
    """How a consumer asks the broker for records: as soon as one arrives (the default,
    for consumers on a call's path), or in fewer, fuller fetches (for consumers that
    may see a record a few milliseconds late, such as the scheduler's completions under
    direct leases): each fetch request is a socket write and a broker round in every
    service, the larger part of their CPU per call."""

    max_wait_ms: int = 500
    """The broker answers a fetch after this long even if fewer than `min_bytes` came."""
    min_bytes: int = 1
    """The broker answers a fetch once this many bytes of records are there."""

    def __post_init__(self) -> None:
        if self.max_wait_ms < 0 or self.min_bytes < 1:
            raise ValueError(
                f"max_wait_ms is {self.max_wait_ms} and min_bytes {self.min_bytes}; the wait "
                "must be >= 0 and min_bytes >= 1 (1: answer at the first record)"
            )


LOW_LATENCY = FetchTuning()
"""Answer at the first record; an idle consumer asks again every half second."""


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
        commit_interval_s: float = 0.25,
        answer: Answer | None = None,
        skipped: Skipped | None = None,
        after_batch: AfterBatch | None = None,
        before_commit: AfterBatch | None = None,
        before_batch: BeforeBatch | None = None,
        tuning: ConsumerTuning | None = None,
        fetch: FetchTuning = LOW_LATENCY,
        clock: Callable[[], float] = time.monotonic,
        security: KafkaSecurity = PLAINTEXT,
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
        # Who answers the callers of a dead letter, and (when the owner commits offsets
        # itself) who must count a dead-lettered offset as finished.
        self._answer = answer
        self._skipped = skipped
        # For handlers that queue their effects and write them together (one Redis
        # round trip per poll, not per message): the offsets of a poll are marked for
        # commit only after it returned, so a crash before it replays the poll.
        self._after_batch = after_batch
        # For handlers whose queued effects may lag their messages by a commit interval:
        # written once per commit, before it (a crash before the write replays the
        # messages, as a crash before `after_batch` does), not once per poll.
        self._before_commit = before_commit if group is not None else None
        if before_commit is not None and group is None:
            raise ValueError(f"{name}: before_commit needs a consumer group (offsets to commit)")
        # For handlers that read ahead for a whole poll (one round trip for all its
        # messages): an optimisation only, so a failure is logged and the handlers read
        # for themselves.
        self._before_batch = before_batch
        self._tuning = tuning or ConsumerTuning()
        self._clock = clock
        self._to_commit: dict[TopicPartition, int] = {}
        self._consumer = AIOKafkaConsumer(
            *topics,
            **security.client_options(),
            bootstrap_servers=bootstrap,
            group_id=group,
            client_id=name,
            enable_auto_commit=False,
            auto_offset_reset="latest" if from_latest else "earliest",
            # By default the broker answers a fetch as soon as a record arrives
            # (fetch_min_bytes=1): the wait bounds only how often an idle consumer asks
            # again (a request, a response, a socket write and a wake-up each time).
            fetch_max_wait_ms=fetch.max_wait_ms,
            fetch_min_bytes=fetch.min_bytes,
            max_partition_fetch_bytes=16 * 1024 * 1024,
            fetch_max_bytes=64 * 1024 * 1024,
            session_timeout_ms=self._tuning.session_timeout_ms,
            max_poll_interval_ms=self._tuning.max_poll_interval_ms,
            heartbeat_interval_ms=1000,
            request_timeout_ms=self._tuning.request_timeout_ms,
            metadata_max_age_ms=METADATA_MAX_AGE_MS,
        )
        self._fetch = fetch
        self.handled = 0
        self.dead_lettered = 0
        self.retries = 0
        self._stop: asyncio.Event | None = None
        self._running = False
        self._died: str | None = None
        self._last_poll = clock()
        self._handling_since: float | None = None
        self._failing_since: float | None = None

    @property
    def name(self) -> str:
        return self._name

    @property
    def fetch(self) -> FetchTuning:
        """How its fetches ask the broker now (`tune`)."""
        return self._fetch

    def tune(self, fetch: FetchTuning) -> None:
        """Ask the broker this way from the next fetch on (one waiting at the broker now
        keeps the terms it was sent with). aiokafka reads the two figures from its
        fetcher for every request it builds and has no setter for them."""
        if fetch == self._fetch:
            return
        self._fetch = fetch
        for holder in (self._consumer, getattr(self._consumer, "_fetcher", None)):
            if holder is not None:
                holder._fetch_max_wait_ms = fetch.max_wait_ms
                holder._fetch_min_bytes = fetch.min_bytes

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

    def health(self) -> dict[str, Any]:
        """`ok` is False when the loop died while the service runs, or is stuck."""
        now = self._clock()
        stopping = self._stop is not None and self._stop.is_set()
        failing_s = 0.0 if self._failing_since is None else now - self._failing_since
        idle_s = 0.0 if self._handling_since is not None else now - self._last_poll
        dead = self._stop is not None and not self._running and not stopping
        stuck = self._running and max(failing_s, idle_s) > self._tuning.stuck_after_s
        problem = (
            f"the consume loop ended: {self._died}"
            if dead
            else f"one message has failed for {failing_s:.0f}s"
            if failing_s > self._tuning.stuck_after_s
            else f"no poll for {idle_s:.0f}s"
            if stuck
            else ""
        )
        return {
            "ok": not (dead or stuck),
            "running": self._running,
            "handled": self.handled,
            "dead_lettered": self.dead_lettered,
            "retries": self.retries,
            **({"problem": problem} if problem else {}),
        }

    async def run(self, stop: asyncio.Event) -> None:
        """Consume until `stop` is set; a message in hand is finished first.

        Offsets are committed in the background (every `commit_interval_s`, and once
        more on the way out), never before their message's handler returned: still
        at-least-once, without a broker round trip between one message and the next.
        """
        self._stop = stop
        self._running = True
        self._last_poll = self._clock()  # idle time counts from the loop's start
        committer = asyncio.create_task(self._commit_periodically(stop))
        try:
            await self._consume(stop)
        except ConsumerStoppedError:
            self._died = "the Kafka consumer was stopped"
        except BaseException as exc:
            self._died = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            self._running = False
            committer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await committer
            try:
                await asyncio.wait_for(self._flush_commits(), self._tuning.final_commit_s)
            except TimeoutError:
                log.warning(
                    "%s: the last commit took over %gs (the group's coordinator away?): "
                    "left to the partitions' next owner, which handles those messages again",
                    self._name,
                    self._tuning.final_commit_s,
                )

    async def _consume(self, stop: asyncio.Event) -> None:
        polls_failed = 0
        while not stop.is_set():
            try:
                batches = await self._poll()
            except ConsumerStoppedError:
                raise
            except Exception as exc:  # a broker away: poll again, never end the loop
                polls_failed += 1
                log.warning("%s: polling failed (%r); retrying", self._name, exc)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self._tuning.backoff.delay(polls_failed))
                continue
            polls_failed = 0
            self._last_poll = self._clock()
            handled: dict[TopicPartition, int] = {}
            abandoned = False
            decoded = {
                (r.topic, r.partition, r.offset): self._decode(r)
                for records in batches.values()
                for r in records
            }
            if self._before_batch is not None and decoded:
                try:
                    await self._before_batch(
                        [m for m in decoded.values() if not isinstance(m, MessageError)]
                    )
                except Exception:
                    log.warning("%s: reading ahead for a poll failed", self._name, exc_info=True)
            for tp, records in batches.items():
                for record in records:
                    message = decoded[(record.topic, record.partition, record.offset)]
                    if await self._handle(record, message, stop) is _Outcome.ABANDONED:
                        abandoned = True
                        break
                    handled[tp] = record.offset + 1
                if abandoned:
                    break
            if self._after_batch is not None and handled:
                await self._after_batch()
            if self._commit_after_handler:
                self._to_commit.update(handled)
            if abandoned:
                return
            self._last_poll = self._clock()

    async def _poll(self) -> dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]]:
        """A poll. No span marks it: each handler continues its message's trace from the
        record's headers (`Delivery.context`) in a span of its own."""
        return await self._consumer.getmany(timeout_ms=200, max_records=64)

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
            if self._before_commit is not None:
                await self._before_commit()
            await self._consumer.commit(offsets)
        except asyncio.CancelledError:
            # The periodic commit cut short on the way out: the last flush sends them
            # (committing an offset twice is harmless; leaving it is a replay).
            self._recommit(offsets)
            raise
        except Exception:  # a rebalance, say: the next flush (or a replay) covers it
            log.warning("%s: committing %s failed", self._name, offsets, exc_info=True)
            self._recommit(offsets)

    def _recommit(self, offsets: dict[TopicPartition, int]) -> None:
        for tp, offset in offsets.items():
            self._to_commit[tp] = max(offset, self._to_commit.get(tp, 0))

    def _decode(self, record: ConsumerRecord[bytes, bytes]) -> Any:
        """The record's message, or the MessageError that says why it is none."""
        try:
            return decode(record.value or b"", self._message_type)
        except MessageError as exc:
            return exc

    async def _handle(
        self, record: ConsumerRecord[bytes, bytes], message: Any, stop: asyncio.Event
    ) -> _Outcome:
        """Hand the (decoded) message on, retrying failures; dead-letter it only if it
        cannot be read or its handler keeps failing for reasons other than unavailable
        infrastructure."""
        delivery = Delivery(record.topic, record.partition, record.offset, record.headers)
        if isinstance(message, MessageError):
            await self._dead_letter(record, delivery, message.reason, message.detail, stop)
            return _Outcome.DEAD_LETTERED
        self._handling_since = self._clock()
        attempts = 0  # failures that were not transient
        tries = 0
        try:
            while True:
                try:
                    await self._handler(message, delivery)
                    self.handled += 1
                    return _Outcome.HANDLED
                except Exception as exc:
                    transient = is_transient(exc)
                    if not transient:
                        attempts += 1
                    if stop.is_set():
                        log.warning(
                            "%s: stopping with %s@%s unhandled (%r); a replay will retry it",
                            self._name,
                            record.topic,
                            record.offset,
                            exc,
                        )
                        return _Outcome.ABANDONED
                    if attempts >= self._tuning.handler_attempts:
                        log.exception(
                            "%s: handler failed %d times on %s@%s",
                            self._name,
                            attempts,
                            record.topic,
                            record.offset,
                        )
                        await self._dead_letter(
                            record, delivery, DeadLetterReason.HANDLER_FAILED, repr(exc), stop
                        )
                        return _Outcome.DEAD_LETTERED
                    if self._failing_since is None:
                        self._failing_since = self._clock()
                    tries += 1
                    self.retries += 1
                    HANDLER_RETRIES.labels(self._name).inc()
                    wait = self._tuning.backoff.delay(tries)
                    log.warning(
                        "%s: handling %s@%s failed (%s: %s); %s, again in %.2fs",
                        self._name,
                        record.topic,
                        record.offset,
                        type(exc).__name__,
                        exc,
                        "transient" if transient else f"attempt {attempts}",
                        wait,
                    )
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), wait)
        finally:
            self._handling_since = None
            self._failing_since = None

    async def _dead_letter(
        self,
        record: ConsumerRecord[bytes, bytes],
        delivery: Delivery,
        reason: DeadLetterReason,
        detail: str,
        stop: asyncio.Event,
    ) -> None:
        """Publish the letter (retried), answer its callers, count its offset as done."""
        self.dead_lettered += 1
        DLQ_MESSAGES.labels(str(reason), self._name).inc()
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
        steps: list[tuple[str, Callable[[], Awaitable[None]]]] = [
            (
                "publishing a dead letter",
                lambda: self._dlq_publisher.publish(self._dlq_topic, record.key, letter),
            )
        ]
        answer, skipped = self._answer, self._skipped
        if answer is not None:
            steps.append(("answering a dead letter's callers", lambda: answer(letter)))
        if skipped is not None:
            steps.append(("finishing a dead-lettered offset", lambda: skipped(delivery)))
        for what, step in steps:
            try:
                await retrying(
                    step, what=f"{self._name}: {what}", stop=stop, backoff=self._tuning.backoff
                )
            except Exception:  # never end the loop over one letter; the log keeps it
                log.exception(
                    "%s: %s failed for %s@%s", self._name, what, record.topic, record.offset
                )


__all__ = [
    "DLQ_MESSAGES",
    "LOW_LATENCY",
    "ConsumerTuning",
    "Delivery",
    "FetchTuning",
    "MessageConsumer",
    "Publisher",
    "TopicPartition",
    "TopicReplication",
    "ensure_topics",
    "wait_for_kafka",
]
