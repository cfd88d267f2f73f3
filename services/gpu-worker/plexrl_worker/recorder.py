"""Records a call's completion (Redis first, then Kafka) and its timeline entry."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from plexrl.kafka import Publisher
from plexrl.messages import CompletionStatus, PhaseCompletion, PhaseRequest, Timings
from plexrl.payloads import inline_or_ref
from plexrl.stores import CallStore, PayloadStore, TimelineEntry, TimelineStore
from plexrl.stores.calls import FENCED, RecordFence
from plexrl_worker import metrics
from plexrl_worker.runner import Ran

log = logging.getLogger(__name__)


class ResultRecorder:
    def __init__(
        self,
        *,
        worker_id: str,
        calls: CallStore,
        payloads: PayloadStore,
        timeline: TimelineStore,
        publisher: Publisher,
        completions_topic: str,
        inline_max_bytes: int,
    ) -> None:
        self._worker_id = worker_id
        self._calls = calls
        self._payloads = payloads
        self._timeline = timeline
        self._publisher = publisher
        self._topic = completions_topic
        self._inline_max_bytes = inline_max_bytes
        self._unacked: list[tuple[PhaseCompletion, asyncio.Future[Any]]] = []
        """Completions queued on the producer whose acknowledgement is not seen yet."""

    async def recorded(self, requests: list[PhaseRequest]) -> dict[str, PhaseCompletion]:
        """Completions recorded earlier for any of these requests (those already ran)."""
        return await self._calls.get_completions(r.request_id for r in requests)

    async def record(
        self,
        request: PhaseRequest,
        ran: Ran,
        dispatch_id: str,
        last: bool,
        commit: Callable[[PhaseCompletion], Awaitable[bool]] | None = None,
        fence: RecordFence | None = None,
    ) -> PhaseCompletion | None:
        """Record and announce the call's completion; None when `commit` or `fence`
        refused it (the call was fenced off: another worker owns its job now, so nothing
        is announced)."""
        completion, entry = await self._completion(request, ran, dispatch_id, last)
        # The job's ledger first: once the call is its last applied one, a replay is
        # answered from there, however long after; then the future's record (first wins).
        if commit is not None and not await commit(completion):
            return None
        return (await self._store([(completion, entry)], fence))[0]

    async def record_together(
        self,
        finished: Sequence[tuple[PhaseRequest, Ran, bool]],
        dispatch_id: str,
        fence: RecordFence | None = None,
    ) -> list[PhaseCompletion | None]:
        """`record` for calls that finished together (co-batched samples ending in one
        decode step), none numbered: their records, notices and timeline entries in one
        Redis round trip, their completions queued back to back, in this order. Each
        `(request, ran, last)`."""
        made = [await self._completion(r, ran, dispatch_id, last) for r, ran, last in finished]
        return await self._store(made, fence)

    async def _completion(
        self, request: PhaseRequest, ran: Ran, dispatch_id: str, last: bool
    ) -> tuple[PhaseCompletion, TimelineEntry]:
        """The call's completion (its output inline or by reference) and timeline entry."""
        result = (
            None
            if ran.output is None
            else await inline_or_ref(self._payloads, ran.output, self._inline_max_bytes)
        )
        queue_s = max(0.0, ran.started_at - request.arrival_time)
        completion = PhaseCompletion(
            request_id=request.request_id,
            job_id=request.job_id,
            tenant=request.tenant,
            worker_id=self._worker_id,
            function=request.function,
            status=CompletionStatus.OK if ran.error is None else CompletionStatus.ERROR,
            timings=Timings(
                queue_s=queue_s,
                swap_s=ran.swap_s,
                compute_s=ran.compute_s,
                slices=ran.slices,
            ),
            result=result,
            error=ran.error,
            finished_at=time.time(),
            dispatch_id=dispatch_id,
            last_in_dispatch=last,
        )
        entry = TimelineEntry(
            worker_id=self._worker_id,
            job_id=request.job_id,
            request_id=request.request_id,
            function=request.function,
            started_at=ran.started_at,
            swap_s=ran.swap_s,
            compute_s=ran.compute_s,
            ok=ran.error is None,
            tail_released_at=ran.tail_released_at,
            preempted=ran.preempted,
            slices=ran.slices,
            queue_s=queue_s,
        )
        return completion, entry

    async def _store(
        self, made: Sequence[tuple[PhaseCompletion, TimelineEntry]], fence: RecordFence | None
    ) -> list[PhaseCompletion | None]:
        """Record, announce and publish completions while `fence` stands; returns the
        records that stand (None: the fence refused it, nothing was announced)."""
        # Independent writes in one round trip (a retry of the whole record may append
        # a timeline entry twice, as it could before; each record is NX).
        async with self._calls.pipeline() as pipe:
            announced = [self._calls.queue_completion(pipe, c, fence) for c, _ in made]
            for _, entry in made:
                self._timeline.queue_timeline(pipe, entry)
            replies = (await pipe.execute())[: len(made)]  # the records' replies
        # Recorded before (a replay that ran again): those records stand, read in one go.
        earlier = await self._calls.get_completions(
            c.request_id for (c, _), reply in zip(made, replies, strict=True) if reply == 0
        )
        stood = [
            None if reply == FENCED else earlier.get(c.request_id, c)
            for (c, _), reply in zip(made, replies, strict=True)
        ]
        # The records (and the ledger commit and results before them) must outlive a
        # failover before the completions are announced and published.
        await self._calls.replicated()
        for completion, told, reply in zip(stood, announced, replies, strict=True):
            if completion is not None and not (told and reply == 1):
                await self._calls.announce(completion)
        for completion in stood:
            if completion is not None:
                await self.publish(completion)
        for (completion, entry), reply in zip(made, replies, strict=True):
            if reply == FENCED:
                continue
            function, seconds = str(entry.function), entry.swap_s + entry.compute_s
            metrics.CALLS.labels(function, str(completion.status)).inc()
            metrics.BUSY_SECONDS.labels(function).inc(seconds)
            metrics.COMPUTE_SECONDS.labels(function).observe(entry.compute_s)
        return stood

    async def answer(self, stored: PhaseCompletion) -> None:
        """Answer a replayed call with the completion it had the first time."""
        await self.publish(await self._calls.record_completion(stored))

    async def replay(self, recorded: PhaseCompletion) -> None:
        """Answer a redelivered call whose completion this poll read recorded already."""
        await self._calls.announce(recorded)
        await self.publish(recorded)

    async def publish(self, completion: PhaseCompletion) -> None:
        """Hand the recorded completion to the producer; `settle` waits for the broker.

        Redis holds the truth (recorded first); the message wakes the gateway's waiter
        and tells the scheduler. A dispatch's completions are queued one after another
        and acknowledged together (they keep their order on the job's partition)."""
        try:
            ack = await self._publisher.publish_deferred(self._topic, completion.job_id, completion)
        except Exception:  # not even queued (the broker away): send it the patient way
            await self._publisher.publish(self._topic, completion.job_id, completion)
            return
        self._unacked.append((completion, ack))

    async def settle(self) -> None:
        """Until every completion handed over so far is acknowledged; one whose send
        failed is published again (retried while the broker is away). The dispatch
        handler settles before it returns, so a dispatch's offset is committed only
        once its completions are in Kafka, as when each was awaited in turn."""
        while self._unacked:
            completion, ack = self._unacked.pop(0)
            try:
                await ack
            except Exception as exc:
                log.warning(
                    "completion %s not acknowledged (%r); sending it again",
                    completion.request_id,
                    exc,
                )
                await self._publisher.publish(self._topic, completion.job_id, completion)
