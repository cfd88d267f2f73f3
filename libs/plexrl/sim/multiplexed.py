"""The shared-cluster deployments: a discrete-event simulation in which every placement,
dispatch, eviction and prefetch is decided by `plexrl.policy.plan` — the live
scheduler's own policy functions — on `ClusterSnapshot`s built from simulator state.

Scoping: under affinity a group's dispatch decisions depend only on the jobs homed on
it, so when something happens on one group the simulator asks the policy about a
snapshot of that group alone (its worker, its homed jobs, their pending calls, the
group's own tier bandwidths). Admission needs every group, so while jobs wait for a
home the simulator asks about the whole cluster. The policy itself is never told
which kind of snapshot it gets.

Execution follows the plan literally: a Run's evictions, then its onload, then its
calls in order, for exactly the seconds the workload's steps say; swap seconds come
from `SwapCosts.move_s` with the group's bandwidths, as the live worker's would.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from plexrl.messages import Function, Tier
from plexrl.policy import (
    Admit,
    CallEstimates,
    ClusterSnapshot,
    JobView,
    Move,
    PendingCall,
    PolicyConfig,
    Prefetch,
    Reject,
    Run,
    WorkerView,
    plan,
)
from plexrl.policy.history import CallHistory, Prior, describe, priors
from plexrl.sim.results import DeploymentResult, GroupUsage, JobResult, Timeline
from plexrl.sim.workload import CoLocation, GroupSpec, JobFactory, JobSpec, Steps, nbytes

_TRAIN = (Function.FORWARD_BACKWARD, Function.OPTIM_STEP, Function.SAVE)

# Event kinds, in the order they are handled when simultaneous.
_RUN_DONE, _TAIL_DONE, _TRAIN_CALLS, _NEXT_STEP, _FINISH, _ARRIVE = range(6)


class SimulationError(RuntimeError):
    """The policy asked for something impossible, or an invariant broke."""


@dataclass
class _Job:
    spec: JobSpec
    steps: Steps
    devices: int
    state_bytes: int
    result: JobResult
    history: CallHistory = field(default_factory=CallHistory)
    """What the scheduler has learned of the job from its calls so far."""
    stalls_s: float = 0.0
    """Sum of its reward / tool stalls so far: the job's own idle hint is their mean."""
    gaps_s: float = 0.0
    """Sum of its host-side gaps between steps so far."""
    home: str | None = None
    tier: Tier | None = None
    last_active: float = 0.0
    idle_until: float = 0.0
    pinned: bool = False
    ready_at: float = 0.0
    """When a prefetch in flight lands on the device."""
    step: int = 0
    first_step_at: float = math.nan
    pending: list[PendingCall] = field(default_factory=list)
    view: JobView | None = None
    trail: list[tuple[int, Function]] | None = None

    def touch(self) -> None:
        self.view = None

    def as_view(self, now: float, learned: dict[str, Prior], min_history_s: float) -> JobView:
        """The job as the live scheduler would describe it: its measured figures, or its
        kind's (`learned`, by profile) until it has a history. Cached until `touch`."""
        if self.view is None:
            seen = describe(self.history, learned.get(self.spec.profile), now, min_history_s)
            self.view = JobView(
                job_id=self.spec.job_id,
                state_bytes=self.state_bytes,
                home=self.home,
                tier=self.tier,
                devices=self.devices,
                last_active=self.last_active,
                idle_until=self.idle_until,
                estimates=CallEstimates(seen.durations),
                duty_cycle=seen.duty_cycle,
                pinned=self.pinned,
                step_calls=seen.step_calls,
            )
        return self.view


@dataclass
class _Group:
    spec: GroupSpec
    usage: GroupUsage
    homed: dict[str, _Job] = field(default_factory=dict)
    running: str | None = None
    busy_until: float = 0.0
    tails: list[tuple[float, float]] = field(default_factory=list)
    """(end, fraction of the group) of straggler tails decoding in the background."""
    last_job: str | None = None
    """The job of its previous Run: a Run of another job pays the engine switch."""
    held_since: float | None = None
    link_free: float = 0.0
    view: WorkerView | None = None

    def as_view(self) -> WorkerView:
        if self.view is None:
            self.view = WorkerView(
                worker_id=self.spec.group_id,
                device_bytes=self.spec.device_bytes,
                host_bytes=self.spec.host_bytes,
                devices=self.spec.devices,
                running=self.running,
                busy_until=self.busy_until,
            )
        return self.view

    def bytes_in(self, tier: Tier) -> int:
        return sum(j.state_bytes for j in self.homed.values() if j.tier == tier)


