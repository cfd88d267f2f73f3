"""Direct leases: a resident, active job's calls go straight from the gateways to its
worker, and the scheduler takes the lease back before it acts on that worker.

The protocol, and why per-job order and exactly-once hold across a grant and a revoke,
are in `plexrl.direct`; this component decides when. It grants a lease when a job's
dispatch has just ended on its home with nothing else queued for that worker and no
other job's dispatch running there (the job is resident and active); renews it while the
job keeps calling; revokes it when a call of any job is queued for the worker (one of
the job's own that came the normal way too), when the actuator is about to act on the
worker (a swap, a preemption), when the worker dies or the job leaves its home, and
when the job's home is due for review (`ClusterState.due_for_review`: the policy
reviews a home only while its job is between calls, which a held worker hides; a job
alone on its worker that keeps calling would otherwise never be reviewed). From the
grant until every call handed out under the lease is answered, the worker is held
(`ClusterState.held`): the policy sees the job running there and nothing else is sent to
it (nor follows a dispatch of the job still in flight there), so no dispatch of the
scheduler overtakes a direct call on the worker's topic. A direct call that will not be
answered (its worker died; or the worker reported idle past the grace with it
unanswered: a gateway died holding it) is put back in the queue, numbered as it was, for
the scheduler to dispatch itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from plexrl.direct import LEASED, DirectLeases, Granted, read_element
from plexrl.failpoints import failpoint
from plexrl.messages import MessageError, PhaseCompletion, PhaseRequest, Tier
from plexrl_scheduler import metrics
from plexrl_scheduler.state import ClusterState, InFlight

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DirectConfig:
    """When direct leases are granted, renewed and given up."""

    ttl_s: float = 3.0
    """A lease lapses this long after its last renewal: gateways stop sending a job's
    calls direct at most this long after the scheduler stopped renewing (it died, or
    lost Redis). 0 turns direct leases off."""
    renew_every_s: float = 1.0
    """How often live leases are renewed (one Redis round trip for all of them); under
    `ttl_s`, so that a live lease never lapses between two renewals."""
    idle_s: float = 30.0
    """A lease whose job made no call for this long is let go (a long tool or reward
    stall); its next call goes through the scheduler, which may grant it again."""
    grace_s: float = 5.0
    """After a revocation, calls handed out under it still unanswered once their worker
    reported idle this long after it were lost on the way: they are requeued (the
    dispatches' own rule, `LivenessConfig.lease_grace_s`)."""

    def __post_init__(self) -> None:
        if self.ttl_s < 0:
            raise ValueError(f"ttl_s is {self.ttl_s}; it must be >= 0 (0 turns leases off)")
        if self.ttl_s > 0 and not 0 < self.renew_every_s < self.ttl_s:
            raise ValueError(
                f"renew_every_s is {self.renew_every_s} with ttl_s {self.ttl_s}; it must be "
                "positive and under ttl_s, or live leases lapse between renewals"
            )

    @property
    def enabled(self) -> bool:
        return self.ttl_s > 0


@dataclass
class _Lease:
    job_id: str
    worker_id: str
    lease_id: int
    live: bool
    outstanding: dict[str, tuple[int, PhaseRequest]] = field(default_factory=dict)
    """Once revoked: the calls handed out under it not answered yet (request id → seq,
    request)."""
    revoked_at: float = 0.0
    high: int = 0
    """The highest seq handed out under it (known once revoked)."""
    revoking: bool = False
    seen: set[str] = field(default_factory=set)
    """Completions taken while its revocation was in flight."""


class DirectPath:
    def __init__(
        self,
        state: ClusterState,
        leases: DirectLeases,
        config: DirectConfig,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._state = state
        self._leases = leases
        self._config = config
        self._clock = clock
        """Wall clock (a heartbeat's `sent_at` is compared with it)."""
        self._by_worker: dict[str, _Lease] = {}
        self._by_job: dict[str, _Lease] = {}
        self._next_renewal = 0.0
        self.granted = 0
        self.requeued = 0

    # The scheduler's other parts ----------------------------------------------

    async def restore(self, job_ids: list[str]) -> None:
        """After a restart: revoke every lease recorded (this scheduler knows none) and
        hold each worker until what was handed out under it is answered."""
        for job_id, (_, worker_id) in (await self._leases.recorded(job_ids)).items():
            revoked = await self._leases.revoke(job_id)
            failpoint("scheduler.direct_revoked")
            metrics.DIRECT_REVOKES.labels("restart").inc()
            outstanding = self._parse(revoked.outstanding, lease_id=None)
            if not outstanding or not worker_id:
                continue
            lease = _Lease(job_id, worker_id, revoked.lease_id, live=False, high=revoked.high)
            lease.outstanding, lease.revoked_at = outstanding, self._clock()
            self._add(lease)
            log.info(
                "direct lease %d of %s on %s: %d calls to see answered first",
                revoked.lease_id,
                job_id,
                worker_id,
                len(outstanding),
            )

    def on_completion(self, completion: PhaseCompletion) -> None:
        """A call sent direct was answered (the receiver counts its usage)."""
        metrics.DIRECT_CALLS.labels(str(completion.function)).inc()
        lease = self._by_job.get(completion.job_id)
        if lease is None:
            return
        if lease.revoking:
            lease.seen.add(completion.request_id)
        elif lease.outstanding.pop(completion.request_id, None) and not lease.outstanding:
            self._end(lease)

    async def clear(self, worker_id: str) -> bool:
        """Whether the scheduler may act on the worker now: no lease holds it. A live one
        is revoked first; True once every call handed out under it is answered."""
        lease = self._by_worker.get(worker_id)
        if lease is not None and lease.live:
            await self._revoke(lease, "acting")
        return worker_id not in self._by_worker

    async def worker_lost(self, worker_id: str) -> None:
        """The worker died (its jobs' epochs were bumped, which already stopped the
        gateways): what was handed out under its lease goes back in the queue."""
        lease = self._by_worker.get(worker_id)
        if lease is None:
            return
        if lease.live:
            await self._revoke(lease, "lost")
        if worker_id in self._by_worker:
            self._requeue(lease)

    # The control loop's step ----------------------------------------------------

    async def step(self) -> None:
        """Revoke where a call waits for a held worker, the job left it or its home is due
        for review; renew; requeue what a revoked lease lost; grant where a job's
        dispatch just ended."""
        for worker_id in self._state.take_wanted():
            lease = self._by_worker.get(worker_id)
            if lease is not None and lease.live:
                await self._revoke(lease, "wanted")
        now = self._clock()
        for lease in list(self._by_worker.values()):
            if lease.live and self._gone(lease):
                await self._revoke(lease, "gone")
            elif lease.live and self._state.due_for_review(lease.job_id):
                await self._revoke(lease, "review")
            if self._by_worker.get(lease.worker_id) is not lease or lease.live:
                continue
            if self._dead(lease) or self._lost_on_the_way(lease):
                self._requeue(lease)
        if now >= self._next_renewal:
            self._next_renewal = now + self._config.renew_every_s
            await self._renew(now)
        for worker_id, run in self._state.take_freed().items():
            await self._grant(worker_id, run)

    # Internals --------------------------------------------------------------------

    def _gone(self, lease: _Lease) -> bool:
        job = self._state.jobs.get(lease.job_id)
        return (
            job is None or job.home != lease.worker_id or not self._state.healthy(lease.worker_id)
        )

    def _dead(self, lease: _Lease) -> bool:
        """Its worker was declared dead, or the job lives elsewhere now: the calls sent
        there will not run (a re-homed job's old worker drops them as stale). This also
        catches a revocation that failed in `worker_lost`, and a lease a restarted
        scheduler found on a worker its job has left."""
        worker = self._state.workers.get(lease.worker_id)
        job = self._state.jobs.get(lease.job_id)
        return (worker is not None and worker.lost) or (
            job is not None and job.home != lease.worker_id
        )

    def _lost_on_the_way(self, lease: _Lease) -> bool:
        """The worker reported idle well after the revocation with calls unanswered."""
        worker = self._state.workers.get(lease.worker_id)
        return (
            worker is not None
            and self._state.healthy(lease.worker_id)
            and not worker.heartbeat.busy
            and worker.heartbeat.sent_at > lease.revoked_at + self._config.grace_s
        )

    async def _grant(self, worker_id: str, run: InFlight) -> None:
        if not self._config.enabled or worker_id in self._by_worker:
            return
        job = self._state.jobs.get(run.job_id)
        if (
            job is None
            or job.home != worker_id
            or job.tier != Tier.DEVICE
            or job.epoch == 0  # not known since a restart: its next dispatch learns it
            # The worker runs another dispatch; one of this job's own (its next call,
            # dispatched before this one's end was seen: completions come up to a
            # fetch's wait late) does not stand in the way: the lease's calls go to the
            # worker's topic behind it, and the grant waits for its numbered calls.
            or self._state.inflight.get(worker_id, run).job_id != run.job_id
            or not self._state.healthy(worker_id)
            or not any(p.request.function in LEASED for p in run.calls)  # sampling, say
            or any(t.worker_id == worker_id for t in self._state.tails.values())
            or self._state.wanted(worker_id)
            or self._state.due_for_review(job.job_id)  # (revoked for it at once)
            # Its training must stay preemptible between micro-batches: a direct call
            # is not the scheduler's to preempt.
            or self._state.sliceable(job.job_id, worker_id)
        ):
            return
        granted = await self._leases.grant(job.job_id, worker_id, job.epoch, self._config.ttl_s)
        if not isinstance(granted, Granted):
            log.debug("no direct lease for %s on %s: %s", job.job_id, worker_id, granted)
            return
        failpoint("scheduler.direct_granted")
        lease = _Lease(job.job_id, worker_id, granted.lease_id, live=True)
        self._add(lease)
        self.granted += 1
        metrics.DIRECT_LEASES.labels(worker_id).inc()
        if self._state.wanted(worker_id):  # a call came while the grant was in Redis
            await self._revoke(lease, "wanted")

    async def _renew(self, now: float) -> None:
        live = [lease for lease in self._by_worker.values() if lease.live]
        due: dict[str, int] = {}
        for lease in live:
            job = self._state.jobs.get(lease.job_id)
            if job is None or now - job.last_active > self._config.idle_s:
                await self._revoke(lease, "idle")
            else:
                due[lease.job_id] = lease.lease_id
        held = await self._leases.renew(due, self._config.ttl_s)
        for job_id, still in held.items():
            renewed = self._by_job.get(job_id)
            if not still and renewed is not None and renewed.live:
                await self._revoke(renewed, "lapsed")

    async def _revoke(self, lease: _Lease, reason: str) -> None:
        """End the lease in Redis; the worker stays held until what was handed out under
        it is answered."""
        lease.revoking, lease.seen = True, set()
        try:
            revoked = await self._leases.revoke(lease.job_id)
        finally:
            lease.revoking = False
        failpoint("scheduler.direct_revoked")
        lease.live, lease.revoked_at, lease.high = False, self._clock(), revoked.high
        outstanding = self._parse(revoked.outstanding, lease.lease_id)
        lease.outstanding = {r: c for r, c in outstanding.items() if r not in lease.seen}
        lease.seen = set()
        metrics.DIRECT_REVOKES.labels(reason).inc()
        log.debug(
            "direct lease %d of %s on %s revoked (%s): high %d, %d calls unanswered",
            lease.lease_id,
            lease.job_id,
            lease.worker_id,
            reason,
            revoked.high,
            len(lease.outstanding),
        )
        if not lease.outstanding:
            self._end(lease)

    def _parse(
        self, elements: dict[str, bytes], lease_id: int | None
    ) -> dict[str, tuple[int, PhaseRequest]]:
        """The calls of `lease_id` (None: of any lease) among outbox elements, leaving
        out those the scheduler has in hand already (requeued earlier)."""
        out = {}
        for request_id, raw in elements.items():
            try:
                route, entry = read_element(raw)
            except (MessageError, ValueError):
                log.exception("unreadable direct call %s; left alone", request_id)
                continue
            if route is None or (lease_id is not None and route.lease_id != lease_id):
                continue
            if not self._state.knows_request(request_id):
                out[request_id] = (route.seq, entry.request)
        return out

    def _requeue(self, lease: _Lease) -> None:
        """Put the lease's unanswered calls at the head of the queue: numbered ones in seq
        order (each applies only after the one before), unnumbered ones after."""
        calls = sorted(
            lease.outstanding.values(), key=lambda c: (c[0] == 0, c[0], c[1].arrival_time)
        )
        self._state.requeue_direct([request for _, request in calls])
        self.requeued += len(calls)
        metrics.DIRECT_REQUEUED.inc(len(calls))
        log.warning(
            "direct lease %d of %s on %s: requeued %d calls handed out under it",
            lease.lease_id,
            lease.job_id,
            lease.worker_id,
            len(calls),
        )
        self._end(lease)

    def _add(self, lease: _Lease) -> None:
        self._by_worker[lease.worker_id] = lease
        self._by_job[lease.job_id] = lease
        self._state.hold(lease.worker_id, lease.job_id)

    def _end(self, lease: _Lease) -> None:
        if self._by_worker.get(lease.worker_id) is lease:
            del self._by_worker[lease.worker_id]
            self._state.release(lease.worker_id)
        if self._by_job.get(lease.job_id) is lease:
            del self._by_job[lease.job_id]

    def status(self) -> dict[str, int]:
        return {
            "live": sum(lease.live for lease in self._by_worker.values()),
            "draining": sum(not lease.live for lease in self._by_worker.values()),
            "granted": self.granted,
            "requeued": self.requeued,
        }
