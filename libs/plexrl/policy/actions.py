"""What a policy returns: a plan, a tuple of actions the caller carries out in order."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from plexrl.messages import Tier
from plexrl.policy.frozen import quick_init


class RejectReason(enum.StrEnum):
    """Why a job was refused at admission."""

    TOO_LARGE = "too_large"
    """No worker group has device memory (or devices) enough to ever run the job."""
    NO_WORKERS = "no_workers"
    """No healthy worker is known yet; the caller should retry later, not fail."""
    NO_BASE_MODEL = "no_base_model"
    """No worker group serves the job's base model."""


@quick_init
@dataclass(frozen=True)
class Admit:
    """Give a new job its home worker group."""

    job_id: str
    worker_id: str


@quick_init
@dataclass(frozen=True)
class Rehome:
    """Review a job's home once it has figures of its own (`plexrl.policy.rehome`):
    move it to `to_worker`, or keep it where it is when that is `from_worker`. Either
    way its review is done, unless `waits`; a moved job's state is restored at its new
    home from the disk tier (its snapshot and logged calls)."""

    job_id: str
    from_worker: str
    to_worker: str
    waits: bool = False
    """Kept where it is for now, though its group is over the budget with it: no group
    takes it yet. It stays under review, and is reviewed again at the next decision on
    every group that follows a change of homes (a group freed, a job gone)."""

    @property
    def moves(self) -> bool:
        return self.to_worker != self.from_worker


@quick_init
@dataclass(frozen=True)
class Reject:
    """Refuse a job; every pending call of it fails with the reason."""

    job_id: str
    reason: RejectReason
    detail: str


@quick_init
@dataclass(frozen=True)
class Move:
    """Move one job's state on a worker group to a tier."""

    job_id: str
    to_tier: Tier


@quick_init
@dataclass(frozen=True)
class Run:
    """Run calls of one job on its home group, after making room and onloading it."""

    worker_id: str
    job_id: str
    request_ids: tuple[str, ...]
    evict: tuple[Move, ...] = ()
    """Moves down that make room for the job, applied before its calls."""
    expected_swap_s: float = 0.0
    expected_compute_s: float = 0.0


@quick_init
@dataclass(frozen=True)
class Prefetch:
    """Bring a job's state up while the group computes for another."""

    worker_id: str
    job_id: str
    evict: tuple[Move, ...] = ()


@quick_init
@dataclass(frozen=True)
class Preempt:
    """Let the group's next Run in beside its running sample batch now (the batch pauses
    while that Run runs)."""

    worker_id: str
    job_id: str
    """The job whose sample batch yields."""
    for_job: str
    """The waiting job it yields to."""


Action = Admit | Rehome | Reject | Run | Prefetch | Preempt
Plan = tuple[Action, ...]


@dataclass(frozen=True)
class Decision:
    """What `plexrl.policy.decide` returns: the plan to carry out now, in order, and the
    groups held for a bursting job (`plexrl.policy.anticipate`)."""

    plan: Plan
    held: Mapping[str, tuple[str, float]] = field(default_factory=dict)
    """Worker id → (the job it is held for, when the hold ends; snapshot clock)."""

    @property
    def wake_at(self) -> float | None:
        """When the earliest hold ends (None: no group held): decide again then, whatever
        arrives meanwhile."""
        return min((until for _, until in self.held.values()), default=None)
