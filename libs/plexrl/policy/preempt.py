"""Preemption of a running sample batch (the live scheduler's, plexrl policy only).

A group running a long sample batch of one job makes a neighbour's short training
call wait for all of it; shortest remaining work first says the short call should go
first. Calls are the policy's unit everywhere else, but a rollout is one call, so the
group yields inside it: the worker lets the next dispatch in now, as it would at the
batch's tail (`TailReleased` of reason PREEMPT), and pauses the batch while that
dispatch's other calls run (sample calls join the batch instead).

A batch yields when, for a job homed on its group with pending calls, the expected
seconds of those calls (plus bringing its state onto the device) are at most
`preempt_ratio` of the batch's expected remaining seconds (its group's `busy_until`),
and the batch has run at least `preempt_after_s`. The waiting job with the least such
work goes next (the dispatch then picks it by the same rule). A batch is asked once,
so the yielding job waits at most one such dispatch: at most `preempt_ratio` of its own
remaining sampling, as far as the estimates go.

A group whose in-flight Run is *sliced* training (`WorkerView.sliced`: an asynchronous
job's `forward_backward`, run in micro-batches the worker can pause between) yields at
the next slice to a job whose next call is a sample, whatever their lengths: the
sample is on its job's critical path, the training within its job's slack. That
includes the training's own job, whose next sample reads saved weights (its rollout
lane runs ahead of its training lane by up to its staleness, and without the yield
would wait out the rest of its own training call). The
simulator slices it into `Profile.fb_slices` pieces; a live worker that slices training
(`WorkerHeartbeat.slices_training`) pauses at its next micro-batch, every rank of a
group in step.
"""

from __future__ import annotations

from plexrl.messages import Function
from plexrl.policy.actions import Preempt
from plexrl.policy.anticipate import pending_s
from plexrl.policy.common import make_room, switch_s
from plexrl.policy.config import PolicyConfig
from plexrl.policy.snapshot import ClusterSnapshot, JobView, WorkerView


def preemptions(snapshot: ClusterSnapshot, config: PolicyConfig) -> tuple[Preempt, ...]:
    """The sample batches that should yield now, one per group at most."""
    if config.preempt_ratio <= 0:
        return ()
    out = []
    for worker in snapshot.workers.values():
        chosen = _yields_to(snapshot, config, worker)
        if chosen is not None and worker.running is not None:
            out.append(Preempt(worker.worker_id, worker.running, chosen.job_id))
    return tuple(out)


def _yields_to(
    snapshot: ClusterSnapshot, config: PolicyConfig, worker: WorkerView
) -> JobView | None:
    """The waiting job the group's batch should yield to, if any."""
    since = worker.preemptible_since
    if since is None or worker.running is None or not worker.healthy:
        return None
    if snapshot.now - since < config.preempt_after_s:
        return None
    remaining = worker.busy_until - snapshot.now
    if remaining <= 0:
        return None
    best: tuple[float, str] | None = None
    chosen: JobView | None = None
    for job in snapshot.homed_view(worker.worker_id):
        calls = snapshot.calls_view(job.job_id)
        if not calls:
            continue
        if worker.sliced:
            # Sliced training (an asynchronous job's: within its slack) yields to a
            # sample, which is on its job's critical path, however long it is: its own
            # job's too, whose rollout lane needs nothing of it (a sample of saved
            # weights, `PendingCall.portable`).
            if calls[0].function != Function.SAMPLE:
                continue
            if job.job_id == worker.running and not calls[0].portable:
                continue
            key = (pending_s(snapshot, job), job.job_id)
            if best is None or key < best:
                best, chosen = key, job
            continue
        if job.job_id == worker.running:
            continue
        evict = make_room(snapshot, worker.worker_id, job)
        if evict is None:
            continue
        work = pending_s(snapshot, job) + switch_s(snapshot, job, evict)
        if work > config.preempt_ratio * remaining:
            continue
        key = (work, job.job_id)
        if best is None or key < best:
            best, chosen = key, job
    return chosen
