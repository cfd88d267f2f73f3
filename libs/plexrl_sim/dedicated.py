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
  between the pools every step. Only the throughput-bound part of a rollout scales
  with its pool; rewards are scored beside the pools (`SplitAsync.scoring`); the
  split is searched per job; partial rollouts are an option.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from plexrl.policy.costs import MAX_TAIL_SHARE, SharingCosts
from plexrl.policy.defer import waiting_sooner
from plexrl_sim.results import DeploymentResult, GroupUsage, JobResult, Timeline
from plexrl_sim.workload import (
    TAIL_RELEASE,
    GroupSpec,
    JobFactory,
    JobSpec,
    Profile,
    SplitAsync,
    Steps,
)

DEDICATED = ("isolated", "colocated", "split-async")


def isolated_wall_s(steps: Steps, costs: SharingCosts | None = None) -> float:
    """The job's run alone on a group of its own (create included)."""
    return steps.create_s + alone_step_s(steps, costs)


def alone_reference_s(factory: JobFactory, job: JobSpec, costs: SharingCosts) -> float:
    """The slowdown reference and Isolated's run: the job's steps alone on a group of its
    own, on the engine that serves it best. A synchronous job's steps do not depend on
    where its engine releases the group; an asynchronous job alone trains beside its
    own stragglers when the group is released at the tail, which slows them: it is
    taken on whichever engine (the profile's release, or `TAIL_RELEASE`) is faster, on
    the latter its training run beside its own stragglers or waiting them out where
    that lets its next rollout start sooner (`plexrl.policy.defer.waits_for_own`, on
    its true mean figures)."""
    key = ("alone", job.index, costs)
    known = factory.memo.get(key)
    if known is not None:
        return known
    steps = factory.steps(job)
    if steps.staleness <= 0:
        found = float(steps.isolated_step_s.sum())
    else:
        released = factory.with_tail_release(TAIL_RELEASE).steps(job)
        found = min(
            alone_step_s(factory.with_tail_release(None).steps(job), costs),
            alone_step_s(released, costs),
            alone_step_s(released, costs, waits=True),
        )
    for engine in (factory, factory.with_tail_release(None)):
        engine.memo[key] = found  # the same figure whichever engine asks (costs alike)
    return found


def alone_step_s(steps: Steps, costs: SharingCosts | None = None, waits: bool = False) -> float:
    """Its steps' seconds alone on a group of its own (first sample to last step's end):
    the slowdown reference. A synchronous job's steps add up (nothing overlaps); an
    asynchronous one's (`Steps.staleness`) are played out by `_alone_async` (`waits`:
    its training waits out its own stragglers where that is sooner)."""
    if steps.staleness <= 0:
        return float(steps.isolated_step_s.sum())
    return _alone_async(steps, costs or SharingCosts(), waits)


_RUN_DONE, _TAIL_DONE, _SCORED, _LANE_FREE, _FINISH = range(5)
"""The one-job loop's events, in the simulator's order for simultaneous ones (a Run's
end, a tail's end, a rollout scored, a host-side gap's end, the last step's end)."""


