"""Accepts phase requests and publishes them: futures, retry claims, cursor, then Kafka.

For each call the client may poll, a FutureRecord is written before anything is
published, so `retrieve_future` never meets an unknown id that is in flight. A client
that re-sends a call (same model and seq_id, or same sampling session and seq_id) gets
the first request id back instead of running it twice: the key is claimed in Redis. A
training model's calls pass through the sequencer, which publishes them in seq_id
order. The futures, the claim, the model's cursor and the requests are written in one
Redis transaction (plexrl_gateway.outbox), so a gateway that dies between any two
steps leaves nothing half done; what was accepted but not published is published by
the next gateway (or, while Kafka is away, by this one's outbox loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from opentelemetry import trace

from plexrl import direct, tracing
from plexrl.direct import Route
from plexrl.messages import (
    Dispatch,
    Function,
    JobSpec,
    Lease,
    PhaseInput,
    PhaseRequest,
    WorkHint,
)
from plexrl.payloads import inline_or_ref
from plexrl.stores import CallStore, FutureRecord, PayloadStore
from plexrl.topics import Topics
from plexrl_gateway import metrics
from plexrl_gateway.accepted import AcceptedCalls
from plexrl_gateway.errors import ApiError, Category
from plexrl_gateway.outbox import Accept, Flushes, Outbox
from plexrl_gateway.render import ResponseKind
from plexrl_gateway.sequencer import SequenceGapError, Sequencer, Turn

log = logging.getLogger(__name__)
_tracer = tracing.tracer("plexrl.gateway")


class RequestPublisher(Protocol):
    """The part of plexrl.kafka.Publisher the gateway uses (tests fake only this edge)."""

    async def publish(self, topic: str, key: str | bytes | None, message: Any) -> None: ...

    async def publish_deferred(
        self, topic: str, key: str | bytes | None, message: Any
    ) -> Awaitable[Any]: ...

    async def ping(self, timeout_s: float = 2.0) -> bool: ...


@dataclass(frozen=True)
class Call:
    """One phase request to publish, and how its result will be shown."""

    function: Function
    payload: PhaseInput
    response: ResponseKind
    context: dict[str, str] = field(default_factory=dict)
    spec: JobSpec | None = None
    work: WorkHint = field(default_factory=WorkHint)


CallBuilder = Callable[[], Awaitable[list[Call]]]
"""Validates a request and returns its calls; runs in the model's turn, so a call it
refuses (ApiError 4xx) still uses up its seq_id, as the client assumes."""


def ready(*calls: Call) -> CallBuilder:
    """A builder for calls that need no more validation."""

    async def build() -> list[Call]:
        return list(calls)

    return build


@dataclass(frozen=True)
class Submission:
    """Calls of one job published together, in order, under one seq_id and retry key."""

    job_id: str
    tenant: str
    seq_id: int | None = None
    """The model's seq_id; None appends after what the job published so far."""
    sequenced: bool = True
    """False: publish at once, in no order with the job's other calls (samples, echo)."""
    retry_key: str | None = None
    """Identifies a client's re-send of this call; None: never deduplicated."""


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex}"


def direct_dispatch(
    requests: list[PhaseRequest], routes: list[Route], traceparents: list[str]
) -> Dispatch:
    """Calls of one job accepted under its direct lease, as its worker runs them: in
    order, numbered and fenced as the scheduler's dispatches are (`Lease`). Its id names
    the lease and the first call."""
    first = routes[0]
    return Dispatch(
        dispatch_id=direct.dispatch_id(first.lease_id, requests[0].request_id),
        worker_id=first.worker_id,
        calls=requests,
        traceparents=traceparents,
        issued_at=time.time(),
        lease=Lease(first.epoch, [route.seq for route in routes]),
    )


