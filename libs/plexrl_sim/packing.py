"""How densely the own policy is expected to pack each job, and how fast each model
size drains its backlog, known before anything runs: for a shared cluster's layout sized
by the expected packing (`partition: packed`).

The layout of a shared cluster fixes how many groups each model size gets. Sized by
the group time the jobs' calls hold (`shared`), it would be right if every size packed
as densely as its idle time allows; sized by whole runs (`dedicated`), if every size
packed alike. Within a slowdown budget the packing is what admission allows, so each
size's packing here is admission's own rule played out on that size's jobs
(`admitted_per_group`): a group filled one newcomer at a time, each judged as admission
judges it (its kind's mean figures, guarded by its kind's busiest tenth), while the
residents are who they turn out to be (random jobs of the size, each by its own figures
once it has a history). With the budget held over the cluster (`PolicyConfig.
budget_over_cluster`, the default) the groups of a size are filled together
(`admitted_in_cluster`): jobs alone hold the mean down and the fullest groups go past
the budget per group, as admission lets them. Each job's figures are its step model's
means, the view the live scheduler would have of it once it has a history.

Demand alone gives each size the same share of its work, whenever that work arrives.
A size whose jobs arrive early and run long then drains last while another's last
arrivals bound it anyway: `drain_minimum` gives each size at least the groups that
drain its backlog by the time the slowest size can (`drain_days`), and the rest of
the GPUs follow demand (`workload.apportion`).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import replace

from plexrl.messages import Function
from plexrl.policy.costs import SharingCosts
from plexrl.policy.history import HIGH_DUTY_QUANTILE, Spread, quantile
from plexrl.policy.plexrl_policy import InterferenceFit
from plexrl.policy.snapshot import CallEstimates, ClusterSnapshot, JobView, WorkerView
from plexrl_sim.dedicated import alone_reference_s
from plexrl_sim.workload import JobFactory, JobSpec, Steps

MOST_PER_GROUP = 8
"""The densest packing considered (the prediction's own bound is the budget)."""
FILLS = 200
"""Groups filled per size to estimate its packing (`admitted_per_group`)."""
CLUSTER_GROUPS = 100
"""Groups of one size filled together to estimate its packing under a budget held over
the cluster (`admitted_in_cluster`)."""
DAY_S = 86400.0


def expected_view(job: JobSpec, steps: Steps, alone_s: float) -> JobView:
    """The job as the scheduler would see it with a history: each call's mean seconds,
    its calls per step, its duty cycle over its step alone (`alone_s`, its whole run
    alone), its stragglers' and its stalls' mean seconds, its loop."""
    fb_calls = max(steps.fb_calls, 1)
    seconds = {
        Function.SAMPLE: float(steps.dense_s.mean()),
        Function.FORWARD_BACKWARD: float(steps.fb_s.mean()) / fb_calls,
        Function.OPTIM_STEP: steps.optim_s,
    }
    calls = [Function.SAMPLE, *([Function.FORWARD_BACKWARD] * fb_calls), Function.OPTIM_STEP]
    if steps.save_s > 0:
        seconds[Function.SAVE] = steps.save_s
        calls.append(Function.SAVE)
    busy = float(steps.exclusive_s.mean())
    step_alone = alone_s / max(steps.n, 1)
    return JobView(
        job_id=job.job_id,
        state_bytes=0,
        estimates=CallEstimates(seconds),
        duty_cycle=min(1.0, busy / step_alone) if step_alone > 0 else 1.0,
        step_calls=tuple(calls),
        tail_s=float(steps.tail_s.mean()),
        stall_s=float(steps.reward_s.mean()),
        stall_sigma=_log_sd(steps.reward_s),
        staleness=steps.staleness,
    )


def newcomer_view(views: Sequence[JobView]) -> JobView:
    """A job of this kind as admission sees it before it has a history: its kind's mean
    duty cycle, call seconds, tail and stall, guarded by the kind's busiest tenth
    (`JobView.duty_bound`; `plexrl.policy.history.priors`)."""
    duties = [v.duty_cycle for v in views]
    seconds: dict[Function, list[float]] = {}
    for v in views:
        for function, s in v.estimates.seconds.items():
            seconds.setdefault(function, []).append(s)
    n = len(views)
    return replace(
        views[0],
        job_id="newcomer",
        duty_cycle=sum(duties) / n,
        duty_bound=quantile(duties, HIGH_DUTY_QUANTILE),
        estimates=CallEstimates({f: sum(v) / len(v) for f, v in seconds.items()}),
        tail_s=sum(v.tail_s for v in views) / n,
        stall_s=sum(v.stall_s for v in views) / n,
        stall_sigma=sum(v.stall_sigma for v in views) / n,
    )


def _log_sd(seconds: Iterable[float]) -> float:
    """The log-standard deviation of the positive durations (0 with fewer than two):
    what the scheduler learns of a job's stalls (`history.Spread`)."""
    spread = Spread()
    for s in seconds:
        spread.add(float(s))
    return spread.sigma


def admitted_per_group(
    views: Sequence[JobView],
    devices: int,
    costs: SharingCosts,
    budget: float,
    rng: random.Random,
    fills: int = FILLS,
) -> float:
    """The mean jobs one group of `devices` holds when admission fills it: newcomers are
    added while admission (`InterferenceFit`, packing) takes one beside the residents,
    and each one taken turns out to be a random job of `views` (at least one: a job
    alone is never refused a group; at most `MOST_PER_GROUP`)."""
    newcomer = newcomer_view(views)
    worker = WorkerView("g", device_bytes=1 << 62, host_bytes=1 << 62, devices=devices)
    held = 0
    for _ in range(fills):
        residents: list[JobView] = []
        while len(residents) < MOST_PER_GROUP:
            jobs = {f"r{i}": replace(r, job_id=f"r{i}", home="g") for i, r in enumerate(residents)}
            jobs[newcomer.job_id] = newcomer
            snapshot = ClusterSnapshot(0.0, {"g": worker}, jobs, ())
            if InterferenceFit(budget, costs=costs)(snapshot, newcomer) is None:
                break
            residents.append(rng.choice(views))
        held += len(residents)
    return held / fills


def admitted_in_cluster(
    views: Sequence[JobView],
    devices: int,
    costs: SharingCosts,
    budget: float,
    rng: random.Random,
    groups: int = CLUSTER_GROUPS,
) -> float:
    """The mean jobs a group of `devices` holds when admission fills `groups` of them
    together with its budget a mean over every homed job (`PolicyConfig.
    budget_over_cluster`): each newcomer goes where admission (`InterferenceFit`,
    packing, over the cluster) homes it, the fullest group where everyone stays within
    the budget, else an empty one, and turns out a random job of `views`; the fill ends
    at the first newcomer no group takes. The jobs alone hold the mean down, so a group
    may hold more than `admitted_per_group`'s, which holds the budget per group."""
    newcomer = newcomer_view(views)
    workers = {
        f"g{i}": WorkerView(f"g{i}", device_bytes=1 << 62, host_bytes=1 << 62, devices=devices)
        for i in range(groups)
    }
    place = InterferenceFit(budget, costs=costs, over_cluster=True)
    jobs: dict[str, JobView] = {newcomer.job_id: newcomer}
    homes: set[str] = set()
    placed = 0
    while placed < groups * MOST_PER_GROUP:
        home = place(ClusterSnapshot(0.0, workers, dict(jobs), ()), newcomer)
        if home is None:
            break
        jobs[f"r{placed}"] = replace(rng.choice(views), job_id=f"r{placed}", home=home)
        place.forget(home)  # it holds the job it turned out to be, not the newcomer
        homes.add(home)
        placed += 1
    return placed / max(1, len(homes))


def packing_by_profile(
    factory: JobFactory,
    jobs: Sequence[JobSpec],
    costs: SharingCosts,
    budget: float,
    over_cluster: bool = False,
) -> dict[str, float]:
    """Each profile's `admitted_per_group` over its jobs in `jobs` (their `expected_view`s),
    drawn from a stream of the factory's seed; with `over_cluster` (the budget a mean
    over every homed job), its `admitted_in_cluster`."""
    views: dict[str, list[JobView]] = {}
    for job in jobs:
        steps = factory.steps(job)
        view = expected_view(job, steps, alone_reference_s(factory, job, costs))
        views.setdefault(job.profile, []).append(view)
    rng = random.Random(f"packing-{factory.seed}")
    profiles = factory.workload.profiles
    fill = admitted_in_cluster if over_cluster else admitted_per_group
    return {
        name: fill(found, profiles[name].devices, costs, budget, rng)
        for name, found in sorted(views.items())
    }


def drain_days(
    arrivals_d: Sequence[float], runs_d: Sequence[float], groups: int, packing: float
) -> float:
    """When a size's last job is expected to finish on `groups` groups holding `packing`
    jobs each: the backlog drains as a fluid (from each arrival on, the work still to
    come over the groups' capacity), then its last jobs run on for a mean run; never
    before the floor (a job's arrival plus its run alone). Days; arrivals sorted."""
    capacity = groups * packing
    fluid, later = 0.0, 0.0
    for arrival, run in zip(reversed(arrivals_d), reversed(runs_d), strict=True):
        later += run
        fluid = max(fluid, arrival + later / capacity)
    floor = max(a + r for a, r in zip(arrivals_d, runs_d, strict=True))
    return max(floor, fluid + sum(runs_d) / len(runs_d))


def drain_minimum(
    factory: JobFactory,
    jobs: Sequence[JobSpec],
    packing: dict[str, float],
    costs: SharingCosts,
    gpus: int,
) -> dict[str, int]:
    """The fewest groups per profile with which every profile drains (`drain_days`) by
    the earliest day the GPUs allow every profile to: the least makespan the layout
    can give, before the rest of the GPUs are split by demand."""
    profiles = factory.workload.profiles
    by_profile: dict[str, list[tuple[float, float]]] = {}
    for job in sorted(jobs, key=lambda j: j.arrival_s):
        run = alone_reference_s(factory, job, costs) / DAY_S
        by_profile.setdefault(job.profile, []).append((job.arrival_s / DAY_S, run))
    drains: dict[str, list[float]] = {}
    for name, seen in by_profile.items():
        arrivals, runs = [a for a, _ in seen], [r for _, r in seen]
        most = max(1, gpus // profiles[name].devices)
        drains[name] = [drain_days(arrivals, runs, g, packing[name]) for g in range(1, most + 1)]

    def needed(day: float) -> dict[str, int] | None:
        counts: dict[str, int] = {}
        for name, days in drains.items():
            fewest = next((g for g, d in enumerate(days, 1) if d <= day), None)
            if fewest is None:
                return None
            counts[name] = fewest
        if sum(profiles[k].devices * c for k, c in counts.items()) > gpus:
            return None
        return counts

    for day in sorted({d for days in drains.values() for d in days}):
        counts = needed(day)
        if counts is not None:  # the earliest day the GPUs allow
            return counts
    return {name: 1 for name in drains}