def _alone_async(steps: Steps, costs: SharingCosts, waits: bool = False) -> float:
    """An asynchronous job alone on its group, event by event, by the simulator's own
    rules (`plexrl_sim.replay`, `plexrl_sim.executor`): calls run in the order they were
    sent, a sample alone, a step's training calls together; a rollout's stragglers
    decode in the background, `tail_contention` times slower and holding
    `tail_min_share` of the group while the job's own training runs beside them (with
    `contention_while: shared` a job alone pays neither); with `waits`, a training
    call waits for them instead where its next rollout starts sooner so
    (`plexrl.policy.defer.waiting_sooner`, on its mean tail, training and stall: what
    a scheduler learns of it).
    `tests/test_sim_async.py` checks it against the simulator running the job alone."""
    n, stale = steps.n, steps.staleness
    contention = costs.tail_contention if costs.contention_while == "run" else 1.0
    wait = waits and contention > 1
    share = costs.tail_share if costs.contention_while == "run" else (lambda u: u)
    fb = steps.fb_s.tolist()
    dense, tail, tail_work = steps.dense_s.tolist(), steps.tail_s.tolist(), steps.tail_work.tolist()
    reward, misc = steps.reward_s.tolist(), steps.misc_s.tolist()
    fixed = steps.optim_s + steps.save_s
    heap: list[tuple[float, int, int, int]] = []
    seq = 0

    def push(at: float, kind: int, k: int) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(heap, (at, kind, seq, k))

    queue: list[tuple[bool, int]] = []
    """Calls sent and not run, in order: (sample?, step)."""
    running: tuple[bool, int] | None = None
    tail_k, tail_left, tail_at, tail_slowed, tail_due, tail_util = -1, 0.0, 0.0, False, 0.0, 0.0
    tail_start = 0.0
    scored = saves = step = 0
    training = blocked = False
    sample_step = 0
    start = now = 0.0
    queue.append((True, 0))
    finish = math.nan

    def pace(slowed: bool) -> None:
        nonlocal tail_left, tail_at, tail_slowed, tail_due
        if tail_k < 0 or tail_slowed == slowed:
            return
        elapsed = now - tail_at
        tail_left = max(0.0, tail_left - (elapsed / contention if tail_slowed else elapsed))
        tail_at, tail_slowed = now, slowed
        tail_due = now + tail_left * (contention if slowed else 1.0)
        push(tail_due, _TAIL_DONE, tail_k)

    mean_tail = sum(tail) / n if n else 0.0
    mean_train = sum(fb) / n + fixed if n else 0.0
    mean_stall = sum(reward) / n if n else 0.0

    def waits_out() -> bool:
        """Whether the training waits for the stragglers decoding (at full speed)."""
        rest = mean_tail - (now - tail_start)
        return waiting_sooner(rest, mean_train, mean_stall, contention, share(tail_util))

    def start_run() -> None:
        nonlocal running
        if running is not None or not queue:
            return
        if wait and tail_k >= 0 and not queue[0][0] and waits_out():
            return  # started when the stragglers end
        running = queue.pop(0)
        is_sample, k = running
        work = dense[k] if is_sample else fb[k] + fixed
        end = now + work
        if tail_k >= 0:
            pace(True)
            speed = 1.0 - min(share(tail_util), MAX_TAIL_SHARE)
            if tail_due > now:
                if speed * (tail_due - now) >= work:
                    end = now + work / speed
                else:
                    end = tail_due + work - speed * (tail_due - now)
        push(end, _RUN_DONE, k)

    def issue_sample() -> None:
        queue.append((True, sample_step))

    def issue_train() -> None:
        nonlocal training
        training = True
        queue.append((False, step))

    start_run()
    while heap:
        now, kind, _, k = heapq.heappop(heap)
        if kind == _RUN_DONE:
            assert running is not None
            was_sample, _k = running
            running = None
            pace(False)
            if was_sample:
                if tail[k] > 0:
                    tail_k, tail_left, tail_at, tail_slowed = k, tail[k], now, False
                    tail_start = now
                    tail_util, tail_due = tail_work[k] / tail[k], now + tail[k]
                    push(tail_due, _TAIL_DONE, k)
                else:
                    push(now + reward[k], _SCORED, k)
            else:
                saves = k + 1
                if blocked and saves >= sample_step - stale:
                    blocked = False
                    issue_sample()
                push(now + misc[k], _FINISH if saves >= n else _LANE_FREE, k)
        elif kind == _TAIL_DONE:
            if k != tail_k or now != tail_due:
                continue  # stale: the tail changed pace since
            tail_k = -1
            push(now + reward[k], _SCORED, k)
        elif kind == _SCORED:
            scored = k + 1
            if k + 1 < n:
                sample_step = k + 1
                if saves >= k + 1 - stale:
                    issue_sample()
                else:
                    blocked = True
            if not training and step == k:
                issue_train()
        elif kind == _LANE_FREE:
            step += 1
            training = False
            if scored > step:
                issue_train()
        else:
            finish = now
        start_run()
    return finish - start


def colocated_wall_s(steps: Steps, profile: Profile) -> float:
    c = profile.colocated
    per_step = steps.isolated_step_s + steps.scalable_s * (c.rollout_slowdown - 1.0) + c.switch_s
    return steps.create_s + float(per_step.sum())


@dataclass(frozen=True)
class SplitStages:
    """Per-step stage seconds of a Split-Async pipeline at one split of the devices."""

    rollout: list[float]
    """The rollout pool's seconds per step (with the reward stall when it waits for it)."""
    scoring: list[float]
    """The reward service's seconds per step after the rollout (0 when the pool waits)."""
    train: list[float]
    """The trainer pool's seconds per step (forward_backward, optim_step, host-side gap)."""


def split_stages(steps: Steps, split: SplitAsync, rollout_share: float) -> SplitStages:
    """Stage times when `rollout_share` of the devices generate and the rest train.

    Only the throughput-bound part of a rollout (`Steps.scalable_s`: up to the point
    where 75% of its sequences are done) shrinks or grows with the pool; the latency-
    bound tail after it takes as long on any number of devices. With partial rollouts
    the pool's batch stays full, so an iteration is all throughput (its tokens at
    full-batch speed, `useful` rollout work), but no shorter than the longest response
    spread over the `staleness + 1` iterations it may span.
    """
    roll_scale = 1.0 / rollout_share
    train_scale = 1.0 / (1.0 - rollout_share)
    whole = steps.dense_s + steps.tail_s
    if split.partial_rollouts:
        throughput = (steps.dense_work + steps.tail_work) * roll_scale
        rollout = np.maximum(throughput, whole / (split.staleness + 1))
    else:
        rollout = steps.scalable_s * roll_scale + (whole - steps.scalable_s)
    if split.scoring == "rollout":
        rollout, scoring = rollout + steps.reward_s, np.zeros(steps.n)
    else:
        scoring = steps.reward_s
    train = (steps.fb_s + steps.optim_s) * train_scale + steps.misc_s
    return SplitStages(rollout.tolist(), scoring.tolist(), train.tolist())


