"""Roaming samples: a job's sample call that reads saved sampler weights (or the base)
runs on another group of its size when its home is busy and that group is idle.

Such a call (`PendingCall.portable`) needs nothing of the job's training state, so any
group serving the job's base model can run it: it loads the sampler weights
(`JobView.sampler_bytes`, from the disk tier where the job's save put them), decodes,
and leaves its stragglers there in the background, as at home. An asynchronous job
(one that samples its next rollout while it trains on the last) then samples away
from its home while its home trains it, or while its home trains a neighbour.

The rule (plexrl policy, `PolicyConfig.roam`): for each job whose portable calls wait
while its home group is busy (running, or given another Run in this plan), or whose
home's Run in this plan is that sample with the job's training waiting behind it (the
home then runs the training: a sample and training that wait together both start
now), oldest call first, a group of the home's size that serves its base model, runs
nothing, has no call of its own waiting, is held anyway (it holds a job, or the
pool is fixed: `pack` False), and whose jobs all said they will stay idle at least as
long as the roaming Run is expected to take (a stopped job, duty cycle 0, and an empty
group are quiet): the quietest such group. So a roaming sample never delays a job at
home on the group it borrows, as far as the idle hints go; its stragglers may still
slow a call that comes there later, which the costs of sharing price.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from plexrl.messages import Tier
from plexrl.policy.actions import Run
from plexrl.policy.common import can_ever_hold, quanta, run_of, run_quantum
from plexrl.policy.config import PolicyConfig
from plexrl.policy.snapshot import ClusterSnapshot, JobView, PendingCall, WorkerView

_INF = float("inf")


def sampler_load_s(snapshot: ClusterSnapshot, job: JobView) -> float:
    """Seconds to bring the job's sampler weights onto another group (from disk)."""
    return snapshot.swap.move_s(job.sampler_bytes, Tier.DISK, Tier.DEVICE)


def roaming_runs(
    snapshot: ClusterSnapshot, config: PolicyConfig, runs: list[Run]
) -> tuple[list[Run], list[Run]]:
    """Runs of waiting portable calls on idle groups other than their jobs' homes, and
    `runs` with each home Run of a sample that roams instead given its job's other
    calls."""
    if not config.roam:
        return [], runs
    taken = {r.worker_id for r in runs}
    started = {rid for r in runs for rid in r.request_ids}
    at_home = {r.worker_id: i for i, r in enumerate(runs)}
    idle = [
        w
        for w in snapshot.workers.values()
        if w.healthy
        and w.running is None
        and w.worker_id not in taken
        and _idle(snapshot, w, held=not config.pack)
    ]
    if not idle:
        return [], runs
    out: list[Run] = []
    for job_id in snapshot.callers():
        job = snapshot.jobs.get(job_id)
        if job is None or job.home is None:
            continue
        home = snapshot.workers.get(job.home)
        if home is None or (home.running is None and home.worker_id not in taken):
            continue  # its home can run it now
        mine = at_home.get(home.worker_id)
        swap = mine is not None and runs[mine].job_id == job_id
        if swap:
            # Its home runs its sample now, its training waiting behind it: the sample
            # may roam and the home take the training.
            waiting = list(snapshot.calls_view(job_id))
            if all(c.portable for c in waiting):
                continue
        else:
            waiting = [c for c in snapshot.calls_view(job_id) if c.request_id not in started]
        calls = _portable(waiting, config.max_calls_per_run)
        if not calls:
            continue
        expected = sum(job.estimates.expected_s(c.function) for c in calls)
        load_s = sampler_load_s(snapshot, job)
        best: tuple[float, str] | None = None
        chosen: WorkerView | None = None
        for worker in idle:
            if worker.devices != home.devices or not can_ever_hold(worker, job):
                continue
            quiet = _quiet_s(snapshot, worker.worker_id)
            if quiet < load_s + worker.costs(config.sharing).switch_s + expected:
                continue
            key = (-quiet, worker.worker_id)
            if best is None or key < best:
                best, chosen = key, worker
        if chosen is None:
            continue
        if swap and mine is not None:
            home_run = runs[mine]
            quantum = run_quantum(snapshot, home.worker_id, job, *quanta(config))
            runs = list(runs)
            runs[mine] = run_of(
                snapshot, config, home.worker_id, job, home_run.evict, quantum, others=True
            )
        idle.remove(chosen)
        out.append(
            Run(
                chosen.worker_id,
                job_id,
                tuple([c.request_id for c in calls]),
                (),
                load_s,
                expected,
            )
        )
        if not idle:
            break
    return out, runs


def with_roaming(snapshot: ClusterSnapshot, runs: list[Run]) -> ClusterSnapshot:
    """The snapshot with the roaming Runs' groups busy (their jobs' own states stay
    where they are)."""
    workers = dict(snapshot.workers)
    for run in runs:
        workers[run.worker_id] = replace(
            workers[run.worker_id],
            running=run.job_id,
            busy_until=snapshot.now + run.expected_swap_s + run.expected_compute_s,
        )
    return replace(snapshot, workers=workers)


def _quiet_s(snapshot: ClusterSnapshot, worker_id: str) -> float:
    """Seconds before a job homed on the group may want it: the nearest end of their idle
    hints; a stopped job (duty cycle 0) or an empty group never; 0 if one may call now."""
    quiet, now = _INF, snapshot.now
    for job in snapshot.homed_view(worker_id):
        if snapshot.calls_view(job.job_id):
            return 0.0
        if job.duty_cycle <= 0:
            continue
        if job.idle_until <= now:
            return 0.0
        quiet = min(quiet, job.idle_until - now)
    return quiet


def _idle(snapshot: ClusterSnapshot, worker: WorkerView, held: bool) -> bool:
    """The group is held anyway (it holds jobs, or `held`: a fixed pool's) and none of
    its jobs has a call waiting."""
    homed = snapshot.homed_view(worker.worker_id)
    if not homed and not held:
        return False
    return not any(snapshot.calls_view(j.job_id) for j in homed)


def _portable(calls: Sequence[PendingCall], most: int) -> list[PendingCall]:
    """The job's first portable calls, in order, that are consecutive among its portable
    ones (a roaming Run keeps their order; the rest of the job's calls wait at home)."""
    out: list[PendingCall] = []
    for call in calls:
        if call.portable:
            out.append(call)
            if len(out) >= most:
                break
        elif out:
            break
    return out
