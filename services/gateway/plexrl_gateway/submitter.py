"""Publishes phase requests: a future record, one claim per client retry key, then Kafka.

For each call the client may poll, a FutureRecord is written before anything is
published, so `retrieve_future` never meets an unknown id that is in flight. A client
that re-sends a call (same model and seq_id, or same sampling session and seq_id) gets
the first request id back instead of running it twice: the key is claimed with SET NX
in Redis. A training model's calls pass through the sequencer, which publishes them in
seq_id order.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from opentelemetry import trace

from plexrl import tracing
from plexrl.messages import (
    CompletionStatus,
    ErrorCode,
    ErrorInfo,
    Function,
    JobSpec,
    PhaseCompletion,
    PhaseInput,
    PhaseRequest,
    Timings,
    WorkHint,
)
from plexrl.meta import FutureRecord, MetaStore
from plexrl.payloads import inline_or_ref
from plexrl.topics import Topics
from plexrl_gateway import metrics
from plexrl_gateway.errors import ApiError, Category
from plexrl_gateway.render import ResponseKind
from plexrl_gateway.sequencer import SequenceGapError, Sequencer

log = logging.getLogger(__name__)
_tracer = tracing.tracer("plexrl.gateway")


class RequestPublisher(Protocol):
    """The part of plexrl.kafka.Publisher the gateway uses (tests fake only this edge)."""

    async def publish(self, topic: str, key: str | bytes | None, message: Any) -> None: ...

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


class Submitter:
    def __init__(
        self,
        meta: MetaStore,
        publisher: RequestPublisher,
        topics: Topics,
        sequencer: Sequencer,
        inline_max_bytes: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._meta = meta
        self._publisher = publisher
        self._topics = topics
        self._sequencer = sequencer
        self._inline_max_bytes = inline_max_bytes
        self._clock = clock

    async def existing(self, retry_key: str) -> str | None:
        """The request id an earlier send of this call got, if there was one."""
        return await self._meta.claimed_request(retry_key)

    async def submit(self, sub: Submission, build: CallBuilder) -> str:
        """Build and publish the calls; returns the request id of the last (the one the
        client polls), or of the earlier send when this call was sent before."""
        if sub.retry_key is not None:
            earlier = await self.existing(sub.retry_key)
            if earlier is not None:
                return earlier
        if not sub.sequenced:
            return await self._publish_all(sub, await build())
        try:
            async with self._sequencer.turn(sub.job_id, sub.seq_id) as turn:
                try:
                    calls = await build()
                except ApiError as exc:
                    if exc.status < 500:
                        turn.settle()
                    raise
                return await self._publish_all(sub, calls)
        except SequenceGapError as exc:
            raise ApiError(400, str(exc)) from None

    async def _publish_all(self, sub: Submission, calls: list[Call]) -> str:
        now = self._clock()
        ids = [new_request_id() for _ in calls]
        for request_id, call in zip(ids, calls, strict=True):
            await self._meta.put_future(
                FutureRecord(
                    request_id=request_id,
                    tenant=sub.tenant,
                    job_id=sub.job_id,
                    function=str(call.function),
                    created_at=now,
                    response_kind=str(call.response),
                    response_context=call.context,
                )
            )
        if sub.retry_key is not None:
            standing = await self._meta.claim_request(sub.retry_key, ids[-1])
            if standing != ids[-1]:
                return standing  # a concurrent send of the same call won
        try:
            for request_id, call in zip(ids, calls, strict=True):
                await self._publish(sub, request_id, call, now)
        except Exception as exc:
            await self._unpublished(sub, ids, calls, exc)
            raise ApiError(
                503,
                f"could not queue the call ({type(exc).__name__}: {exc}); try again",
                Category.SERVER,
            ) from exc
        return ids[-1]

    async def _publish(self, sub: Submission, request_id: str, call: Call, now: float) -> None:
        payload = await inline_or_ref(self._meta, call.payload, self._inline_max_bytes)
        request = PhaseRequest(
            request_id=request_id,
            job_id=sub.job_id,
            tenant=sub.tenant,
            function=call.function,
            payload=payload,
            arrival_time=now,
            work=call.work,
            spec=call.spec,
        )
        start = time.perf_counter()
        with _tracer.start_as_current_span(
            "gateway.publish",
            kind=trace.SpanKind.PRODUCER,
            attributes={
                "plexrl.request_id": request_id,
                "plexrl.job_id": sub.job_id,
                "plexrl.function": str(call.function),
                "plexrl.seq_id": -1 if sub.seq_id is None else sub.seq_id,
            },
        ):
            await self._publisher.publish(self._topics.requests, sub.job_id, request)
        metrics.PUBLISH_LATENCY.labels(str(call.function)).observe(time.perf_counter() - start)

    async def _unpublished(
        self, sub: Submission, ids: list[str], calls: list[Call], exc: Exception
    ) -> None:
        """Free the retry key and fail the futures, so nobody polls a call that never left."""
        log.error("publishing %s for %s failed: %r", ids, sub.job_id, exc)
        try:
            if sub.retry_key is not None:
                await self._meta.release_request(sub.retry_key, ids[-1])
            for request_id, call in zip(ids, calls, strict=True):
                await self._meta.record_completion(
                    PhaseCompletion(
                        request_id=request_id,
                        job_id=sub.job_id,
                        tenant=sub.tenant,
                        worker_id="",
                        function=call.function,
                        status=CompletionStatus.ERROR,
                        timings=Timings(),
                        error=ErrorInfo(
                            ErrorCode.INTERNAL, f"the gateway could not queue it: {exc}"
                        ),
                        finished_at=self._clock(),
                    )
                )
        except Exception:  # Redis down too: the client's retry is all that is left
            log.exception("could not record the failure of %s", ids)
