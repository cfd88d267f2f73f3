"""The scheduler's view of the cluster, fed by requests, completions and events.

It changes only through the `on_*` methods and `apply_*` methods (which record
what the scheduler just decided); `snapshot()` freezes it for the policy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field, replace

from plexrl.kafka import Delivery
from plexrl.ledger import SEQUENCED
from plexrl.messages import (
    Function,
    JobSpec,
    PhaseCompletion,
    PhaseRequest,
    TailReleased,
    Tier,
    WorkerHeartbeat,
)
from plexrl.policy import (
    CallEstimates,
    ClusterSnapshot,
    JobView,
    Move,
    PendingCall,
    SwapCosts,
    WorkerView,
)
from plexrl.policy.common import fewest_devices
from plexrl.policy.costs import SharingCosts
from plexrl.policy.history import (
    CallHistory,
    Described,
    Prior,
    RecentUse,
    Spread,
    describe,
    duty_of,
    priors,
)

Clock = Callable[[], float]
log = logging.getLogger(__name__)

_TRAINING = frozenset({Function.FORWARD_BACKWARD, Function.OPTIM_STEP})

# Wall time a job must have been seen for before its measured duty cycle is used.
_MIN_HISTORY_S = 5.0
# A job that has made no call for this long, has none waiting or running and no idle
# hint in force is taken to have stopped (a finished run, a closed client): it keeps its
# home and its state, but adds no load to its group when jobs are placed (its duty cycle
# reads 0) and lends no figures to newcomers. Its next call wakes it. The scheduler's
# `dormant_s` setting (`PLEXRL_DORMANT_S`) replaces it.
DORMANT_S = 60.0

Kind = tuple[str, str, bool]


@dataclass
class JobState:
    job_id: str
    tenant: str
    spec: JobSpec
    state_bytes: int
    home: str | None = None
    tier: Tier | None = None
    last_active: float = 0.0
    idle_until: float = 0.0
    last_gap_s: float = 0.0
    """Seconds from the end of its calls to its next call, the last time it had none
    queued or running (`JobView.last_gap_s`)."""
    burst_since: float = 0.0
    """When its current burst began: its first call after a gap longer than the
    scheduler's `burst_gap_s` (0: none seen)."""
    history: CallHistory = field(default_factory=CallHistory)
    """What its calls have shown so far: the simulator's estimator, so the live policy
    sees a job as the simulated one does."""
    epoch: int = 0
    """Its lease's fencing token on its home (see plexrl.ledger); 0: not known here yet."""
    used: RecentUse = field(default_factory=RecentUse)
    """Its recent engine seconds (`JobView.used_s`): its tenant's share of its group."""
    last_started: float = 0.0
    """When a dispatch with its calls was last sent (`JobView.last_started`)."""
    staleness: int = 0
    """Its declared loop (`JobOptions`, `JobView.staleness`): 0 synchronous."""
    learned_staleness: int = 0
    """1 once a sample of it on saved weights and its own training were open (queued or
    running) at once: an asynchronous loop, though it declared none (`loop_staleness`)."""
    open_samples: set[str] = field(default_factory=set)
    """Its sample calls on saved weights (`WorkHint.portable`) not answered yet."""
    overlapping: dict[str, float] = field(default_factory=dict)
    """Its open calls of one lane (training, or samples on saved weights) that a call of
    the other lane arrived beside, by request id, with the earliest such arrival (the
    gateway's clock). The overlap is the loop's only if the open call then finished
    after that arrival: one that had finished, its result on its way to the client,
    while its completion had not reached this scheduler yet is a synchronous loop's
    next call overtaking the completion, not a second lane."""
    declared_steps: int = 0
    """Its declared training steps in all (`JobOptions`, `JobView.declared_steps`)."""
    train_slices: int = 1
    """The micro-batches its last sliced `forward_backward` ran in (`Timings.slices`,
    `JobView.train_slices`); 1 until one was."""
    hints: int = 0
    """Idle hints it sent."""
    hinted_s: float = 0.0
    """Their seconds, summed: their mean is `JobView.stall_s`."""
    hinted_at: float = 0.0
    """When its latest idle hint came, until its next call (0: none open)."""
    stalls: Spread = field(default_factory=Spread)
    """Its stalls as they turned out, each from an idle hint to its next call: their
    spread is `JobView.stall_sigma`."""
    provisional: bool = False
    """Its home is due for review at a whole decision once it has a history of its own
    (`JobView.review`): homed on its kind's figures (it had none then), or left alone
    on its group (`PolicyConfig.rehome_lone`), and not reviewed since."""
    awaiting: bool = False
    """Reviewed and kept where it is for want of a group to take it (`Rehome.waits`):
    still under review, at whole decisions only, not at each of its calls."""
    left_alone: bool = False
    """Its review is due because its last neighbour left its group, not as a
    newcomer's (`review_reason`)."""
    alone: bool = False
    """Its review is due because it is alone on its group and another job alone could
    take it within budget (`plexrl.policy.lone_pairs`, `review_reason`)."""
    described: _Described | None = field(default=None, repr=False, compare=False)
    """Its figures for the policy as last described (`ClusterState._view`)."""

    @property
    def review_reason(self) -> str:
        """Why its home is under review: `newcomer`, `left alone` or `alone` (another
        job alone could take it)."""
        if self.left_alone:
            return "left alone"
        return "alone" if self.alone else "newcomer"

    @property
    def loop_staleness(self) -> int:
        """The staleness its loop runs at: declared, or learned from its calls."""
        return max(self.staleness, self.learned_staleness)

    @property
    def kind(self) -> Kind:
        """Jobs of one kind (tenant, base model, LoRA or full) lend a newcomer their figures:
        without them a new job counts as half busy with near-instant calls until it has
        run for `_MIN_HISTORY_S`, and an interference-aware policy finds no group for it."""
        return (self.tenant, self.spec.base_model, self.spec.lora is None)


