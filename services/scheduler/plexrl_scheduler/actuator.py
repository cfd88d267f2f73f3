"""Carries out a plan: publishes dispatches and admissions, fails rejected calls."""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from opentelemetry import trace

from plexrl import tracing
from plexrl.kafka import Delivery
from plexrl.ledger import SEQUENCED, Ledger
from plexrl.messages import (
    CompletionStatus,
    Dispatch,
    ErrorCode,
    ErrorInfo,
    Function,
    JobAdmitted,
    Lease,
    PhaseCompletion,
    PreemptBatch,
    StateMove,
    Tier,
    Timings,
)
from plexrl.policy import (
    Action,
    Admit,
    Plan,
    Preempt,
    Prefetch,
    Rehome,
    Reject,
    RejectReason,
    Run,
)
from plexrl.retry import retrying
from plexrl.stores import CallStore, JobStore
from plexrl.topics import Topics
from plexrl_scheduler import metrics
from plexrl_scheduler.direct import DirectPath
from plexrl_scheduler.state import ClusterState, Pending

log = logging.getLogger(__name__)
_tracer = tracing.tracer("plexrl.scheduler")

Committer = Callable[[Delivery | None], Awaitable[None]]


class Sends(Protocol):
    """What the actuator sends with (`plexrl.kafka.Publisher`): a message, and with
    `headers` the record's trace context where the caller has it already."""

    async def publish(
        self,
        topic: str,
        key: str | bytes | None,
        message: Any,
        headers: tracing.Headers | None = None,
    ) -> None: ...


def dispatch_span(pending: Pending, action: Run) -> trace.Span:
    """The call's `scheduler.dispatch` span, in the trace its request carried. It is
    started and ended here, never made current: it marks the dispatch, and nothing runs
    in it, so the context switches and the propagator's round through a carrier are
    skipped. While the scheduler exports no spans, the unrecorded span is made from the
    request's header directly (`tracing.unrecorded_child`)."""
    request = pending.request
    if pending.delivery is not None:
        unrecorded = tracing.unrecorded_child(pending.delivery.headers)
        if unrecorded is not None:
            return unrecorded
    span = _tracer.start_span(
        "scheduler.dispatch",
        context=pending.delivery.context if pending.delivery else None,
        kind=trace.SpanKind.INTERNAL,
        attributes={
            "plexrl.request_id": request.request_id,
            "plexrl.job_id": request.job_id,
            "plexrl.worker_id": action.worker_id,
            "plexrl.function": request.function,
            "plexrl.expected_swap_s": action.expected_swap_s,
        },
    )
    span.end()
    return span


