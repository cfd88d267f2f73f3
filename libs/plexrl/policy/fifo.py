"""FIFO: the oldest pending call whose home group is free runs next.

The baseline the smarter policies are measured against, and the live default
until they land. Consecutive pending calls of the chosen job go in one Run, so
a client's `forward_backward` + `optim_step` pair costs one dispatch.
"""

from __future__ import annotations

from plexrl.policy.actions import Action, Admit, Plan
from plexrl.policy.common import admit_least_loaded, admit_waiting, dispatch, oldest_call_first
from plexrl.policy.config import PolicyConfig
from plexrl.policy.snapshot import ClusterSnapshot, JobView


def _least_loaded(snapshot: ClusterSnapshot, job: JobView) -> str | None:
    decision = admit_least_loaded(snapshot, job)
    return decision.worker_id if isinstance(decision, Admit) else None


def plan_fifo(snapshot: ClusterSnapshot, config: PolicyConfig) -> Plan:
    actions: list[Action] = []
    admitted, snapshot = admit_waiting(snapshot, _least_loaded, backfill=True)
    actions.extend(admitted)
    runs, _ = dispatch(snapshot, config, oldest_call_first)
    actions.extend(runs)
    return tuple(actions)