@dataclass(frozen=True)
class _Described:
    """A job's `describe`d figures and their `CallEstimates`, with what they were
    described from: the history's `version`, its kind's prior, whether it had a history
    of its own. Until one of those changes, only the duty cycle (which reads the clock)
    is described again: a decision on a group reads each job homed there."""

    version: int
    prior: Prior | None
    own: bool
    seen: Described
    estimates: CallEstimates


@dataclass
class Pending:
    request: PhaseRequest
    delivery: Delivery | None


@dataclass
class InFlight:
    dispatch_id: str
    worker_id: str
    job_id: str
    remaining: set[str]
    issued_at: float
    calls: list[Pending] = field(default_factory=list)
    """The dispatched calls, in order: requeued as they were if the lease is lost."""
    preempt_asked: bool = False
    """A Preempt was sent for it (asked once; the worker's TailReleased answers it)."""
    released_at: float = 0.0
    """When the worker released it at its tail (0: not released): its sample calls'
    answers after that time its stragglers (`CallHistory.tail`)."""
    dispatches: int = 1
    """Dispatches it stands for: the first and its follow-ups (`apply_follow_up`)."""
    sliceable: bool = False
    """Its dispatch said the worker may pause its training between micro-batches
    (`Dispatch.sliceable`), as decided when it was issued."""

    @property
    def samples_only(self) -> bool:
        return bool(self.calls) and all(p.request.function == Function.SAMPLE for p in self.calls)


@dataclass
class WorkerState:
    heartbeat: WorkerHeartbeat
    seen_at: float
    lost: bool = False
    """Declared dead (heartbeats stopped): its jobs were re-homed."""


