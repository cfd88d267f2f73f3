"""Spread+Backfill: Spread's placement, but admission does not stop at a job that must
wait: later jobs that fit are admitted past it (EASY-style backfill without reservations).

The reference paper's best policy. Dispatch stays FIFO, passing over a job whose state
cannot be brought in (`common.dispatch` does that for every policy).
"""

from __future__ import annotations

from functools import partial

from plexrl.policy.actions import Action, Plan
from plexrl.policy.common import admit_waiting, dispatch, oldest_call_first
from plexrl.policy.config import PolicyConfig
from plexrl.policy.snapshot import ClusterSnapshot
from plexrl.policy.spread import least_loaded


def plan_spread_backfill(snapshot: ClusterSnapshot, config: PolicyConfig) -> Plan:
    actions: list[Action] = []
    admitted, snapshot = admit_waiting(
        snapshot, partial(least_loaded, max_load=config.max_load), backfill=True
    )
    actions.extend(admitted)
    runs, _ = dispatch(snapshot, config, oldest_call_first)
    actions.extend(runs)
    return tuple(actions)
