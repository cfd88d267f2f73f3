"""librdkafka's producer (confluent-kafka) driven from an event loop.

A send is `produce` (C, returns at once) and a future; one thread per producer polls
librdkafka for delivery reports and hands every report of a poll to the loop in one
`call_soon_threadsafe`. It costs a service about a third less CPU per acknowledged
message than aiokafka's producer and answers sooner (`bench/kafka_clients.py`).

librdkafka retries a send by itself until `message.timeout.ms`; what it then reports
is raised from the send's future as a `KafkaException` (`plexrl.retry.is_transient`
says which are worth sending again). A fatal error (an idempotent producer the
brokers no longer take) ends the producer: every later send raises it, and the owner
replaces the producer (`plexrl.kafka.Publisher`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import deque
from collections.abc import Sequence
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer

from plexrl.kafka_security import KafkaSecurity, librdkafka_options

log = logging.getLogger(__name__)
librdkafka_log = logging.getLogger("plexrl.librdkafka")

_POLL_S = 0.2
"""The poll thread's longest wait: a report wakes it at once, so this bounds only how
long closing waits for the thread."""

Report = tuple[asyncio.Future[None], KafkaError | None]


def producer_config(
    bootstrap: str,
    client_id: str,
    security: KafkaSecurity,
    request_timeout_ms: int,
    metadata_max_age_ms: int,
    max_message_bytes: int,
) -> dict[str, Any]:
    """The services' producer settings: idempotent (a send librdkafka retries after a
    lost acknowledgement is written once, in order; acks=all is what that requires),
    sent at once, each send given up after `request_timeout_ms` (the caller decides
    whether to send again, as with any transient error)."""
    return {
        **librdkafka_options(security),
        "bootstrap.servers": bootstrap,
        "client.id": client_id,
        "enable.idempotence": True,
        "acks": "all",
        "linger.ms": 0,
        "message.timeout.ms": request_timeout_ms,
        "request.timeout.ms": request_timeout_ms,
        "socket.timeout.ms": request_timeout_ms,
        "metadata.max.age.ms": metadata_max_age_ms,
        "topic.metadata.refresh.interval.ms": metadata_max_age_ms,
        "message.max.bytes": max_message_bytes,
        "logger": librdkafka_log,
    }


class LoopProducer:
    """One librdkafka producer whose deliveries settle futures on the loop that made it."""

    def __init__(self, config: dict[str, Any], name: str) -> None:
        self._loop = asyncio.get_running_loop()
        self._fatal: KafkaError | None = None
        self._producer = Producer({**config, "error_cb": self._on_error})
        self._reports: deque[Report] = deque()
        """Reports of deliveries, appended within librdkafka's callbacks (on the poll
        thread, or the one flushing) and taken off by the poll thread."""
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._poll, name=f"{name}-kafka", daemon=True)
        self._thread.start()

    @property
    def fatal(self) -> KafkaError | None:
        """The fatal error that ended this producer, if one did."""
        return self._fatal

    def send(
        self,
        topic: str,
        value: bytes,
        key: bytes | None,
        headers: Sequence[tuple[str, bytes]],
    ) -> asyncio.Future[None]:
        """Queue one message; the future settles with the broker's acknowledgement, or
        raises the `KafkaException` librdkafka reported for it."""
        delivery: asyncio.Future[None] = self._loop.create_future()
        if self._fatal is not None:
            delivery.set_exception(KafkaException(self._fatal))
            return delivery
        reports = self._reports

        def delivered(err: KafkaError | None, _msg: Any) -> None:  # within a poll or flush
            reports.append((delivery, err))

        try:
            self._producer.produce(topic, value, key, headers=list(headers), on_delivery=delivered)
        except BufferError as exc:  # its queue is full: the brokers are slow or away
            delivery.set_exception(KafkaException(KafkaError(KafkaError._QUEUE_FULL, str(exc))))
        except KafkaException as exc:
            err = exc.args[0]
            if err.code() == KafkaError._FATAL or err.fatal():  # ended before the poll saw it
                self._ended(KafkaError(err.code(), err.str(), fatal=True))
                exc = KafkaException(self._fatal)
            delivery.set_exception(exc)
        return delivery

    def _poll(self) -> None:
        producer, closing = self._producer, self._closing
        while not closing.is_set():
            try:
                producer.poll(_POLL_S)
            except KafkaException as exc:  # a fatal error is raised from the poll too
                self._ended(exc.args[0])
                closing.wait(_POLL_S)
            self._hand_over()

    def _hand_over(self) -> None:
        pending = self._reports
        if not pending:
            return
        reports = []
        with contextlib.suppress(IndexError):
            while True:
                reports.append(pending.popleft())
        if (fatal := self._fatal) is not None:  # what failed, failed for it
            reports = [(d, err if err is None else fatal) for d, err in reports]
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
            self._loop.call_soon_threadsafe(_settle, reports)

    def _on_error(self, err: KafkaError) -> None:  # on the poll thread, within `poll`
        if err.fatal():
            self._ended(err)
        else:
            log.debug("Kafka producer: %s", err)

    def _ended(self, err: KafkaError) -> None:
        if self._fatal is None:
            self._fatal = err
            log.error("the Kafka producer met a fatal error: %s", err)
            self._producer.purge()  # what it still holds fails now, not at its timeout

    async def close(self, timeout_s: float) -> int:
        """Wait up to `timeout_s` for what is queued to be acknowledged, then stop the
        poll thread; returns how many messages were left undelivered (their sends
        raise)."""
        try:
            left = await asyncio.to_thread(self._producer.flush, timeout_s)
        except KafkaException as exc:  # it had met a fatal error: nothing more goes out
            self._ended(exc.args[0])
            left = len(self._producer)
        self._closing.set()
        await asyncio.to_thread(self._thread.join)
        if left:
            self._producer.purge()
            self._producer.poll(0)
        self._hand_over()
        await asyncio.sleep(0)  # let the reports just handed over settle their futures
        return int(left)


def _settle(reports: list[Report]) -> None:
    for delivery, err in reports:
        if delivery.done():
            continue
        if err is None:
            delivery.set_result(None)
        else:
            delivery.set_exception(KafkaException(err))
