"""Records a call's completion (Redis first, then Kafka) and its timeline entry."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from plexrl.kafka import Publisher
from plexrl.messages import CompletionStatus, PhaseCompletion, PhaseRequest, Timings
from plexrl.meta import MetaStore, TimelineEntry
from plexrl.payloads import inline_or_ref
from plexrl_worker import metrics
from plexrl_worker.runner import Ran


class ResultRecorder:
    def __init__(
        self,
        *,
        worker_id: str,
        meta: MetaStore,
        publisher: Publisher,
        completions_topic: str,
        inline_max_bytes: int,
    ) -> None:
        self._worker_id = worker_id
        self._meta = meta
        self._publisher = publisher
        self._topic = completions_topic
        self._inline_max_bytes = inline_max_bytes

    async def recorded(self, requests: list[PhaseRequest]) -> dict[str, PhaseCompletion]:
        """Completions recorded earlier for any of these requests (those already ran)."""
        return await self._meta.get_completions(r.request_id for r in requests)

    async def record(
        self,
        request: PhaseRequest,
        ran: Ran,
        dispatch_id: str,
        last: bool,
        commit: Callable[[PhaseCompletion], Awaitable[bool]] | None = None,
    ) -> PhaseCompletion | None:
        """Record and announce the call's completion; None when `commit` refused it (the
        call was fenced off: another worker owns its job now, so nothing is announced)."""
        result = (
            None
            if ran.output is None
            else await inline_or_ref(self._meta, ran.output, self._inline_max_bytes)
        )
        completion = PhaseCompletion(
            request_id=request.request_id,
            job_id=request.job_id,
            tenant=request.tenant,
            worker_id=self._worker_id,
            function=request.function,
            status=CompletionStatus.OK if ran.error is None else CompletionStatus.ERROR,
            timings=Timings(
                queue_s=max(0.0, ran.started_at - request.arrival_time),
                swap_s=ran.swap_s,
                compute_s=ran.compute_s,
            ),
            result=result,
            error=ran.error,
            finished_at=time.time(),
            dispatch_id=dispatch_id,
            last_in_dispatch=last,
        )
        # The job's ledger first: once the call is its last applied one, a replay is
        # answered from there, however long after; then the future's record (first wins).
        if commit is not None and not await commit(completion):
            return None
        completion = await self._meta.record_completion(completion)
        await self.publish(completion)
        metrics.CALLS.labels(str(request.function), str(completion.status)).inc()
        metrics.BUSY_SECONDS.labels(request.job_id).inc(ran.swap_s + ran.compute_s)
        metrics.COMPUTE_SECONDS.labels(str(request.function)).observe(ran.compute_s)
        await self._meta.append_timeline(
            TimelineEntry(
                worker_id=self._worker_id,
                job_id=request.job_id,
                request_id=request.request_id,
                function=request.function,
                started_at=ran.started_at,
                swap_s=ran.swap_s,
                compute_s=ran.compute_s,
                ok=ran.error is None,
                tail_released_at=ran.tail_released_at,
            )
        )
        return completion

    async def answer(self, stored: PhaseCompletion) -> None:
        """Answer a replayed call with the completion it had the first time."""
        await self.publish(await self._meta.record_completion(stored))

    async def publish(self, completion: PhaseCompletion) -> None:
        await self._publisher.publish(self._topic, completion.job_id, completion)
