"""Policy tunables: one small dataclass, passed to the policy and nothing else."""

from __future__ import annotations

from dataclasses import dataclass, field

from plexrl.policy.costs import SharingCosts


@dataclass(frozen=True)
class PolicyConfig:
    name: str = "fifo"
    """Which policy `plan` runs; one of `plexrl.policy.POLICIES`."""
    max_calls_per_run: int = 8
    """Most consecutive calls of one job sent in one Run (one dispatch)."""
    max_load: float = 1.0
    """Admission cap of the load-aware policies (pack, spread, spread-backfill): the sum
    of the duty cycles of the jobs homed on one group may not exceed it. 1.0 plans a
    group to be at most fully busy; a job whose own duty cycle exceeds it still gets an
    empty group."""
    slowdown_budget: float = 0.05
    """The plexrl policy admits a job onto a shared group only while the mean predicted
    step-time slowdown of the jobs stays within this fraction (of every homed job's,
    `budget_over_cluster`, or of the group's), and no job's exceeds `slowdown_guard` times
    it."""
    budget_over_cluster: bool = True
    """Packing (`pack`), the plexrl policy checks `slowdown_budget` against the mean
    predicted slowdown of every homed job (those alone at 0) with the new one added,
    rather than of the group it joins; no job's may exceed `slowdown_guard` times it
    either way. The target is a mean over the jobs: held per group, each group stays
    within it and the cluster's mean falls short of it. False: per group."""
    slowdown_guard: float = 2.0
    """No job's predicted slowdown may exceed this multiple of `slowdown_budget` where
    the plexrl policy admits or keeps a job beside others: the budget is a mean, the
    guard keeps it fair (and the tail of the slowdowns short)."""
    pack: bool = True
    """How the plexrl policy places a new job. True: on the *fullest* group where every
    job stays within `slowdown_budget`, else an empty group, else it waits, so whole
    groups stay free for later jobs (a cluster whose idle groups cost nothing, as the
    simulator's occupied cost counts them). False, for a fixed pool whose groups are
    held whether they run anything or not (the live scheduler's default): on the group
    where the jobs' predicted mean slowdown after adding it is least, never waiting
    while a group can hold its state; packing there would only lengthen the makespan."""
    least_added: bool = False
    """Packing (`pack`), which group holding jobs takes a newcomer the plexrl policy
    shares: True, the one where it adds least to the jobs' summed predicted slowdown,
    its own included; False, the fullest where everyone stays within budget. (Measured
    alike on the fitted trace, less saved on the unfitted one: docs/simulator.md.)"""
    longest_first: bool = True
    """The plexrl policy's admission order: among the jobs waiting for a group, the most
    declared work first (`JobView.declared_steps` times its step's expected seconds), so
    a backlog drains with its long jobs started early instead of last (the makespan);
    the shorter jobs wait longer for admission. Jobs that declared nothing follow, in
    arrival order; backfill admits any that fit past those that must wait. False: arrival
    order."""
    bound_newcomers: bool = True
    """Packing (`pack`), the plexrl policy admits a job that has no history of its own
    (described by its kind's mean duty cycle) onto a shared group only if everyone there
    also stays within twice the budget were it as busy as its kind's busiest tenth
    (`JobView.duty_bound`). False: the kind's mean alone decides."""
    switch_weight: float = 1.0
    """How strongly the plexrl policy's dispatch discounts a job by the seconds needed
    to bring its state onto the device (0: ignore switch cost)."""
    prefetch: bool = True
    """Whether the plexrl policy prefetches the state of the job most likely next."""
    quantum_s: float = 10.0
    """On a group shared by several jobs, the plexrl policy sends a job's consecutive
    calls in one Run only up to about this many expected seconds (at least one call), so
    the group is decided again at the next call boundary after it: a job with less
    remaining work cuts in after at most about one quantum (or one call) of another."""

    hold_s: float = 0.1
    """Anticipation (`plexrl.policy.anticipate`, plexrl policy only): a free group whose
    last job is in a burst of calls (its last gap between calls was at most this) is held
    for that job's next call for up to twice its last gap (and at most this), instead of
    going to another job for one call. 0 turns it off. The live scheduler's default
    (`PLEXRL_HOLD_S`); the simulator holds its groups by the same rule."""

    fair_share: bool = True
    """Tenants' share of each group (`plexrl.policy.share`, plexrl policy only; it acts
    only where jobs of several tenants are homed). Placement keeps a tenant's jobs off
    groups where other tenants' jobs are homed while a group with less of other
    tenants' load can hold them; dispatch serves first the tenant that used the group's
    engine least recently-weighted (within one turn per tenant), and a Run there holds
    at most about `tenant_quantum_s` of calls. False: tenant-blind placement and tenants
    in plain turns (the served-longest-ago first of `fifo`)."""
    tenant_quantum_s: float = 0.25
    """With `fair_share`, on a group where another tenant's job is homed and active, a Run
    stops after about this many expected seconds of calls (at least one call), so that
    tenant's next call waits behind at most about one call of this one (or this long)."""

    max_cosampled_calls: int = 32
    """Co-sampling (`plexrl.policy.cosample`): a Run of sample calls takes other jobs'
    pending sample calls on its group along, up to this many calls in all, decoded in one
    batch; 0 turns it off. The simulator decodes such a Run as one batch too."""

    preempt_ratio: float = 0.5
    """Preemption (`plexrl.policy.preempt`, plexrl policy only): a
    group's running sample batch yields to a waiting job of the group whose pending calls
    are expected to take at most this fraction of the batch's expected remaining seconds
    (the yielding job waits that long at most, once per batch). 0 turns it off. The
    simulator pauses the batch for the Run that preempts it, as the worker does."""
    preempt_after_s: float = 0.05
    """A batch is never preempted before it has run this long (its own prompts and first
    steps go first, and a batch about to be released anyway is not asked twice)."""

    roam: bool = True
    """The plexrl policy's roaming samples (`plexrl.policy.roam`): a job's sample call on
    saved sampler weights, waiting while its home group is busy, runs on an idle group of
    the same size whose jobs all expect to stay idle that long. False: every call on its
    home group."""
    rehome: bool = True
    """The plexrl policy's re-homing (`plexrl.policy.rehome`): a job placed on its
    kind's figures is placed again, once, when it has figures of its own, and moves
    where that pays (its state is restored at the new home from the disk tier). False:
    a job keeps its first home for its whole run (unless its worker is lost)."""
    rehome_lone: bool = True
    """With `rehome`, a job left alone on its group (its last neighbour gone) has its
    home reviewed again: packing, it joins a job alone on another group where both
    stay within budget, and its own group is freed. False: only a newcomer's home is
    reviewed."""
    review_alone: bool = True
    """With `rehome_lone`, every review interval (`review_histories`) a job alone on
    its group that another job alone could take within budget, on the figures the two
    have now, is reviewed again (`plexrl_policy.lone_pairs`): a pair refused when one of
    them was left alone may fit on what they learned since. False: a job alone is
    reviewed only when it is left alone."""
    review_histories: float = 8.0
    """A newcomer's home is reviewed once it has this many times the history the
    scheduler needs before it judges a job by its own figures (`min_history_s`): a
    duty cycle learned from a few steps is noisy, and the jobs whose early steps
    looked idle enough to join a group turn out busier."""
    rehome_gain: float = 0.02
    """In a fixed pool (`pack` False), a reviewed job moves only where the jobs' summed
    predicted slowdown drops by more than this (0.02: two points of one job's step)."""
    sharing: SharingCosts = field(default_factory=SharingCosts)
    """What sharing a group costs beyond swaps (engine switches, stragglers' memory and
    contention): the plexrl policy's interference model predicts with these; the
    simulator sets them to the workload's, which its executor charges."""

    def __post_init__(self) -> None:
        if not 0 <= self.preempt_ratio <= 1:
            raise ValueError(
                f"preempt_ratio is {self.preempt_ratio}; use 0 (off) up to 1 (0.5: a job "
                "yields only to calls at most half its remaining sampling)"
            )
        if self.preempt_after_s < 0:
            raise ValueError(f"preempt_after_s is {self.preempt_after_s}; it must be 0 or more")
        if self.max_cosampled_calls < 0:
            raise ValueError(
                f"max_cosampled_calls is {self.max_cosampled_calls}; use 0 (off) or more"
            )
        if self.max_calls_per_run < 1:
            raise ValueError(
                f"max_calls_per_run is {self.max_calls_per_run}; it must be at least 1"
            )
        if self.max_load <= 0:
            raise ValueError(
                f"max_load is {self.max_load}; it must be positive (1.0 = a fully busy group)"
            )
        if self.slowdown_budget < 0:
            raise ValueError(
                f"slowdown_budget is {self.slowdown_budget}; it must be 0 or more (0.05 = 5%)"
            )
        if self.review_histories < 1:
            raise ValueError(
                f"review_histories is {self.review_histories}; it must be at least 1 "
                "(a home is reviewed on the job's own figures)"
            )
        if self.rehome_gain < 0:
            raise ValueError(f"rehome_gain is {self.rehome_gain}; it must be 0 or more")
        if self.hold_s < 0:
            raise ValueError(f"hold_s is {self.hold_s}; it must be 0 (off) or more (seconds)")
        if self.tenant_quantum_s <= 0:
            raise ValueError(
                f"tenant_quantum_s is {self.tenant_quantum_s}; it must be positive (seconds; "
                "0.25: a Run beside another tenant holds about one long call)"
            )
        if self.quantum_s <= 0:
            raise ValueError(f"quantum_s is {self.quantum_s}; it must be positive (seconds)")
        if self.switch_weight < 0:
            raise ValueError(f"switch_weight is {self.switch_weight}; it must be 0 or more")
