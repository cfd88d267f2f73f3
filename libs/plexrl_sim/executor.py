"""The group executor: carries out the policy's actions on the simulated groups, as a
live worker would, and checks the invariants a worker relies on.

A Run is its evictions, then its job's onload (or the rest of a prefetch in flight),
then the engine switch if the group last ran another job, then its calls in order for
the seconds the job's step says, stretched by any stragglers decoding beside them.
Swap seconds come from `SwapCosts.move_s` with the group's bandwidths. The invariants
(raised as `SimulationError`): one Run per group at a time; a Run takes a prefix of its
job's pending calls, in order; no eviction of a running or pinned job; the device and
host tiers never over capacity; a job only runs on its home group.

What the live worker does with a Run, the executor does too:

- **Co-sampling** (`plexrl.policy.cosample`): a Run of sample calls may carry other
  jobs' leading sample calls on the same group (their states on the device). They
  decode as one batch: the batch's dense part lasts as long as its longest member's
  alone, or as its members' useful work together if that is more (the group decodes
  at most a full batch at full speed), each job's stragglers then in the background.
  Each call is charged and observed its share of the batch by useful work (the
  worker's rows).
- **Re-homing** (`plexrl.policy.Rehome`): a job between calls leaves its group and is
  restored at another from the disk tier, its logged calls since its snapshot replayed
  on its next Run there.
- **Preemption** (`plexrl.policy.Preempt`): a running sample batch yields to the next
  Run on its group and is paused while that Run runs, then resumes where it was and
  holds the group to its end; it is asked once.

Straggler tails decode in the background on their group and pay the costs of sharing
(`plexrl.policy.costs.SharingCosts`, the definition the policy predicts with): while a
Run is in flight on the group each tail decodes `tail_contention` times slower and holds
at least `tail_min_share` of it, which the Run computes without. A tail's end therefore
moves whenever a Run starts or ends on its group.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from plexrl.messages import Function, SharingMeasured, Tier
from plexrl.policy import Admit, Move, PendingCall, Preempt, Prefetch, Rehome, Run, WorkerView
from plexrl.policy.costs import SharingCosts
from plexrl.policy.snapshot import samples_first
from plexrl_sim.accounting import Accounting
from plexrl_sim.events import Attention, Event, EventQueue
from plexrl_sim.replay import SimJob
from plexrl_sim.workload import GroupSpec

_DEVICE, _RUN_DONE, _TAIL_DONE = Tier.DEVICE, Event.RUN_DONE, Event.TAIL_DONE
_SAMPLE, _FB = Function.SAMPLE, Function.FORWARD_BACKWARD
"""(Module constants: an enum member read off its class costs an attribute lookup.)"""

RESTORE_REPLAYED_CALLS = 1.5
"""Training calls a re-homed job's restore replays on average: the worker snapshots a
job after every 4 logged calls (`SnapshotConfig.every_calls`), so 0 to 3 follow its
latest snapshot."""


class SimulationError(Exception):
    """The policy asked for something impossible, or an invariant broke."""


@dataclass
class SimGroup:
    spec: GroupSpec
    homed: dict[str, SimJob] = field(default_factory=dict)
    running: str | None = None
    busy_until: float = 0.0
    """When the Run in flight is expected to end by the policy's own estimates (what the
    live scheduler believes, `WorkerView.busy_until`), not when it will."""
    inflight: RunInFlight | None = None
    """The Run in flight."""
    paused: RunInFlight | None = None
    """A preempted sample batch waiting for the Run that preempted it to end."""
    tails: list[Tail] = field(default_factory=list)
    """Straggler tails decoding in the background."""
    last_job: str | None = None
    """The job of its previous Run: a Run of another job pays the engine switch."""
    link_free: float = 0.0
    """When the host link is free for the next prefetch."""
    wake_at: float = -1.0
    """When a wake-up is due (a hold on the group ends); -1: none."""
    free_at: float = 0.0
    """When the group is free to start a Run (a sliced Run paused at its next slice)."""
    view: WorkerView | None = None

    @property
    def group_id(self) -> str:
        return self.spec.group_id

    def as_view(self) -> WorkerView:
        if self.view is None:
            run = self.inflight
            preemptible = None
            # (A roaming sample never yields: its job's state is not this group's.)
            if (
                run is not None
                and run.yields
                and not run.preempted
                and self.paused is None
                and run.job.home == self.spec.group_id
            ):
                preemptible = run.issued
            tail_until = 0.0
            for tail in self.tails:  # as the scheduler expects them: its jobs' mean tails
                tail_until = max(tail_until, tail.started + tail.job.history.tail_s, 1e-9)
            self.view = WorkerView(
                worker_id=self.spec.group_id,
                device_bytes=self.spec.device_bytes,
                host_bytes=self.spec.host_bytes,
                devices=self.spec.devices,
                running=self.running,
                busy_until=self.busy_until,
                tail_until=tail_until,
                tail_jobs=frozenset(t.job.job_id for t in self.tails),
                sliced=preemptible is not None and run is not None and run.slice_s > 0,
                preemptible_since=preemptible,
            )
        return self.view

    def bytes_in(self, tier: Tier) -> int:
        return sum(j.state_bytes for j in self.homed.values() if j.tier == tier)


@dataclass(slots=True)
class Tail:
    """A rollout's stragglers decoding in the background on their group."""

    job: SimJob
    group: SimGroup
    util: float
    """Fraction of the group its stragglers keep busy alone (their share of the batch)."""
    left_s: float
    """Seconds of decoding left, at full speed."""
    at: float
    """When `left_s` was brought up to date."""
    slowed: bool
    """Decoding beside a Run (at 1 / `tail_contention` of its speed, holding at least
    `tail_min_share` of the group)."""
    due: float = 0.0
    """When it ends at its present pace; its TAIL_DONE events at other times are stale."""
    started: float = 0.0
    useful_s: float = 0.0
    """Group-seconds of useful work (its util times its seconds alone)."""
    beside_s: float = 0.0
    """Seconds it decoded beside a Run."""
    done: bool = False
    event_at: float = 0.0
    """When its earliest TAIL_DONE event is due (at or before `due`)."""


