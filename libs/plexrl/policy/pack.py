"""Pack: fill groups one after another (first fit), strict FIFO admission, FIFO dispatch.

The reference paper's consolidating placement. It keeps as few groups in use as the
load cap allows, which is cheapest when the cluster is lightly loaded, but it stacks
new jobs onto busy groups while others sit empty, and affinity then holds them there.
"""

from __future__ import annotations

from functools import partial

from plexrl.policy.actions import Action, Plan
from plexrl.policy.common import (
    admit_waiting,
    dispatch,
    oldest_call_first,
    size_class,
    under_load_cap,
)
from plexrl.policy.config import PolicyConfig
from plexrl.policy.snapshot import ClusterSnapshot, JobView


def first_fit(snapshot: ClusterSnapshot, job: JobView, max_load: float) -> str | None:
    for worker in size_class(snapshot, job):
        if under_load_cap(snapshot, worker, job, max_load):
            return worker.worker_id
    return None


def plan_pack(snapshot: ClusterSnapshot, config: PolicyConfig) -> Plan:
    actions: list[Action] = []
    admitted, snapshot = admit_waiting(
        snapshot, partial(first_fit, max_load=config.max_load), backfill=False
    )
    actions.extend(admitted)
    runs, _ = dispatch(snapshot, config, oldest_call_first)
    actions.extend(runs)
    return tuple(actions)
