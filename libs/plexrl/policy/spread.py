"""Spread: home each job on the least-loaded group; strict FIFO admission, FIFO dispatch.

The reference paper's balancing placement: jobs share a group only once every group
of their size class has load on it, so contention is even across groups.
"""

from __future__ import annotations

from functools import partial

from plexrl.policy.actions import Action, Plan
from plexrl.policy.common import (
    admit_waiting,
    dispatch,
    load,
    oldest_call_first,
    size_class,
    under_load_cap,
)
from plexrl.policy.config import PolicyConfig
from plexrl.policy.snapshot import ClusterSnapshot, JobView


def least_loaded(snapshot: ClusterSnapshot, job: JobView, max_load: float) -> str | None:
    fits = [w for w in size_class(snapshot, job) if under_load_cap(snapshot, w, job, max_load)]
    if not fits:
        return None
    best = min(
        fits,
        key=lambda w: (
            load(snapshot, w.worker_id),
            len(snapshot.homed(w.worker_id)),
            w.worker_id,
        ),
    )
    return best.worker_id


def plan_spread(snapshot: ClusterSnapshot, config: PolicyConfig) -> Plan:
    actions: list[Action] = []
    admitted, snapshot = admit_waiting(
        snapshot, partial(least_loaded, max_load=config.max_load), backfill=False
    )
    actions.extend(admitted)
    runs, _ = dispatch(snapshot, config, oldest_call_first)
    actions.extend(runs)
    return tuple(actions)