class Submitter:
    def __init__(
        self,
        calls: CallStore,
        payloads: PayloadStore,
        outbox: Outbox,
        publisher: RequestPublisher,
        topics: Topics,
        sequencer: Sequencer,
        inline_max_bytes: int,
        clock: Callable[[], float] = time.time,
        accepted: AcceptedCalls | None = None,
    ) -> None:
        """`calls`: retry keys are read here (the outbox writes them with the call);
        `payloads`: where a payload over `inline_max_bytes` goes; `accepted`: told of
        each call before its acceptance is sent (the waiters' shortcut)."""
        self._calls = calls
        self._payloads = payloads
        self._publisher = publisher
        self._topics = topics
        self._sequencer = sequencer
        self._inline_max_bytes = inline_max_bytes
        self._clock = clock
        self._outbox = outbox
        self._flushes = Flushes(outbox)
        self._accepted = AcceptedCalls() if accepted is None else accepted

    async def existing(self, retry_key: str) -> str | None:
        """The request id an earlier send of this call got, if there was one."""
        return await self._calls.claimed_request(retry_key)

    async def submit(self, sub: Submission, build: CallBuilder) -> str:
        """Build and publish the calls; returns the request id of the last (the one the
        client polls), or of the earlier send when this call was sent before."""
        if sub.retry_key is not None:
            earlier = await self.existing(sub.retry_key)
            if earlier is not None:
                return earlier
        if not sub.sequenced:
            return await self._publish_all(sub, await build(), None)
        try:
            async with self._sequencer.turn(sub.job_id, sub.seq_id) as turn:
                try:
                    calls = await build()
                except ApiError as exc:
                    if exc.status < 500:
                        turn.settle()
                    raise
                return await self._publish_all(sub, calls, turn)
        except SequenceGapError as exc:
            raise ApiError(400, str(exc)) from None

    async def _publish_all(self, sub: Submission, calls: list[Call], turn: Turn | None) -> str:
        """Accept the calls in one Redis transaction, then publish the job's outbox."""
        now = self._clock()
        ids = [new_request_id() for _ in calls]
        traceparent = tracing.traceparent_of() or ""
        futures = [
            FutureRecord(
                request_id=request_id,
                tenant=sub.tenant,
                job_id=sub.job_id,
                function=str(call.function),
                created_at=now,
                response_kind=str(call.response),
                response_context=call.context,
                traceparent=traceparent,
            )
            for request_id, call in zip(ids, calls, strict=True)
        ]
        try:
            requests = [
                await self._request(sub, request_id, call, now)
                for request_id, call in zip(ids, calls, strict=True)
            ]
            # Before Redis holds them: no flush, of this request or another, can
            # publish them earlier, so no notice of them can come earlier.
            self._accepted.note(futures)
            accepted = await self._outbox.accept(
                Accept(
                    job_id=sub.job_id,
                    futures=futures,
                    requests=requests,
                    retry_key=sub.retry_key,
                    seq_id=sub.seq_id if sub.sequenced else None,
                )
            )
        except Exception as exc:  # nothing was accepted: the client may simply send again
            self._accepted.forget(ids)
            log.error("accepting %s for %s failed: %r", ids, sub.job_id, exc)
            raise ApiError(
                503,
                f"could not accept the call ({type(exc).__name__}: {exc}); try again",
                Category.SERVER,
            ) from exc
        standing = accepted.standing
        if standing is not None and standing != ids[-1]:
            self._accepted.forget(ids)  # never written
            return standing  # a concurrent send of the same call won
        # (`standing == ids[-1]`: Redis ran the acceptance, then the connection dropped
        # and the client library sent it again: it is ours.)
        if turn is not None:
            turn.settle(stored=True)  # the cursor moved with the acceptance
        try:
            await self._flushes.flush(sub.job_id, self._send, head=accepted.head)
        except Exception as exc:  # accepted all the same: the outbox sweeper delivers it
            log.warning(
                "publishing %s for %s failed (%r); it stays in the outbox", ids, sub.job_id, exc
            )
        return ids[-1]

    async def _request(
        self, sub: Submission, request_id: str, call: Call, now: float
    ) -> PhaseRequest:
        payload = await inline_or_ref(self._payloads, call.payload, self._inline_max_bytes)
        return PhaseRequest(
            request_id=request_id,
            job_id=sub.job_id,
            tenant=sub.tenant,
            function=call.function,
            payload=payload,
            arrival_time=now,
            work=call.work,
            spec=call.spec,
        )

    async def _send(
        self, requests: list[PhaseRequest], routes: list[Route] | None
    ) -> Awaitable[Any]:
        """Queue one record on the producer: a request to the scheduler (`routes` None),
        or calls of one job straight to its worker under a direct lease, as one dispatch;
        returns the broker's acknowledgement to await. Each call has a span of its own,
        which its worker's span continues."""
        start = time.perf_counter()
        first = requests[0]
        if routes is None:
            with self._publish_span(first, direct=False):
                ack = await self._publisher.publish_deferred(
                    self._topics.requests, first.job_id, first
                )
        else:
            traceparents = []
            for request in requests:
                with self._publish_span(request, direct=True):
                    traceparents.append(tracing.traceparent_of() or "")
            ack = await self._publisher.publish_deferred(
                self._topics.dispatch(routes[0].worker_id),
                first.job_id,
                direct_dispatch(requests, routes, traceparents),
            )
        if isinstance(ack, asyncio.Future):
            latencies = [metrics.PUBLISH_LATENCY.labels(str(r.function)) for r in requests]

            def observe(_: Any) -> None:
                elapsed = time.perf_counter() - start
                for latency in latencies:
                    latency.observe(elapsed)

            ack.add_done_callback(observe)
        return ack

    @staticmethod
    def _publish_span(request: PhaseRequest, direct: bool) -> Any:
        return _tracer.start_as_current_span(
            "gateway.publish",
            kind=trace.SpanKind.PRODUCER,
            attributes={
                "plexrl.request_id": request.request_id,
                "plexrl.job_id": request.job_id,
                "plexrl.function": str(request.function),
                "plexrl.direct": direct,
            },
        )

    async def deliver(self, min_age_s: float) -> int:
        """Publish what any gateway accepted but did not publish (it died, or Kafka was
        away) and is older than `min_age_s`; returns how many went out."""
        sent = 0
        for job_id in await self._outbox.pending_jobs():
            try:
                sent += await self._outbox.flush(job_id, self._send, min_age_s=min_age_s)
            except Exception as exc:  # Kafka still away: the next round tries again
                log.warning("delivering the outbox of %s failed: %r", job_id, exc)
        return sent

    async def run_outbox(self, stop: asyncio.Event, interval_s: float = 1.0) -> None:
        """Deliver the outbox until `stop`: everything at start (a predecessor's leftovers),
        then what the request path could not publish."""
        min_age_s = 0.0
        while not stop.is_set():
            try:
                sent = await self.deliver(min_age_s)
                if sent:
                    log.info("delivered %d accepted calls from the outbox", sent)
            except Exception:  # Redis away: the next round tries again
                log.warning("reading the outbox failed", exc_info=True)
            min_age_s = max(2.0, 2 * interval_s)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)