@dataclass(slots=True)
class Rider:
    """A co-sampled job's part of a Run: its calls and each call's planned seconds."""

    job: SimJob
    calls: list[PendingCall]
    planned_s: list[float]
    queue_s: float


@dataclass(slots=True)
class RunInFlight:
    job: SimJob
    calls: list[PendingCall]
    swap_s: float
    started: float
    """When its calls began (after its swaps)."""
    planned_s: list[float]
    """Each call's seconds on the whole group (before any stragglers stretched them)."""
    queue_s: float
    """How long the job was ready before the Run started."""
    due: float = 0.0
    """When it ends; a RUN_DONE event at another time is stale (the Run was paused)."""
    issued: float = 0.0
    """When the Run was started (its swaps included): the live dispatch's issue time."""
    riders: list[Rider] | None = None
    """Other jobs' co-sampled calls in the batch."""
    samples_only: bool = False
    preempted: bool = False
    """Asked to yield once already (never again)."""
    paused_s: float = 0.0
    """Seconds it spent paused for the Run that preempted it."""
    left_s: float = 0.0
    """While paused: the seconds it still had to run."""
    paused_at: float = 0.0
    slice_s: float = 0.0
    """Sliced training (an asynchronous job's, `Profile.fb_slices`): the seconds of one
    slice, at whose ends it may pause; 0: not sliced."""
    group: SimGroup | None = None
    """The group it runs on (its job's home, or the group a roaming sample borrowed)."""

    @property
    def yields(self) -> bool:
        """Whether it may be preempted: a sample batch, or sliced training."""
        return self.samples_only or self.slice_s > 0