class Actuator:
    def __init__(
        self,
        state: ClusterState,
        publisher: Sends,
        jobs: JobStore,
        calls: CallStore,
        topics: Topics,
        finished: Committer,
        ledger: Ledger,
        direct: DirectPath | None = None,
    ) -> None:
        """`direct`: the direct leases, revoked (and waited out) before the actuator
        acts on a worker one holds."""
        self._state = state
        self._direct = direct
        self._publisher = publisher
        self._jobs = jobs
        self._calls = calls
        self._topics = topics
        self._finished = finished
        self._ledger = ledger
        self.dispatches = 0

    async def carry_out(self, plan: Plan) -> None:
        """Each action in the plan's order, except that consecutive runs on different
        workers go out together: each dispatch still waits for the broker's
        acknowledgement, but the dispatches of one pass wait for theirs at once instead
        of one broker round trip after another. A worker's dispatches stay in order (a
        second run on the same worker waits for the first's)."""
        runs: dict[str, Run] = {}
        for action in plan:
            if isinstance(action, Run) and action.worker_id not in runs:
                runs[action.worker_id] = action
                continue
            await self._runs(runs)
            if isinstance(action, Rehome):
                if not await self._rehome(action):
                    # The rest of the plan has the job at its new home: decided again.
                    self._state.review_again()
                    return
            elif isinstance(action, Run):
                runs[action.worker_id] = action
            else:
                await self._act(action)
        await self._runs(runs)

    async def _runs(self, runs: dict[str, Run]) -> None:
        """Carry out runs on distinct workers together (and forget them)."""
        chosen = list(runs.values())
        runs.clear()
        if len(chosen) <= 1:
            if chosen:
                await self._act(chosen[0])
            return
        done = await asyncio.gather(*(self._act(run) for run in chosen), return_exceptions=True)
        for outcome in done:  # the others went out: the pass's failure is the first one's
            if isinstance(outcome, BaseException):
                raise outcome

    async def _act(self, action: Action) -> None:
        if isinstance(action, Run | Prefetch | Preempt) and not await self._clear(action):
            return  # decided again once the calls sent direct there are answered
        match action:
            case Admit():
                await self._admit(action)
            case Reject():
                await self._reject(action)
            case Run():
                await self._run(action)
            case Prefetch():
                await self._prefetch(action)
            case Preempt():
                await self._preempt(action)

    async def _clear(self, action: Run | Prefetch | Preempt) -> bool:
        """No direct lease holds the action's worker (one is revoked first, before any
        swap or preemption there; the policy sees a held worker busy and rarely asks)."""
        return self._direct is None or await self._direct.clear(action.worker_id)

    async def _preempt(self, action: Preempt) -> None:
        """Ask the worker to let the next dispatch in beside its running sample batch
        (or, on a worker that slices training, after the running forward_backward's
        current micro-batch)."""
        dispatch_id = self._state.apply_preempt(action.worker_id)
        if dispatch_id is None:
            return
        message = PreemptBatch(
            worker_id=action.worker_id,
            dispatch_id=dispatch_id,
            for_job=action.for_job,
            issued_at=time.time(),
        )
        await self._publisher.publish(self._topics.control(action.worker_id), dispatch_id, message)
        metrics.PREEMPTS.labels(action.worker_id).inc()
        log.info(
            "preempting %s's running call on %s for %s",
            action.job_id,
            action.worker_id,
            action.for_job,
        )

    async def _admit(self, action: Admit) -> None:
        # A new lease: whoever held the job before (a dead worker) is fenced off now.
        epoch = await self._ledger.bump_epoch(action.job_id, action.worker_id)
        self._state.apply_admit(action.job_id, action.worker_id, epoch)
        await self._announce_home(action.job_id, action.worker_id)
        metrics.JOBS_ADMITTED.labels(action.worker_id).inc()
        log.info("admitted %s on %s", action.job_id, action.worker_id)

    async def _rehome(self, action: Rehome) -> bool:
        """Move a job between calls to another worker: a new lease there fences off its
        old home, which is told to drop its copy; the new home restores the job from its
        snapshot and logged calls at its next call (as for a lost worker's jobs). False
        (nothing moved) for a job with a call in flight at home, or on a worker whose
        direct lease is being revoked: it is reviewed again at a later decision."""
        state, job_id, old = self._state, action.job_id, action.from_worker
        job = state.jobs.get(job_id)
        if job is None or job.home != old:
            return False
        why = job.review_reason
        if not action.moves:
            state.apply_review(job_id, waits=action.waits)
            if not action.waits:  # (a job kept under review is reviewed again, unlogged)
                log.info("reviewed %s (%s): it stays on %s", job_id, why, old)
            return True
        if not state.between_calls(job_id):
            return False
        if self._direct is not None and not await self._direct.clear(old):
            return False
        epoch = await self._ledger.bump_epoch(job_id, action.to_worker)
        state.apply_rehome(job_id, action.to_worker, epoch)
        await self._announce_home(job_id, action.to_worker)
        drop = Dispatch(
            dispatch_id=uuid.uuid4().hex,
            worker_id=old,
            calls=[],
            drop=[job_id],
            issued_at=time.time(),
        )
        await self._publisher.publish(self._topics.dispatch(old), job_id, drop)
        metrics.REHOMES.labels(old, why).inc()
        log.info("re-homed %s from %s to %s (reviewed: %s)", job_id, old, action.to_worker, why)
        return True

    async def _announce_home(self, job_id: str, worker_id: str) -> None:
        """Record the job's home and tell the cluster (`JobAdmitted`)."""
        job = self._state.jobs[job_id]
        await self._jobs.set_home(job_id, worker_id)
        event = JobAdmitted(
            job_id=job.job_id,
            tenant=job.tenant,
            home_worker=worker_id,
            base_model=job.spec.base_model,
            state_bytes=job.state_bytes,
            at=time.time(),
        )
        await self._publisher.publish(self._topics.events, worker_id, event)

    async def _reject(self, action: Reject) -> None:
        if action.reason == RejectReason.NO_WORKERS:
            return  # not a refusal: the calls wait until a worker reports
        log.warning("rejected job %s: %s", action.job_id, action.detail)
        metrics.JOBS_REJECTED.labels(str(action.reason)).inc()
        doomed = [p for p in self._state.pending.values() if p.request.job_id == action.job_id]
        self._state.take_pending(tuple(p.request.request_id for p in doomed))
        self._state.jobs.pop(action.job_id, None)
        for pending in doomed:
            await self.fail(pending, ErrorInfo(ErrorCode.REJECTED, action.detail))

    async def fail(self, pending: Pending, error: ErrorInfo) -> None:
        """Answer a call with an error without running it."""
        request = pending.request
        completion = PhaseCompletion(
            request_id=request.request_id,
            job_id=request.job_id,
            tenant=request.tenant,
            worker_id="",
            function=request.function,
            status=CompletionStatus.ERROR,
            timings=Timings(queue_s=max(0.0, time.time() - request.arrival_time)),
            error=error,
            finished_at=time.time(),
        )
        # The call has left the queue: its answer must be written, however long Redis is away.
        completion = await retrying(
            lambda: self._calls.record_completion(completion), what="recording a refusal"
        )
        await self._publisher.publish(self._topics.completions, request.job_id, completion)
        metrics.CALLS_FAILED.labels(str(error.code)).inc()
        await self._finished(pending.delivery)

    async def follow_up(self, worker_id: str, request_ids: list[str]) -> None:
        """Send the worker's job's next calls behind its dispatch in flight (numbered and
        fenced as any dispatch; `plexrl.policy.follow_up` says which)."""
        run = self._state.inflight[worker_id]
        await self._run(Run(worker_id, run.job_id, tuple(request_ids)), follow_up=True)

    async def _run(self, action: Run, follow_up: bool = False) -> None:
        chosen = [self._state.pending[r] for r in action.request_ids if r in self._state.pending]
        if not chosen:
            return
        roaming = self._state.jobs[action.job_id].home != action.worker_id
        # Numbered before they leave the queue: a failed ledger write loses no call. A
        # roaming sample (`plexrl.policy.roam`) is not numbered and takes no lease: the
        # job's lease stays with its home.
        lease = None if roaming else await self._lease(action.job_id, action.worker_id, chosen)
        taken = self._state.take_pending(action.request_ids)
        dispatch_id = os.urandom(16).hex()
        spans = [dispatch_span(p, action) for p in taken]
        now = time.time()
        functions: dict[str, int] = {}
        for pending in taken:
            metrics.DISPATCH_LATENCY.observe(max(0.0, now - pending.request.arrival_time))
            function = str(pending.request.function)
            functions[function] = functions.get(function, 0) + 1
        for function, count in functions.items():
            metrics.DISPATCHED_CALLS.labels(function).inc(count)
        dispatch = Dispatch(
            dispatch_id=dispatch_id,
            worker_id=action.worker_id,
            calls=[p.request for p in taken],
            traceparents=[tracing.span_traceparent(span) for span in spans],
            evict=[StateMove(m.job_id, m.to_tier) for m in action.evict],
            issued_at=time.time(),
            lease=lease,
            sliceable=(
                lease is not None
                and taken[-1].request.function == Function.FORWARD_BACKWARD
                and all(p.request.job_id == action.job_id for p in taken)
                and self._state.sliceable(action.job_id, action.worker_id)
            ),
        )
        if follow_up:
            self._state.apply_follow_up(dispatch_id, action.worker_id, action.job_id, taken)
            metrics.FOLLOW_UPS.labels(action.worker_id).inc()
        else:
            self._state.apply_run(
                dispatch_id,
                action.worker_id,
                action.job_id,
                taken,
                action.evict,
                sliceable=dispatch.sliceable,
            )
        # The dispatch message's producer span (its Kafka header) under the first call's.
        topic = self._topics.dispatch(action.worker_id)
        headers = tracing.unrecorded_headers(spans[0])
        if headers is not None:
            await self._publisher.publish(topic, action.job_id, dispatch, headers)
        else:
            with trace.use_span(spans[0], record_exception=False, set_status_on_exception=False):
                await self._publisher.publish(topic, action.job_id, dispatch)
        self.dispatches += 1
        metrics.DISPATCHES.labels(action.worker_id).inc()
        if roaming:
            metrics.ROAMED_CALLS.labels(action.worker_id).inc(len(taken))
            log.info("%s's sample roams to %s", action.job_id, action.worker_id)
        for move in action.evict:
            metrics.EVICTIONS.labels(str(move.to_tier)).inc()

    async def _lease(self, job_id: str, worker_id: str, taken: list[Pending]) -> Lease:
        """The job's epoch on its home and the seq of each numbered call (a replayed
        request gets the seq it had the first time)."""
        job = self._state.jobs[job_id]
        if job.epoch == 0:  # restarted scheduler: the ledger knows the lease
            head = await self._ledger.head(job_id)
            epoch = head.epoch
            if epoch == 0 or head.owner != worker_id:
                epoch = await self._ledger.bump_epoch(job_id, worker_id)
            self._state.apply_epoch(job_id, epoch)
        numbered = [p.request.request_id for p in taken if p.request.function in SEQUENCED]
        seqs = dict(zip(numbered, await self._ledger.assign(job_id, numbered), strict=True))
        return Lease(job.epoch, [seqs.get(p.request.request_id, 0) for p in taken])

    async def _prefetch(self, action: Prefetch) -> None:
        dispatch = Dispatch(
            dispatch_id=uuid.uuid4().hex,
            worker_id=action.worker_id,
            calls=[],
            evict=[StateMove(m.job_id, m.to_tier) for m in action.evict],
            prefetch=[StateMove(action.job_id, Tier.DEVICE)],
            issued_at=time.time(),
        )
        for move in action.evict:
            if move.job_id in self._state.jobs:
                self._state.jobs[move.job_id].tier = move.to_tier
        if action.job_id in self._state.jobs:
            self._state.jobs[action.job_id].tier = Tier.DEVICE
        await self._publisher.publish(
            self._topics.dispatch(action.worker_id), action.job_id, dispatch
        )
        metrics.PREFETCHES.labels(action.worker_id).inc()
        for move in action.evict:
            metrics.EVICTIONS.labels(str(move.to_tier)).inc()
