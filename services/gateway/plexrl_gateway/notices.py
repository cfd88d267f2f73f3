"""Wakes the gateway's waiters from the completions announced on Redis.

Whoever records a completion (`CallStore.record_completion`, the worker's recorder)
announces it on `<cluster>:completed` once it is recorded and replicated; this listener
hands each notice to the waiters and to the pending-calls quota. Pub/sub delivers at
most once, and only to a connected subscriber, so Redis stays the truth: after each
(re)subscription the listener reads the completions of every call it waits for or counts
as pending (what was announced while it was away), and every `sweep_s` it reads those of
the calls waited for longer than that (a recorder that died between its record and its
announcement), so no waiter depends on a notice arriving. Each period it also pings the
subscription: one that answers nothing for a few periods is replaced.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import redis.asyncio as aioredis

from plexrl.messages import CompletionNotice, CompletionNoticeHead, MessageError, decode
from plexrl.stores.redis import raw_bytes
from plexrl_gateway import metrics
from plexrl_gateway.futures import FutureWaiter

log = logging.getLogger(__name__)

SWEEP_CHUNK = 512
"""Request ids per Redis read when sweeping."""

SILENT_PERIODS = 3
"""Sweep periods without a notice or an answer to a ping after which the subscription's
connection is taken for dead and a new one is made."""


class CompletionNotices:
    """The listener: one subscription, its reconnection and the sweeps."""

    name = "gateway-notices"

    def __init__(
        self,
        redis: aioredis.Redis,
        channel: str,
        futures: FutureWaiter,
        pending: Callable[[], Iterable[str]] = tuple,
        sweep_s: float = 2.0,
        retry_s: float = 0.5,
    ) -> None:
        self._redis = redis
        self._channel = channel
        self._futures = futures
        self._pending = pending
        """The request ids the pending-calls quota counts (swept on each subscription)."""
        self._sweep_s = sweep_s
        self._retry_s = retry_s
        self._subscribed = asyncio.Event()
        self._failed: str | None = None
        self._resweep = False
        """The subscription's connection was opened again (redis-py resubscribed it)."""
        self.notices = 0
        self.subscriptions = 0

    @property
    def subscribed(self) -> bool:
        return self._subscribed.is_set()

    async def wait_subscribed(self) -> None:
        await self._subscribed.wait()

    def health(self) -> dict[str, Any]:
        """Ok while subscribed, or while a lost subscription is being made again after a
        Redis error (an outage shows in /healthz's `redis`); not ok after anything else
        failed the listener, until it is subscribed again."""
        return {
            "ok": self._failed is None,
            "subscribed": self.subscribed,
            "notices": self.notices,
            "subscriptions": self.subscriptions,
            **({"error": self._failed} if self._failed else {}),
        }

    async def run(self, stop: asyncio.Event) -> None:
        """Until `stop`: subscribe, sweep, hand notices over; after an error, wait
        `retry_s` and subscribe again (each subscription sweeps what it missed)."""
        try:
            while not stop.is_set():
                try:
                    await self._listen(stop)
                except (aioredis.ConnectionError, aioredis.TimeoutError, OSError) as e:
                    log.warning("completion notices: %s; subscribing again", e)
                except Exception as e:  # not Redis's: shown as unhealthy until it recovers
                    self._failed = f"{type(e).__name__}: {e}"
                    log.exception("completion notices failed; subscribing again")
                self._subscribed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self._retry_s)
        finally:
            self._subscribed.clear()

    async def _listen(self, stop: asyncio.Event) -> None:
        pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(self._channel)
            # redis-py reopens a lost connection by itself and subscribes again: what
            # was announced in between is swept as after the first subscription.
            if pubsub.connection is not None:
                pubsub.connection.register_connect_callback(self._reconnected)
            self.subscriptions += 1
            self._futures.accepted.listening(self.subscriptions)
            self._subscribed.set()
            self._failed = None
            self._resweep = True
            swept_at = heard_at = time.monotonic()
            while not stop.is_set():
                if self._resweep:
                    # Whatever was announced before the subscription took is in Redis.
                    self._resweep = False
                    await self._sweep([*self._futures.waiting, *self._pending()])
                message = await pubsub.get_message(timeout=self._sweep_s)
                if message is not None:
                    heard_at = time.monotonic()
                    if message.get("type") == "message":
                        await self._on_message(raw_bytes(message["data"]))
                if time.monotonic() - swept_at >= self._sweep_s:
                    # A connection cut off without a reset (a partition, a primary that
                    # hangs) looks subscribed: each period asks it for a pong.
                    if time.monotonic() - heard_at > SILENT_PERIODS * self._sweep_s:
                        raise aioredis.ConnectionError(
                            f"no notice nor pong on the subscription for "
                            f"{time.monotonic() - heard_at:.1f}s"
                        )
                    await pubsub.ping()
                    await self._sweep(self._futures.waiting_since(time.monotonic() - self._sweep_s))
                    swept_at = time.monotonic()
        finally:
            self._subscribed.clear()
            self._futures.accepted.listening(None)
            with contextlib.suppress(Exception):
                await pubsub.aclose()

    def _reconnected(self, _connection: object) -> None:
        # What the lost connection missed may concern any call accepted before.
        self.subscriptions += 1
        self._futures.accepted.listening(self.subscriptions)
        self._resweep = True

    async def _on_message(self, data: bytes) -> None:
        try:
            # A call nobody here waits for nor accepted (another gateway's) is read
            # only as far as its id, not its result (a sample's can run to megabytes).
            head: CompletionNoticeHead = decode(data, CompletionNoticeHead)
            request_id = head.completion.request_id
            notice: CompletionNotice | None = (
                decode(data, CompletionNotice) if self._futures.wants(request_id) else None
            )
        except MessageError:
            log.warning("completion notices: an unreadable notice (%d bytes) skipped", len(data))
            return
        self.notices += 1
        if notice is None:
            self._futures.answered(request_id)
            return
        try:
            await self._futures.on_completion(notice.completion, notice.traceparent, len(data))
        except Exception:  # one notice's failure is not the subscription's
            log.exception("completion notices: handling %s failed", request_id)

    async def _sweep(self, request_ids: list[str]) -> None:
        for start in range(0, len(request_ids), SWEEP_CHUNK):
            found = await self._futures.sweep(request_ids[start : start + SWEEP_CHUNK])
            if found:
                metrics.NOTICES_SWEPT.inc(found)
