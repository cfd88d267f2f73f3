"""Per-tenant quota on pending calls and their bytes: one tenant cannot fill the queues
(and the payloads Redis holds for them) that every tenant shares.

A call is pending from the moment this gateway publishes it until its completion is
seen (announced, or read by `retrieve_future`). A tenant at either cap
gets 429 with Retry-After for new calls until some of its calls are answered; the
SDK retries a 429 by itself. The count is this gateway's (several gateways each
enforce the cap on what they published); an entry whose completion never shows up
is forgotten after `forget_after_s`, so a lost message cannot lock a tenant out.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from plexrl.limits import CallLimits
from plexrl.messages import Dispatch, PayloadRef, PhaseRequest
from plexrl_gateway.errors import ApiError, Category
from plexrl_gateway.submitter import RequestPublisher


@dataclass(frozen=True)
class _Pending:
    at: float
    """When it was published (the injected clock)."""
    bytes: int
    """Its payload's encoded size."""


class PendingCalls:
    def __init__(
        self,
        limits: CallLimits,
        forget_after_s: float = 900.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._limits = limits
        self._forget_after_s = forget_after_s
        self._clock = clock
        self._by_tenant: dict[str, dict[str, _Pending]] = {}
        self._tenant_of: dict[str, str] = {}

    def count(self, tenant: str) -> int:
        self._forget_stale(tenant)
        return len(self._by_tenant.get(tenant, {}))

    def pending_bytes(self, tenant: str) -> int:
        self._forget_stale(tenant)
        return sum(p.bytes for p in self._by_tenant.get(tenant, {}).values())

    def admit(self, tenant: str) -> None:
        """Raises 429 (with Retry-After) when the tenant has `max_pending_calls` calls or
        `max_pending_bytes` of payloads pending."""
        calls, size = self.count(tenant), self.pending_bytes(tenant)
        over = None
        if calls >= self._limits.max_pending_calls:
            over = (
                f"{calls} calls pending, the most one tenant may have queued "
                f"({self._limits.max_pending_calls})"
            )
        elif size >= self._limits.max_pending_bytes:
            over = (
                f"{size} bytes of calls pending, the most one tenant may have queued "
                f"({self._limits.max_pending_bytes})"
            )
        if over is not None:
            raise ApiError(
                429,
                f"tenant {tenant!r} has {over}; wait for some results (retrieve_future) "
                "before sending more",
                Category.USER,
                headers={"Retry-After": str(self._limits.retry_after_s)},
            )

    def published(self, tenant: str, request_id: str, size: int = 0) -> None:
        self._by_tenant.setdefault(tenant, {}).setdefault(request_id, _Pending(self._clock(), size))
        self._tenant_of[request_id] = tenant

    def ids(self) -> list[str]:
        """Every request id counted as pending, of every tenant."""
        return list(self._tenant_of)

    def done(self, request_id: str) -> None:
        tenant = self._tenant_of.pop(request_id, None)
        if tenant is not None:
            calls = self._by_tenant.get(tenant, {})
            calls.pop(request_id, None)
            if not calls:
                self._by_tenant.pop(tenant, None)

    def _forget_stale(self, tenant: str) -> None:
        calls = self._by_tenant.get(tenant)
        if not calls:
            return
        horizon = self._clock() - self._forget_after_s
        # Oldest first (dicts keep insertion order): stop at the first fresh one.
        for request_id, pending in list(calls.items()):
            if pending.at >= horizon:
                break
            self.done(request_id)


class CountingPublisher:
    """The gateway's Kafka edge, noting each phase request it sends as pending.

    Counting at the edge (not in the submitter) counts every path that publishes a
    request: the request path and the outbox's re-publication alike, to the scheduler
    or straight to a worker.
    """

    def __init__(self, inner: RequestPublisher, pending: PendingCalls, requests_topic: str):
        self._inner = inner
        self._pending = pending
        self._requests_topic = requests_topic

    async def publish(self, topic: str, key: str | bytes | None, message: Any) -> None:
        await self._inner.publish(topic, key, message)
        self._count(topic, message)

    async def publish_deferred(
        self, topic: str, key: str | bytes | None, message: Any
    ) -> Awaitable[Any]:
        ack = await self._inner.publish_deferred(topic, key, message)
        self._count(topic, message)  # pending from now: a failed send is sent again
        return ack

    def _count(self, topic: str, message: Any) -> None:
        if topic == self._requests_topic and isinstance(message, PhaseRequest):
            self._pending.published(message.tenant, message.request_id, payload_bytes(message))
        elif isinstance(message, Dispatch):  # calls sent straight to a worker (plexrl.direct)
            for call in message.calls:
                self._pending.published(call.tenant, call.request_id, payload_bytes(call))

    async def ping(self, timeout_s: float = 2.0) -> bool:
        return await self._inner.ping(timeout_s)


def payload_bytes(request: PhaseRequest) -> int:
    """What a request's payload occupies: a ref's stored size, or the inline encoding
    (at most `payload_inline_max_bytes`, so cheap to measure)."""
    if isinstance(request.payload, PayloadRef):
        return request.payload.size
    return len(msgspec.msgpack.encode(request.payload))
