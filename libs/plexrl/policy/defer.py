"""Asynchronous jobs' training waits out a rollout's stragglers.

A rollout released at its tail (`TailReleased`) decodes its stragglers in the
background; a Run beside them slows them (`plexrl.policy.costs`: `tail_contention`) and
runs slower itself (they hold `tail_min_share` of the group). The stragglers are on
their job's critical path: its next step waits for them. An asynchronous job's training
(`JobView.staleness` >= 1) is not: it trains on one rollout while it samples the next,
so its training calls may wait about a step less their own length before its rollouts
wait for them (`SLACK_CYCLES`: one step whatever the staleness).

So while stragglers decode on a group (`WorkerView.tail_until`), the plexrl policy
passes over a job whose next calls are training calls of an asynchronous loop, as
long as the time its call has waited and the stragglers' expected rest fit within that
job's slack; the group's
other work (samples, a synchronous job's training) runs as usual. When the stragglers
end, the worker's answer wakes the group and the training runs at full speed beside
nothing. A job with a sample waiting, or with a slack shorter than the stragglers'
remaining time, is never passed over; nor is anything when no straggler decodes.

Its own stragglers are another matter: beside them its training lengthens its own
rollout, which its next rollout waits for (scored `stall_s` after the stragglers end),
while waiting delays only what its stall does not hide. A job's training waits out its
own stragglers, whatever its slack, where that lets its next rollout start sooner
(`waits_for_own`): before it, a job of the calibrated profiles alone on its group at
the profile's stalls ran slower than keeping the group through its tail, 3.3-3.6% (7B,
235B) at the default contention (1.25) and 9.7-19.3% (all three) at 2
(`bench/sim_interference.py --jobs 1`); without contention running beside them is free.
"""

from __future__ import annotations

from collections.abc import Sequence

from plexrl.messages import Function
from plexrl.policy.costs import MAX_TAIL_SHARE, SharingCosts
from plexrl.policy.snapshot import ClusterSnapshot, JobView, WorkerView

_SAMPLE = Function.SAMPLE
_STEP = (Function.SAMPLE, Function.FORWARD_BACKWARD, Function.OPTIM_STEP, Function.SAVE)


SLACK_CYCLES = 1
"""Steps of slack an asynchronous job's training is given, whatever its staleness, here
and in the interference prediction (`plexrl_policy.figures_of`). A job of staleness 2
has a second step before its rollouts wait for its training; held back for stragglers
as long as both fitted, its training lane trailed by it and its rollouts waited anyway:
forced groups at staleness 2 measured a 30B triple at the trace's median stalls 21.4%
with two steps here, 15.8% with one (docs/simulator.md, "At staleness 2"). The second
step stays a margin for the training's waits behind its neighbours. Fitted there."""


def slack_s(job: JobView) -> float:
    """Seconds the job's training may wait without its rollouts waiting for it: its
    staleness in steps (at most `SLACK_CYCLES`), less one step's busy seconds (0 for a
    synchronous job or one without figures yet)."""
    if job.staleness <= 0 or job.duty_cycle <= 0:
        return 0.0
    busy = sum(job.estimates.expected_s(f) for f in job.step_calls or _STEP)
    period = busy / job.duty_cycle
    return max(0.0, min(job.staleness, SLACK_CYCLES) * period - busy)


def passed_over(
    snapshot: ClusterSnapshot, worker: WorkerView, job: JobView, pool: SharingCosts
) -> bool:
    """Whether the job's calls wait for the group's stragglers (see the module); `pool`:
    the pool's costs of sharing (the group's own where it measured them)."""
    until = worker.tail_until
    if until <= 0 or job.staleness <= 0:
        return False
    calls = snapshot.calls_view(job.job_id)
    if not calls or calls[0].function == _SAMPLE:
        return False
    rest = max(0.0, until - snapshot.now)
    if job.job_id in worker.tail_jobs and waits_for_own(job, rest, worker.costs(pool)):
        return True
    # Its call has waited since it arrived: that wait and the stragglers' rest together
    # stay within its slack, so passing it over never makes its rollouts wait.
    waited = snapshot.now - calls[0].arrival_time
    return waited + rest <= slack_s(job)


def waits_for_own(job: JobView, rest: float, costs: SharingCosts) -> bool:
    """Whether the job's training starts sooner for its next rollout after its own
    stragglers (`rest` seconds left alone) than beside them (see the module)."""
    if costs.contention_while != "run":
        return False  # (scoped `shared`, a tail's pace is not its own job's doing)
    train = sum(job.estimates.expected_s(f) for f in job.step_calls or _STEP if f != _SAMPLE)
    return waiting_sooner(rest, train, job.stall_s, costs.tail_contention, costs.tail_min_share)


def waiting_sooner(rest: float, train: float, stall: float, c: float, share: float) -> bool:
    """Whether an asynchronous job may send its next rollout sooner with its training
    (`train` seconds alone) run after its own stragglers (`rest` seconds alone) than
    beside them (`beside_own_s`)."""
    if c <= 1 or rest <= 0:
        return False
    return rest + max(stall, train) <= beside_own_s(rest, train, stall, c, share)


def beside_own_s(rest: float, train: float, stall: float, c: float, share: float) -> float:
    """Seconds from now until an asynchronous job may send its next rollout, its
    training (`train` seconds alone) run at once beside its own stragglers (`rest`
    seconds alone, decoding `c` times slower beside it and holding `share` of the group):
    the later of its rollout scored (`stall` seconds after its stragglers end) and its
    training's end."""
    speed = 1.0 - min(share, MAX_TAIL_SHARE)
    if train / speed < c * rest:  # the training ends first; the stragglers then speed up
        trained = train / speed
        return max(rest + trained * (1.0 - 1.0 / c) + stall, trained)
    return max(c * rest + stall, train + share * c * rest)


def not_passed_over(
    snapshot: ClusterSnapshot, worker: WorkerView, jobs: Sequence[JobView], pool: SharingCosts
) -> list[JobView]:
    """`jobs` but those whose training waits out the group's stragglers."""
    if worker.tail_until <= 0:
        return list(jobs)
    return [j for j in jobs if not passed_over(snapshot, worker, j, pool)]