class ClusterState:
    def __init__(
        self,
        *,
        clock: Clock = time.time,
        worker_timeout_s: float = 10.0,
        swap: SwapCosts | None = None,
        burst_gap_s: float = 0.1,
        review_histories: float = 8.0,
        review_lone: bool = True,
        dormant_s: float = DORMANT_S,
        review: bool = True,
    ) -> None:
        """`review_histories`: a newcomer's home is reviewed once it has this many
        times the history it is judged on alone (`PolicyConfig.review_histories`).
        `review_lone`: a job whose last neighbour left its group is reviewed again
        (`PolicyConfig.rehome_lone`). `dormant_s`: a job silent this long is taken to
        have stopped (`DORMANT_S`). `review`: the policy reviews homes at all
        (`PolicyConfig.rehome`); without it, no job is reviewed, alone or not."""
        self._clock = clock
        self._review_after_s = review_histories * _MIN_HISTORY_S
        self._review_lone = review and review_lone
        self._dormant_s = dormant_s
        self._review = review
        self._burst_gap_s = burst_gap_s
        """A gap between a job's calls longer than this ends its burst (the policy's
        `hold_s`)."""
        self._worker_timeout_s = worker_timeout_s
        self._swap = swap or SwapCosts()
        self.workers: dict[str, WorkerState] = {}
        self.sharing: dict[str, SharingCosts] = {}
        """By worker id: the costs of sharing its group is predicted with where its own
        measurements moved off the pool's (`plexrl.policy.costs.by_worker`, kept by
        the scheduler's costs step; `WorkerView.sharing`)."""
        self.jobs: dict[str, JobState] = {}
        self.pending: dict[str, Pending] = {}
        self.inflight: dict[str, InFlight] = {}
        """By worker id: the dispatch that worker is running."""
        self.tails: dict[str, InFlight] = {}
        """By dispatch id: dispatches whose sample batch a worker released at its tail
        (TailReleased): still running there, beside whatever it was sent next."""
        self.held: dict[str, str] = {}
        """By worker id: the job whose direct lease holds it (live, or revoked with calls
        handed out under it not answered yet; `plexrl_scheduler.direct`). The policy
        sees that job running there, and the actuator sends the worker nothing."""
        self._freed: dict[str, InFlight] = {}
        """Workers whose dispatch just ended, and that dispatch (`take_freed`)."""
        self._wanted: set[str] = set()
        """Held workers a call was queued for since the last `take_wanted`."""
        self._inflight_requests: dict[str, tuple[str, Delivery | None]] = {}
        self._open: dict[str, int] = {}
        """Per job: its calls queued or running (in `pending` or `_inflight_requests`),
        kept as they move, so a request does not scan the queue to learn it."""
        self._started_at = clock()
        self._never_seen_lost: set[str] = set()
        """Homes (recorded before a restart) that have not reported since: declared lost."""
        self._changed = asyncio.Event()
        self._touched: set[str] = set()
        """Groups an event touched since the last decision (`take_touched`)."""
        self._everything = True
        """A change that every group's decision may read (a job to admit, a worker that
        joined or died, calls back in the queue): the next decision looks at them all."""
        self._learned: dict[Kind, Prior] = {}
        """The kinds' figures as of the last whole snapshot (`snapshot`)."""
        self._served: dict[str, JobState] = {}
        """Per tenant, its job whose call ended last (`fifo.last_served` reads it)."""
        self._homed: dict[str, set[str]] = {}
        """Per group, the jobs given it as their home (some may have left since: read
        through `_homed_on`)."""
        self._queued: dict[str, set[str]] = {}
        """Per job, its request ids in `pending`."""
        self._place: dict[str, int] = {}
        """Per request id in `pending`, its place in the queue's order."""
        self._places = (0, 0)
        """The lowest place given so far, and the next place at the back."""

    # Ingest -------------------------------------------------------------------

    def knows_request(self, request_id: str) -> bool:
        return request_id in self.pending or request_id in self._inflight_requests

    def dispatched(self, request_id: str) -> bool:
        """Whether the call is in a dispatch this scheduler sent and is unanswered."""
        return request_id in self._inflight_requests

    def add_job(self, job_id: str, tenant: str, spec: JobSpec, home: str | None) -> JobState:
        job = self.jobs.get(job_id)
        if job is None:
            job = self.jobs[job_id] = JobState(job_id, tenant, spec, spec.state_bytes, home)
            if home is not None:
                self._homed.setdefault(home, set()).add(job_id)
                # Homed before this scheduler started: its history starts here.
                job.history.homed(self._clock())
        return job

    def on_request(self, request: PhaseRequest, delivery: Delivery | None) -> None:
        job = self.jobs.get(request.job_id)
        if job is not None:
            job.history.arrived(request.function)
            if job.hinted_at:
                job.stalls.add(self._clock() - job.hinted_at)
                job.hinted_at = 0.0
            if request.work.portable:
                job.open_samples.add(request.request_id)
            if not job.learned_staleness:
                for rid in self._other_lane(job, request):
                    at = job.overlapping.get(rid)
                    job.overlapping[rid] = request.arrival_time if at is None else at
            if job.last_active > 0 and not self._open.get(job.job_id):
                now = self._clock()
                job.last_gap_s = max(now - job.last_active, 1e-6)
                if job.last_gap_s > self._burst_gap_s or not job.burst_since:
                    job.burst_since = now
        if request.request_id not in self.pending:
            self._queue(request.job_id, request.request_id, back=True)
        self.pending[request.request_id] = Pending(request, delivery)
        self._touch(job.home if job is not None else None)

    def _other_lane(self, job: JobState, request: PhaseRequest) -> list[str]:
        """The job's open calls of the other lane, where the call is a sample on saved
        weights (its training calls) or a training call (its open samples on saved
        weights): a synchronous loop sends neither while the other is open."""
        if request.function in _TRAINING:
            return list(job.open_samples)
        return self._training(job) if request.work.portable else []

    def _training(self, job: JobState) -> list[str]:
        """The job's training calls (`forward_backward`, `optim_step`) queued, or running
        on its home (as a dispatch or released there to the background)."""
        queued = [
            rid
            for rid in self._queued.get(job.job_id, ())
            if rid in self.pending and self.pending[rid].request.function in _TRAINING
        ]
        running = (p.request for p in self._at_home(job))
        return queued + [r.request_id for r in running if r.function in _TRAINING]

    def _at_home(self, job: JobState) -> Iterator[Pending]:
        """The job's calls running on its home: in the dispatch there (its own, or
        another job's it is co-sampled in) or in a batch released there to the
        background."""
        home = job.home
        runs = [self.inflight.get(home or ""), *self.tails.values()]
        for run in runs:
            if run is None or run.worker_id != home:
                continue
            for p in run.calls:
                if p.request.job_id == job.job_id and p.request.request_id in run.remaining:
                    yield p

    def _touch(self, worker_id: str | None) -> None:
        """An event changed what the group's decision reads (None: a job with no home,
        whose admission reads every group)."""
        if worker_id is None:
            self._everything = True
        else:
            self._touched.add(worker_id)
        self._changed.set()

    def take_touched(self, everything: bool) -> set[str] | None:
        """The groups to decide on now, forgotten here: those events touched since the
        last call, or None for all of them (when `everything`, and whenever a change
        every group's decision reads is due and `everything` allows it)."""
        if everything:
            self._touched, self._everything = set(), False
            return None
        touched, self._touched = self._touched, set()
        return touched

    def touch_again(self, worker_ids: Iterable[str]) -> None:
        """Groups to decide on again at the next decision (held for a bursting job)."""
        self._touched.update(worker_ids)

    @property
    def everything_due(self) -> bool:
        """Whether a change every group's decision reads waits for a whole decision."""
        return self._everything

    def _queue(self, job_id: str, request_id: str, back: bool) -> None:
        """A call joins the queue, at its back or (requeued) at its front."""
        self._count(job_id, 1)
        job = self.jobs.get(job_id)
        if job is not None and job.home in self.held:
            self._wanted.add(job.home)
        self._queued.setdefault(job_id, set()).add(request_id)
        low, high = self._places
        if back:
            self._place[request_id], self._places = high, (low, high + 1)
        else:
            self._place[request_id], self._places = low - 1, (low - 1, high)

    def _unqueue(self, job_id: str, request_id: str) -> None:
        self._count(job_id, -1)
        self._place.pop(request_id, None)
        queued = self._queued.get(job_id)
        if queued is not None:
            queued.discard(request_id)
            if not queued:
                del self._queued[job_id]

    def _count(self, job_id: str, change: int) -> None:
        left = self._open.get(job_id, 0) + change
        if left > 0:
            self._open[job_id] = left
        else:
            self._open.pop(job_id, None)

    def _busy_jobs(self) -> set[str]:
        """Jobs with a call queued, or running (in a dispatch or a released tail)."""
        return set(self._open)

    def on_completion(self, completion: PhaseCompletion) -> Delivery | None:
        """Free the worker when its dispatch is done; returns the request's delivery."""
        job = self.jobs.get(completion.job_id)
        if job is not None:
            job.open_samples.discard(completion.request_id)
            beside = job.overlapping.pop(completion.request_id, None)
            if beside is not None and completion.finished_at > beside and not job.learned_staleness:
                job.learned_staleness = 1
                if not job.staleness:
                    log.info("%s samples while it trains: asynchronous (staleness 1)", job.job_id)
        entry = self._inflight_requests.pop(completion.request_id, None)
        if entry is None:
            return None
        self._count(completion.job_id, -1)
        worker_id, delivery = entry
        self._observe(completion, worker_id)
        run = self.inflight.get(worker_id)
        if run is not None and completion.request_id in run.remaining:
            run.remaining.discard(completion.request_id)
            if not run.remaining:
                del self.inflight[worker_id]
                self._freed[worker_id] = run
        for dispatch_id, tail in list(self.tails.items()):
            if completion.request_id not in tail.remaining:
                continue
            tail.remaining.discard(completion.request_id)
            if job is not None and completion.function == Function.SAMPLE:
                job.history.tail(self._clock() - tail.released_at)
            if not tail.remaining:
                del self.tails[dispatch_id]
        self._touch(worker_id)
        return delivery

    def on_direct_completion(self, completion: PhaseCompletion) -> None:
        """A call that went straight to its worker under a direct lease ended: the
        scheduler sees it here for the first time (its arrival and its end)."""
        job = self.jobs.get(completion.job_id)
        if job is not None:
            job.history.arrived(completion.function)
        self._observe(completion, completion.worker_id)
        self._touch(completion.worker_id)

    def _observe(self, completion: PhaseCompletion, worker_id: str) -> None:
        """A call of the job ended: its history, recent use and activity."""
        job = self.jobs.get(completion.job_id)
        if job is None:
            return
        now, t = self._clock(), completion.timings
        if t.slices > 0:
            job.train_slices = t.slices
        queued = _queued(job, t.queue_s, started=now - t.compute_s - t.swap_s)
        job.history.observe(completion.function, t.compute_s, t.swap_s, queued)
        job.used.add(t.compute_s + t.swap_s, now)
        job.last_active = now
        served = self._served.get(job.tenant)
        if served is None or served.last_active <= now:
            self._served[job.tenant] = job
        if job.home is not None and job.home != worker_id:
            self._touch(job.home)
        if not job.awaiting and self._due_for_review(job, now):
            self._touch(None)  # its home is reviewed at the next whole decision
        if completion.function == Function.UNLOAD:
            del self.jobs[job.job_id]
            if self._served.get(job.tenant) is job:
                self._serve_again(job.tenant)
            self._left(job.home, now)

    def _serve_again(self, tenant: str) -> None:
        """The tenant's last served job is gone: find the next one."""
        self._served.pop(tenant, None)
        for job in self.jobs.values():
            served = self._served.get(tenant)
            if job.tenant == tenant and (served is None or job.last_active > served.last_active):
                self._served[tenant] = job

    def on_heartbeat(self, beat: WorkerHeartbeat) -> bool:
        """Record a heartbeat; True when the worker is new to this scheduler."""
        previous = self.workers.get(beat.worker_id)
        new = previous is None
        if previous is not None and previous.heartbeat.started_at != beat.started_at:
            # Restarted with the same id: the states it held in memory are gone (its
            # dispatch in flight comes back to it from Kafka; it restores the job).
            for homed in self.jobs.values():
                if homed.home == beat.worker_id and homed.tier is not None:
                    homed.tier = Tier.DISK
            # Batches it had released (a tail, a preempted rollout) died with it, and
            # their dispatches were acknowledged at the release: Kafka will not bring
            # them back, so their unanswered calls go back to the queue.
            back = self.requeue_tails(beat.worker_id)
            if back:
                log.warning("worker %s restarted: requeued %s", beat.worker_id, back)
        self.workers[beat.worker_id] = WorkerState(beat, self._clock())
        # The worker's own report is the truth about residency, but only while no
        # dispatch of ours is on its way there (our plan runs ahead of its report).
        if beat.worker_id not in self.inflight and not beat.busy:
            for resident in beat.resident:
                job = self.jobs.get(resident.job_id)
                if job is not None and job.home == beat.worker_id:
                    job.tier = resident.tier
                    job.state_bytes = resident.bytes
        if new:
            self._touch(None)  # a group to place waiting jobs on
        self._touch(beat.worker_id)
        return new

    def on_tail_released(self, event: TailReleased) -> bool:
        """The worker's dispatch is down to its sample tail: the worker is free for the
        next dispatch, the tail's jobs stay pinned until their calls complete. False when
        the dispatch is no longer in flight (it finished first)."""
        run = self.inflight.get(event.worker_id)
        if run is None or run.dispatch_id != event.dispatch_id:
            return False
        del self.inflight[event.worker_id]
        run.released_at = self._clock()
        self.tails[run.dispatch_id] = run
        self._touch(event.worker_id)
        return True

    def apply_preempt(self, worker_id: str) -> str | None:
        """Record that the worker's running batch was asked to yield; its dispatch id
        (None: nothing runs there now)."""
        run = self.inflight.get(worker_id)
        if run is None:
            return None
        run.preempt_asked = True
        return run.dispatch_id

    def on_job_options(self, job_id: str, staleness: int, steps: int = 0) -> None:
        job = self.jobs.get(job_id)
        if job is not None:
            job.staleness = staleness
            job.declared_steps = steps
            self._touch(job.home)

    def on_idle_hint(self, job_id: str, seconds: float) -> None:
        job = self.jobs.get(job_id)
        if job is not None:
            now = self._clock()
            job.idle_until = now + seconds
            job.hinted_at = now
            job.hints += 1
            job.hinted_s += seconds
            self._touch(job.home)

    # Record decisions --------------------------------------------------------

    def apply_admit(self, job_id: str, worker_id: str, epoch: int = 0) -> None:
        job = self.jobs[job_id]
        job.home = worker_id
        if worker_id in self.held and job_id in self._queued:
            self._wanted.add(worker_id)
        self._homed.setdefault(worker_id, set()).add(job_id)
        job.epoch = epoch
        # Its duty cycle counts from its first home: waiting for admission is not the
        # job's idleness. A re-home (its worker died) keeps the span, which the busy
        # seconds measured so far belong to.
        if job.history.first_seen is None:
            job.history.homed(self._clock())
        job.provisional = not job.history.has_history(self._clock(), _MIN_HISTORY_S)

    def apply_rehome(self, job_id: str, worker_id: str, epoch: int) -> None:
        """The job moved to `worker_id` between calls (`plexrl.policy.Rehome`): its new
        home restores it from the disk tier; its figures and history go with it."""
        job = self.jobs[job_id]
        old = job.home
        self.apply_admit(job_id, worker_id, epoch)
        job.provisional = job.awaiting = job.left_alone = job.alone = False
        job.tier = Tier.DISK if job.tier is not None else None
        self._touch(old)
        self._touch(worker_id)
        if old != worker_id:
            self._left(old, self._clock())

    def _left(self, worker_id: str | None, now: float) -> None:
        """A job left `worker_id`: a job left alone there is due for review again
        (`PolicyConfig.rehome_lone`), at the next whole decision."""
        if not self._review_lone or worker_id is None:
            return
        homed = self._homed_on(worker_id)
        if len(homed) == 1 and not homed[0].awaiting:
            if not homed[0].provisional:  # (a newcomer not reviewed yet stays one)
                homed[0].left_alone = True
            homed[0].provisional = True
            if self._due_for_review(homed[0], now):
                self._touch(None)

    @property
    def review_interval_s(self) -> float:
        """How much history a newcomer's review waits for; also how often the jobs alone
        on their groups are asked about (`review_alone`)."""
        return self._review_after_s

    def review_alone(self, job_ids: Iterable[str]) -> None:
        """Jobs alone on their groups that another job alone could take within budget
        (`plexrl.policy.lone_pairs`): each is due for review, as a job left alone is,
        at the next whole decision (`PolicyConfig.rehome_lone`)."""
        if not self._review_lone:
            return
        now = self._clock()
        for job_id in job_ids:
            job = self.jobs.get(job_id)
            if job is None or job.provisional or job.awaiting:
                continue
            job.provisional = job.alone = True
            if self._due_for_review(job, now):
                self._touch(None)

    def apply_review(self, job_id: str, waits: bool = False) -> None:
        """The policy kept the job where it is (`plexrl.policy.Rehome` to its own home):
        its review is done, or (`waits`) goes on at later whole decisions."""
        job = self.jobs.get(job_id)
        if job is not None:
            job.provisional = job.awaiting = waits
            job.left_alone = job.left_alone and waits
            job.alone = job.alone and waits

    def _due_for_review(self, job: JobState, now: float) -> bool:
        """Under a policy that reviews homes, the job is provisional and has the history
        its review waits for (under one that does not, no job ever is: nothing would
        answer the review, and each of its calls would ask for a whole decision)."""
        return (
            self._review and job.provisional and job.history.has_history(now, self._review_after_s)
        )

    def due_for_review(self, job_id: str) -> bool:
        """The job's home is due for review, which only a whole decision that sees the
        job between calls makes: a direct lease on its worker, which shows the worker
        busy with the job, is taken back for it (`plexrl_scheduler.direct`)."""
        job = self.jobs.get(job_id)
        return job is not None and self._due_for_review(job, self._clock())

    def between_calls(self, job_id: str) -> bool:
        """No call of the job is in flight on its home (dispatched, co-sampled in
        another job's dispatch, or decoding as a released tail). A sample of it roaming
        on another worker reads its saved sampler weights, not its state there."""
        return next(self._at_home(self.jobs[job_id]), None) is None

    def review_again(self) -> None:
        """A review could not be carried out now: the next decision is a whole one."""
        self._touch(None)

    def apply_epoch(self, job_id: str, epoch: int) -> None:
        self.jobs[job_id].epoch = epoch

    def take_pending(self, request_ids: tuple[str, ...]) -> list[Pending]:
        taken = [self.pending.pop(rid) for rid in request_ids if rid in self.pending]
        for p in taken:
            self._unqueue(p.request.job_id, p.request.request_id)
        return taken

    def apply_run(
        self,
        dispatch_id: str,
        worker_id: str,
        job_id: str,
        taken: list[Pending],
        evict: tuple[Move, ...],
        sliceable: bool = False,
    ) -> None:
        """`sliceable`: the dispatch's own (`Dispatch.sliceable`)."""
        for move in evict:
            if move.job_id in self.jobs:
                self.jobs[move.job_id].tier = move.to_tier
        runner = self.jobs[job_id]
        if runner.home == worker_id:  # (a roaming sample leaves the job's state at home)
            runner.tier = Tier.DEVICE
        ids = {p.request.request_id for p in taken}
        now = self._clock()
        self.inflight[worker_id] = InFlight(
            dispatch_id, worker_id, job_id, ids, now, list(taken), sliceable=sliceable
        )
        for p in taken:  # (co-sampled calls of other jobs start with it)
            started = self.jobs.get(p.request.job_id)
            if started is not None:
                started.last_started = now
        for p in taken:
            self._inflight_requests[p.request.request_id] = (worker_id, p.delivery)
            self._count(p.request.job_id, 1)

    # Follow-ups: more than one dispatch in flight per worker ---------------------

    def queued_count(self, job_id: str) -> int:
        """The job's calls waiting in the queue."""
        return len(self._queued.get(job_id, ()))

    def follow_up_running(self, worker_id: str) -> list[Function] | None:
        """The functions of the worker's dispatch in flight, in order, when its job has
        calls queued that might follow it at once (a second dispatch behind it on the
        worker's topic; `plexrl.policy.follow_up` says which); None when none may: no
        dispatch, or one asked to yield, its job not homed there or with nothing queued,
        or another job homed there waiting (the policy chooses between them when the
        worker is free), or a direct lease holding the worker (granted behind the
        dispatch: its calls may be on the topic already, and nothing of the scheduler's
        goes after them until they are answered)."""
        run = self.inflight.get(worker_id)
        if run is None or run.preempt_asked or run.job_id not in self._queued:
            return None
        if worker_id in self.held:
            return None
        job = self.jobs.get(run.job_id)
        if job is None or job.home != worker_id:
            return None
        if any(
            j.job_id != job.job_id and j.job_id in self._queued for j in self._homed_on(worker_id)
        ):
            return None
        return [p.request.function for p in run.calls]

    def apply_follow_up(
        self, dispatch_id: str, worker_id: str, job_id: str, taken: list[Pending]
    ) -> None:
        """`taken` went to the worker behind its dispatch in flight: the worker is free
        once those are answered too. If that dispatch ended meanwhile (its completions
        came in while the follow-up was numbered), the follow-up is a dispatch of its
        own."""
        run = self.inflight.get(worker_id)
        if run is None:
            self.apply_run(dispatch_id, worker_id, job_id, taken, ())
            return
        run.dispatches += 1
        run.issued_at = self._clock()  # (a lost follow-up is seen from its own send)
        run.calls += taken
        for p in taken:
            run.remaining.add(p.request.request_id)
            self._inflight_requests[p.request.request_id] = (worker_id, p.delivery)
            self._count(p.request.job_id, 1)
        job = self.jobs.get(run.job_id)
        if job is not None:
            job.last_started = run.issued_at

    # Direct leases ------------------------------------------------------------

    def hold(self, worker_id: str, job_id: str) -> None:
        """The job's direct lease holds the worker (`held`)."""
        self.held[worker_id] = job_id
        self._freed.pop(worker_id, None)

    def release(self, worker_id: str) -> None:
        """The worker's direct lease ended and every call handed out under it is answered
        (or back in the queue): the worker is the policy's again."""
        if self.held.pop(worker_id, None) is not None:
            self._touch(worker_id)

    def take_freed(self) -> dict[str, InFlight]:
        """Workers whose dispatch ended since the last call, and that dispatch."""
        freed, self._freed = self._freed, {}
        return freed

    def take_wanted(self) -> set[str]:
        """Held workers a call was queued for since the last call."""
        wanted, self._wanted = self._wanted, set()
        return wanted

    def wanted(self, worker_id: str) -> bool:
        """Whether a call of any job homed on the worker waits in the queue."""
        return any(j.job_id in self._queued for j in self._homed_on(worker_id))

    def requeue_direct(self, calls: list[PhaseRequest]) -> None:
        """Calls handed out under a direct lease that no worker will answer (it died, or
        they were lost on the way) join the head of the queue, in this order, as
        requests the scheduler dispatches itself (numbered ones keep their seq)."""
        back = [Pending(r, None) for r in calls if not self.knows_request(r.request_id)]
        for p in reversed(back):
            self._queue(p.request.job_id, p.request.request_id, back=False)
        self.pending = {p.request.request_id: p for p in back} | self.pending
        self._touch(None)

    # Liveness -----------------------------------------------------------------

    def lost_workers(self) -> list[str]:
        """Workers whose heartbeats stopped and whose jobs are not re-homed yet; after a
        scheduler restart, also the recorded homes no heartbeat came from in time."""
        lost = [w for w, s in self.workers.items() if not s.lost and not self.healthy(w)]
        if self._clock() - self._started_at >= self._worker_timeout_s:
            silent = {
                j.home
                for j in self.jobs.values()
                if j.home is not None and j.home not in self.workers
            }
            lost += sorted(silent - self._never_seen_lost)
        return lost

    def on_worker_lost(self, worker_id: str) -> list[str]:
        """The worker is dead: unhome its jobs (admission re-homes each at its next call)
        and requeue its dispatch in flight; returns the unhomed jobs."""
        if worker_id in self.workers:
            self.workers[worker_id].lost = True
        else:
            self._never_seen_lost.add(worker_id)
        unhomed = []
        self._touch(None)
        for job in self.jobs.values():
            if job.home == worker_id:
                job.home = None
                job.epoch = 0
                # Its snapshot and log are on the disk tier (None: never created).
                job.tier = Tier.DISK if job.tier is not None else None
                unhomed.append(job.job_id)
        self.requeue(worker_id)
        return unhomed

    def expired_leases(self, grace_s: float) -> list[str]:
        """Workers alive but idle well after we sent them a dispatch whose calls are not
        all answered: the dispatch was lost on the way (its lease expired)."""
        expired = []
        for worker_id, run in self.inflight.items():
            state = self.workers.get(worker_id)
            if state is None or not self.healthy(worker_id) or state.heartbeat.busy:
                continue
            if state.heartbeat.sent_at > run.issued_at + grace_s:
                expired.append(worker_id)
        return expired

    def requeue(self, worker_id: str) -> list[str]:
        """Put the unanswered calls of the worker's dispatch (and of the tails it was
        finishing) back at the head of the queue, in their order (a numbered call that
        did apply is answered from its job's ledger)."""
        runs = self._pop_tails(worker_id)
        run = self.inflight.pop(worker_id, None)
        if run is not None:
            runs.append(run)
        return self._back_to_queue(runs)

    def requeue_tails(self, worker_id: str) -> list[str]:
        """`requeue`, for the worker's released tails only."""
        return self._back_to_queue(self._pop_tails(worker_id))

    def _pop_tails(self, worker_id: str) -> list[InFlight]:
        return [self.tails.pop(d) for d, t in list(self.tails.items()) if t.worker_id == worker_id]

    def _back_to_queue(self, runs: list[InFlight]) -> list[str]:
        if not runs:
            return []
        back = [p for r in runs for p in r.calls if p.request.request_id in r.remaining]
        for p in back:
            if self._inflight_requests.pop(p.request.request_id, None) is not None:
                self._count(p.request.job_id, -1)
        for p in reversed(back):  # each to the front: they keep their order there
            if p.request.request_id not in self.pending:
                self._queue(p.request.job_id, p.request.request_id, back=False)
        self.pending = {p.request.request_id: p for p in back} | self.pending
        self._touch(None)
        return [p.request.request_id for p in back]

    # Decide ------------------------------------------------------------------

    async def wait_changed(self, timeout_s: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout_s)
        self._changed.clear()

    def _homed_on(self, worker_id: str) -> list[JobState]:
        homed = self._homed.get(worker_id)
        if not homed:
            return []
        jobs = [j for jid in homed if (j := self.jobs.get(jid)) is not None and j.home == worker_id]
        if len(jobs) < len(homed):  # left, or homed elsewhere since
            self._homed[worker_id] = {j.job_id for j in jobs}
        return jobs

    def dormant(self, now: float, jobs: dict[str, JobState] | None = None) -> set[str]:
        """Jobs (of `jobs`, or all) taken to have stopped (`DORMANT_S`)."""
        active = self._open
        return {
            jid
            for jid, job in (self.jobs if jobs is None else jobs).items()
            if jid not in active
            and job.home is not None
            and job.idle_until <= now
            and now - max(job.last_active, job.history.first_seen or 0.0) > self._dormant_s
        }

    @staticmethod
    def _view(
        job: JobState,
        now: float,
        learned: dict[Kind, Prior],
        pinned: bool,
        dormant: bool,
        review: bool = False,
    ) -> JobView:
        """`review`: its home is due for review, and the view is for a decision on every
        group (only such a decision reviews a home, `JobView.review`)."""
        prior, history = learned.get(job.kind), job.history
        own = history.has_history(now, _MIN_HISTORY_S)
        was = job.described
        if (
            was is None
            or was.version != history.version
            or was.prior is not prior
            or was.own != own
        ):
            seen = describe(history, prior, now, _MIN_HISTORY_S)
            was = job.described = _Described(
                history.version, prior, own, seen, CallEstimates(seen.durations)
            )
        seen = was.seen
        duty = duty_of(history, prior, now, _MIN_HISTORY_S)
        return JobView(
            job_id=job.job_id,
            state_bytes=job.state_bytes,
            # A LoRA adapter (and its moments) is whole on every rank of a group.
            replicated_bytes=job.state_bytes if job.spec.lora is not None else 0,
            home=job.home,
            tier=job.tier,
            base_model=job.spec.base_model,
            last_active=job.last_active,
            idle_until=job.idle_until,
            estimates=was.estimates,
            duty_cycle=0.0 if dormant else duty,
            duty_bound=0.0 if dormant else seen.duty_bound,
            step_calls=seen.step_calls,
            pinned=pinned,
            tenant=job.tenant,
            last_gap_s=job.last_gap_s,
            burst_s=now - job.burst_since if job.burst_since else 0.0,
            used_s=job.used.as_of(now),
            last_started=job.last_started,
            tail_s=seen.tail_s,
            stall_s=job.hinted_s / job.hints if job.hints else 0.0,
            stall_sigma=job.stalls.sigma,
            staleness=job.loop_staleness,
            declared_steps=job.declared_steps,
            train_slices=job.train_slices,
            # A LoRA job's sampler weights are its adapter: a few MB, nothing to plan.
            sampler_bytes=job.state_bytes // 8 if job.spec.lora is None else 0,
            review=review and not dormant,
        )

    def _worker_view(self, wid: str, w: WorkerState, jobs: dict[str, JobView]) -> WorkerView:
        run = self.inflight.get(wid)
        sliced = run is not None and run.dispatches == 1 and run.sliceable
        preemptible = run is not None and (run.samples_only or sliced) and not run.preempt_asked
        tail_until = 0.0
        tail_jobs: set[str] = set()
        for tail in self.tails.values():  # released batches: their jobs' mean tails
            if tail.worker_id == wid:
                for p in tail.calls:
                    job = self.jobs.get(p.request.job_id)
                    if job is not None and p.request.request_id in tail.remaining:
                        ends = tail.released_at + self._tail_s(p.request, jobs)
                        tail_until = max(tail_until, ends, 1e-9)
                        tail_jobs.add(p.request.job_id)
        running = run.job_id if run is not None else self.held.get(wid)
        return WorkerView(
            worker_id=wid,
            device_bytes=w.heartbeat.device_bytes,
            host_bytes=w.heartbeat.host_bytes,
            devices=w.heartbeat.devices,
            base_models=frozenset(w.heartbeat.base_models),
            running=running,
            busy_until=_expected_end(run, jobs) if run is not None else 0.0,
            tail_until=tail_until,
            tail_jobs=frozenset(tail_jobs),
            preemptible_since=run.issued_at if run is not None and preemptible else None,
            healthy=self.healthy(wid),
            sliced=sliced,
            sharing=self.sharing.get(wid),
        )

    def sliceable(self, job_id: str, worker_id: str) -> bool:
        """A dispatch of the job's own calls ending in its `forward_backward` may be
        preempted between micro-batches on this worker (`Dispatch.sliceable`): the
        worker slices training and the job is asynchronous (its training has the slack
        its staleness gives it). A synchronous job's training is never preempted, so
        its worker runs it whole."""
        job = self.jobs.get(job_id)
        worker = self.workers.get(worker_id)
        return (
            job is not None
            and job.loop_staleness >= 1
            and worker is not None
            and worker.heartbeat.slices_training
        )

    def _tail_s(self, request: PhaseRequest, jobs: dict[str, JobView]) -> float:
        """How long a released call is expected to run on after its release: a sample
        batch's straggling tail, or a preempted training call (all of it, at most)."""
        if request.function == Function.SAMPLE:
            job = self.jobs.get(request.job_id)
            return job.history.tail_s if job is not None else 0.0
        view = jobs.get(request.job_id)
        return view.estimates.expected_s(request.function) if view is not None else 0.0

    def _not_behind_training(self, queue: Iterable[Pending]) -> Iterable[Pending]:
        """The queue without the calls that must wait for a job's training call released
        to the background (preempted between micro-batches, `TailReleased`): from the
        job's first queued numbered call on, its calls wait until that call is answered,
        so they run in order on its ledger; its samples of saved weights do not (the
        policy may send one ahead while the call is paused: its rollout lane needs
        nothing of it)."""
        training = {
            p.request.job_id
            for tail in self.tails.values()
            for p in tail.calls
            if p.request.request_id in tail.remaining and p.request.function != Function.SAMPLE
        }
        if not training:
            yield from queue
            return
        waiting: set[str] = set()
        for p in queue:
            job_id = p.request.job_id
            if p.request.work.portable:
                yield p  # a sample of saved weights reads nothing the call changes
                continue
            if job_id in training and (job_id in waiting or p.request.function in SEQUENCED):
                waiting.add(job_id)
                continue
            yield p

    def healthy(self, worker_id: str) -> bool:
        state = self.workers.get(worker_id)
        return state is not None and self._clock() - state.seen_at < self._worker_timeout_s

    def snapshot(self, groups: Collection[str] | None = None) -> ClusterSnapshot:
        """The cluster for the policy; with `groups`, only those groups, the jobs homed
        there and their calls (and, per tenant among them, the job it was served last
        by, which tenants' turns read), for a decision on those groups alone: groups
        share no jobs, so the policy decides each one from these alone. The kinds'
        figures (`priors`) are those of the last whole snapshot then."""
        now = self._clock()
        if groups is None:
            chosen = self.jobs
        else:
            chosen = {j.job_id: j for g in groups for j in self._homed_on(g)}
            for tenant in {j.tenant for j in chosen.values()}:
                served = self._served.get(tenant)
                if served is not None and self.jobs.get(served.job_id) is served:
                    chosen.setdefault(served.job_id, served)
        dormant = self.dormant(now, chosen)
        if groups is None or not self._learned:
            self._learned = priors(
                ((j.kind, j.history) for jid, j in self.jobs.items() if jid not in dormant),
                now,
                _MIN_HISTORY_S,
            )
        learned = self._learned
        pinned = {
            p.request.job_id
            for tail in self.tails.values()
            for p in tail.calls
            if p.request.request_id in tail.remaining
        }
        # A co-sampled job's sample runs in another job's dispatch: its state is in use
        # there, though the worker runs "the other job" (never evicted for a prefetch).
        for run in self.inflight.values():
            for p in run.calls:
                if p.request.job_id != run.job_id and p.request.request_id in run.remaining:
                    pinned.add(p.request.job_id)
        jobs = {
            jid: self._view(
                j,
                now,
                learned,
                jid in pinned,
                jid in dormant,
                groups is None and self._due_for_review(j, now),
            )
            for jid, j in chosen.items()
        }
        workers = {
            wid: self._worker_view(wid, w, jobs)
            for wid, w in self.workers.items()
            if groups is None or wid in groups
        }
        jobs = _sized(jobs, list(workers.values()))
        if groups is None:
            queue: Iterable[Pending] = self.pending.values()
        else:
            ids = [rid for jid in jobs for rid in self._queued.get(jid, ())]
            queue = [self.pending[rid] for rid in sorted(ids, key=self._place.__getitem__)]
        pending = tuple(
            PendingCall(
                p.request.request_id,
                p.request.job_id,
                p.request.function,
                p.request.arrival_time,
                p.request.work.portable,
            )
            for p in self._not_behind_training(queue)
            if p.request.job_id in jobs
        )
        return ClusterSnapshot(
            now=now, workers=workers, jobs=jobs, pending=pending, swap=self._swap
        )


