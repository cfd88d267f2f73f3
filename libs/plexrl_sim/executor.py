"""The group executor: carries out the policy's actions on the simulated groups, as a
live worker would, and checks the invariants a worker relies on.

A Run is its evictions, then its job's onload (or the rest of a prefetch in flight),
then the engine switch if the group last ran another job, then its calls in order for
the seconds the job's step says, stretched by any stragglers decoding beside them.
Swap seconds come from `SwapCosts.move_s` with the group's bandwidths. The invariants
(raised as `SimulationError`): one Run per group at a time; a Run takes a prefix of its
job's pending calls, in order; no eviction of a running or pinned job; the device and
host tiers never over capacity; a job only runs on its home group.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from plexrl.messages import Tier
from plexrl.policy import Admit, Move, PendingCall, Prefetch, Run, WorkerView
from plexrl_sim.accounting import Accounting
from plexrl_sim.events import Attention, Event, EventQueue
from plexrl_sim.replay import SimJob
from plexrl_sim.workload import CoLocation, GroupSpec

_DEVICE, _RUN_DONE = Tier.DEVICE, Event.RUN_DONE
"""(Module constants: an enum member read off its class costs an attribute lookup.)"""


class SimulationError(Exception):
    """The policy asked for something impossible, or an invariant broke."""


@dataclass
class SimGroup:
    spec: GroupSpec
    homed: dict[str, SimJob] = field(default_factory=dict)
    running: str | None = None
    busy_until: float = 0.0
    tails: list[tuple[float, float]] = field(default_factory=list)
    """(end, fraction of the group) of straggler tails decoding in the background."""
    last_job: str | None = None
    """The job of its previous Run: a Run of another job pays the engine switch."""
    link_free: float = 0.0
    """When the host link is free for the next prefetch."""
    view: WorkerView | None = None

    @property
    def group_id(self) -> str:
        return self.spec.group_id

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


class GroupExecutor:
    """Every group of the cluster, and the actions that change them."""

    def __init__(
        self,
        groups: list[GroupSpec],
        costs: CoLocation,
        events: EventQueue,
        attention: Attention,
        accounting: Accounting,
    ) -> None:
        self.groups = {g.group_id: SimGroup(g) for g in groups}
        self.costs = costs
        self.events = events
        self.attention = attention
        self.accounting = accounting

    # Admission ---------------------------------------------------------------------------

    def admit(self, job: SimJob, action: Admit) -> None:
        group = self.groups[action.worker_id]
        if group.spec.devices < job.devices:
            raise SimulationError(f"{action.job_id} admitted to a group too small for it")
        now = self.events.now
        job.home = action.worker_id
        # The duty cycle counts from here: waiting for a home is not the job's idleness.
        job.history.homed(now)
        job.touch()
        job.result.start_s = now
        job.result.group = action.worker_id
        group.homed[job.job_id] = job
        self.accounting.hold(group.group_id, now, len(group.homed))
        self.attention.group(action.worker_id)

    def unhome(self, job: SimJob) -> None:
        group = self.groups[job.home or ""]
        del group.homed[job.job_id]
        job.tier = None
        if not group.homed:
            self.accounting.release(group.group_id, self.events.now)
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

    def start_run(self, run: Run) -> None:
        group = self.groups[run.worker_id]
        job = group.homed.get(run.job_id)
        if job is None:
            raise SimulationError(f"run of {run.job_id} on {run.worker_id}, not its home")
        if group.running is not None:
            raise SimulationError(f"run on {run.worker_id} while {group.running} runs there")
        ids, pending = run.request_ids, job.pending
        n = len(ids)
        if n == 0 or n > len(pending):
            raise SimulationError(f"run of {run.job_id} skips or reorders its calls")
        calls = pending[:n]
        if [c.request_id for c in calls] != list(ids):
            raise SimulationError(f"run of {run.job_id} skips or reorders its calls")
        job.pending = pending[n:]
        now = self.events.now
        swap = self._evict(group, job.job_id, run.evict) if run.evict else 0.0
        moved = bool(run.evict)
        if job.tier != _DEVICE:
            moved = True
            swap += self._move_s(group, job, job.tier, _DEVICE)
            job.tier = _DEVICE
        swap += max(0.0, job.ready_at - now)
        last = group.last_job
        if last is not None and last != job.job_id:
            swap += self.costs.switch_s
        group.last_job = job.job_id
        if moved:
            self._check_memory(group)
        seconds_of, useful_of = job.figures()
        try:
            planned = [seconds_of[c.function] for c in calls]
        except KeyError as err:
            raise ValueError(f"unexpected call {err.args[0]}") from None
        work = sum(planned)
        start = now + swap
        end = self._stretched_end(group, start, work) if group.tails else start + work
        group.running = job.job_id
        group.busy_until = end
        group.view = None
        job.idle_until = 0.0
        job.view = None
        r = job.result
        # Time the job was ready but the group was not: from its oldest call's arrival
        # (or its home, or the end of its own previous Run, whichever is later) to now.
        ready = max(calls[0].arrival_time, r.start_s, job.last_active)
        queued = max(0.0, now - ready)
        r.call_queue_s += queued
        r.swap_s += swap
        r.compute_s += end - start
        devices = group.spec.devices
        self.accounting.charge(r, group.spec.group_id, devices * (swap + work))
        useful = sum([useful_of.get(c.function, 0.0) for c in calls]) * devices
        self.accounting.busy(start, end, useful)
        self.events.push(end, _RUN_DONE, RunInFlight(job, calls, swap, start, planned, queued))

    def run_done(self, done: RunInFlight) -> None:
        """The Run's calls ended: the group is free; the scheduler sees each call's compute
        seconds (the Run's, stretched by any stragglers beside it, split in proportion)
        and its swaps."""
        job, now = done.job, self.events.now
        group = self.groups[job.home or ""]
        group.running = None
        group.view = None
        job.last_active = now
        job.view = None
        self.attention.groups.add(group.spec.group_id)
        planned, calls = done.planned_s, done.calls
        work = sum(planned)
        stretch = (now - done.started) / work if work > 0 else 1.0
        observe = job.history.observe
        # The first call carries the Run's swaps and queueing; the rest only compute.
        observe(calls[0].function, planned[0] * stretch, done.swap_s, done.queue_s)
        for i in range(1, len(calls)):
            observe(calls[i].function, planned[i] * stretch, 0.0, 0.0)

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

    def start_tail(self, job: SimJob, tail_s: float, util: float) -> float:
        """The job's stragglers decode in the background on its group, `util` of it, for
        `tail_s` alone; beside other jobs they keep at least `tail_min_share` (their KV
        cache's memory) and take `tail_contention` times longer. Returns their seconds."""
        group = self.groups[job.home or ""]
        now = self.events.now
        useful = group.spec.devices * util * tail_s
        if len(group.homed) > 1:
            util = max(util, self.costs.tail_min_share)
            tail_s *= self.costs.tail_contention
        group.tails.append((now + tail_s, util))
        self.accounting.charge(job.result, group.group_id, group.spec.devices * util * tail_s)
        self.accounting.busy(now, now + tail_s, useful)
        return tail_s

    def _stretched_end(self, group: SimGroup, start: float, work: float) -> float:
        """When `work` seconds of full-group compute end, given the stragglers decoding in
        the background take their share of the group until each tail ends."""
        tails = [t for t in group.tails if t[0] > start]
        group.tails = tails
        if not tails:
            return start + work
        if len(tails) > 1:
            tails.sort()
        share = min(sum([u for _, u in tails]), 0.9)
        t, left = start, work
        for end, util in tails:
            speed = 1.0 - share
            if speed * (end - t) >= left:
                return t + left / speed
            left -= speed * (end - t)
            t = end
            share = max(share - util, 0.0)
        return t + left / (1.0 - share)
