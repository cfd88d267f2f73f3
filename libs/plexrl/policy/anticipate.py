"""Anticipation: hold a free group for the job that is in a burst of calls.

A job in a dense phase (supervised steps, a loop of short training calls) sends its next
call a client round trip after the last one ended. Work-conserving dispatch gives the
group to another job's pending call in that gap, so two such jobs on one group alternate
call by call: both finish their bursts late (processor sharing), and on a group that
cannot hold both states every switch is a swap. Holding the group for the bursting job
for about one round trip lets it run its burst out first (run to completion), which for
jobs of equal bursts halves the mean delay, and saves the swaps.

The rule, per free healthy group with another job's calls ready on it: its last job (the
homed job whose call ended last) is held for when that job is on the device, has no call
queued, gave no idle hint, its last gap between calls was at most `hold_s`, and its
burst (its calls since its last longer gap) has lasted less than `quantum_s`; the hold
lasts twice that gap (at most `hold_s`) from the end of its last call. When its call
arrives it goes first (`plexrl_policy.shortest_remaining_first`). After a quantum of
burst the group moves on as usual, so no job waits on another's burst for more than
about a quantum.

Only between like bursts, though: run to completion beats alternation when the bursts
are about equal, but a neighbour whose calls are much shorter should go first (shortest
remaining work first). So the bursting job is held for, and goes first, only while its
calls are expected to take at most `BURST_TOLERANCE` times the least pending work of
the jobs waiting beside it (held for: its mean call over a step; going first: its
pending calls). Without that a job calling back to back with a long rollout in every
step kept a neighbour's 30 ms training calls out for whole quanta (`bench/preempt.py`).

Across tenants (with `PolicyConfig.fair_share`), a group is held only for a job whose
tenant the dispatch would serve first among the tenants waiting there
(`plexrl.policy.share.tenant_order`): holding it for a tenant that has had its turn
would only keep the next tenant's call out for the length of the hold.

A job whose last gap was a stall (longer than `hold_s`) is not held
for, so a group never waits on a job that is computing rewards or calling tools. Results
do not change: only the order of calls of different jobs does.
"""

from __future__ import annotations

from dataclasses import replace

from plexrl.messages import Tier
from plexrl.policy.share import several_tenants, tenant_order
from plexrl.policy.snapshot import ClusterSnapshot, JobView

BURST_TOLERANCE = 2.0
"""How much longer than the waiting work a bursting job's calls may be and still go
first: about equal bursts (within estimation noise) run to completion in turn."""


def mean_call_s(job: JobView) -> float:
    """Expected seconds of one of the job's calls, over the calls of one of its steps
    (its default estimate before any step is known)."""
    calls = job.step_calls
    if not calls:
        return job.estimates.default_s
    return sum(job.estimates.expected_s(f) for f in calls) / len(calls)


def pending_s(snapshot: ClusterSnapshot, job: JobView) -> float:
    """Expected seconds of the job's pending calls."""
    return sum(job.estimates.expected_s(c.function) for c in snapshot.calls_view(job.job_id))


def bursting_job(
    snapshot: ClusterSnapshot, worker_id: str, hold_s: float, quantum_s: float
) -> str | None:
    """The group's job in a burst, if any: the homed job whose call ended last, on the
    device, whose last gap between calls was at most `hold_s` and whose burst has lasted
    less than `quantum_s` (so another job waits at most about a quantum for it)."""
    homed = snapshot.homed_view(worker_id)
    if not homed:
        return None
    last = max(homed, key=lambda j: (j.last_active, j.job_id))
    if (
        last.tier != Tier.DEVICE
        or last.last_active <= 0
        or not 0 < last.last_gap_s <= hold_s
        or last.burst_s >= quantum_s
    ):
        return None
    return last.job_id


def held_groups(
    snapshot: ClusterSnapshot, hold_s: float, quantum_s: float, fair_share: bool = False
) -> dict[str, tuple[str, float]]:
    """Groups to hold now: worker id → (the job held for, when the hold ends)."""
    if hold_s <= 0:
        return {}
    held: dict[str, tuple[str, float]] = {}
    for worker_id, worker in snapshot.workers.items():
        if not worker.healthy or worker.running is not None:
            continue
        homed = snapshot.homed_view(worker_id)
        # (Asked on every decision: a group none of whose jobs is in a burst is passed
        # over before anything else is read.)
        if not any(0 < j.last_gap_s <= hold_s for j in homed):
            continue
        callers = [j for j in homed if snapshot.calls_view(j.job_id)]
        if not callers:
            continue
        bursting = bursting_job(snapshot, worker_id, hold_s, quantum_s)
        if bursting is None:
            continue
        least = min(pending_s(snapshot, j) for j in callers)
        job = snapshot.jobs[bursting]
        if mean_call_s(job) > BURST_TOLERANCE * least:
            continue  # the waiting work is much shorter: it goes first
        everyone = [job, *callers]
        if (
            fair_share
            and several_tenants(everyone)
            and tenant_order(snapshot, worker_id, everyone)[0] != job.tenant
        ):
            continue  # another tenant goes next anyway
        until = _hold_until(snapshot, job, hold_s)
        if until is not None:
            held[worker_id] = (bursting, until)
    return held


def _hold_until(snapshot: ClusterSnapshot, job: JobView, hold_s: float) -> float | None:
    if job.idle_until > snapshot.now or snapshot.calls_view(job.job_id):
        return None
    until = job.last_active + min(2 * job.last_gap_s, hold_s)
    return until if snapshot.now < until else None


def without(snapshot: ClusterSnapshot, held: dict[str, tuple[str, float]]) -> ClusterSnapshot:
    """The snapshot with the held groups shown busy with the job they wait for, so no
    policy dispatches there (nor evicts that job)."""
    if not held:
        return snapshot
    workers = dict(snapshot.workers)
    for worker_id, (job_id, _) in held.items():
        workers[worker_id] = replace(workers[worker_id], running=job_id)
    return replace(snapshot, workers=workers)
