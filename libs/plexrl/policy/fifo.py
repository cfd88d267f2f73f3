"""FIFO: the oldest pending call whose home group is free runs next, tenants in turns.

The baseline the smarter policies are measured against (the live default is the
project's own, `plexrl`). Consecutive pending calls of the chosen job go in one Run, so
a client's `forward_backward` + `optim_step` pair costs one dispatch.

Across tenants a group takes turns: of the tenants with a call ready on it, the one
served longest ago (the latest end of any of its jobs' calls) goes first, and within
a tenant the oldest call. So once a group has started a dispatch, another tenant's
call waits behind at most one dispatch of each other tenant with calls ready there,
however many calls or jobs those tenants queued first. With one tenant (or jobs
without one) this is plain FIFO.
"""

from __future__ import annotations

from collections.abc import Sequence

from plexrl.policy.actions import Action, Admit, Plan
from plexrl.policy.common import admit_least_loaded, admit_waiting, dispatch
from plexrl.policy.config import PolicyConfig
from plexrl.policy.snapshot import ClusterSnapshot, JobView, WorkerView


def _least_loaded(snapshot: ClusterSnapshot, job: JobView) -> str | None:
    decision = admit_least_loaded(snapshot, job)
    return decision.worker_id if isinstance(decision, Admit) else None


def tenants_in_turn(
    snapshot: ClusterSnapshot, worker: WorkerView, jobs: list[JobView]
) -> Sequence[JobView]:
    """The tenant served longest ago first; within it, the job whose oldest call arrived
    first."""
    served = last_served(snapshot)

    def key(job: JobView) -> tuple[float, float, str]:
        first = snapshot.calls_view(job.job_id)[0].arrival_time
        return (served[job.tenant], first, job.job_id)

    return sorted(jobs, key=key)


def last_served(snapshot: ClusterSnapshot) -> dict[str, float]:
    """Per tenant, the latest end of any of its jobs' calls (0: never served)."""
    served: dict[str, float] = {}
    for job in snapshot.jobs.values():
        served[job.tenant] = max(served.get(job.tenant, 0.0), job.last_active)
    return served


def plan_fifo(snapshot: ClusterSnapshot, config: PolicyConfig) -> Plan:
    actions: list[Action] = []
    admitted, snapshot = admit_waiting(snapshot, _least_loaded, backfill=True)
    actions.extend(admitted)
    runs, _ = dispatch(snapshot, config, tenants_in_turn)
    actions.extend(runs)
    return tuple(actions)
