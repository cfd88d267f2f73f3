"""Turns the three input topics into ClusterState changes."""

from __future__ import annotations

import logging

from plexrl import direct
from plexrl.kafka import Delivery, MessageConsumer
from plexrl.messages import (
    ErrorCode,
    ErrorInfo,
    Event,
    Function,
    IdleHint,
    JobOptions,
    PhaseCompletion,
    PhaseRequest,
    ResidencyChanged,
    TailReleased,
    WorkerHeartbeat,
)
from plexrl.retry import retrying
from plexrl.stores import JobStore, UsageStore
from plexrl_scheduler import metrics
from plexrl_scheduler.actuator import Actuator
from plexrl_scheduler.direct import DirectPath
from plexrl_scheduler.offsets import OffsetTracker
from plexrl_scheduler.state import ClusterState, Pending

log = logging.getLogger(__name__)


class Receiver:
    def __init__(
        self,
        state: ClusterState,
        jobs: JobStore,
        usage: UsageStore,
        direct: DirectPath | None = None,
    ) -> None:
        self._state = state
        self._direct = direct
        self._jobs = jobs
        self._usage = usage
        self._actuator: Actuator | None = None
        self._offsets = OffsetTracker()
        self._requests: MessageConsumer[PhaseRequest] | None = None
        self._usage_due = UsageDue()
        self.new_workers: list[str] = []

    def use(self, actuator: Actuator) -> None:
        """The actuator that answers calls this receiver cannot accept."""
        self._actuator = actuator

    def attach(self, requests: MessageConsumer[PhaseRequest]) -> None:
        """The consumer whose offsets this receiver commits once calls are answered."""
        self._requests = requests

    async def finished(self, delivery: Delivery | None) -> None:
        if delivery is None or self._requests is None:
            return
        point = self._offsets.finished(delivery.tp, delivery.offset)
        if point is not None:
            await self._requests.commit_upto(delivery.tp, point)

    async def on_request(self, request: PhaseRequest, delivery: Delivery) -> None:
        if self._state.knows_request(request.request_id):
            await self.finished(delivery)
            return
        self._offsets.seen(delivery.tp, delivery.offset)
        if request.job_id not in self._state.jobs:
            record = await self._jobs.get_job(request.job_id)
            spec = request.spec or (record.spec if record else None)
            if spec is None:
                assert self._actuator is not None, "Receiver.use(actuator) was not called"
                await self._actuator.fail(
                    Pending(request, delivery),
                    ErrorInfo(ErrorCode.NOT_FOUND, f"unknown job {request.job_id}"),
                )
                return
            home = (await self._jobs.homes()).get(request.job_id) if record else None
            self._state.add_job(request.job_id, request.tenant, spec, home)
        self._state.on_request(request, delivery)

    async def on_completion(self, completion: PhaseCompletion, delivery: Delivery) -> None:
        """Take the completion into the state now; its usage is written with the rest
        taken since the last commit (`flush_usage`, before their offsets are committed).
        A call sent straight to its worker (`plexrl.direct`) is seen here for the first
        time."""
        # By what this scheduler dispatched first: a call answered from its ledger keeps
        # the dispatch id it first ran under (a requeued direct call, say).
        dispatched = self._state.dispatched(completion.request_id)
        if not dispatched and direct.lease_of(completion.dispatch_id) is not None:
            self._state.on_direct_completion(completion)
            if self._direct is not None:
                self._direct.on_completion(completion)
            self._usage_due.add(completion)
            return
        request_delivery = self._state.on_completion(completion)
        if request_delivery is None:
            return
        if completion.function == Function.UNLOAD:
            metrics.JOBS_FINISHED.inc()
        await self.finished(request_delivery)
        worker = self._state.workers.get(completion.worker_id)
        self._usage_due.add(completion, worker.heartbeat.devices if worker is not None else 1)

    async def flush_usage(self) -> None:
        """Write the usage of the completions taken since the last flush: one Redis
        transaction for all of them (a commit interval's). Retried in place while Redis is
        away: the state already took the completions, so a second delivery would not count
        again."""
        usages = self._usage_due.take()
        if not usages:
            return
        try:
            await retrying(lambda: self._usage.add_usages(usages), what="recording usage")
        except Exception:  # not transient: lost, as a replay would not count it either
            log.exception("could not record the usage of %d jobs", len(usages))

    async def on_event(self, event: Event, delivery: Delivery) -> None:
        match event:
            case WorkerHeartbeat():
                if self._state.on_heartbeat(event):
                    log.info("worker %s joined (%s)", event.worker_id, event.device)
                    self.new_workers.append(event.worker_id)
            case IdleHint():
                self._state.on_idle_hint(event.job_id, event.seconds)
            case JobOptions():
                self._state.on_job_options(event.job_id, event.staleness, event.steps)
            case TailReleased():
                if self._state.on_tail_released(event):
                    metrics.TAIL_RELEASES.labels(event.worker_id, str(event.reason)).inc()
            case ResidencyChanged():
                pass  # the scheduler moved it itself; heartbeats reconcile
            case _:
                pass


class UsageDue:
    """Completions' usage not yet written, summed per job."""

    def __init__(self) -> None:
        self._due: dict[str, tuple[dict[str, float], float, float]] = {}

    def add(self, completion: PhaseCompletion, devices: int = 1) -> None:
        """`devices`: the ranks of the group that ran it, each a device held for its time."""
        t = completion.timings
        at = completion.finished_at
        due = self._due.get(completion.job_id)
        if due is None:
            fields = dict.fromkeys(_USAGE_FIELDS, 0.0)
            first, last = at, at
        else:
            fields, first, last = due
            first, last = min(first, at), max(last, at)
        fields["calls"] += 1.0
        fields["queue_s"] += t.queue_s
        fields["swap_s"] += t.swap_s
        fields["compute_s"] += t.compute_s
        fields["device_s"] += devices * (t.swap_s + t.compute_s)
        self._due[completion.job_id] = (fields, first, last)

    def take(self) -> dict[str, tuple[dict[str, float], float, float]]:
        due, self._due = self._due, {}
        return due


_USAGE_FIELDS = ("calls", "queue_s", "swap_s", "compute_s", "device_s")