@dataclass
class _RunInFlight:
    job: _Job
    calls: list[PendingCall]
    swap_s: float
    started: float
    """When its calls began (after its swaps)."""


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
    ) -> None:
        self.config = config
        self.costs = colocation if colocation is not None else factory.workload.cluster.colocation
        self._priors: dict[str, Prior] = {}
        self.min_history_s = factory.workload.estimates.min_history_s
        self.name = name or config.name
        self.gpus = gpus
        self.now = 0.0
        self._seq = 0
        self._events: list[tuple[float, int, int, object]] = []
        self.groups = {g.group_id: _Group(g, GroupUsage(g.group_id, g.devices)) for g in groups}
        self.jobs: dict[str, _Job] = {}
        self.waiting: dict[str, _Job] = {}
        self.timeline = Timeline()
        self.plans = 0
        self.plan_s = 0.0
        self.events = 0
        self._admission_due = False
        self._dirty: set[str] = set()
        profiles = factory.workload.profiles
        for spec in jobs:
            p = profiles[spec.profile]
            steps = factory.steps(spec)
            self.jobs[spec.job_id] = self._make_job(
                spec, steps, p.devices, int(nbytes(p.state_bytes))
            )
            if record_trail:
                self.jobs[spec.job_id].trail = []
            self._push(spec.arrival_s, _ARRIVE, self.jobs[spec.job_id])

    @staticmethod
    def _make_job(spec: JobSpec, steps: Steps, devices: int, state_bytes: int) -> _Job:
        result = JobResult(
            job_id=spec.job_id,
            profile=spec.profile,
            devices=devices,
            steps=spec.steps,
            arrival_s=spec.arrival_s,
            isolated_step_time_s=float(steps.isolated_step_s.sum()),
            useful_device_s=float(steps.useful_work.sum()) * devices,
        )
        return _Job(spec=spec, steps=steps, devices=devices, state_bytes=state_bytes, result=result)

    # Event queue -------------------------------------------------------------------------

    def _push(self, at: float, kind: int, obj: object) -> None:
        self._seq += 1
        heapq.heappush(self._events, (at, kind, self._seq, obj))

    def run(
        self, progress: Callable[[float], None] | None = None, until_s: float = math.inf
    ) -> DeploymentResult:
        started = time.perf_counter()
        while self._events:
            at, kind, _, obj = heapq.heappop(self._events)
            if at > until_s:
                break
            self.now = at
            self.events += 1
            self._handle(kind, obj)
            self._decide()
            if progress is not None and self.events % 4096 == 0:
                progress(self.now)
        if progress is not None:
            progress(self.now)
        return self._result(time.perf_counter() - started)

    def _handle(self, kind: int, obj: object) -> None:
        if kind == _RUN_DONE:
            assert isinstance(obj, _RunInFlight)
            self._run_done(obj)
        elif kind == _TAIL_DONE:
            assert isinstance(obj, _Job)
            self._tail_done(obj)
        elif kind == _TRAIN_CALLS:
            assert isinstance(obj, _Job)
            self._issue_train(obj)
        elif kind == _NEXT_STEP:
            assert isinstance(obj, _Job)
            self._begin_step(obj)
        elif kind == _FINISH:
            assert isinstance(obj, _Job)
            self._finish(obj)
        elif kind == _ARRIVE:
            assert isinstance(obj, _Job)
            self._arrive(obj)

    # Asking the policy -------------------------------------------------------------------

    def _decide(self) -> None:
        if self._admission_due and self.waiting:
            self._admission_due = False
            self._carry_out(self.full_snapshot())
        self._admission_due = False
        while self._dirty:
            group = self.groups[self._dirty.pop()]
            if self._wants_plan(group):
                self._carry_out(self.group_snapshot(group.spec.group_id))

    def _wants_plan(self, group: _Group) -> bool:
        if group.running is None:
            return any(j.pending for j in group.homed.values())
        # Busy: only a prefetch could be decided, and only for a job off the device.
        return any(j.tier in (Tier.HOST, Tier.DISK) for j in group.homed.values())

    def group_snapshot(self, group_id: str) -> ClusterSnapshot:
        """What the policy sees when something happens on one group."""
        group = self.groups[group_id]
        jobs = {
            jid: j.as_view(self.now, self._priors, self.min_history_s)
            for jid, j in group.homed.items()
        }
        calls = [c for j in group.homed.values() for c in j.pending]
        calls.sort(key=lambda c: c.arrival_time)
        return ClusterSnapshot(
            now=self.now,
            workers={group.spec.group_id: group.as_view()},
            jobs=jobs,
            pending=tuple(calls),
            swap=group.spec.swap,
        )

    def full_snapshot(self) -> ClusterSnapshot:
        """What the policy sees when admission is due: every group, job and pending call."""
        homed = [j for g in self.groups.values() for j in g.homed.values()]
        learned = priors(((j.spec.profile, j.history) for j in homed), self.now, self.min_history_s)
        if learned != self._priors:
            self._priors = learned
            for j in (*homed, *self.waiting.values()):
                j.touch()
        jobs: dict[str, JobView] = {}
        calls: list[PendingCall] = []
        for j in (*homed, *self.waiting.values()):
            jobs[j.spec.job_id] = j.as_view(self.now, self._priors, self.min_history_s)
            calls.extend(j.pending)
        calls.sort(key=lambda c: c.arrival_time)
        return ClusterSnapshot(
            now=self.now,
            workers={gid: g.as_view() for gid, g in self.groups.items()},
            jobs=jobs,
            pending=tuple(calls),
        )

    def _carry_out(self, snapshot: ClusterSnapshot) -> None:
        t0 = time.perf_counter()
        actions = plan(snapshot, self.config)
        self.plan_s += time.perf_counter() - t0
        self.plans += 1
        for action in actions:
            if isinstance(action, Admit):
                self._admit(action)
            elif isinstance(action, Reject):
                self._reject(action)
            elif isinstance(action, Run):
                self._start_run(action)
            elif isinstance(action, Prefetch):
                self._prefetch(action)

    # Actions -----------------------------------------------------------------------------

    def _admit(self, action: Admit) -> None:
        job = self.waiting.pop(action.job_id, None)
        if job is None:
            raise SimulationError(f"admit of {action.job_id}, which is not waiting")
        group = self.groups[action.worker_id]
        if group.spec.devices < job.devices:
            raise SimulationError(f"{action.job_id} admitted to a group too small for it")
        job.home = action.worker_id
        # The duty cycle counts from here: waiting for a home is not the job's idleness.
        job.history.first_seen = self.now
        job.touch()
        job.result.start_s = self.now
        job.result.group = action.worker_id
        if not group.homed:
            group.held_since = self.now
        group.homed[job.spec.job_id] = job
        group.usage.peak_jobs = max(group.usage.peak_jobs, len(group.homed))
        self._dirty.add(action.worker_id)

    def _reject(self, action: Reject) -> None:
        job = self.waiting.pop(action.job_id, None)
        if job is not None:
            job.result.rejected = f"{action.reason}: {action.detail}"
            job.pending.clear()

    def _move_s(self, group: _Group, job: _Job, src: Tier | None, dst: Tier) -> float:
        seconds = group.spec.swap.move_s(job.state_bytes, src, dst)
        if src is not None and src != dst:
            job.result.swaps += 1
            job.result.swapped_bytes += job.state_bytes
        return seconds

    def _evict(self, group: _Group, run_job_id: str, moves: tuple[Move, ...]) -> float:
        seconds = 0.0
        for move in moves:
            victim_id, to_tier = move.job_id, move.to_tier
            victim = group.homed.get(victim_id)
            if victim is None or victim.tier != Tier.DEVICE:
                raise SimulationError(
                    f"evict of {victim_id}, not on {group.spec.group_id}'s device"
                )
            if victim.pinned or victim_id in (run_job_id, group.running):
                raise SimulationError(f"evict of {victim_id}, which is in use")
            seconds += self._move_s(group, victim, Tier.DEVICE, to_tier)
            victim.tier = to_tier
            victim.touch()
        return seconds

    def _check_memory(self, group: _Group) -> None:
        if group.bytes_in(Tier.DEVICE) > group.spec.device_bytes:
            raise SimulationError(f"{group.spec.group_id}: device tier over capacity")
        if group.bytes_in(Tier.HOST) > group.spec.host_bytes:
            raise SimulationError(f"{group.spec.group_id}: host tier over capacity")

    def _start_run(self, run: Run) -> None:
        group = self.groups[run.worker_id]
        job = group.homed.get(run.job_id)
        if job is None:
            raise SimulationError(f"run of {run.job_id} on {run.worker_id}, not its home")
        if group.running is not None:
            raise SimulationError(f"run on {run.worker_id} while {group.running} runs there")
        n = len(run.request_ids)
        if n == 0 or tuple(c.request_id for c in job.pending[:n]) != run.request_ids:
            raise SimulationError(f"run of {run.job_id} skips or reorders its calls")
        calls, job.pending = job.pending[:n], job.pending[n:]
        swap = self._evict(group, job.spec.job_id, run.evict)
        if job.tier != Tier.DEVICE:
            swap += self._move_s(group, job, job.tier, Tier.DEVICE)
            job.tier = Tier.DEVICE
        swap += max(0.0, job.ready_at - self.now)
        if group.last_job not in (None, job.spec.job_id):
            swap += self.costs.switch_s
        group.last_job = job.spec.job_id
        self._check_memory(group)
        work = sum(self._call_s(job, c.function) for c in calls)
        start = self.now + swap
        end = self._stretched_end(group, start, work)
        group.running = job.spec.job_id
        group.busy_until = end
        group.view = None
        job.idle_until = 0.0
        job.touch()
        r = job.result
        # Time the job was ready but the group was not: from its oldest call's arrival
        # (or its home, or the end of its own previous Run, whichever is later) to now.
        ready = max(calls[0].arrival_time, r.start_s, job.last_active)
        r.call_queue_s += max(0.0, self.now - ready)
        r.swap_s += swap
        r.compute_s += end - start
        used = group.spec.devices * (swap + work)
        r.used_device_s += used
        group.usage.used_device_s += used
        useful = sum(self._call_useful(job, c.function) for c in calls) * group.spec.devices
        self.timeline.add("busy", start, end, useful)
        self._push(end, _RUN_DONE, _RunInFlight(job, calls, swap, start))

    def _prefetch(self, action: Prefetch) -> None:
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
        job.ready_at = max(self.now, group.link_free) + seconds
        group.link_free = job.ready_at

    @staticmethod
    def _call_s(job: _Job, function: Function) -> float:
        s, k = job.steps, job.step
        if function == Function.SAMPLE:
            return float(s.dense_s[k])
        if function == Function.FORWARD_BACKWARD:
            return float(s.fb_s[k]) / s.fb_calls
        if function == Function.OPTIM_STEP:
            return s.optim_s
        if function == Function.SAVE:
            return s.save_s
        if function == Function.CREATE:
            return s.create_s
        raise SimulationError(f"unexpected call {function}")

    @staticmethod
    def _call_useful(job: _Job, function: Function) -> float:
        s, k = job.steps, job.step
        if function == Function.SAMPLE:
            return float(s.dense_work[k])
        if function == Function.FORWARD_BACKWARD:
            return float(s.fb_s[k]) / s.fb_calls * s.train_util
        if function == Function.OPTIM_STEP:
            return s.optim_s * s.train_util
        if function == Function.SAVE:
            return s.save_s * s.save_util
        return 0.0

    def _stretched_end(self, group: _Group, start: float, work: float) -> float:
        """When `work` seconds of full-group compute end, given the stragglers decoding in
        the background take their share of the group until each tail ends."""
        tails = sorted(t for t in group.tails if t[0] > start)
        group.tails = tails
        if not tails:
            return start + work
        share = min(sum(u for _, u in tails), 0.9)
        t, left = start, work
        for end, util in tails:
            speed = 1.0 - share
            if speed * (end - t) >= left:
                return t + left / speed
            left -= speed * (end - t)
            t = end
            share = max(share - util, 0.0)
        return t + left / (1.0 - share)

    # The job's life ----------------------------------------------------------------------

    def _issue(self, job: _Job, function: Function, index: int = 0) -> None:
        job.history.arrived(function, self.now)
        job.pending.append(
            PendingCall(
                f"{job.spec.job_id}/{job.step}/{function.value}{index}",
                job.spec.job_id,
                function,
                self.now,
            )
        )

    def _arrive(self, job: _Job) -> None:
        self.waiting[job.spec.job_id] = job
        self._issue(job, Function.CREATE)
        self._admission_due = True

    def _run_done(self, done: _RunInFlight) -> None:
        job = done.job
        group = self.groups[job.home or ""]
        group.running = None
        group.view = None
        job.last_active = self.now
        job.touch()
        self._dirty.add(group.spec.group_id)
        # What the live scheduler sees of it: each call's compute seconds (the Run's,
        # stretched by any stragglers beside it, split in proportion) and its swaps.
        planned = [self._call_s(job, c.function) for c in done.calls]
        stretch = (self.now - done.started) / sum(planned) if sum(planned) > 0 else 1.0
        for i, (call, seconds) in enumerate(zip(done.calls, planned, strict=True)):
            job.history.observe(call.function, seconds * stretch, done.swap_s if i == 0 else 0.0)
        for call in done.calls:
            if job.trail is not None:
                job.trail.append((job.step, call.function))
            if call.function == Function.CREATE:
                self._begin_step(job)
            elif call.function == Function.SAMPLE:
                self._start_tail(job, group)
            elif call.function == Function.SAVE:
                self._step_done(job)

    def _begin_step(self, job: _Job) -> None:
        if math.isnan(job.first_step_at):
            job.first_step_at = self.now
        job.idle_until = 0.0
        job.touch()
        self._issue(job, Function.SAMPLE)
        self._dirty.add(job.home or "")

    def _start_tail(self, job: _Job, group: _Group) -> None:
        s, k = job.steps, job.step
        tail_s = float(s.tail_s[k])
        if tail_s <= 0:
            self._tail_done(job)
            return
        util = float(s.tail_work[k]) / tail_s
        if len(group.homed) > 1:
            # Another job may run beside the stragglers: they keep their KV cache's share
            # of the group, and decode slower beside its kernels.
            util = max(util, self.costs.tail_min_share)
            tail_s *= self.costs.tail_contention
        group.tails.append((self.now + tail_s, util))
        job.pinned = True
        job.touch()
        used = group.spec.devices * util * tail_s
        job.result.used_device_s += used
        group.usage.used_device_s += used
        self.timeline.add(
            "busy", self.now, self.now + tail_s, group.spec.devices * float(s.tail_work[k])
        )
        self._push(self.now + tail_s, _TAIL_DONE, job)

    def _tail_done(self, job: _Job) -> None:
        job.pinned = False
        # The job's idle hint, "reward / tool stall for about this long": the mean of its
        # own stalls so far (no hint before its first).
        job.idle_until = self.now + job.stalls_s / job.step if job.step else 0.0
        job.touch()
        stall = float(job.steps.reward_s[job.step])
        job.stalls_s += stall
        self._push(self.now + stall, _TRAIN_CALLS, job)
        self._dirty.add(job.home or "")

    def _issue_train(self, job: _Job) -> None:
        for i in range(job.steps.fb_calls):
            self._issue(job, Function.FORWARD_BACKWARD, i)
        self._issue(job, Function.OPTIM_STEP)
        self._issue(job, Function.SAVE)
        job.idle_until = 0.0
        job.touch()
        self._dirty.add(job.home or "")

    def _step_done(self, job: _Job) -> None:
        misc = float(job.steps.misc_s[job.step])
        hint = job.gaps_s / job.step if job.step else 0.0
        job.gaps_s += misc
        job.step += 1
        if job.step >= job.steps.n:
            self._push(self.now + misc, _FINISH, job)
            return
        job.idle_until = self.now + hint if hint else 0.0
        job.touch()
        self._push(self.now + misc, _NEXT_STEP, job)

    def _finish(self, job: _Job) -> None:
        group = self.groups[job.home or ""]
        r = job.result
        r.finish_s = self.now
        r.step_time_s = self.now - job.first_step_at
        del group.homed[job.spec.job_id]
        job.tier = None
        if not group.homed and group.held_since is not None:
            self._release(group)
        self._dirty.add(group.spec.group_id)
        self._admission_due = True

    def _release(self, group: _Group) -> None:
        assert group.held_since is not None
        held = self.now - group.held_since
        group.usage.held_s += held
        self.timeline.add("allocated", group.held_since, self.now, held * group.spec.devices)
        group.held_since = None

    # Results -----------------------------------------------------------------------------

    def _result(self, wall_s: float) -> DeploymentResult:
        for group in self.groups.values():
            if group.held_since is not None:
                self._release(group)
        # Charge each group's held GPU-seconds to its jobs in proportion to their use.
        by_group: dict[str, list[JobResult]] = {}
        for job in self.jobs.values():
            if job.result.group:
                by_group.setdefault(job.result.group, []).append(job.result)
        for gid, results in by_group.items():
            usage = self.groups[gid].usage
            held = usage.held_s * usage.devices
            total = sum(r.used_device_s for r in results)
            for r in results:
                r.occupied_gpu_s = held * r.used_device_s / total if total > 0 else 0.0
        return DeploymentResult(
            name=self.name,
            kind="multiplexed",
            gpus=self.gpus,
            jobs=[j.result for j in self.jobs.values()],
            timeline=self.timeline,
            groups=[g.usage for g in self.groups.values()],
            wall_s=wall_s,
            events=self.events,
            plans=self.plans,
            plan_s=self.plan_s,
        )

    def trails(self) -> dict[str, list[tuple[int, Function]]]:
        return {jid: list(j.trail or []) for jid, j in self.jobs.items()}