class GroupExecutor:
    """Every group of the cluster, and the actions that change them."""

    def __init__(
        self,
        groups: list[GroupSpec],
        costs: SharingCosts,
        events: EventQueue,
        attention: Attention,
        accounting: Accounting,
    ) -> None:
        self.groups = {g.group_id: SimGroup(g) for g in groups}
        self.costs = costs
        self._whole_tail = costs.contention_while == "shared"
        self.events = events
        self.attention = attention
        self.accounting = accounting
        self.preempted = 0
        """Sample batches that yielded to another job's Run."""
        self.roamed = 0
        """Calls that ran on a group other than their job's home."""
        self.jobs: dict[str, SimJob] = {}
        """Every job, by id (a roaming Run's job is not homed on its group)."""
        self.cosampled = 0
        """Calls that rode along in another job's sample batch."""
        self.rehomed = 0
        """Jobs moved to another group once their own figures were known."""
        self.switches = 0
        """Runs that paid the engine switch."""
        self.runs_beside_tails = 0
        """Runs that computed beside stragglers (paying their share of the group)."""
        self.tails_slowed = 0
        """Times a tail decoded beside a Run (paying the contention)."""

    def measured(self) -> SharingMeasured:
        """What a worker's meter would have measured of the costs of sharing so far
        (`plexrl_worker.sharing`): each cost as charged, exactly, with how often it was
        paid. The live meter's figures are noisy, and the share it reads is what the
        stragglers took, at least the least share charged here."""
        costs = self.costs
        return SharingMeasured(
            switch_s=costs.switch_s,
            switches=self.switches,
            tail_share=costs.tail_min_share,
            shared_calls=self.runs_beside_tails,
            tail_contention=costs.tail_contention,
            tail_steps=self.tails_slowed,
        )

    # Admission ---------------------------------------------------------------------------

    def admit(self, job: SimJob, action: Admit) -> None:
        group = self.groups[action.worker_id]
        if group.spec.devices < job.devices:
            raise SimulationError(f"{action.job_id} admitted to a group too small for it")
        now = self.events.now
        job.home = action.worker_id
        # Placed on its kind's figures unless the policy was given its own (a control).
        job.provisional = job.known_duty <= 0
        # The duty cycle counts from here: waiting for a home is not the job's idleness.
        job.history.homed(now)
        job.touch()
        job.result.start_s = now
        job.result.group = action.worker_id
        group.homed[job.job_id] = job
        self.accounting.hold(group.group_id, now, len(group.homed))
        self.attention.group(action.worker_id)

    def rehome(self, job: SimJob, action: Rehome) -> None:
        """Move a job between calls to another group (`plexrl.policy.rehome`): its state
        leaves the old group and is restored at the new one from the disk tier, its
        snapshot read and its logged calls since replayed (`restore_s`, charged to its
        next Run there: on average half a snapshot interval of training calls). A sample
        of it roaming on a third group runs on its saved sampler weights and goes on."""
        old = self.groups[action.from_worker]
        new = self.groups[action.to_worker]
        if job.home != old.group_id or job.pinned or old.running == job.job_id:
            raise SimulationError(f"re-home of {job.job_id} while its calls hold its group")
        if new.spec.devices < job.devices:
            raise SimulationError(f"{job.job_id} re-homed to a group too small for it")
        self.unhome(job)
        new.homed[job.job_id] = job
        self.accounting.hold(new.group_id, self.events.now, len(new.homed))
        job.home = new.group_id
        job.tier = Tier.DISK
        seconds_of = job.figures()[0]
        training = [seconds_of[f] for f in (_FB, Function.OPTIM_STEP) if f in seconds_of]
        if training:
            job.restore_s = RESTORE_REPLAYED_CALLS * sum(training) / len(training)
        job.result.group = new.group_id
        job.result.rehomed_from = old.group_id
        job.touch()
        old.view = new.view = None
        self.rehomed += 1
        self.attention.group(new.group_id)

    def unhome(self, job: SimJob) -> None:
        group = self.groups[job.home or ""]
        del group.homed[job.job_id]
        job.tier = None
        if not group.homed:
            self.accounting.release(group.group_id, self.events.now)
        elif len(group.homed) == 1:
            self.attention.left_alone.extend(group.homed)
        self.attention.group(group.group_id)

    # Runs --------------------------------------------------------------------------------

    def _move_s(self, group: SimGroup, job: SimJob, src: Tier | None, dst: Tier) -> float:
        seconds = group.spec.swap.move_s(job.state_bytes, src, dst)
        if src is not None and src != dst:
            job.result.swaps += 1
            job.result.swapped_bytes += job.state_bytes
        return seconds

    def _evict(self, group: SimGroup, run_job_id: str, moves: tuple[Move, ...]) -> float:
        seconds = 0.0
        for move in moves:
            victim = group.homed.get(move.job_id)
            if victim is None or victim.tier != Tier.DEVICE:
                raise SimulationError(f"evict of {move.job_id}, not on {group.group_id}'s device")
            if victim.pinned or move.job_id in (run_job_id, group.running):
                raise SimulationError(f"evict of {move.job_id}, which is in use")
            seconds += self._move_s(group, victim, Tier.DEVICE, move.to_tier)
            victim.tier = move.to_tier
            victim.touch()
        return seconds

    def _check_memory(self, group: SimGroup) -> None:
        if group.bytes_in(Tier.DEVICE) > group.spec.device_bytes:
            raise SimulationError(f"{group.group_id}: device tier over capacity")
        if group.bytes_in(Tier.HOST) > group.spec.host_bytes:
            raise SimulationError(f"{group.group_id}: host tier over capacity")

    def _take(self, job: SimJob, ids: tuple[str, ...] | list[str]) -> list[PendingCall]:
        """The job's calls `ids`, which must lead its pending calls, in order, or lead its
        portable ones (a sample of saved weights may go before its other calls) or its
        others (its sample roams while its home trains it)."""
        pending = job.pending
        n = len(ids)
        if 0 < n <= len(pending) and [c.request_id for c in pending[:n]] == list(ids):
            job.pending = pending[n:]
            return pending[:n]
        kind = _in_kind(pending, ids)
        if n == 0 or [c.request_id for c in kind[:n]] != list(ids):
            waiting = [c.request_id for c in pending]
            raise SimulationError(
                f"run of {job.job_id} skips or reorders its calls: {list(ids)} of {waiting}"
            )
        taken = set(ids)
        job.pending = [c for c in pending if c.request_id not in taken]
        return kind[:n]

    def _take_portable(self, job: SimJob, ids: tuple[str, ...]) -> list[PendingCall]:
        """The job's portable calls `ids` (a roaming Run): the first of its portable
        pending calls, in order."""
        calls = self._take(job, ids)
        if not all(c.portable for c in calls):
            raise SimulationError(f"roaming run of {job.job_id} takes calls that are not portable")
        return calls

    def _start_guest(self, group: SimGroup, run: Run) -> None:
        """A roaming Run (`plexrl.policy.roam`): a job's portable calls on a group other
        than its home. It loads the job's sampler weights from the disk tier into the
        group's sampling engine (outside the device tier of homed states) and pays the
        engine switch; the job's own state stays at home."""
        job = self.jobs.get(run.job_id)
        if job is None or job.home is None:
            raise SimulationError(f"run of {run.job_id} on {run.worker_id}: no such homed job")
        if run.evict or group.spec.devices != job.devices:
            raise SimulationError(
                f"roaming run of {run.job_id} on {run.worker_id} evicts or misfits"
            )
        calls = self._take_portable(job, run.request_ids)
        now = self.events.now
        swap = group.spec.swap.move_s(job.sampler_bytes, Tier.DISK, _DEVICE)
        if group.last_job != job.job_id:
            swap += self.costs.switch_s
            self.switches += 1
        group.last_job = job.job_id
        seconds_of, useful_of = job.figures()
        planned = [seconds_of[c.function] for c in calls]
        work = sum(planned)
        r = job.result
        start, end, queued = self._begin_run(
            group, job, run, swap, work, max(calls[0].arrival_time, r.start_s)
        )
        job.sample_group = group.group_id
        r.swap_s += swap
        r.compute_s += end - start
        r.roamed += len(calls)
        devices = group.spec.devices
        self.accounting.charge(r, group.spec.group_id, devices * (swap + work))
        useful = sum([useful_of.get(c.function, 0.0) for c in calls])
        self.accounting.busy(start, end, useful * devices)
        flight = RunInFlight(job, calls, swap, start, planned, queued, end, now)
        flight.samples_only = True
        flight.group = group
        group.inflight = flight
        self.roamed += len(calls)
        self.events.push(end, _RUN_DONE, flight)

    def _begin_run(
        self, group: SimGroup, job: SimJob, run: Run, swap: float, work: float, ready: float
    ) -> tuple[float, float, float]:
        """`group` starts `run` of `job` now: its calls begin after `swap` seconds and take
        `work` (stretched by any stragglers beside them). Returns their start and end, and
        the seconds the job waited since `ready` (time it was ready but the group was not),
        which count in its call queue time."""
        now = self.events.now
        start = now + swap
        if group.tails:
            self._pace_tails(group, True)
            end = self._stretched_end(group, start, work)
        else:
            end = start + work
        group.running = job.job_id
        group.busy_until = now + run.expected_swap_s + run.expected_compute_s
        group.view = None
        job.idle_until = 0.0
        job.view = None
        job.running += 1
        queued = max(0.0, now - ready)
        job.result.call_queue_s += queued
        return start, end, queued

    def _riders(self, group: SimGroup, job: SimJob, ids: tuple[str, ...]) -> list[Rider]:
        """The co-sampled calls of a Run (`ids` past the leading job's own): other jobs'
        leading sample calls, their states on the group's device."""
        owner: dict[str, SimJob] = {}
        for other in group.homed.values():
            if other is not job:
                for call in samples_first(other.pending):
                    if call.function != _SAMPLE:
                        break
                    owner[call.request_id] = other
        by_job: dict[str, list[str]] = {}
        for rid in ids:
            rider = owner.get(rid)
            if rider is None:
                raise SimulationError(
                    f"co-sampled call {rid}: no pending sample on {group.group_id}"
                    + _whose(self.jobs, rid, job, ids)
                )
            by_job.setdefault(rider.job_id, []).append(rid)
        riders = []
        now = self.events.now
        for jid, rids in by_job.items():
            other = owner[rids[0]]
            if other.tier != _DEVICE:
                raise SimulationError(f"co-sampled job {jid} is not on {group.group_id}'s device")
            calls = self._take(other, rids)
            seconds_of = other.figures()[0]
            r = other.result
            ready = max(calls[0].arrival_time, r.start_s, other.last_active)
            queued = max(0.0, now - ready)
            r.call_queue_s += queued
            riders.append(Rider(other, calls, [seconds_of[c.function] for c in calls], queued))
        self.cosampled += len(ids)
        return riders

    def start_run(self, run: Run) -> None:
        group = self.groups[run.worker_id]
        if group.running is not None:
            raise SimulationError(f"run on {run.worker_id} while {group.running} runs there")
        job = group.homed.get(run.job_id)
        if job is None:
            self._start_guest(group, run)
            return
        if group.paused is not None and group.paused.job is job:
            # (but a sample of saved weights, which needs nothing of it)
            portable = {c.request_id for c in job.pending if c.portable}
            if not run.request_ids or run.request_ids[0] not in portable:
                raise SimulationError(f"run of {run.job_id} while a Run of it is paused")
        # The leading job's own calls first (`_take` checks their order), then, co-sampled,
        # other jobs' samples.
        ids = run.request_ids
        mine = {c.request_id for c in job.pending}
        own = 0
        while own < len(ids) and ids[own] in mine:
            own += 1
        calls = self._take(job, ids[:own])
        riders = self._riders(group, job, ids[own:]) if own < len(ids) else None
        now = self.events.now
        swap = self._evict(group, job.job_id, run.evict) if run.evict else 0.0
        moved = bool(run.evict)
        if job.tier != _DEVICE:
            moved = True
            swap += self._move_s(group, job, job.tier, _DEVICE)
            job.tier = _DEVICE
        swap += max(0.0, job.ready_at - now, group.free_at - now)
        if job.restore_s:
            moved = True
            swap += job.restore_s
            job.restore_s = 0.0
        last = group.last_job
        if last is not None and last != job.job_id:
            swap += self.costs.switch_s
            self.switches += 1
        group.last_job = job.job_id
        if moved:
            self._check_memory(group)
        seconds_of, useful_of = job.figures()
        try:
            planned = [seconds_of[c.function] for c in calls]
        except KeyError as err:
            raise ValueError(f"unexpected call {err.args[0]}") from None
        useful = sum([useful_of.get(c.function, 0.0) for c in calls])
        if riders is None:
            work = sum(planned)
        else:
            # One batch: as long as its longest member alone, or as its members' useful
            # work together where that is more (the group decodes one full batch at a time).
            shares = [useful]
            work = max(planned)
            for rider in riders:
                rider_useful = rider.job.figures()[1]
                u = sum([rider_useful.get(c.function, 0.0) for c in rider.calls])
                shares.append(u)
                useful += u
                work = max(work, *rider.planned_s)
            work = max(work, useful)
        r = job.result
        # The job was ready from its oldest call's arrival (or its home, or the end of its
        # own previous Run, whichever is later).
        start, end, queued = self._begin_run(
            group, job, run, swap, work, max(calls[0].arrival_time, r.start_s, job.last_active)
        )
        devices = group.spec.devices
        flight = RunInFlight(job, calls, swap, start, planned, queued, end, now)
        flight.group = group
        if riders is None:
            r.swap_s += swap
            r.compute_s += end - start
            self.accounting.charge(r, group.spec.group_id, devices * (swap + work))
        else:
            flight.riders = riders
            total = sum(shares) or 1.0
            r.swap_s += swap
            r.compute_s += (end - start) * shares[0] / total
            self.accounting.charge(
                r, group.spec.group_id, devices * (swap + work * shares[0] / total)
            )
            for rider, share in zip(riders, shares[1:], strict=True):
                other = rider.job
                other.result.compute_s += (end - start) * share / total
                self.accounting.charge(
                    other.result, group.spec.group_id, devices * work * share / total
                )
                other.running += 1
                other.idle_until = 0.0
                other.view = None
                # As the live scheduler expects a batch to last: each call's expected
                # seconds (a co-batched call's are its share of the batch), summed.
                durations = other.history.durations
                group.busy_until += sum([durations.get(c.function, 0.0) for c in rider.calls])
        flight.samples_only = riders is not None or all(c.function == _SAMPLE for c in calls)
        slices = job.steps.fb_slices
        if slices > 1 and job.asynchronous and calls[0].function == _FB:
            flight.slice_s = planned[0] / slices
        if flight.samples_only:
            job.sample_group = group.group_id
            for rider in riders or ():
                rider.job.sample_group = group.group_id
        group.inflight = flight
        self.accounting.busy(start, end, useful * devices)
        self.events.push(end, _RUN_DONE, flight)

    def run_done(self, done: RunInFlight) -> bool:
        """The Run's calls ended: the group is free (or back to the batch a preemption
        paused); the scheduler sees each call's compute seconds (the Run's, stretched by
        any stragglers beside it, split in proportion) and its swaps. False for a stale
        event (the Run was paused since and ends later)."""
        job, now = done.job, self.events.now
        if done.due != now:
            return False
        group = done.group or self.groups[job.home or ""]
        group.running = None
        group.inflight = None
        group.view = None
        self._pace_tails(group, False)
        self.attention.groups.add(group.spec.group_id)
        self._observe(job, done.calls, done.planned_s, done, done.swap_s, done.queue_s)
        if done.riders is not None:
            for rider in done.riders:
                self._observe(rider.job, rider.calls, rider.planned_s, done, 0.0, rider.queue_s)
        paused = group.paused
        if paused is not None:
            self._resume(group, paused)
        return True

    def _observe(
        self,
        job: SimJob,
        calls: list[PendingCall],
        planned: list[float],
        done: RunInFlight,
        swap_s: float,
        queue_s: float,
    ) -> None:
        now = self.events.now
        job.last_active = now
        job.running -= 1
        job.view = None
        work = sum(planned)
        ran = now - done.started - done.paused_s
        whole = 0.0
        for seconds in done.planned_s:
            whole += seconds
        for rider in done.riders or ():
            for seconds in rider.planned_s:
                whole += seconds
        if done.riders is not None:
            # A batch's seconds split by the calls' planned seconds (the worker's rows).
            stretch = ran / whole if whole > 0 else 1.0
        else:
            stretch = ran / work if work > 0 else 1.0
        observe = job.history.observe
        # The first call carries the Run's swaps and queueing; the rest only compute.
        observe(calls[0].function, planned[0] * stretch, swap_s, queue_s)
        for i in range(1, len(calls)):
            observe(calls[i].function, planned[i] * stretch, 0.0, 0.0)

    # Preemption --------------------------------------------------------------------------

    def preempt(self, action: Preempt) -> bool:
        """The group's sample batch yields: paused, its jobs pinned, the group free for
        the next Run. False when nothing preemptible runs there (it ended first, or it is
        a roaming sample, whose state is not the group's to pin)."""
        group = self.groups[action.worker_id]
        run = group.inflight
        if run is None or run.job.job_id != action.job_id or not run.yields:
            return False
        if run.job.home != group.group_id or group.paused is not None:
            return False  # (one paused Run per group: the next waits for the next Run)
        if run.preempted:
            raise SimulationError(f"{action.worker_id}: a batch preempted twice")
        now = self.events.now
        run.preempted = True
        run.left_s = max(0.0, run.due - now)
        if run.slice_s > 0:
            # Sliced training pauses at the end of the slice in progress: the group
            # finishes it (the next Run starts then) and the rest waits.
            ran = max(0.0, now - run.started)
            boundary = min(run.left_s, run.slice_s - ran % run.slice_s)
            run.left_s -= boundary
            group.free_at = now + boundary
            now += boundary
        run.paused_at = now
        run.due = -1.0  # its RUN_DONE is stale now
        group.paused = run
        group.inflight = None
        group.running = None
        group.view = None
        self._pace_tails(group, False)
        for job in self._jobs_of(run):
            job.pins += 1
            job.view = None
        self.preempted += 1
        self.attention.groups.add(group.spec.group_id)
        return True

    def resume_unused(self, group: SimGroup) -> None:
        """The policy started nothing on the group after its batch yielded: the pause
        lifts at once (the worker's grace ends)."""
        paused = group.paused
        if paused is not None and group.running is None:
            self._resume(group, paused)

    def _resume(self, group: SimGroup, paused: RunInFlight) -> None:
        now = self.events.now
        group.paused = None
        # A new record for its new end: the event of the old one (its `due` left at -1)
        # is stale, however soon the pause ended.
        run = replace(paused)
        run.paused_s += now - paused.paused_at
        run.due = now + paused.left_s
        for job in self._jobs_of(run):
            job.pins -= 1
            job.view = None
        group.running = run.job.job_id
        group.inflight = run
        group.busy_until = run.due
        group.view = None
        self._pace_tails(group, True)
        self.events.push(run.due, _RUN_DONE, run)

    @staticmethod
    def _jobs_of(run: RunInFlight) -> list[SimJob]:
        jobs = [run.job]
        if run.riders is not None:
            jobs += [r.job for r in run.riders]
        return jobs

    # Prefetch ----------------------------------------------------------------------------

    def prefetch(self, action: Prefetch) -> None:
        group = self.groups[action.worker_id]
        job = group.homed.get(action.job_id)
        if job is None:
            raise SimulationError(
                f"prefetch of {action.job_id} on {action.worker_id}, not its home"
            )
        if job.tier == Tier.DEVICE:
            return
        seconds = self._evict(group, group.running or "", action.evict)
        seconds += self._move_s(group, job, job.tier, Tier.DEVICE)
        job.tier = Tier.DEVICE
        job.touch()
        self._check_memory(group)
        # Copies ride the host links while the group computes; one stream per group.
        job.ready_at = max(self.events.now, group.link_free) + seconds
        group.link_free = job.ready_at

    # Stragglers --------------------------------------------------------------------------

    def start_tail(self, job: SimJob, tail_s: float, util: float) -> None:
        """The job's stragglers decode in the background on the group its sample ran on,
        `util` of it, for `tail_s` alone; their TAIL_DONE comes when they end
        (`tail_end`). On its home group they pin its state there."""
        group = self.groups[job.sample_group or job.home or ""]
        now = self.events.now
        if group.group_id == job.home:
            job.pins += 1
        # Slowed now: beside a Run in flight (or, scoped `shared`, beside any homed job).
        slowed = len(group.homed) > 1 if self._whole_tail else group.inflight is not None
        tail = Tail(job, group, util, tail_s, now, slowed, started=now, useful_s=util * tail_s)
        tail.due = tail.event_at = now + tail_s * (self.costs.tail_contention if slowed else 1.0)
        self.tails_slowed += slowed
        group.tails.append(tail)
        group.view = None
        self.events.push(tail.due, _TAIL_DONE, tail)

    def tail_end(self, tail: Tail) -> bool:
        """A tail's TAIL_DONE: True when it ended now (False: stale, it was slowed or
        sped up since). Its job is charged its share of the group for its seconds."""
        now = self.events.now
        if tail.done or now < tail.event_at:
            return False  # an earlier event of it, moved since
        if now < tail.due:  # it was slowed since this event was set: wait for its end
            tail.event_at = tail.due
            self.events.push(tail.due, _TAIL_DONE, tail)
            return False
        job, group = tail.job, tail.group
        if group.group_id == job.home:
            job.pins -= 1
            job.view = None
        self._bring_up_to_date(tail, now)
        tail.done = True
        group.tails.remove(tail)
        group.view = None
        self.attention.groups.add(group.group_id)
        wall = now - tail.started
        beside = wall if self._whole_tail and tail.slowed else tail.beside_s
        seconds = tail.util * (wall - beside) + self.costs.tail_share(tail.util) * beside
        devices = group.spec.devices
        self.accounting.charge(job.result, group.group_id, devices * seconds)
        self.accounting.busy(tail.started, now, devices * tail.useful_s)
        return True

    def _bring_up_to_date(self, tail: Tail, now: float) -> None:
        elapsed = now - tail.at
        if tail.slowed:
            tail.left_s -= elapsed / self.costs.tail_contention
            tail.beside_s += elapsed
        else:
            tail.left_s -= elapsed
        if tail.left_s < 0.0:
            tail.left_s = 0.0
        tail.at = now

    def _pace_tails(self, group: SimGroup, slowed: bool) -> None:
        """A Run started (`slowed`) or ended on the group: its tails change pace."""
        if self._whole_tail or not group.tails:
            return
        now = self.events.now
        contention = self.costs.tail_contention
        for tail in group.tails:
            if tail.slowed == slowed:
                continue
            self._bring_up_to_date(tail, now)
            tail.slowed = slowed
            self.tails_slowed += slowed
            tail.due = now + tail.left_s * (contention if slowed else 1.0)
            if tail.due < tail.event_at:  # (a later end is found when the event comes)
                tail.event_at = tail.due
                self.events.push(tail.due, _TAIL_DONE, tail)

    def _stretched_end(self, group: SimGroup, start: float, work: float) -> float:
        """When `work` seconds of full-group compute end, given the stragglers decoding in
        the background hold their share of the group until each tail ends."""
        costs = self.costs
        tails = sorted(
            [(t.due, costs.tail_share(t.util) if t.slowed else t.util) for t in group.tails]
        )
        tails = [t for t in tails if t[0] > start]
        if not tails:
            return start + work
        self.runs_beside_tails += 1
        shares = sum([u for _, u in tails])
        t, left = start, work
        for end, share in tails:
            speed = costs.run_speed(shares)
            if speed * (end - t) >= left:
                return t + left / speed
            left -= speed * (end - t)
            t = end
            shares = max(shares - share, 0.0)
        return t + left / costs.run_speed(shares)


def _whose(jobs: dict[str, SimJob], rid: str, leader: SimJob, ids: tuple[str, ...]) -> str:
    """Where the call a co-sampled Run named is (for the error that it is not there)."""
    for other in jobs.values():
        for i, call in enumerate(other.pending):
            if call.request_id == rid:
                return (
                    f" (it is {other.job_id}'s call {i} of {len(other.pending)} pending, "
                    f"{call.function}, homed on {other.home}, sampling on "
                    f"{other.sample_group}; the Run's leader {leader.job_id}, riders {ids})"
                )
    return f" (no job has it pending; the Run's leader {leader.job_id}, riders {ids})"


def _in_kind(pending: list[PendingCall], ids: tuple[str, ...] | list[str]) -> list[PendingCall]:
    """The job's pending calls of the kind (portable or not) of the call `ids` starts
    with, in order: a Run takes a prefix of its job's calls, or of one kind of them."""
    first = ids[0] if ids else None
    portable = next((c.portable for c in pending if c.request_id == first), True)
    return [c for c in pending if c.portable == portable]
