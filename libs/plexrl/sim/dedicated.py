"""Deployments where every job owns its pool for its whole run: Isolated, Colocated and
Split-Async. Nothing is shared, so each job's run time follows from its own steps, and
the cluster is a queue of jobs waiting for a free pool of their size.

- Isolated: the job alone on a group, executed exactly as on a shared group (the same
  calls, the same order) with nobody else there: the slowdown reference.
- Colocated: rollout and training on the same devices, one after the other; rollout
  runs at training's data-parallel width (slower dense part) and every step pays the
  switch between trainer and rollout engine.
- Split-Async: a rollout pool and a trainer pool; rollouts may use weights
  `staleness` steps old, so generation overlaps training; new weights are broadcast
  between the pools every step.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

import numpy as np

from plexrl.sim.results import DeploymentResult, GroupUsage, JobResult, Timeline
from plexrl.sim.workload import GroupSpec, JobFactory, JobSpec, Profile, Steps

DEDICATED = ("isolated", "colocated", "split-async")


def isolated_wall_s(steps: Steps) -> float:
    return steps.create_s + float(steps.isolated_step_s.sum())


def colocated_wall_s(steps: Steps, profile: Profile) -> float:
    c = profile.colocated
    per_step = steps.isolated_step_s + steps.scalable_s * (c.rollout_slowdown - 1.0) + c.switch_s
    return steps.create_s + float(per_step.sum())


def split_async_wall_s(steps: Steps, profile: Profile) -> float:
    """The disaggregated pipeline's run time (steady-state recurrence over the steps)."""
    s = profile.split
    d = profile.devices
    d_roll = max(1, round(s.rollout_fraction * d))
    d_train = max(1, d - d_roll)
    rollout = (steps.dense_s * (d / d_roll) + steps.tail_s + steps.reward_s).tolist()
    train = ((steps.fb_s + steps.optim_s) * (d / d_train) + steps.misc_s).tolist()
    roll_end = 0.0
    train_end: list[float] = []
    for k in range(steps.n):
        ready = k - 1 - s.staleness
        weights = train_end[ready] + s.sync_s if ready >= 0 else 0.0
        roll_end = max(roll_end, weights) + rollout[k]
        prev = train_end[-1] + s.sync_s if train_end else 0.0
        train_end.append(max(roll_end, prev) + train[k])
    return steps.create_s + (train_end[-1] if train_end else 0.0) + s.sync_s


def simulate_dedicated(
    name: str,
    factory: JobFactory,
    jobs: list[JobSpec],
    groups: list[GroupSpec],
    gpus: int,
    progress: Callable[[float], None] | None = None,
) -> DeploymentResult:
    """Run every job on its own pool; pools of a size are handed out first come first served."""
    if name not in DEDICATED:
        raise ValueError(f"unknown dedicated deployment {name!r}; choose one of {DEDICATED}")
    profiles = factory.workload.profiles
    free: dict[int, list[tuple[float, str]]] = {}
    for g in groups:
        free.setdefault(g.devices, []).append((0.0, g.group_id))
    for heap in free.values():
        heapq.heapify(heap)
    sizes = sorted(free)
    usage = {g.group_id: GroupUsage(g.group_id, g.devices) for g in groups}
    timeline = Timeline()
    results: list[JobResult] = []
    for i, job in enumerate(sorted(jobs, key=lambda j: (j.arrival_s, j.index))):
        profile = profiles[job.profile]
        steps = factory.steps(job)
        if name == "isolated":
            wall = isolated_wall_s(steps)
        elif name == "colocated":
            wall = colocated_wall_s(steps, profile)
        else:
            wall = split_async_wall_s(steps, profile)
        useful = float(steps.useful_work.sum()) * profile.devices
        result = JobResult(
            job_id=job.job_id,
            profile=job.profile,
            devices=profile.devices,
            steps=job.steps,
            arrival_s=job.arrival_s,
            isolated_step_time_s=float(steps.isolated_step_s.sum()),
            useful_device_s=useful,
        )
        results.append(result)
        size = next((s for s in sizes if s >= profile.devices), None)
        if size is None:
            result.rejected = (
                f"needs {profile.devices} devices; the largest pool has {sizes[-1] if sizes else 0}"
            )
            continue
        free_at, group_id = heapq.heappop(free[size])
        start = max(free_at, job.arrival_s)
        result.start_s = start
        result.finish_s = start + wall
        result.step_time_s = wall - steps.create_s
        result.group = group_id
        # A pool is held (and paid for) for the job's whole run, busy or not.
        result.used_device_s = result.occupied_gpu_s = size * wall
        result.compute_s = wall
        usage[group_id].held_s += wall
        usage[group_id].used_device_s += size * wall
        usage[group_id].peak_jobs = 1
        timeline.add("allocated", start, start + wall, size * wall)
        timeline.add("busy", start, start + wall, useful)
        heapq.heappush(free[size], (start + wall, group_id))
        if progress is not None:
            progress((i + 1) / len(jobs))
    return DeploymentResult(
        name=name,
        kind="dedicated",
        gpus=gpus,
        jobs=results,
        timeline=timeline,
        groups=list(usage.values()),
    )


def bubble_ratio(steps: Steps, profile: Profile, layout: str) -> float:
    """Idle fraction of a job's pool in a dedicated layout."""
    walls = {
        "isolated": isolated_wall_s,
        "colocated": lambda s: colocated_wall_s(s, profile),
        "split-async": lambda s: split_async_wall_s(s, profile),
    }
    wall = walls[layout](steps)
    return 1.0 - float(np.sum(steps.useful_work)) / wall if wall > 0 else 0.0
