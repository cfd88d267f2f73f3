"""PlexRL's own policy: interference-aware placement, backfilled admission, response-ratio
dispatch discounted by switch cost, idle-hint-aware eviction and prefetch.

Placement predicts, for every job on a candidate group, the extra seconds per training
step it would wait behind its neighbours' calls, and homes the new job on the *fullest*
group where the mean of those predictions stays within `slowdown_budget` of the jobs'
step times (and none exceeds twice the budget). Jobs whose busy periods rarely
coincide (low duty cycles, short calls) therefore stack deep; jobs with long calls get
fewer neighbours. When no shared group is within budget the job takes an empty group,
and when none is empty it waits while later jobs that do fit are admitted past it.

The interference model (per job i, neighbours k on the same group):

    wait_i  = runs_i * sum_k(duty_k * residual_k) / (1 - sum_k duty_k / 2)
    slow_i  = wait_i / period_i

where `runs_i` is the number of dispatches i makes per step (a sample, then the
training calls), `residual_k` the mean remaining time of a k dispatch found in
progress (sum s^2 / 2 sum s over k's dispatches) and `period_i` the job's step time
(its busy seconds over its duty cycle). With `1 - sum duty` in the denominator it would
be the M/G/1 wait of Poisson arrivals; RLVR jobs are periodic and queue far less
(the simulator measures about half of that at the loads that matter), so the
amplification is halved.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

from plexrl.messages import Function, Tier
from plexrl.policy.actions import Action, Move, Plan, Prefetch, Run
from plexrl.policy.common import (
    admit_waiting,
    dispatch,
    fits_memory,
    make_room,
    size_class,
    switch_s,
)
from plexrl.policy.config import PolicyConfig
from plexrl.policy.snapshot import ClusterSnapshot, JobView, WorkerView

_TRAIN = (Function.FORWARD_BACKWARD, Function.OPTIM_STEP, Function.SAVE)
_UNBOUNDED = float("inf")


def step_runs(job: JobView) -> tuple[float, ...]:
    """Expected seconds of each dispatch of one training step: the rollout's sample, then
    the training calls (sent together, so one dispatch)."""
    sample = job.estimates.expected_s(Function.SAMPLE)
    train = sum(job.estimates.expected_s(f) for f in _TRAIN)
    return tuple(s for s in (sample, train) if s > 0)


def residual_s(job: JobView) -> float:
    runs = step_runs(job)
    total = sum(runs)
    return sum(s * s for s in runs) / (2 * total) if total > 0 else 0.0


def predicted_slowdown(job: JobView, neighbours: Sequence[JobView]) -> float:
    """Expected fractional step-time increase of `job` from sharing with `neighbours`."""
    if not neighbours:
        return 0.0
    others = sum(k.duty_cycle for k in neighbours)
    if others >= 1.0:
        return _UNBOUNDED
    runs = step_runs(job)
    busy = sum(runs)
    if busy <= 0 or job.duty_cycle <= 0:
        return 0.0
    period = busy / job.duty_cycle
    wait = len(runs) * sum(k.duty_cycle * residual_s(k) for k in neighbours) / (1.0 - others / 2)
    return wait / period


def worst_slowdown(jobs: Sequence[JobView]) -> float:
    """The largest `predicted_slowdown` among jobs sharing one group."""
    return max(
        (predicted_slowdown(j, [k for k in jobs if k.job_id != j.job_id]) for j in jobs),
        default=0.0,
    )


class InterferenceFit:
    """Placement: the fullest group of the job's size class where everyone stays within
    budget; else an empty group; else None (wait).

    One instance serves one plan: it caches each job's step figures, since admission
    asks about every waiting job against every group.
    """

    def __init__(self, budget: float) -> None:
        self.budget = budget
        self._figures: dict[str, tuple[int, float, float, float]] = {}

    def figures(self, job: JobView) -> tuple[int, float, float, float]:
        """(dispatches per step, duty, duty * residual, step period) of a job."""
        cached = self._figures.get(job.job_id)
        if cached is None:
            runs = step_runs(job)
            busy = sum(runs)
            period = busy / job.duty_cycle if job.duty_cycle > 0 and busy > 0 else 0.0
            cached = (len(runs), job.duty_cycle, job.duty_cycle * residual_s(job), period)
            self._figures[job.job_id] = cached
        return cached

    def slowdowns(self, members: Sequence[JobView]) -> list[float]:
        """The predicted slowdown of each of `members` sharing one group."""
        figs = [self.figures(j) for j in members]
        total_duty = sum(f[1] for f in figs)
        total_dr = sum(f[2] for f in figs)
        out: list[float] = []
        for runs, duty, dr, period in figs:
            others = total_duty - duty
            if others >= 1.0:
                out.append(_UNBOUNDED)
            elif period <= 0:
                out.append(0.0)
            else:
                out.append(runs * (total_dr - dr) / (1.0 - others / 2) / period)
        return out

    def within_budget(self, members: Sequence[JobView]) -> bool:
        """The group's mean predicted slowdown is within budget and nobody's exceeds
        twice the budget (the target is a mean; the guard keeps it fair)."""
        slow = self.slowdowns(members)
        return sum(slow) / len(slow) <= self.budget and max(slow) <= 2 * self.budget

    def __call__(self, snapshot: ClusterSnapshot, job: JobView) -> str | None:
        best: tuple[float, str] | None = None
        empty: str | None = None
        duty = job.duty_cycle
        for worker in size_class(snapshot, job):
            if not fits_memory(snapshot, worker, job):
                continue
            homed = snapshot.homed(worker.worker_id)
            if not homed:
                empty = empty or worker.worker_id
                continue
            group_load = sum(j.duty_cycle for j in homed)
            if group_load + duty >= 1.0 or (best is not None and group_load <= best[0]):
                continue
            if not self.within_budget([*homed, job]):
                continue
            best = (group_load, worker.worker_id)
        if best is not None:
            return best[1]
        return empty


def interference_fit(snapshot: ClusterSnapshot, job: JobView, budget: float) -> str | None:
    """`InterferenceFit` for a single question."""
    return InterferenceFit(budget)(snapshot, job)


def _idle_first(now: float) -> partial[tuple[float, ...]]:
    return partial(_idle_key, now)


def _idle_key(now: float, job: JobView) -> tuple[float, ...]:
    # Evict the job that said it will stay idle longest first, then the least recent.
    return (-max(job.idle_until - now, 0.0), job.last_active)


def response_ratio_order(
    snapshot: ClusterSnapshot, worker: WorkerView, jobs: list[JobView], switch_weight: float
) -> Sequence[JobView]:
    """Highest (waiting + service) / (service + weight * switch seconds) first; a resident
    job (no switch) wins ties."""

    def key(job: JobView) -> tuple[float, int, float, str]:
        calls = snapshot.calls_of(job.job_id)
        service = max(sum(job.estimates.expected_s(c.function) for c in calls), 1e-6)
        waiting = max(snapshot.now - calls[0].arrival_time, 0.0)
        switch = switch_s(snapshot, job, ()) if job.tier != Tier.DEVICE else 0.0
        ratio = (waiting + service) / (service + switch_weight * switch)
        return (-ratio, 0 if job.tier == Tier.DEVICE else 1, calls[0].arrival_time, job.job_id)

    return sorted(jobs, key=key)


def prefetches(snapshot: ClusterSnapshot, config: PolicyConfig, runs: list[Run]) -> list[Prefetch]:
    """On each busy group, bring up the off-device job most likely to run next: one with
    pending calls (highest response ratio), else the one whose idle hint ends first,
    provided that ends before the group frees up."""
    out: list[Prefetch] = []
    key = _idle_first(snapshot.now)
    for worker in snapshot.workers.values():
        if not worker.healthy or worker.running is None:
            continue
        homed = snapshot.homed(worker.worker_id)
        candidates = [
            j for j in homed if j.tier not in (Tier.DEVICE, None) and j.job_id != worker.running
        ]
        if not candidates:
            continue
        with_calls = [j for j in candidates if snapshot.calls_of(j.job_id)]
        if with_calls:
            target = response_ratio_order(snapshot, worker, with_calls, config.switch_weight)[0]
        else:
            hinted = [j for j in candidates if snapshot.now < j.idle_until <= worker.busy_until]
            if not hinted:
                continue
            target = min(hinted, key=lambda j: (j.idle_until, j.job_id))
        evict = make_room(snapshot, worker.worker_id, target, key)
        if evict is None or any(_has_calls(snapshot, m) for m in evict):
            continue
        out.append(Prefetch(worker.worker_id, target.job_id, evict))
    return out


def _has_calls(snapshot: ClusterSnapshot, move: Move) -> bool:
    return bool(snapshot.calls_of(move.job_id))


def plan_plexrl(snapshot: ClusterSnapshot, config: PolicyConfig) -> Plan:
    actions: list[Action] = []
    admitted, snapshot = admit_waiting(
        snapshot, InterferenceFit(config.slowdown_budget), backfill=True
    )
    actions.extend(admitted)
    order = partial(response_ratio_order, switch_weight=config.switch_weight)
    runs, snapshot = dispatch(
        snapshot, config, order, key=_idle_first(snapshot.now), keep_snapshot=config.prefetch
    )
    actions.extend(runs)
    if config.prefetch:
        actions.extend(prefetches(snapshot, config, runs))
    return tuple(actions)
