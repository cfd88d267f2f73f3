"""The scheduling policy: pure functions from a ClusterSnapshot to a Plan.

The live scheduler and the simulator both call `decide`: the policy's `plan`, with
anticipation, co-sampling and preemption. Nothing here does I/O, reads a clock or keeps
state between calls.
"""

from __future__ import annotations

from collections.abc import Callable

from plexrl.policy.actions import (
    Action,
    Admit,
    Decision,
    Move,
    Plan,
    Preempt,
    Prefetch,
    Rehome,
    Reject,
    RejectReason,
    Run,
)
from plexrl.policy.anticipate import held_groups, without
from plexrl.policy.backfill import plan_spread_backfill
from plexrl.policy.config import PolicyConfig
from plexrl.policy.cosample import co_sample
from plexrl.policy.fifo import plan_fifo
from plexrl.policy.follow import follow_up
from plexrl.policy.pack import plan_pack
from plexrl.policy.plexrl_policy import lone_pairs, plan_plexrl, reviews_alone
from plexrl.policy.preempt import preemptions
from plexrl.policy.snapshot import (
    CallEstimates,
    ClusterSnapshot,
    JobView,
    PendingCall,
    SwapCosts,
    WorkerView,
)
from plexrl.policy.spread import plan_spread

PolicyFn = Callable[[ClusterSnapshot, PolicyConfig], Plan]

POLICIES: dict[str, PolicyFn] = {
    "fifo": plan_fifo,
    "pack": plan_pack,
    "spread": plan_spread,
    "spread-backfill": plan_spread_backfill,
    "plexrl": plan_plexrl,
}
"""Every policy by the name `PolicyConfig.name` selects. `pack`, `spread` and
`spread-backfill` are the reference paper's; `plexrl` is this project's own."""


def plan(snapshot: ClusterSnapshot, config: PolicyConfig) -> Plan:
    """Decide what to do now. Raises ValueError naming the choices for an unknown policy."""
    try:
        policy = POLICIES[config.name]
    except KeyError:
        raise ValueError(
            f"unknown policy {config.name!r}; choose one of {sorted(POLICIES)}"
        ) from None
    return policy(snapshot, config)


def decide(snapshot: ClusterSnapshot, config: PolicyConfig) -> Decision:
    """The one decision: what the live scheduler and the simulator do now.

    The policy's plan, on the groups that are not held for a bursting job (`anticipate`;
    plexrl policy only), with co-sampling (`cosample`), and with the plexrl policy the
    running sample batches that should yield to a waiting job (`preempt`). The caller
    carries out `plan` in order and decides again by `wake_at` (a hold ends) whatever
    arrives meanwhile."""
    own = config.name == "plexrl"
    held = held_groups(snapshot, config.hold_s, config.quantum_s, config.fair_share) if own else {}
    view = without(snapshot, held)
    decided = co_sample(view, plan(view, config), config.max_cosampled_calls)
    if own:
        decided += preemptions(view, config)
    return Decision(decided, held)


__all__ = [
    "POLICIES",
    "Action",
    "Admit",
    "CallEstimates",
    "ClusterSnapshot",
    "Decision",
    "JobView",
    "Move",
    "PendingCall",
    "Plan",
    "PolicyConfig",
    "Preempt",
    "Prefetch",
    "Rehome",
    "Reject",
    "RejectReason",
    "Run",
    "SwapCosts",
    "WorkerView",
    "co_sample",
    "decide",
    "follow_up",
    "lone_pairs",
    "plan",
    "preemptions",
    "reviews_alone",
]
