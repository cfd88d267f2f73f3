"""The shared-cluster deployments: a discrete-event simulation in which every placement,
dispatch, eviction, prefetch, hold and preemption is decided by `plexrl.policy.decide`
— the live scheduler's own entry point, anticipation, co-sampling and preemption
included — on `ClusterSnapshot`s built from simulator state.

Three parts, one job each: the workload replay (`replay.py`: each job's client loop and
what the scheduler learns of it), the group executor (`executor.py`: the policy's
actions carried out on the groups, and the worker's invariants) and the accounting
(`accounting.py`: charges, held time, timeline). This module is the loop that ties them:
pop an event, let its part handle it, ask the policy, carry out the plan.

Scoping: under affinity a group's dispatch decisions depend only on the jobs homed on
it, so when something happens on one group the simulator asks the policy about a
snapshot of that group alone (its worker, its homed jobs, their pending calls, the
group's own tier bandwidths). Admission needs every group, so while jobs wait for a
home the simulator asks about the whole cluster. The policy itself is never told
which kind of snapshot it gets.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from plexrl.messages import Function, Tier
from plexrl.policy import (
    Admit,
    ClusterSnapshot,
    JobView,
    PendingCall,
    PolicyConfig,
    Preempt,
    Prefetch,
    Rehome,
    Reject,
    Run,
    decide,
    lone_pairs,
    reviews_alone,
)
from plexrl.policy.costs import LEARN_SAMPLES, SharingCosts, learned, moved
from plexrl.policy.history import Prior, priors
from plexrl_sim.accounting import Accounting
from plexrl_sim.dedicated import alone_reference_s
from plexrl_sim.events import Attention, Event, EventQueue
from plexrl_sim.executor import GroupExecutor, RunInFlight, SimGroup, SimulationError, Tail
from plexrl_sim.replay import JobReplay, SimJob
from plexrl_sim.results import DeploymentResult, GroupUsage
from plexrl_sim.workload import CoLocation, GroupSpec, JobFactory, JobSpec, nbytes

__all__ = ["MultiplexedSim", "SimulationError"]


_OFF_DEVICE = (Tier.HOST, Tier.DISK)


def _arrival(call: PendingCall) -> float:
    return call.arrival_time


class MultiplexedSim:
    """One shared-cluster deployment driven by one policy."""

    def __init__(
        self,
        factory: JobFactory,
        jobs: list[JobSpec],
        groups: list[GroupSpec],
        config: PolicyConfig,
        gpus: int,
        record_trail: bool = False,
        name: str | None = None,
        colocation: CoLocation | None = None,
        known_duty: Mapping[str, float] | None = None,
        assumed: SharingCosts | None = None,
        learn_samples: int = LEARN_SAMPLES,
    ) -> None:
        """`known_duty`: by job, the duty cycle the policy is given for it from its
        arrival, until it has a history of its own (`SimJob.known_duty`): a control for
        what judging a newcomer by its kind's figures costs admission. `assumed`: the
        costs of sharing the policy starts from where they are not the ones charged; it
        learns those charged as the live scheduler learns its workers' measurements,
        each once paid `learn_samples` times (0: never)."""
        chosen = colocation if colocation is not None else factory.workload.cluster.colocation
        costs = chosen.costs()
        # One definition of the costs of sharing: the executor charges them, the policy
        # predicts with them (or with `assumed` until it has learned them).
        prior = assumed if assumed is not None else costs
        self.config = config = replace(config, sharing=prior)
        self._learn_samples = learn_samples
        self._to_learn = (
            prior.switch_s != costs.switch_s,
            prior.tail_min_share != costs.tail_min_share,
            prior.tail_contention != costs.tail_contention,
        )
        self._learning = learn_samples > 0 and any(self._to_learn)
        self._measured_enough = (False, False, False)
        self.costs_learned_s = 0.0
        """When the policy last took costs of sharing it learned (0: never)."""
        self.name = name or config.name
        self.gpus = gpus
        self.min_history_s = factory.workload.estimates.min_history_s
        self.clock = EventQueue()
        self.attention = Attention()
        self.accounting = Accounting(
            {g.group_id: GroupUsage(g.group_id, g.devices) for g in groups}
        )
        self.executor = GroupExecutor(groups, costs, self.clock, self.attention, self.accounting)
        self.replay = JobReplay(self.clock, self.attention, self.executor, config.hold_s)
        self.jobs: dict[str, SimJob] = {}
        self.executor.jobs = self.jobs
        self.waiting: dict[str, SimJob] = {}
        self._priors: dict[str, Prior] = {}
        self.plans = 0
        self.plan_s = 0.0
        self.held = 0
        """Holds decided for a bursting job (`plexrl.policy.anticipate`)."""
        self._roaming = config.name == "plexrl" and config.roam
        self._roamers: dict[str, SimJob] = {}
        """Jobs whose portable calls wait while their home group is busy."""
        self._idle: dict[int, set[str]] = {}
        """Per group size, the groups that hold jobs and have nothing to run."""
        self._roam_due: set[int] = set()
        """Group sizes where a roamer or an idle group came up since the last ask."""
        self._reviewing = config.name == "plexrl" and config.rehome
        self._review_after_s = config.review_histories * self.min_history_s
        self._review_lone = self._reviewing and config.rehome_lone
        self._alone: set[str] = set()
        """Jobs due for review because their last neighbour left (`_left_alone`)."""
        self.rehomed_alone = 0
        """Of the moves, those of a job left alone on its group."""
        self._asks_alone = self._reviewing and reviews_alone(config)
        self._lone_at = 0.0
        """When the jobs alone on their groups are next asked about (`_lone_pairs`)."""
        self._awaiting: set[str] = set()
        """Jobs kept where they are under review for want of a group to take them
        (`Rehome.waits`): reviewed again at each decision on every group that follows a
        change of homes, not at each of their calls."""
        self._reviews = False
        """A job's home is due for review (`plexrl.policy.rehome`): the next decision is
        on the whole cluster, where every group it could move to is seen."""
        self.events = 0
        profiles = factory.workload.profiles
        for spec in jobs:
            p = profiles[spec.profile]
            state = int(nbytes(p.state_bytes))
            sampler = int(nbytes(p.sampler_bytes)) if p.sampler_bytes is not None else state // 8
            alone = alone_reference_s(factory, spec, costs)  # its slowdown reference
            job = SimJob.of(spec, factory.steps(spec), p.devices, state, sampler, alone)
            if known_duty is not None:
                job.known_duty = known_duty.get(spec.job_id, 0.0)
            if record_trail:
                job.trail = []
            self.jobs[spec.job_id] = job
            self.clock.push(spec.arrival_s, Event.ARRIVE, job)

    @property
    def now(self) -> float:
        return self.clock.now

    @property
    def groups(self) -> dict[str, SimGroup]:
        return self.executor.groups

    def run(
        self, progress: Callable[[float], None] | None = None, until_s: float = math.inf
    ) -> DeploymentResult:
        started = time.perf_counter()
        decide = self._decide
        by_kind: dict[Event, Callable[[Any], None]] = {
            Event.RUN_DONE: self._run_done,
            Event.TAIL_DONE: self._tail_done,
            Event.TRAIN_CALLS: self.replay.issue_train,
            Event.NEXT_STEP: self.replay.next_step,
            Event.FINISH: self.replay.finish,
            Event.ARRIVE: self._arrive,
            Event.WAKE: self._woken,
        }
        # Indexed by the kind's number: one index per event instead of comparing the kind
        # with each `Event.X`, every one of which is an attribute lookup on the enum class.
        handlers = tuple(by_kind[kind] for kind in sorted(Event))
        events = self.events
        for kind, obj in self.clock.until(until_s):
            events += 1
            handlers[kind](obj)
            decide()
            if progress is not None and events % 4096 == 0:
                self.events = events
                progress(self.now)
        self.events = events
        if progress is not None:
            progress(self.now)
        return self.accounting.close(
            self.name,
            self.gpus,
            [j.result for j in self.jobs.values()],
            self.now,
            time.perf_counter() - started,
            self.events,
            self.plans,
            self.plan_s,
            {
                "preempted": self.executor.preempted,
                "cosampled": self.executor.cosampled,
                "roamed": self.executor.roamed,
                "held": self.held,
                "rehomed": self.executor.rehomed,
                "rehomed_alone": self.rehomed_alone,
                **({"costs_learned_s": round(self.costs_learned_s)} if any(self._to_learn) else {}),
            },
        )

    def _run_done(self, done: RunInFlight) -> None:
        if not self.executor.run_done(done):
            return  # paused by a preemption: it ends later
        if self._learning:
            self._learn()
        self.replay.calls_done(done.job, done.calls)
        if done.riders is not None:
            for rider in done.riders:
                self.replay.calls_done(rider.job, rider.calls)
        if self._reviewing:
            self._reviews |= self._due_for_review(done.job) or any(
                self._due_for_review(r.job) for r in done.riders or ()
            )

    def _learn(self) -> None:
        """Each cost of sharing the executor has charged `learn_samples` times replaces
        the policy's (`plexrl.policy.costs.learned`, as the live scheduler does with
        its workers' measurements), once it moved enough to matter (`moved`)."""
        executor, least = self.executor, self._learn_samples
        enough = (
            executor.switches >= least,
            executor.runs_beside_tails >= least,
            executor.tails_slowed >= least,
        )
        if enough == self._measured_enough:
            return
        self._measured_enough = enough
        config = self.config
        new = learned(config.sharing, [executor.measured()], least)
        if moved(config.sharing, new):
            self.config = replace(config, sharing=new)
            self.costs_learned_s = self.now
        self._learning = not all(e or not d for e, d in zip(enough, self._to_learn, strict=True))

    def _left_alone(self) -> None:
        """Jobs whose last neighbour left are due for review (`PolicyConfig.rehome_lone`):
        another group of their size holding one job may take them, and theirs be freed.
        Where no other such group exists the review would keep them where they are, so
        none is asked for (the whole decision it takes is the dearest the policy makes):
        the next job left alone on such a group is reviewed, and may join them."""
        left = self.attention.left_alone
        if self._review_lone:
            for job_id in left:
                job = self.jobs[job_id]
                home = self.groups.get(job.home or "")
                if home is not None and job.tier is not None and self._another_alone(home):
                    job.provisional = True
                    self._alone.add(job_id)
                    self._reviews |= self._due_for_review(job)
        left.clear()

    def _lone_pairs(self) -> None:
        """Every review interval, a job alone on its group that another alone could take
        within budget is due for review as a job left alone is (`plexrl.policy.
        lone_pairs`): a pair refused when one of them was left alone may fit on the
        figures they learned since."""
        self._lone_at = self.now + self._review_after_s
        for job_id in lone_pairs(self.full_snapshot(), self.config):
            job = self.jobs[job_id]
            if not job.provisional:
                job.provisional = True
                self._alone.add(job_id)
                self._reviews |= self._due_for_review(job)

    def _another_alone(self, home: SimGroup) -> bool:
        devices = home.spec.devices
        for group in self.groups.values():
            if group is not home and len(group.homed) == 1 and group.spec.devices == devices:
                return True
        return False

    def _due_for_review(self, job: SimJob) -> bool:
        return (
            job.provisional
            and job.job_id not in self._awaiting
            and job.history.has_history(self.now, self._review_after_s)
        )

    def _tail_done(self, tail: Tail) -> None:
        if self.executor.tail_end(tail):
            self.replay.tail_done(tail.job, self.now - tail.started)

    def _woken(self, group: SimGroup) -> None:
        if group.wake_at == self.now:
            group.wake_at = -1.0
        self.attention.groups.add(group.group_id)

    def _arrive(self, job: SimJob) -> None:
        self.waiting[job.job_id] = job
        self.replay.arrive(job)

    # Asking the policy -------------------------------------------------------------------

    def _decide(self) -> None:
        attention = self.attention
        if attention.left_alone:
            self._left_alone()
        if self._asks_alone and self.now >= self._lone_at:
            self._lone_pairs()
        if attention.admission_due or self._reviews:
            attention.admission_due = False
            if self.waiting or self._reviews or self._awaiting:
                self._reviews = False
                self._carry_out(self.full_snapshot(), whole=True)
        dirty = attention.groups
        if dirty:
            groups, wants_plan, snapshot = self.groups, self._wants_plan, self.group_snapshot
            roaming = self._roaming
            while dirty:
                group = groups[dirty.pop()]
                if wants_plan(group):
                    self._carry_out(snapshot(group))
                    if group.paused is not None and group.group_id not in dirty:
                        self.executor.resume_unused(group)
                if roaming:
                    self._note_roaming(group)
            if self._roam_due:
                self._roam()

    def _note_roaming(self, group: SimGroup) -> None:
        """After a decision on `group`: its jobs whose portable calls wait while it is
        busy may roam; if it is idle (jobs homed, none calling, nothing running), it may
        take such a call. Either is news for the next roaming decision (`_roam`)."""
        size = group.spec.devices
        if group.running is not None:
            self._idle.get(size, set()).discard(group.group_id)
            for job in group.homed.values():
                if job.job_id not in self._roamers and any(c.portable for c in job.pending):
                    self._roamers[job.job_id] = job
                    self._roam_due.add(size)
        elif group.homed and not any(j.pending for j in group.homed.values()):
            idle = self._idle.setdefault(size, set())
            if group.group_id not in idle:
                idle.add(group.group_id)
                self._roam_due.add(size)
        else:
            self._idle.get(size, set()).discard(group.group_id)

    def _roam(self) -> None:
        """Ask the policy about the groups of a size where a portable call waits at a busy
        home and another group is idle: those homes and the idle groups together (the
        policy decides whether and where it roams, `plexrl.policy.roam`)."""
        due, self._roam_due = self._roam_due, set()
        for job_id, job in list(self._roamers.items()):
            home = self.groups[job.home] if job.home is not None else None
            if home is None or home.running is None or not any(c.portable for c in job.pending):
                del self._roamers[job_id]
        for size in due:
            idle = [g for g in self._idle.get(size, ()) if self.groups[g].running is None]
            homes = {
                job.home
                for job in self._roamers.values()
                if job.devices == size and job.home is not None
            }
            if not idle or not homes:
                continue
            chosen = [self.groups[g] for g in sorted({*idle, *homes})]
            self._carry_out(self.groups_snapshot(chosen))
            for group in chosen:
                if group.running is not None:
                    self._idle.get(size, set()).discard(group.group_id)

    @staticmethod
    def _wants_plan(group: SimGroup) -> bool:
        if group.running is None:
            return any(j.pending for j in group.homed.values())
        # Busy: only a prefetch (a job off the device) or a preemption (a sample batch
        # or sliced training that may yield to another job with calls waiting; sliced
        # training to its own job's sample too) could be decided.
        run = group.inflight
        preemptible = run is not None and run.yields and not run.preempted and group.paused is None
        running = group.running
        sliced = preemptible and run is not None and run.slice_s > 0
        return any(
            j.tier in _OFF_DEVICE
            or (
                preemptible
                and j.pending
                and (j.job_id != running or (sliced and any(c.portable for c in j.pending)))
            )
            for j in group.homed.values()
        )

    def group_snapshot(self, group: SimGroup) -> ClusterSnapshot:
        """What the policy sees when something happens on one group."""
        now = self.clock.now
        jobs: dict[str, JobView] = {}
        calls: list[PendingCall] = []
        calling = 0
        hold_s = self.config.hold_s
        # A job whose Run is paused (preempted) sends nothing more until it resumes (its
        # calls keep their order) but its samples of saved weights.
        paused = group.paused.job if group.paused is not None else None
        for jid, j in group.homed.items():
            view = j.view
            if view is None or (hold_s > 0 and j.bursting(hold_s)):
                j.view = None
                view = j.as_view(now, self._priors, self.min_history_s)
            jobs[jid] = view
            if j.pending and j is not paused:
                calls += j.pending
                calling += 1
            elif j.pending:  # its portable calls need nothing of its paused Run
                portable = [c for c in j.pending if c.portable]
                if portable:
                    calls += portable
                    calling += 1
        if calling > 1:  # one job's calls are already in arrival order
            calls.sort(key=_arrival)
        return ClusterSnapshot(
            now, {group.spec.group_id: group.as_view()}, jobs, tuple(calls), group.spec.swap
        )

    def groups_snapshot(self, groups: list[SimGroup]) -> ClusterSnapshot:
        """What the policy sees about several groups (a roaming decision)."""
        now = self.clock.now
        jobs: dict[str, JobView] = {}
        calls: list[PendingCall] = []
        for group in groups:
            paused = group.paused.job if group.paused is not None else None
            for jid, j in group.homed.items():
                jobs[jid] = j.as_view(now, self._priors, self.min_history_s)
                calls += j.pending if j is not paused else [c for c in j.pending if c.portable]
        calls.sort(key=_arrival)
        return ClusterSnapshot(
            now,
            {g.spec.group_id: g.as_view() for g in groups},
            jobs,
            tuple(calls),
            groups[0].spec.swap,
        )

    def full_snapshot(self) -> ClusterSnapshot:
        """What the policy sees when admission is due: every group, job and pending call;
        jobs without a history of their own described by their kind's (`priors`)."""
        homed = [j for g in self.groups.values() for j in g.homed.values()]
        learned = priors(((j.spec.profile, j.history) for j in homed), self.now, self.min_history_s)
        if learned != self._priors:
            self._priors = learned
            for j in (*homed, *self.waiting.values()):
                j.touch()
        jobs: dict[str, JobView] = {}
        calls: list[PendingCall] = []
        paused = {g.paused.job.job_id for g in self.groups.values() if g.paused is not None}
        reviewing = self._reviewing
        for j in (*homed, *self.waiting.values()):
            view = j.as_view(self.now, self._priors, self.min_history_s)
            # Only a decision that sees every group reviews a home.
            if reviewing and (j.job_id in self._awaiting or self._due_for_review(j)):
                view = replace(view, review=True)
            jobs[j.job_id] = view
            if j.job_id not in paused:
                calls.extend(j.pending)
        calls.sort(key=_arrival)
        return ClusterSnapshot(
            now=self.now,
            workers={gid: g.as_view() for gid, g in self.groups.items()},
            jobs=jobs,
            pending=tuple(calls),
        )

    def _carry_out(self, snapshot: ClusterSnapshot, whole: bool = False) -> None:
        """Carry out the policy's decision on `snapshot` (`whole`: of every group, where
        the jobs kept under review and gone since are dropped from `_awaiting`)."""
        t0 = time.perf_counter()
        decision = decide(snapshot, self.config)
        self.plan_s += time.perf_counter() - t0
        self.plans += 1
        executor = self.executor
        awaiting = self._awaiting
        if whole:
            awaiting.intersection_update(snapshot.jobs)  # (less the jobs gone)
        for action in decision.plan:
            if isinstance(action, Run):  # most plans are one Run
                executor.start_run(action)
                self._wake_for_preemption(action)
            elif isinstance(action, Admit):
                job = self.waiting.pop(action.job_id, None)
                if job is None:
                    raise SimulationError(f"admit of {action.job_id}, which is not waiting")
                executor.admit(job, action)
            elif isinstance(action, Rehome):
                moving = self.jobs[action.job_id]
                if action.moves:
                    executor.rehome(moving, action)
                    self.rehomed_alone += action.job_id in self._alone
                if action.waits:
                    awaiting.add(action.job_id)
                else:
                    awaiting.discard(action.job_id)
                    self._alone.discard(action.job_id)
                    moving.provisional = False
            elif isinstance(action, Reject):
                rejected = self.waiting.pop(action.job_id, None)
                if rejected is not None:
                    rejected.result.rejected = f"{action.reason}: {action.detail}"
                    rejected.pending.clear()
            elif isinstance(action, Prefetch):
                executor.prefetch(action)
            elif isinstance(action, Preempt):
                executor.preempt(action)
        for worker_id, (_, until) in decision.held.items():
            self.held += 1
            self._wake_at(worker_id, until)

    def _wake_at(self, worker_id: str, at: float) -> None:
        """Decide on the group again at `at` (once per time)."""
        group = self.groups[worker_id]
        if group.wake_at != at:
            group.wake_at = at
            self.clock.push(at, Event.WAKE, group)

    def _wake_for_preemption(self, run: Run) -> None:
        """A sample batch may be preempted once it has run `preempt_after_s`: the live
        scheduler's next pass sees that, whatever arrives; the simulator wakes the group
        then, when a neighbour's calls wait (an arrival would wake it anyway)."""
        config = self.config
        if config.name != "plexrl" or config.preempt_ratio <= 0:
            return
        group = self.groups[run.worker_id]
        flight = group.inflight
        if flight is None or not flight.yields:
            return
        if any(j.pending for j in group.homed.values()):
            self._wake_at(run.worker_id, self.now + config.preempt_after_s)

    def trails(self) -> dict[str, list[tuple[int, Function]]]:
        return {jid: list(j.trail or []) for jid, j in self.jobs.items()}