def _sized(jobs: dict[str, JobView], workers: list[WorkerView]) -> dict[str, JobView]:
    """Each job sized for the groups: one waiting for a home needs the fewest ranks of a
    group that holds it (`JobView.devices`: a simulated job's profile says how many
    devices it needs, a live job's state size does; jobs of one size are sized once); a
    homed job on a group of several ranks counts what it takes of that group's device
    tier, its replicated part once per rank (`JobView.group_bytes`), so the policy's
    memory bookkeeping of the group is its ranks' together."""
    sizes: dict[tuple[int, int, str], int] = {}
    ranks = {w.worker_id: w.devices for w in workers}
    for job_id, job in jobs.items():
        if job.home is not None:
            n = ranks.get(job.home, 1)
            if n > 1 and job.replicated_bytes:
                jobs[job_id] = replace(job, state_bytes=job.group_bytes(n), replicated_bytes=0)
            continue
        key = (job.state_bytes, job.replicated_bytes, job.base_model)
        if key not in sizes:
            sizes[key] = fewest_devices(workers, job)
        if sizes[key] != job.devices:
            jobs[job_id] = replace(job, devices=sizes[key])
    return jobs


def _expected_end(run: InFlight, jobs: dict[str, JobView]) -> float:
    """When the dispatch should be done: its start plus its calls' expected seconds (a
    co-batched call's seconds are its share of the batch, so they add up to the batch's)."""
    seconds = 0.0
    for p in run.calls:
        job = jobs.get(p.request.job_id)
        if job is not None:
            seconds += job.estimates.expected_s(p.request.function)
    return run.issued_at + seconds


def _queued(job: JobState, queue_s: float, started: float) -> float:
    """Seconds of a completed call's `queue_s` (from its arrival at the gateway) that the
    job was homed and ready while its device ran something else, as the simulator counts
    them: not before its home (waiting for admission is outside its history's span), nor
    before its previous call ended (a later call of one dispatch waited for the earlier
    ones, whose seconds are busy time already)."""
    homed = job.history.first_seen
    ready = max(started if homed is None else homed, job.last_active)
    return max(0.0, min(queue_s, started - ready))
