"""Re-homing (plexrl policy, `PolicyConfig.rehome`): a job placed on its kind's figures
is placed again, once, when it has figures of its own; and a job whose last neighbour
left its group is placed again then (`PolicyConfig.rehome_lone`), so that two groups
each left with one job become one shared group and a free one.

Admission homes a newcomer by its kind's mean duty cycle, guarded by its kind's busiest
tenth (`JobView.duty_bound`): a mean says little of one job, so a newcomer is placed
on what it may turn out to be. Once the job has a history of its own (`JobView.review`),
the policy asks where it would home it now, everyone else staying where they are:

- sharing a group its own figures put over the budget (mean, or anyone above twice
  it): packing, the fullest group where everyone stays within, else an empty group;
  where neither exists it stays, under review, until one does;
- alone on a group (the guard kept it off the shared ones, or its last neighbour left:
  `PolicyConfig.rehome_lone`, or, asked every review interval, another job alone could
  take it: `PolicyConfig.review_alone`, `plexrl_policy.lone_pairs`): packing, a group
  holding one job where both stay within (the fullest), so its own group is freed (for
  a waiting job, which the newcomer guard may keep off the group this one joins, or
  released). Only a job alone: the prediction is checked against forced pairs, and is
  optimistic for a third job, whose neighbours meet each other;
- in a fixed pool (`pack` False): the group where the jobs' summed predicted slowdown
  grows least with it, when that is less than where it is by `rehome_gain`.

Every review is answered with a `Rehome` (to its own home where it stays) and the
caller clears the job's `review`, so a job is moved once per review (a newcomer's, and
each time it is left alone); but a job over the budget where it is, for which no
group is within it nor empty, stays for now (`Rehome.waits`) and is reviewed again
whenever homes change, until a group takes it or its own comes within the budget (a
neighbour gone): otherwise a busy pair placed on their kind's figures would share for
the rest of their runs once the cluster is full.
A move costs the job's state brought onto the new home from the disk tier, where its
snapshot and logged calls are (the path a lost worker's jobs take): the new home
restores it; the old one drops its copy. Only a job between calls moves: not while its
Run, a paused or co-sampled batch of it or its stragglers hold its state on the group
(`pinned`); it is reviewed again in a later plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

from plexrl.messages import Tier
from plexrl.policy.actions import Rehome
from plexrl.policy.common import fits_memory, size_class
from plexrl.policy.config import PolicyConfig
from plexrl.policy.snapshot import ClusterSnapshot, JobView


class Fit(Protocol):
    """The interference model's answers about a job not homed in the snapshot
    (`plexrl_policy.InterferenceFit`)."""

    def __call__(self, snapshot: ClusterSnapshot, job: JobView) -> str | None: ...

    def keeps_within(self, snapshot: ClusterSnapshot, worker_id: str, job: JobView) -> bool: ...

    def added_slowdown(self, snapshot: ClusterSnapshot, worker_id: str, job: JobView) -> float: ...

    def shared_within(self, snapshot: ClusterSnapshot, job: JobView) -> str | None: ...


def due(snapshot: ClusterSnapshot) -> bool:
    """Whether any job's home is due for review."""
    return any(j.review for j in snapshot.jobs.values())


def rehomes(
    snapshot: ClusterSnapshot, config: PolicyConfig, fit: Callable[[], Fit]
) -> tuple[list[Rehome], ClusterSnapshot]:
    """A `Rehome` for each job due for review and between calls, and the snapshot with
    the moved jobs on their new homes (their state on the disk tier there). `fit` makes
    a fresh interference model (one per review: each sees the homes as they are)."""
    actions: list[Rehome] = []
    reviewed = sorted((j for j in snapshot.jobs.values() if j.review), key=lambda j: j.job_id)
    for job in reviewed:
        home = job.home
        worker = snapshot.workers.get(home) if home is not None else None
        if home is None or worker is None or worker.running == job.job_id or job.pinned:
            continue  # not homed (it is admitted as a newcomer) or not between calls
        alone = replace(job, home=None, review=False)
        jobs = dict(snapshot.jobs)
        jobs[job.job_id] = alone
        without = replace(snapshot, jobs=jobs)
        to, settled = _target(without, alone, home, config, fit())
        to = to or home
        actions.append(Rehome(job.job_id, home, to, waits=not settled))
        jobs[job.job_id] = replace(alone, home=to, tier=Tier.DISK if to != home else job.tier)
        snapshot = replace(snapshot, jobs=jobs)
    return actions, snapshot


def _target(
    without: ClusterSnapshot, job: JobView, home: str, config: PolicyConfig, fit: Fit
) -> tuple[str | None, bool]:
    """Where `job` (not homed in `without`) should live instead of `home` (None: stay),
    and whether that settles its review (not where it stays over the budget only for
    want of a group to take it)."""
    if config.pack:
        if not without.homed_view(home):
            return fit.shared_within(without, job), True
        if fit.keeps_within(without, home, job):
            return None, True
        to = fit(without, job)
        return to, to is not None
    here = fit.added_slowdown(without, home, job)
    best: tuple[float, str] | None = None
    for worker in size_class(without, job):
        wid = worker.worker_id
        if wid == home or not fits_memory(without, worker, job):
            continue
        added = fit.added_slowdown(without, wid, job)
        if best is None or (added, wid) < best:
            best = (added, wid)
    if best is not None and best[0] < here - config.rehome_gain:
        return best[1], True
    return None, True
