"""PlexRL's own policy: interference-aware placement, backfilled admission, shortest
remaining work first at call boundaries, idle-hint-aware eviction and prefetch.

Dispatch on a shared group is preemptive at call boundaries: Runs there stop after about
`quantum_s` seconds of calls, and the group then goes to the job with the least
remaining pending work (its pending calls' expected seconds plus the seconds to bring
its state onto the device), ties to the resident job, then the oldest call. Shortest
remaining work first minimises the summed waiting of the jobs (and so, for jobs of one
size class, their mean slowdown): a job back from its reward stall with a short sample
cuts in between a neighbour's training calls instead of waiting for all of them.
Nobody starves: admission keeps each group's planned load (the sum of its jobs' duty
cycles) below 1, so a group always drains.

Placement predicts, for every job on a candidate group, the extra seconds per training
step it would wait behind its neighbours under that dispatch, and homes the new job on
the *fullest* group where the mean of those predictions stays within `slowdown_budget`
of the jobs' step times (and none exceeds `slowdown_guard` times it, twice by
default). Jobs whose busy periods rarely coincide (low duty cycles, short calls) stack
deep; jobs with long calls get fewer neighbours. When no shared group is within budget
the job takes an empty group, and when none is empty it waits while later jobs that do
fit are admitted past it.
That packing pays where an idle group costs nothing (it is released); in a fixed pool
(`PolicyConfig.pack` False) the job goes where the predicted mean slowdown after adding
it is least, and waits only while no group can hold its state.

Where jobs of several tenants are homed, `PolicyConfig.fair_share` adds the tenants'
share (`plexrl.policy.share`): placement weighs other tenants' load first, dispatch
serves the tenant that used the group least lately first (one turn each), and a Run
beside another tenant's active job stops after about `tenant_quantum_s`.

The interference model. A job's step is a sequence of *phases* (its sample, then its
training calls, which arrive together); phase x of job i meets neighbour k (step period
p_k, phases q of l_q seconds, mean remaining call c_k) in three ways:

    k is in a phase no longer than x:        (l_q / p_k) * l_q / 2    (it finishes first)
    k is in a longer phase:                  (l_q / p_k) * ((x/l_q) * x/2 + (1 - x/l_q) * c_k)
                                             (its remaining work goes first if shorter than
                                             x, else i waits for its call in progress)
    k starts a shorter phase during x:       max(x - l_q, 0) * l_q / p_k   (it cuts in)

    slow_i = (sum_x sum_k wait(x, k) / (1 - sum_k duty_k / 2) + sum_k cost(i, k)) / p_i

The pairwise terms are first order (neighbours do not meet each other); the
denominator amplifies the waits with the group's load, at half the M/G/1 rate, since
RLVR jobs are periodic and queue far less than Poisson arrivals would. `cost(i, k)` is
what sharing costs beyond the waits (`sharing_cost_s`: engine switches, Runs beside the
neighbour's stragglers, its own stragglers slowed beside the neighbour's Runs), with
the parameters the simulator's executor charges (`PolicyConfig.sharing`). Against jobs
of the H200 profiles forced onto one group in the simulator (`bench/sim_interference.py`,
docs/simulator.md) it is within a point or two, pessimistic by 0.7 points on average.

An asynchronous job (`JobView.staleness` k >= 1) has only its sample on its critical
path; its training waits off it within its slack, and beyond it as long as its rollouts
wait for a save. Its step is its rollout cycle alone (sample, stragglers `tail_s`,
scores `stall_s`), at least its busy seconds: its learned duty cycle takes its
training's queueing out of its span as if it had lengthened its step, which it mostly
did not. Its slack is one cycle (`defer.SLACK_CYCLES`, whatever k: fitted) less its busy
seconds and the part of its own stragglers its training waits out
(`plexrl.policy.defer`). Its step is the longer of its two
lanes (`two_lanes_s`): its rollout lane grows by its sample's waits and costs, its
training lane by its waits behind its neighbours and their stragglers (met with the
chance that one of them holds the group, then taken as exponential), and a step of
slack S grows by `max(S + rollout, W) - max(S, 0)`. The slack moves step by step with
the job's stalls (`JobView.stall_sigma`, taken as lognormal): a short stall leaves its
training little room, and more of a wait runs past it than the mean slack says.

Where an asynchronous job's training runs in slices (`JobView.train_slices`), it yields
to a neighbour's sample at the end of the slice in progress (`plexrl.policy.preempt`):
a neighbour's sample meets that training only for the rest of one slice (`slice / 2`
when found in it, `training / p_k` of the time) and is never cut in ahead of by it; a
synchronous neighbour's training still meets all of it (`_meeting_sliced_s`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from statistics import NormalDist

from plexrl.messages import Function, Tier
from plexrl.policy.actions import Action, Move, Plan, Prefetch, Run
from plexrl.policy.anticipate import BURST_TOLERANCE, bursting_job, pending_s
from plexrl.policy.common import (
    admit_waiting,
    dispatch,
    make_room,
    quanta,
    size_class,
    switch_s,
    waiting_jobs,
)
from plexrl.policy.config import PolicyConfig
from plexrl.policy.costs import SharingCosts
from plexrl.policy.defer import SLACK_CYCLES, not_passed_over, slack_s
from plexrl.policy.fifo import last_served
from plexrl.policy.frozen import quick_init
from plexrl.policy.rehome import due, rehomes
from plexrl.policy.roam import roaming_runs, with_roaming
from plexrl.policy.share import tenant_order
from plexrl.policy.snapshot import ClusterSnapshot, JobView, WorkerView

_TRAIN = (Function.FORWARD_BACKWARD, Function.OPTIM_STEP, Function.SAVE)
_UNBOUNDED = float("inf")
_SAMPLE = Function.SAMPLE
_DEVICE = Tier.DEVICE


def _runs(job: JobView) -> list[tuple[bool, float]]:
    """Each phase of one training step in order, as (a sample?, expected seconds): each
    sample call, and the training calls between them together (from the job's
    `step_calls` when known; else a sample, then the training calls)."""
    runs: list[tuple[bool, float]] = []
    current = 0.0
    for function in job.step_calls or (_SAMPLE, *_TRAIN):
        seconds = job.estimates.expected_s(function)
        if function == _SAMPLE:
            if current:
                runs.append((False, current))
                current = 0.0
            runs.append((True, seconds))
        else:
            current += seconds
    if current:
        runs.append((False, current))
    return runs


def step_phases(job: JobView) -> tuple[float, ...]:
    """Expected seconds of each phase of one training step: the sample, then the
    training calls together (from the job's `step_calls` when known)."""
    return tuple(s for _, s in _runs(job) if s > 0)


def training_phases(job: JobView) -> tuple[float, ...]:
    """Expected seconds of each phase of one training step but its samples."""
    return tuple(s for sample, s in _runs(job) if not sample and s > 0)


def call_residual_s(job: JobView) -> float:
    """Mean remaining seconds of one of the job's calls found in progress."""
    calls = [job.estimates.expected_s(f) for f in job.step_calls] or list(step_phases(job))
    total = sum(calls)
    return sum(s * s for s in calls) / (2 * total) if total > 0 else 0.0


def _meeting_s(mine: tuple[float, ...], theirs: tuple[float, ...], residual: float) -> float:
    """Seconds per step my phases wait behind a neighbour with step period 1 (divide
    by the neighbour's period): the three terms of the module's model."""
    total = 0.0
    for x in mine:
        for length in theirs:
            if length <= x:
                total += length * length / 2 + (x - length) * length
            else:
                total += x * x / 2 + (length - x) * residual
    return total


def _meeting_sliced_s(mine: Figures, theirs: Figures) -> float:
    """`_meeting_s` of my critical phases behind a neighbour whose training is sliced
    (`Figures.slice_s`, an asynchronous job's): my samples meet its samples as any
    phases, and its training only for the rest of the slice in progress (`slice_s / 2`
    on average, found `training / p_k` of the time; it never cuts in ahead of a sample,
    which it yields to). My other critical phases (a synchronous job's training) meet
    all of it whole: it yields to samples only."""
    # An asynchronous job's critical phases are its samples; a synchronous one's, all.
    samples: tuple[float, ...] = mine.critical if mine.training else mine.samples
    rest = () if mine.training else _without(mine.critical, mine.samples)
    total = _meeting_s(rest, theirs.phases, theirs.residual)
    total += _meeting_s(samples, theirs.samples, theirs.residual)
    rest_of_slice = sum(x * min(theirs.slice_s, x) / 2 for x in theirs.training)
    return total + len(samples) * rest_of_slice


def _without(phases: tuple[float, ...], taken: tuple[float, ...]) -> tuple[float, ...]:
    """`phases` less one occurrence of each of `taken`."""
    left = list(phases)
    for x in taken:
        if x in left:
            left.remove(x)
    return tuple(left)


@quick_init
@dataclass(frozen=True)
class Figures:
    """What the interference model needs of one job."""

    phases: tuple[float, ...]
    period: float
    """Seconds of one step (its busy seconds over its duty cycle); 0 if unknown."""
    residual: float
    duty: float
    tail: float = 0.0
    """Seconds its rollouts' stragglers decode in the background after the release."""
    sample: float = 0.0
    """Seconds of its sample phase (the call its stragglers follow)."""
    critical: tuple[float, ...] = ()
    """Its phases on its step's critical path, whose waits and costs lengthen its steps:
    all of them for a synchronous job; an asynchronous one's sample alone (its training
    waits within its slack, `training`)."""
    shape: int = 0
    """Which (phases, residual, tail), to 1%, this is among the jobs one `InterferenceFit`
    has seen: jobs of one shape meet a neighbour alike, so a meeting of two shapes is
    computed once (from the first job of each) per admission pass."""
    training: tuple[float, ...] = ()
    """An asynchronous job's phases off its critical path (its training): their waits
    lengthen its steps only beyond `slack`."""
    slack: float = 0.0
    """Seconds its training may wait per step behind its neighbours before its rollouts
    wait for it: its staleness in rollout cycles (at most `defer.SLACK_CYCLES`) less its
    busy seconds and the part of its own stragglers its training waits out
    (`plexrl.policy.defer`)."""
    hold: float = 0.0
    """The fraction of its step it holds the group or its stragglers decode there:
    the chance a neighbour's call finds it in the way."""
    samples: tuple[float, ...] = ()
    """Its sample phases (on its critical path, whatever its loop)."""
    slice_s: float = 0.0
    """An asynchronous job's training, sliced (`JobView.train_slices`): the seconds of
    one slice, at whose end it yields to a neighbour's sample; 0: whole."""
    stalls: float = 0.0
    """An asynchronous job's mean stall seconds within its slack (its cycles of slack x
    its mean stall), and `stall_sigma` their log-standard deviation: its slack varies with them
    step by step (`two_lanes_s`); 0: taken as fixed."""
    stall_sigma: float = 0.0

    @property
    def busy(self) -> float:
        return sum(self.phases)


def figures_of(job: JobView) -> Figures:
    runs = _runs(job)
    phases = tuple(s for _, s in runs if s > 0)
    samples = tuple(s for sample, s in runs if sample and s > 0)
    busy = sum(phases)
    period = busy / job.duty_cycle if job.duty_cycle > 0 and busy > 0 else 0.0
    sampled = job.estimates.expected_s(Function.SAMPLE)
    sample = sampled if job.tail_s > 0 else 0.0
    training: tuple[float, ...] = ()
    slack = 0.0
    slice_s = 0.0
    stalls = 0.0
    sigma = 0.0
    duty = job.duty_cycle
    if job.staleness <= 0:
        critical = phases
    else:
        critical = tuple(s for s in (sampled,) if s > 0)
        training = tuple(s for sample, s in runs if not sample and s > 0)
        slack = slack_s(job)
        if job.train_slices > 1:
            slice_s = job.estimates.expected_s(Function.FORWARD_BACKWARD) / job.train_slices
        if job.stall_s > 0 and busy > 0:
            # Its rollout cycle alone (sample, stragglers, scores), at least its busy
            # seconds: its learned duty cycle counts its training's queueing, off its
            # path, as if it lengthened its step.
            period = max(sampled + job.tail_s + job.stall_s, busy)
            duty = busy / period
            # Its training waits out its own stragglers too (`plexrl.policy.defer`), as
            # much of them as that rule's slack allows after its sample: what is left
            # is what its neighbours may take.
            own = min(job.tail_s, max(0.0, slack - sampled))
            cycles = min(job.staleness, SLACK_CYCLES)
            slack = cycles * period - busy - own
            if job.stall_sigma > 0:
                # The slack of a step moves with that step's stalls (the mean slack may
                # be short of 0: most steps wait for the training, alone too).
                stalls = cycles * job.stall_s
                sigma = _sum_sigma(job.stall_sigma, cycles)
            else:
                slack = max(0.0, slack)
    hold = min(1.0, (busy + job.tail_s) / period) if period > 0 else 0.0
    return Figures(
        phases,
        period,
        call_residual_s(job),
        duty,
        job.tail_s,
        sample,
        critical,
        training=training,
        slack=slack,
        hold=hold,
        samples=samples,
        slice_s=slice_s,
        stalls=stalls,
        stall_sigma=sigma,
    )


def _sum_sigma(sigma: float, k: int) -> float:
    """The log-standard deviation of the sum of `k` independent lognormal durations of
    log-standard deviation `sigma` and one mean, as one lognormal of the sum's mean and
    variance (Fenton-Wilkinson)."""
    return math.sqrt(math.log1p(math.expm1(sigma * sigma) / k)) if k > 1 else sigma


def _to_1pct(seconds: float) -> int:
    """A bucket of about 1% width: seconds within 1% of each other share it."""
    return round(math.log(seconds) * 100) if seconds > 0 else -(10**9)


@dataclass
class _Meets:
    """What one job meets of its neighbours on a group, summed over them (seconds per
    step, first order)."""

    waits: float = 0.0
    """Its critical phases' waits behind them."""
    costs: float = 0.0
    """Its critical phases' costs of sharing beside them."""
    training: float = 0.0
    """Its training's waits behind them and their stragglers (asynchronous jobs)."""
    training_costs: float = 0.0
    """Its training's costs of sharing beside them (asynchronous jobs)."""
    free: float = 1.0
    """The chance that none of them is in its way: the product of `1 - hold`."""

    def add(self, other: _Meets) -> None:
        self.waits += other.waits
        self.costs += other.costs
        self.training += other.training
        self.training_costs += other.training_costs
        self.free *= other.free

    def plus(self, other: _Meets) -> _Meets:
        # A copy built field by field (`dataclasses.replace` is generic and slow on this
        # path); the sum is `add`'s.
        total = _Meets(self.waits, self.costs, self.training, self.training_costs, self.free)
        total.add(other)
        return total


_NODES = 16
_Z = tuple(NormalDist().inv_cdf((i + 0.5) / _NODES) for i in range(_NODES))
"""Equally likely standard normal quantiles: a lognormal's expectation as their mean."""


def two_lanes_s(
    rollout: float,
    waits: float,
    slack: float,
    met: float,
    stalls: float = 0.0,
    sigma: float = 0.0,
) -> float:
    """Expected seconds per step an asynchronous job's step grows by, its step the
    longer of its two lanes: its rollout lane by `rollout` (its sample's waits and the
    costs of sharing on that lane) and its training lane by a wait met with chance
    `met`, then exponential (mean `waits` over all steps), its training lane `slack`
    seconds shorter than its rollout lane alone. Of a step with slack S, it grows by
    `max(S + rollout, W) - max(S, 0)`: a rollout lane that grows into its slack is all
    of the growth, and a training lane that is the longer one alone (S < 0) hides the
    rollout lane's growth up to -S. With no rollout growth and a fixed slack s >= 0,
    that is `E[(W - s)+]` = `waits * exp(-s * met / waits)`: all of the wait with no
    slack, little where the slack is many times it.

    Where the slack moves with the step's stalls (`stalls` seconds of them on the mean,
    lognormal of log-standard deviation `sigma`), a step's slack is `slack` plus its
    stalls' difference from their mean, taken over the stalls' quantiles: a short stall
    costs more than a long one returns, so the spread adds to what the mean slack
    says."""
    if sigma <= 0 or stalls <= 0:
        return _lanes_s(rollout, waits, met, max(0.0, slack))
    shift = -sigma * sigma / 2
    total = 0.0
    for z in _Z:
        total += _lanes_s(rollout, waits, met, slack + stalls * (math.exp(sigma * z + shift) - 1.0))
    return total / _NODES


def _lanes_s(rollout: float, waits: float, met: float, slack: float) -> float:
    """`two_lanes_s` of a step of slack `slack`: E[max(S + rollout, W)] - max(S, 0)."""
    a = slack + rollout
    if a <= 0:
        return waits - max(0.0, slack)
    past = waits * math.exp(-a * met / waits) if waits > 0 else 0.0
    return a + past - max(0.0, slack)


def _slowdown(me: Figures, meets: _Meets, others: float) -> float:
    """The waits (first order, seconds per step) amplified by the neighbours' load, plus
    the costs of sharing, over the step; an asynchronous job's step is the longer of
    its lanes, its training's waits off its rollouts' path within its slack
    (`two_lanes_s`)."""
    if others >= 1.0:
        return _UNBOUNDED
    if me.period <= 0:
        return 0.0
    amplify = 1.0 / (1.0 - others / 2)
    seconds = meets.waits * amplify + meets.costs
    if me.training:
        training = meets.training * amplify + meets.training_costs
        met = 1.0 - meets.free
        seconds = two_lanes_s(seconds, training, me.slack, met, me.stalls, me.stall_sigma)
    return seconds / me.period


def sharing_cost_s(me: Figures, neighbour: Figures, costs: SharingCosts) -> float:
    """Seconds per step `me` loses to the costs of sharing beside `neighbour` (besides
    waiting for it; `plexrl.policy.costs`):

    - engine switches: one per critical phase of `me` that follows a Run of the
      neighbour, at most one per phase: `switch_s * min(n_me, n_k * p_me / p_k)`;
    - its critical Runs beside the neighbour's stragglers, at `1 - tail_min_share` of
      the group: the fraction of its busy seconds inside the neighbour's tail is about
      `(tail_k + sample_k) / p_k` (a phase that waited for the neighbour's sample
      starts with its tail; the tail as long as it decodes beside `me`, `tail_wall_s`),
      each second of it costing `share / (1 - share)`;
    - its own stragglers slowed beside the neighbour's Runs (`tail_wall_s` less the
      tail alone; an asynchronous neighbour's training counts as busy too: `defer`
      holds it back only within that rule's slack, which the learned figures make
      short)."""
    pk = neighbour.period
    if pk <= 0:
        return 0.0
    cost = 0.0
    mine = me.critical
    if costs.switch_s > 0 and mine:
        n_me, n_k = len(mine), len(neighbour.phases)
        follows = n_k * me.period / pk if me.period > 0 else float(n_me)
        cost += costs.switch_s * min(float(n_me), follows)
    if neighbour.tail > 0 and costs.tail_min_share > 0:
        inside = min(1.0, (tail_wall_s(neighbour, me, costs) + neighbour.sample) / pk)
        cost += sum(mine) * inside * costs.stretch()
    if me.tail > 0 and costs.tail_contention > 1:
        cost += tail_wall_s(me, neighbour, costs) - me.tail
    return cost


def tail_wall_s(me: Figures, neighbour: Figures, costs: SharingCosts) -> float:
    """Wall seconds `me`'s stragglers take to decode beside `neighbour` (`me.tail`
    alone). A tail decodes at `1 / c` of its speed (`c`: `tail_contention`) while a Run
    of the neighbour is in flight, so a tail of wall `W` overlapping Runs for `O` of it
    takes `W = tail + O (1 - 1/c)`; the overlap grows with `W` itself:

    - the neighbour's busy seconds fall in it `busy / p_k` of the time, each Run
      lengthened beside the tail by its share (`1 + stretch`), at most all of it;
    - the neighbour's phases queued behind my sample (`sample / p_k` each) start at the
      tail's start and overlap it for their whole length (lengthened alike).

    Solved for `W`, and at most `c * tail` (a tail overlapped throughout)."""
    pk = neighbour.period
    c = costs.tail_contention
    if me.tail <= 0 or pk <= 0 or c <= 1:
        return me.tail
    lost = 1.0 - 1.0 / c
    widen = 1.0 + costs.stretch()
    whole = c * me.tail
    busy = min(1.0, neighbour.busy * widen / pk)
    queued = sum(min(x * widen, whole) for x in neighbour.phases) * me.sample / pk
    return min(whole, (me.tail + lost * queued) / (1.0 - lost * busy))


def training_wait_s(me: Figures, neighbour: Figures) -> float:
    """First-order seconds per step an asynchronous job's training waits beside
    `neighbour` (0 for a synchronous job): behind its phases (the module's three terms),
    and out its stragglers (`plexrl.policy.defer`: a training phase arriving in the
    neighbour's tail, `tail_k / p_k` of the time, waits for its rest, `tail_k / 2` on
    average)."""
    pk = neighbour.period
    if not me.training or pk <= 0:
        return 0.0
    waits = _meeting_s(me.training, neighbour.phases, neighbour.residual)
    waits += len(me.training) * neighbour.tail * neighbour.tail / 2
    return waits / pk


def training_cost_s(me: Figures, neighbour: Figures, costs: SharingCosts) -> float:
    """Seconds per step an asynchronous job's training loses to engine switches beside
    `neighbour`: one per training phase that follows a Run of the neighbour."""
    pk = neighbour.period
    if not me.training or pk <= 0 or costs.switch_s <= 0:
        return 0.0
    n_me, n_k = len(me.training), len(neighbour.phases)
    follows = n_k * me.period / pk if me.period > 0 else float(n_me)
    return costs.switch_s * min(float(n_me), follows)


def predicted_slowdown(
    job: JobView, neighbours: Sequence[JobView], costs: SharingCosts | None = None
) -> float:
    """Expected fractional step-time increase of `job` from sharing with `neighbours`
    (with `costs`, the costs of sharing too)."""
    if not neighbours:
        return 0.0
    fit = InterferenceFit(budget=0.0, costs=costs or SharingCosts(0.0, 0.0, 1.0))
    me = fit.figures(job)
    others = [fit.figures(k) for k in neighbours]
    meets = _Meets()
    for k in others:
        meets.add(fit.meet(me, k))
    return _slowdown(me, meets, sum(k.duty for k in others))


@dataclass
class _Group:
    meet: Callable[[Figures, Figures], _Meets]
    """What one of its jobs meets of another, at the group's costs of sharing
    (`InterferenceFit.meet`)."""
    load: float = 0.0
    """Sum of the duty cycles."""
    reserved: int = 0
    members: list[Figures] = field(default_factory=list)
    meets: list[_Meets] = field(default_factory=list)
    """What each member meets of the others."""
    tenants: dict[str, float] = field(default_factory=dict)
    """Sum of the duty cycles per tenant."""
    total: float | None = None
    """The summed predicted slowdown of its jobs (None: not known since the last add)."""

    def add(self, fig: Figures, state_bytes: int, tenant: str = "") -> None:
        meet = self.meet
        mine = _Meets()
        for i, other in enumerate(self.members):
            self.meets[i].add(meet(other, fig))
            mine.add(meet(fig, other))
        self.members.append(fig)
        self.meets.append(mine)
        self.total = None
        self.load += fig.duty
        self.reserved += state_bytes
        self.tenants[tenant] = self.tenants.get(tenant, 0.0) + fig.duty

    def foreign(self, tenant: str) -> float:
        """Summed duty cycles of the other tenants' jobs (`share.foreign_load`)."""
        return self.load - self.tenants.get(tenant, 0.0)


class InterferenceFit:
    """Placement: the fullest group of the job's size class where the jobs stay within
    budget; else an empty group; else None (wait). With `pack` False (a fixed pool):
    the group where the mean predicted slowdown after adding the job is least.

    With `fair_share` and jobs of other tenants among the candidates (`plexrl.policy.
    share`): in a fixed pool, the group with the least of other tenants' load, among
    those the job keeps within `max_load` (before the least slowed); packing, the groups
    within budget with the least of other tenants' load first (fullest first among
    equals), then an empty group.

    One instance serves one admission pass (`admit_waiting`), which admits the job
    wherever this returns: it caches job figures, size classes and group totals, and
    adds each placed job to its group, so asking about every waiting job against every
    group costs arithmetic, not snapshot scans.
    """

    def __init__(
        self,
        budget: float,
        pack: bool = True,
        fair_share: bool = False,
        max_load: float = 1.0,
        costs: SharingCosts | None = None,
        bound_newcomers: bool = True,
        over_cluster: bool = False,
        guard: float = 2.0,
        least_added: bool = False,
    ) -> None:
        self.budget = budget
        self.guard = guard
        self.least_added = least_added
        self.over_cluster = over_cluster
        self.bound_newcomers = bound_newcomers
        self.costs = costs if costs is not None else SharingCosts()
        self.pack = pack
        self.fair_share = fair_share
        self.max_load = max_load
        self._figures: dict[str, Figures] = {}
        self._busiest: dict[str, Figures] = {}
        self._shapes: dict[tuple[tuple[int, ...], int, int, int, int, int], int] = {}
        self._representatives: list[Figures] = []
        self._meetings: dict[tuple[int, int], float] = {}
        self._groups: dict[str, _Group] = {}
        self._classes: dict[tuple[int, str, int, int], list[WorkerView]] = {}
        self._placed = 0
        """Jobs placed so far in this pass: the groups' totals change only when one is."""
        self._refused: dict[tuple[Figures, float, int, str, int, int], int] = {}
        """Figures, duty bound (`busiest`) and size (devices, base model, state and
        replicated bytes) of a job no group took, with `_placed` then. The answer rests
        on nothing else, so a later job alike gets the same None until a job is placed:
        jobs waiting for admission are mostly of a few kinds described alike (their
        kind's `priors`), and each would otherwise be tried against every group of its
        size."""

    def figures(self, job: JobView) -> Figures:
        cached = self._figures.get(job.job_id)
        if cached is None:
            cached = self._figures[job.job_id] = self._shaped(figures_of(job))
        return cached

    def busiest(self, job: JobView) -> Figures | None:
        """A newcomer's figures as busy as its kind's busiest tenth (`JobView.duty_bound`),
        or None where its duty cycle is its own or the bound is no busier."""
        if not self.bound_newcomers or job.duty_bound <= job.duty_cycle:
            return None
        cached = self._busiest.get(job.job_id)
        if cached is None:
            busier = figures_of(replace(job, duty_cycle=job.duty_bound))
            cached = self._busiest[job.job_id] = self._shaped(busier)
        return cached

    def _shaped(self, fig: Figures) -> Figures:
        key = (
            tuple(_to_1pct(x) for x in fig.phases),
            _to_1pct(fig.residual),
            _to_1pct(fig.tail),
            _to_1pct(fig.sample),
            len(fig.critical),
            _to_1pct(fig.slice_s),
        )
        shape = self._shapes.setdefault(key, len(self._shapes))
        if shape == len(self._representatives):
            self._representatives.append(fig)
        return replace(fig, shape=shape)

    def pair(self, me: Figures, neighbour: Figures) -> float:
        """First-order seconds per step `me` waits behind `neighbour`; each meeting of
        two shapes is computed once per pass."""
        if neighbour.period <= 0:
            return 0.0
        key = (me.shape, neighbour.shape)
        meeting = self._meetings.get(key)
        if meeting is None:
            mine, theirs = self._representatives[me.shape], self._representatives[neighbour.shape]
            if theirs.slice_s > 0 and theirs.training:
                meeting = _meeting_sliced_s(mine, theirs)
            else:
                meeting = _meeting_s(mine.critical, theirs.phases, theirs.residual)
            self._meetings[key] = meeting
        return meeting / neighbour.period

    def meet(self, me: Figures, neighbour: Figures) -> _Meets:
        """What `me` meets of `neighbour`: its waits and costs of sharing, per step."""
        return self.meet_at(self.costs, me, neighbour)

    def meet_at(self, costs: SharingCosts, me: Figures, neighbour: Figures) -> _Meets:
        """`meet` on a group whose costs of sharing are `costs`."""
        return _Meets(
            self.pair(me, neighbour),
            sharing_cost_s(me, neighbour, costs),
            training_wait_s(me, neighbour),
            training_cost_s(me, neighbour, costs),
            1.0 - neighbour.hold,
        )

    def _within_adding(self, group: _Group, fig: Figures, busiest: Figures | None) -> bool:
        """Whether `group` plus `fig` stays within budget: the mean predicted slowdown
        within it and nobody's above twice it (the target is a mean; the guard keeps it
        fair). The new job's own slowdown is checked first, as it most often fails. A
        newcomer described by its kind's mean must also keep everyone within the guard
        as busy as its kind's busiest tenth (`busiest`): a mean says little of one job,
        and the tail is who it turns out to be."""
        if not group.members:
            return True
        total = self._total_within_guard(group, fig)
        return total is not None and self._within_given(group, total, busiest)

    def _within_given(self, group: _Group, total: float, busiest: Figures | None) -> bool:
        """`_within_adding` given the new job's summed predicted slowdown with `group`'s
        jobs (`total`, within the guard): the mean within budget, over every homed job
        (`over_cluster`) or the group's, and the newcomer guard (`busiest`)."""
        if self.over_cluster:
            summed, n = self._cluster_adding(group, total)
            if summed / n > self.budget:
                return False
        elif total / (len(group.members) + 1) > self.budget:
            return False
        return busiest is None or self._total_within_guard(group, busiest) is not None

    def _cluster_adding(self, group: _Group, total: float) -> tuple[float, int]:
        """Every homed job's summed predicted slowdown, and their number, were `group`'s
        jobs and the new one to sum to `total` (`over_cluster`; every group is built,
        `_every_group`)."""
        summed, n = total, 1
        for other in self._groups.values():
            if other is not group:
                summed += self._total_of(other)
                n += len(other.members)
        return summed, n + len(group.members)

    def _every_group(self, snapshot: ClusterSnapshot) -> None:
        """With `over_cluster`, every group's jobs, whatever their size: the budget is a
        mean over them all."""
        if self.over_cluster and len(self._groups) < len(snapshot.workers):
            for worker_id in snapshot.workers:
                self._group(snapshot, worker_id)

    def _total_of(self, group: _Group) -> float:
        """The group's summed predicted slowdown, each job's at most 1 (its step twice
        as long): a group its learned figures put past draining would otherwise hold
        every admission of the cluster back."""
        if group.total is None:
            group.total = sum(
                min(1.0, _slowdown(other, meets, group.load - other.duty))
                for other, meets in zip(group.members, group.meets, strict=True)
            )
        return group.total

    def _total_within_guard(self, group: _Group, fig: Figures) -> float | None:
        """The summed predicted slowdown of `group`'s jobs and `fig`'s, or None when any
        of them is above the guard (`slowdown_guard` times the budget, twice by
        default)."""
        guard = self.guard * self.budget
        meet = group.meet
        mine = _Meets()
        for other in group.members:
            mine.add(meet(fig, other))
        total = _slowdown(fig, mine, group.load)
        if total > guard:
            return None
        for other, meets in zip(group.members, group.meets, strict=True):
            slow = _slowdown(
                other, meets.plus(meet(other, fig)), group.load - other.duty + fig.duty
            )
            if slow > guard:
                return None
            total += slow
        return total

    def _mean_adding(self, group: _Group, fig: Figures) -> float:
        """The mean predicted slowdown of `group`'s jobs with `fig` added (inf when the
        group's load would reach 1: it would not drain)."""
        if not group.members:
            return 0.0
        meet = group.meet
        mine = _Meets()
        for other in group.members:
            mine.add(meet(fig, other))
        total = _slowdown(fig, mine, group.load)
        for other, meets in zip(group.members, group.meets, strict=True):
            total += _slowdown(
                other, meets.plus(meet(other, fig)), group.load - other.duty + fig.duty
            )
        return total / (len(group.members) + 1)

    def _least_slowed(self, snapshot: ClusterSnapshot, job: JobView, fig: Figures) -> str | None:
        fits: list[tuple[int, WorkerView, _Group]] = []
        for i, worker in enumerate(self._size_class(snapshot, job)):
            group = self._group(snapshot, worker.worker_id)
            if _holds(worker, group, job):
                fits.append((i, worker, group))
        if not fits:
            return None
        tenant = job.tenant
        # Other tenants' load first: the prediction rests on a newcomer's priors (or
        # defaults), which say least about it exactly now, and the jobs of one tenant
        # share the engine by their own choice, those of two by the policy's.
        apart = self.fair_share and any(g.foreign(tenant) > 0 for _, _, g in fits)
        best: tuple[float, ...] | None = None
        chosen: WorkerView | None = None
        for i, worker, group in fits:
            key: tuple[float, ...] = (
                self._mean_adding(group, fig),
                group.load,
                len(group.members),
                i,
            )
            if apart:
                over = 1.0 if group.load + fig.duty > self.max_load else 0.0
                key = (over, group.foreign(tenant), *key)
            if best is None or key < best:
                best, chosen = key, worker
        assert chosen is not None
        self._groups[chosen.worker_id].add(fig, job.state_bytes, tenant)
        return chosen.worker_id

    def _group(self, snapshot: ClusterSnapshot, worker_id: str) -> _Group:
        group = self._groups.get(worker_id)
        if group is None:
            own = snapshot.workers[worker_id].sharing
            meet = self.meet if own is None else partial(self.meet_at, own)
            group = self._groups[worker_id] = _Group(meet)
            for job in snapshot.homed_view(worker_id):
                group.add(self.figures(job), job.state_bytes, job.tenant)
        return group

    def _size_class(self, snapshot: ClusterSnapshot, job: JobView) -> list[WorkerView]:
        # By everything `size_class` reads of the job: which groups can hold it.
        key = (job.devices, job.base_model, job.state_bytes, job.replicated_bytes)
        if key not in self._classes:
            self._classes[key] = size_class(snapshot, job)
        return self._classes[key]

    def __call__(self, snapshot: ClusterSnapshot, job: JobView) -> str | None:
        fig = self.figures(job)
        alike = (
            fig,
            job.duty_bound,
            job.devices,
            job.base_model,
            job.state_bytes,
            job.replicated_bytes,
        )
        if self._refused.get(alike) == self._placed:
            return None
        if self.pack:
            chosen = self._fullest_within(snapshot, job, fig)
        else:
            chosen = self._least_slowed(snapshot, job, fig)
        if chosen is None:
            self._refused[alike] = self._placed
        else:
            self._placed += 1
        return chosen

    def _fullest_within(
        self,
        snapshot: ClusterSnapshot,
        job: JobView,
        fig: Figures,
        empty_ok: bool = True,
        most: int = 0,
    ) -> str | None:
        """The fullest group of `job`'s size class where everyone stays within budget
        with it, else (`empty_ok`) an empty one; with `most`, only groups holding at
        most that many jobs."""
        self._every_group(snapshot)
        empty: WorkerView | None = None
        shared: list[tuple[float, float, int, WorkerView, _Group]] = []
        tenant = job.tenant
        for i, worker in enumerate(self._size_class(snapshot, job)):
            group = self._group(snapshot, worker.worker_id)
            if not _holds(worker, group, job):
                continue
            if not group.members:
                empty = empty or worker
            elif most and len(group.members) > most:
                continue
            elif group.load + fig.duty < 1.0:
                foreign = group.foreign(tenant) if self.fair_share else 0.0
                shared.append((foreign, -group.load, i, worker, group))
        chosen = empty if empty_ok else None
        busiest = self.busiest(job)
        if self.least_added:
            chosen = self._least_added_within(shared, fig, busiest) or chosen
        else:
            # Fullest first (least of other tenants' load before that, with fair share):
            # the first group within budget is the answer.
            for _, _, _, worker, group in sorted(shared, key=lambda c: (c[0], c[1], c[2])):
                if self._within_adding(group, fig, busiest):
                    chosen = worker
                    break
        if chosen is None:
            return None
        self._groups[chosen.worker_id].add(fig, job.state_bytes, tenant)
        return chosen.worker_id

    def _least_added_within(
        self,
        shared: list[tuple[float, float, int, WorkerView, _Group]],
        fig: Figures,
        busiest: Figures | None,
    ) -> WorkerView | None:
        """`least_added`: among the groups holding jobs, the one where `fig` adds least to
        the jobs' summed predicted slowdown, its own included, of those where everyone
        stays within budget (least of other tenants' load first, with fair share; the
        fullest among equals)."""
        ranked: list[tuple[float, float, float, int, WorkerView, _Group, float]] = []
        for foreign, fuller, i, worker, group in shared:
            total = self._total_within_guard(group, fig)
            if total is not None:
                added = total - self._total_of(group)
                ranked.append((foreign, added, fuller, i, worker, group, total))
        ranked.sort(key=lambda c: c[:4])
        for _, _, _, _, worker, group, total in ranked:
            if self._within_given(group, total, busiest):
                return worker
        return None

    def forget(self, worker_id: str) -> None:
        """The jobs homed on `worker_id` changed since this pass saw them: its figures are
        built afresh from the next snapshot it is asked about."""
        self._groups.pop(worker_id, None)
        self._placed += 1

    # Re-homing (`plexrl.policy.rehome`): questions about a job not homed in `snapshot`.

    def keeps_within(self, snapshot: ClusterSnapshot, worker_id: str, job: JobView) -> bool:
        """Whether the group's jobs and `job` beside them stay within budget."""
        self._every_group(snapshot)
        return self._within_adding(self._group(snapshot, worker_id), self.figures(job), None)

    def added_slowdown(self, snapshot: ClusterSnapshot, worker_id: str, job: JobView) -> float:
        """How much `job` beside the group's jobs adds to their summed predicted
        slowdown, its own included (inf where the group would not drain)."""
        group = self._group(snapshot, worker_id)
        fig = self.figures(job)
        if group.load + fig.duty >= 1.0 and group.members:
            return _UNBOUNDED
        before = sum(
            _slowdown(other, meets, group.load - other.duty)
            for other, meets in zip(group.members, group.meets, strict=True)
        )
        return self._mean_adding(group, fig) * (len(group.members) + 1) - before

    def shared_within(self, snapshot: ClusterSnapshot, job: JobView) -> str | None:
        """The fullest group holding one job where `job` keeps both within budget (None:
        none); the job is added to it. A pair, not more: the prediction of a third job
        on a group is optimistic (its neighbours meet each other)."""
        return self._fullest_within(snapshot, job, self.figures(job), empty_ok=False, most=1)

    def lone_pairs(self, snapshot: ClusterSnapshot) -> list[str]:
        """Of the jobs each alone on its group, one of each two that could share one of
        the two groups within budget (their figures as they are now; the first such
        pair of each job by job id): the jobs whose review (`plexrl.policy.rehome`)
        may free a group. A pre-check: the review decides, the job itself out of the
        cluster's jobs (here it is counted on its own group too, alone, at no
        slowdown)."""
        self._every_group(snapshot)
        lone: dict[str, JobView] = {}
        for worker_id in snapshot.workers:
            homed = snapshot.homed_view(worker_id)
            if len(homed) == 1 and homed[0].tier is not None:
                lone[worker_id] = homed[0]
        paired: set[str] = set()
        marked: list[str] = []
        for home, job in sorted(lone.items(), key=lambda kv: kv[1].job_id):
            if job.job_id in paired:
                continue
            fig = self.figures(job)
            busiest = self.busiest(job)
            for worker in self._size_class(snapshot, job):
                other = lone.get(worker.worker_id)
                if worker.worker_id == home or other is None or other.job_id in paired:
                    continue
                group = self._group(snapshot, worker.worker_id)
                if not _holds(worker, group, job) or group.load + fig.duty >= 1.0:
                    continue
                if self._within_adding(group, fig, busiest):
                    marked.append(job.job_id)
                    paired.update((job.job_id, other.job_id))
                    break
        return marked


def _holds(worker: WorkerView, group: _Group, job: JobView) -> bool:
    """Whether the group's device and host tiers hold `job`'s state beside its jobs'."""
    return group.reserved + job.state_bytes <= worker.device_bytes + worker.host_bytes


def reviews_alone(config: PolicyConfig) -> bool:
    """Whether the policy asks about the jobs alone every review interval
    (`lone_pairs`): the plexrl policy, packing, re-homing jobs left alone, and
    `PolicyConfig.review_alone`."""
    return (
        config.name == "plexrl"
        and config.pack
        and config.rehome
        and config.rehome_lone
        and config.review_alone
    )


def lone_pairs(snapshot: ClusterSnapshot, config: PolicyConfig) -> list[str]:
    """Jobs alone on their group whose home a review should look at again, because
    another job alone on a group of their size could take them within budget
    (`InterferenceFit.lone_pairs`); none unless the policy re-homes jobs left alone
    and reviews them again (`reviews_alone`). The callers ask every review interval
    and mark them for review as a job left alone is: a pair refused when one of its
    jobs was left alone may fit later, on the figures the two have learned since."""
    if not reviews_alone(config):
        return []
    return interference_fit(config).lone_pairs(snapshot)


def interference_fit(config: PolicyConfig) -> InterferenceFit:
    """A fresh placement model for one admission (or re-homing) pass."""
    return InterferenceFit(
        config.slowdown_budget,
        config.pack,
        config.fair_share,
        config.max_load,
        config.sharing,
        config.bound_newcomers,
        config.budget_over_cluster,
        config.slowdown_guard,
        config.least_added,
    )


def _idle_first(now: float) -> partial[tuple[float, ...]]:
    return partial(_idle_key, now)


def _idle_key(now: float, job: JobView) -> tuple[float, ...]:
    # Evict the job that said it will stay idle longest first, then the least recent.
    return (-max(job.idle_until - now, 0.0), job.last_active)


def shortest_remaining_first(
    snapshot: ClusterSnapshot,
    worker: WorkerView,
    jobs: list[JobView],
    switch_weight: float,
    burst: tuple[float, float] = (0.0, 0.0),
    fair_share: bool = False,
) -> Sequence[JobView]:
    """Least remaining work first: the expected seconds of the job's pending calls plus
    `switch_weight` times the seconds to bring its state onto the device; ties to the
    resident job, then the oldest call.

    With `burst` = (hold_s, quantum_s) (the live scheduler's anticipation,
    `plexrl.policy.anticipate`), the group's bursting job goes first: the one that ran
    there last, whose last gap between calls was at most hold_s and whose burst has
    lasted less than quantum_s, and whose pending calls are expected to take at most
    `BURST_TOLERANCE` times the least pending work of the others. So a burst runs out
    before the group moves on, for at most about a quantum, unless a neighbour's work is
    much shorter.

    When jobs of several tenants are ready, tenants take turns first and least remaining
    work orders each tenant's own jobs: short calls of one tenant never hold back
    another's beyond one dispatch each. With `fair_share` the tenant that used the group
    least recently goes first within those turns (`plexrl.policy.share.tenant_order`);
    without it, the one served longest ago (as `fifo` does)."""
    if len(jobs) < 2:
        return jobs
    bursting = bursting_job(snapshot, worker.worker_id, *burst) if burst[0] > 0 else None
    if bursting is not None and any(j.job_id == bursting for j in jobs):
        rest = [j for j in jobs if j.job_id != bursting]
        mine = [j for j in jobs if j.job_id == bursting]
        first = mine[0].tenant
        if all(j.tenant == first for j in rest):
            least = min(pending_s(snapshot, j) for j in rest)
            if pending_s(snapshot, mine[0]) <= BURST_TOLERANCE * least:
                return [
                    *mine,
                    *shortest_remaining_first(
                        snapshot, worker, rest, switch_weight, fair_share=fair_share
                    ),
                ]

    def key(job: JobView) -> tuple[float, int, float, str]:
        calls = snapshot.calls_view(job.job_id)
        seconds_of, default_s = job.estimates.seconds, job.estimates.default_s
        # The work of its next Run: its calls up to where samples and others change
        # (`common.run_of`), so an asynchronous job's sample is not weighed with the
        # training queued behind it on its other lane.
        sampling = calls[0].function == _SAMPLE
        service = 0.0
        for c in calls:
            if (c.function == _SAMPLE) != sampling:
                break
            service += seconds_of.get(c.function, default_s)  # expected_s
        switch = switch_s(snapshot, job, ()) if job.tier != _DEVICE else 0.0
        resident = 0 if job.tier == _DEVICE else 1
        return (service + switch_weight * switch, resident, calls[0].arrival_time, job.job_id)

    first = jobs[0].tenant
    if all(job.tenant == first for job in jobs):
        return sorted(jobs, key=key)
    if fair_share:
        rank = {t: i for i, t in enumerate(tenant_order(snapshot, worker.worker_id, jobs))}
        return sorted(jobs, key=lambda job: (rank[job.tenant], key(job)))
    served = last_served(snapshot)
    return sorted(jobs, key=lambda job: (served[job.tenant], key(job)))


def prefetches(snapshot: ClusterSnapshot, config: PolicyConfig, runs: list[Run]) -> list[Prefetch]:
    """On each busy group, bring up the off-device job most likely to run next: one with
    pending calls (least remaining work), else the one whose idle hint ends first,
    provided that ends before the group frees up."""
    out: list[Prefetch] = []
    key = _idle_first(snapshot.now)
    for worker in snapshot.workers.values():
        if not worker.healthy or worker.running is None:
            continue
        homed = snapshot.homed_view(worker.worker_id)
        candidates = [
            j for j in homed if j.tier not in (Tier.DEVICE, None) and j.job_id != worker.running
        ]
        if not candidates:
            continue
        with_calls = [j for j in candidates if snapshot.calls_view(j.job_id)]
        if with_calls:
            target = shortest_remaining_first(
                snapshot, worker, with_calls, config.switch_weight, fair_share=config.fair_share
            )[0]
        else:
            hinted = [j for j in candidates if snapshot.now < j.idle_until <= worker.busy_until]
            if not hinted:
                continue
            target = min(hinted, key=lambda j: (j.idle_until, j.job_id))
        evict = make_room(snapshot, worker.worker_id, target, key)
        if evict is None or any(_has_calls(snapshot, m) for m in evict):
            continue
        out.append(Prefetch(worker.worker_id, target.job_id, evict))
    return out


def _has_calls(snapshot: ClusterSnapshot, move: Move) -> bool:
    return bool(snapshot.calls_view(move.job_id))


def _off_device(snapshot: ClusterSnapshot) -> bool:
    """Whether any homed job's state is away from its group's device tier."""
    for j in snapshot.jobs.values():  # (a loop, not any(): asked on every decision)
        if j.home is not None and j.tier is not None and j.tier != _DEVICE:
            return True
    return False


def declared_run_s(job: JobView) -> float:
    """Seconds the job's declared steps take at its step's expected period (its figures,
    or its kind's); a step counts as a second while it has none. 0: nothing declared."""
    if job.declared_steps <= 0:
        return 0.0
    busy = sum(step_phases(job))
    period = busy / job.duty_cycle if busy > 0 and job.duty_cycle > 0 else 1.0
    return job.declared_steps * period


def longest_declared_first(jobs: list[JobView]) -> list[JobView]:
    """Waiting jobs, the most declared work first; ties and undeclared jobs keep their
    order (arrival), after every declared one."""
    return sorted(jobs, key=lambda j: -declared_run_s(j))


def plan_plexrl(snapshot: ClusterSnapshot, config: PolicyConfig) -> Plan:
    actions: list[Action] = []
    if config.rehome and due(snapshot):
        moved, snapshot = rehomes(snapshot, config, partial(interference_fit, config))
        actions.extend(moved)
    if waiting_jobs(snapshot):  # (most plans only dispatch: no placement to set up)
        place = interference_fit(config)
        first = longest_declared_first if config.longest_first else None
        admitted, snapshot = admit_waiting(snapshot, place, backfill=True, order=first)
        actions.extend(admitted)
    srf = partial(
        shortest_remaining_first,
        switch_weight=config.switch_weight,
        burst=(config.hold_s, config.quantum_s),
        fair_share=config.fair_share,
    )

    def order(snap: ClusterSnapshot, worker: WorkerView, jobs: list[JobView]) -> Sequence[JobView]:
        return srf(snap, worker, not_passed_over(snap, worker, jobs, config.sharing))

    prefetch = config.prefetch and _off_device(snapshot)
    quantum_s, tenant_quantum_s = quanta(config)
    runs, snapshot = dispatch(
        snapshot,
        config,
        order,
        key=_idle_first(snapshot.now),
        keep_snapshot=prefetch,
        quantum_s=quantum_s,
        tenant_quantum_s=tenant_quantum_s,
    )
    roaming, runs = roaming_runs(snapshot, config, runs)
    actions.extend(runs)
    if roaming:
        actions.extend(roaming)
        if prefetch:
            snapshot = with_roaming(snapshot, roaming)
    if prefetch:
        actions.extend(prefetches(snapshot, config, runs))
    return tuple(actions)
