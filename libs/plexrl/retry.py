"""Retrying what infrastructure refuses for a while: Redis, Kafka, the state-store.

A transient error (a dropped connection, a timeout, a Redis still loading its
append-only file, a broker without a leader) says nothing about the message or call
in hand: the same operation succeeds once the service is back. Those are retried here
with capped exponential backoff; anything else (a bug, bad input) is raised at once,
so callers never retry what can never succeed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import redis.exceptions
from aiokafka.errors import (
    InvalidProducerEpoch,
    KafkaError,
    KafkaTimeoutError,
    OutOfOrderSequenceNumber,
    RequestTimedOutError,
    UnknownProducerId,
)

log = logging.getLogger(__name__)

DESYNCHRONIZED = (OutOfOrderSequenceNumber, UnknownProducerId, InvalidProducerEpoch)
"""What the brokers answer an idempotent producer whose sequence numbers no longer match
theirs (a batch failed after its number was spent: a leader that moved mid-send, say).
The producer never recovers by itself: every later batch of that partition is refused
the same way. `plexrl.kafka.Publisher` starts a new one (a new producer id, numbers
from 0), so a send that met it is worth sending again."""

T = TypeVar("T")


@dataclass(frozen=True)
class Backoff:
    """Capped exponential backoff with jitter between attempts."""

    first_s: float = 0.05
    """Wait after the first failure."""
    max_s: float = 2.0
    """Longest wait between two attempts (a service that comes back is found soon)."""
    factor: float = 2.0
    """Each wait is this many times the previous one, until `max_s`."""

    def __post_init__(self) -> None:
        if self.first_s <= 0 or self.max_s < self.first_s or self.factor < 1:
            raise ValueError(
                f"Backoff(first_s={self.first_s}, max_s={self.max_s}, factor={self.factor}) "
                "needs 0 < first_s <= max_s and factor >= 1"
            )

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number `attempt` (1-based)."""
        base = min(self.max_s, self.first_s * self.factor ** min(attempt - 1, 32))
        return base * (0.5 + random.random() / 2)  # jitter: restarts do not stampede


def is_transient(exc: BaseException) -> bool:
    """True when `exc` is an infrastructure hiccup that a later attempt may not meet."""
    if isinstance(exc, redis.exceptions.ConnectionError | redis.exceptions.TimeoutError):
        return True  # includes BusyLoadingError: Redis replaying its append-only file
    if isinstance(exc, KafkaTimeoutError | RequestTimedOutError):
        return True
    if isinstance(exc, DESYNCHRONIZED):
        return True  # the publisher replaced its producer (plexrl.kafka.Publisher): send again
    if isinstance(exc, KafkaError):
        return bool(getattr(exc, "retriable", False))
    if isinstance(exc, httpx.TransportError):
        return True
    status = getattr(exc, "status_code", None)
    if isinstance(status, int) and status in (502, 503, 504):
        return True  # a service behind HTTP that says "not now"
    return isinstance(exc, ConnectionError | TimeoutError)


async def retrying(
    op: Callable[[], Awaitable[T]],
    *,
    what: str,
    stop: asyncio.Event | None = None,
    backoff: Backoff = Backoff(),
    on_retry: Callable[[BaseException, int], None] | None = None,
    within_s: float | None = None,
) -> T:
    """Run `op` until it returns; transient errors are logged and retried with backoff.

    Raises what `op` raised when the error is not transient, when `stop` is set (the
    service is shutting down: the caller leaves the work for a replay), or when the
    next attempt would start more than `within_s` seconds after the first (the caller
    must not be held longer; the error is still transient, so it may try again later).
    """
    attempt = 0
    started = time.monotonic()
    while True:
        try:
            return await op()
        except Exception as exc:
            if not is_transient(exc) or (stop is not None and stop.is_set()):
                raise
            attempt += 1
            wait = backoff.delay(attempt)
            if within_s is not None and time.monotonic() - started + wait > within_s:
                raise
            if on_retry is not None:
                on_retry(exc, attempt)
            log_ = log.warning if attempt == 1 or attempt % 20 == 0 else log.debug
            log_(
                "%s failed (%s: %s); attempt %d, retrying in %.2fs (%.1fs so far)",
                what,
                type(exc).__name__,
                exc,
                attempt,
                wait,
                time.monotonic() - started,
            )
            if stop is None:
                await asyncio.sleep(wait)
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), wait)


__all__ = ["Backoff", "is_transient", "retrying"]


def retrieved(future: asyncio.Future[Any]) -> None:
    """A done-callback for an outcome nobody awaits: reads it, so a failure is not logged
    as 'exception was never retrieved'."""
    if not future.cancelled():
        future.exception()