def pipeline_s(stages: SplitStages, split: SplitAsync) -> float:
    """The pipeline's run time, step by step: rollout k starts when the pool is free and
    the weights of step k - 1 - staleness have reached it; training k starts when batch
    k is scored and the trainer has sent its previous weights."""
    s = split.staleness
    roll_end = 0.0
    train_end: list[float] = []
    for k, (roll, score, train) in enumerate(
        zip(stages.rollout, stages.scoring, stages.train, strict=True)
    ):
        ready = k - 1 - s
        weights = train_end[ready] + split.sync_s if ready >= 0 else 0.0
        roll_end = max(roll_end, weights) + roll
        prev = train_end[-1] + split.sync_s if train_end else 0.0
        train_end.append(max(roll_end + score, prev) + train)
    return (train_end[-1] + split.sync_s) if train_end else 0.0


def rollout_shares(devices: int) -> list[float]:
    """The splits searched: every whole number of rollout devices (a one-device job
    is split in twentieths of its device)."""
    if devices >= 2:
        return [k / devices for k in range(1, devices)]
    return [k / 20 for k in range(1, 20)]


def best_rollout_share(steps: Steps, profile: Profile) -> float:
    """The split that minimises this job's Split-Async run time.

    Every split is ranked by the pipeline's steady-state bound (the slower pool, or the
    dependency chain rollout -> scoring -> training -> sync spread over `staleness + 1`
    steps); from the best by that bound, splits are run step by step, moving one device
    at a time in the direction that shortens the run, until neither neighbour does
    (per-step variance makes the exact optimum differ from the bound's by a few devices).
    """
    split = profile.split
    if split.rollout_fraction is not None:
        d = profile.devices
        return max(1, round(split.rollout_fraction * d)) / d if d >= 2 else split.rollout_fraction
    shares = np.array(rollout_shares(profile.devices))
    scalable, whole = float(steps.scalable_s.mean()), float((steps.dense_s + steps.tail_s).mean())
    work = float((steps.dense_work + steps.tail_work).mean())
    reward, misc = float(steps.reward_s.mean()), float(steps.misc_s.mean())
    fb = float((steps.fb_s + steps.optim_s).mean())
    if split.partial_rollouts:
        roll = np.maximum(work / shares, whole / (split.staleness + 1))
    else:
        roll = scalable / shares + (whole - scalable)
    score = 0.0
    if split.scoring == "rollout":
        roll = roll + reward
    else:
        score = reward
    train = fb / (1.0 - shares) + misc + split.sync_s
    chain = (roll + score + train) / (split.staleness + 1)
    bound = np.maximum(np.maximum(roll, train), chain)
    walls: dict[int, float] = {}

    def wall(i: int) -> float:
        if i not in walls:
            stages = split_stages(steps, split, float(shares[i]))
            walls[i] = pipeline_s(stages, split)
        return walls[i]

    best = int(np.argmin(bound))
    for step in (1, -1):
        while 0 <= best + step < len(shares) and wall(best + step) < wall(best):
            best += step
    return float(shares[best])


def split_async_wall_s(steps: Steps, profile: Profile, rollout_share: float | None = None) -> float:
    """The disaggregated pipeline's run time at `rollout_share` (default: the best)."""
    share = rollout_share if rollout_share is not None else best_rollout_share(steps, profile)
    stages = split_stages(steps, profile.split, share)
    return steps.create_s + pipeline_s(stages, profile.split)


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
    costs = factory.workload.cluster.colocation.costs()
    for i, job in enumerate(sorted(jobs, key=lambda j: (j.arrival_s, j.index))):
        profile = profiles[job.profile]
        steps = factory.steps(job)
        alone = alone_reference_s(factory, job, costs)
        if name == "isolated":
            wall = steps.create_s + alone
        elif name == "colocated":
            wall = colocated_wall_s(steps, profile)
        else:
            share = best_rollout_share(steps, profile)
            wall = split_async_wall_s(steps, profile, share)
        useful = float(steps.useful_work.sum()) * profile.devices
        result = JobResult(
            job_id=job.job_id,
            profile=job.profile,
            devices=profile.devices,
            steps=job.steps,
            arrival_s=job.arrival_s,
            isolated_step_time_s=alone,
            useful_device_s=useful,
        )
        if name == "split-async":
            result.rollout_share = share
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
