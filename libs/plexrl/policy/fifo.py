"""FIFO: the oldest pending call whose home group is free runs next.

The baseline the smarter policies are measured against, and the live default
until they land. Consecutive pending calls of the chosen job go in one Run, so
a client's `forward_backward` + `optim_step` pair costs one dispatch.
"""

from __future__ import annotations

from plexrl.policy.actions import Action, Admit, Plan, Run
from plexrl.policy.common import (
    admit_least_loaded,
    apply_moves,
    make_room,
    switch_s,
    with_home,
)
from plexrl.policy.config import PolicyConfig
from plexrl.policy.snapshot import ClusterSnapshot


def plan_fifo(snapshot: ClusterSnapshot, config: PolicyConfig) -> Plan:
    actions: list[Action] = []
    rejected: set[str] = set()
    for call in snapshot.pending:
        job = snapshot.jobs[call.job_id]
        if job.home is None and job.job_id not in rejected:
            decision = admit_least_loaded(snapshot, job)
            actions.append(decision)
            if isinstance(decision, Admit):
                snapshot = with_home(snapshot, job.job_id, decision.worker_id)
            else:
                rejected.add(job.job_id)

    started: set[str] = set()
    for call in snapshot.pending:
        job = snapshot.jobs[call.job_id]
        worker = snapshot.workers.get(job.home or "")
        if worker is None or not worker.healthy or worker.running is not None:
            continue
        if job.job_id in started:
            continue
        evict = make_room(snapshot, worker.worker_id, job)
        if evict is None:
            continue
        batch = tuple(c.request_id for c in snapshot.pending if c.job_id == job.job_id)[
            : config.max_calls_per_run
        ]
        swap_s = switch_s(snapshot, job, evict)
        compute_s = sum(
            job.estimates.expected_s(c.function) for c in snapshot.pending if c.request_id in batch
        )
        actions.append(Run(worker.worker_id, job.job_id, batch, evict, swap_s, compute_s))
        started.add(job.job_id)
        snapshot = apply_moves(snapshot, job.job_id, worker.worker_id, evict, now_running=True)
    return tuple(actions)
