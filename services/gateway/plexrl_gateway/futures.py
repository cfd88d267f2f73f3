"""Long-polling for results: answer the moment a call's completion is recorded.

Redis holds the truth (every completion is recorded there before it is announced).
Its announcement (`plexrl_gateway.notices`) only wakes waiters: each waiting request id
has an event that the listener sets. Redis is read after registering the event, so a
completion that lands in between is never missed, and no answer waits for a tick; for a
call this gateway accepted while its notices held (`plexrl_gateway.accepted`) the
notices alone tell whether it completed, and Redis is not read.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable
from typing import Protocol

from opentelemetry import trace

from plexrl import tracing
from plexrl.messages import PhaseCompletion
from plexrl_gateway import metrics
from plexrl_gateway.accepted import AcceptedCalls

_tracer = tracing.tracer("plexrl.gateway")


class CompletionStore(Protocol):
    async def get_completion(self, request_id: str) -> PhaseCompletion | None: ...

    async def get_completions(self, request_ids: Iterable[str]) -> dict[str, PhaseCompletion]: ...


class FutureWaiter:
    def __init__(
        self,
        store: CompletionStore,
        on_answered: Callable[[str], None] | None = None,
        accepted: AcceptedCalls | None = None,
    ) -> None:
        self._store = store
        self.accepted = AcceptedCalls() if accepted is None else accepted
        """The calls this gateway accepted (the submitter notes them, the listener
        tells it of its subscriptions)."""
        self._on_answered = on_answered
        """Told each request id whose completion was seen (the pending-calls quota)."""
        self._events: dict[str, asyncio.Event] = {}
        self._waiters: dict[str, int] = {}
        self._arrived: dict[str, PhaseCompletion] = {}
        self._since: dict[str, float] = {}
        """When each waited request id's first waiter came (`time.monotonic`)."""

    def answered(self, request_id: str) -> None:
        """A call announced: counted off the pending-calls quota (waited for or not)."""
        if self._on_answered is not None:
            self._on_answered(request_id)

    def wants(self, request_id: str) -> bool:
        """Whether a notice of this call is read whole: it is waited for, or this
        gateway accepted it and holds its completion until asked for."""
        return request_id in self._events or self.accepted.knows(request_id)

    async def on_completion(
        self, completion: PhaseCompletion, traceparent: str = "", size: int | None = None
    ) -> None:
        """A completion announced (`traceparent`: the span that recorded it; `size`: the
        notice's bytes, when it came with one)."""
        request_id = completion.request_id
        self.answered(request_id)
        waited = request_id in self._events
        if waited:
            # The notice carries the recorded completion, so a waiter can answer from
            # it without reading Redis again.
            self._arrived[request_id] = completion
        elif size is None or not self.accepted.knows(request_id):
            return
        if not traceparent:
            self._deliver(completion, waited, size)
            return
        # The last hop of the call's trace: the recording span's context came with it.
        with _tracer.start_as_current_span(
            "gateway.completion",
            context=tracing.context_of_traceparent(traceparent),
            kind=trace.SpanKind.CONSUMER,
            attributes={"plexrl.request_id": request_id},
        ):
            self._deliver(completion, waited, size)

    def _deliver(self, completion: PhaseCompletion, waited: bool, size: int | None) -> None:
        """Wake the call's waiters, or hold its completion until one comes."""
        if waited:
            self.wake(completion.request_id)
        elif size is not None:
            self.accepted.hold(completion, size)

    @property
    def waiting(self) -> list[str]:
        """The request ids waited for now."""
        return list(self._events)

    def waiting_since(self, before: float) -> list[str]:
        """The request ids waited for since before `before` (`time.monotonic`)."""
        return [r for r, since in self._since.items() if since <= before]

    async def sweep(self, request_ids: Iterable[str]) -> int:
        """Answer, from Redis, the waiters (and the pending-calls quota) of these
        request ids whose completions are recorded: for announcements this gateway may
        have missed. Returns how many were recorded."""
        found = await self._store.get_completions(request_ids)
        for completion in found.values():
            await self.on_completion(completion)
        return len(found)

    def wake(self, request_id: str) -> None:
        event = self._events.get(request_id)
        if event is not None:
            event.set()

    async def wait(self, request_id: str, timeout_s: float) -> PhaseCompletion | None:
        """The completion, as soon as it exists; None if it did not within `timeout_s`."""
        known = self.accepted.knows(request_id)
        if known and (held := self.accepted.completion(request_id)) is not None:
            self.answered(request_id)
            return held
        # Register first, then read Redis: a completion announced in between sets the
        # event. A call known here has not completed (its notice would be held).
        event = self._events.setdefault(request_id, asyncio.Event())
        self._since.setdefault(request_id, time.monotonic())
        self._waiters[request_id] = self._waiters.get(request_id, 0) + 1
        metrics.FUTURES_WAITING.inc()
        try:
            done = None if known else await self._store.get_completion(request_id)
            if done is None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), timeout_s)
                arrived = self._arrived.get(request_id)
                done = arrived or await self._store.get_completion(request_id)
            if done is not None:
                self.answered(request_id)
            return done
        finally:
            metrics.FUTURES_WAITING.dec()
            self._waiters[request_id] -= 1
            if self._waiters[request_id] == 0:
                del self._waiters[request_id]
                del self._events[request_id]
                del self._since[request_id]
                self._arrived.pop(request_id, None)
