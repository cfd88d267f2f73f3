"""What a scheduler can learn of a job from the calls it has seen, and nothing more.

The live scheduler and the simulator both describe a job to the policy from these
figures: running means of its calls' durations, the fraction of its wall time its calls
kept a device busy (its duty cycle), and the calls one of its training steps makes, as
observed in its loop. Neither may use what only the future or a profile would tell, so
the simulator's decisions are ones the live scheduler could make.

The rules are the live scheduler's (`plexrl_scheduler.state.JobState`): an exponential
running mean per function with weight `EWMA` on the newest observation, and a measured
duty cycle only once the job has been seen for `min_history_s`; until then a job of a
known kind borrows the mean figures of its kind (`priors`).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

from plexrl.messages import Function
from plexrl.policy.frozen import quick_init

EWMA = 0.3
"""Weight of the newest observation in a job's running mean of call durations."""
UNKNOWN_DUTY = 0.5
"""Duty cycle of a job with no history and no kind to borrow from."""
HIGH_DUTY_QUANTILE = 0.9
"""Which of its kind's duty cycles bounds a newcomer's (`Prior.duty_high`): one job in
ten of its kind keeps a device busier than that."""

USAGE_HALF_LIFE_S = 60.0
"""Half-life of a job's recent engine use (`RecentUse`): a minute of history decides a
tenant's share, so a tenant that was busy long ago is not held back for it now."""

Kind = TypeVar("Kind", bound=Hashable)


@dataclass
class RecentUse:
    """Engine seconds a job used, each weighed by half for every `half_life_s` since its
    call ended (`JobView.used_s`). Two numbers, however many calls."""

    half_life_s: float = USAGE_HALF_LIFE_S
    seconds: float = 0.0
    """The weighed sum as of `at`."""
    at: float = 0.0

    def add(self, seconds: float, now: float) -> None:
        """A call that used `seconds` of the engine ended at `now`."""
        self.seconds = self.as_of(now) + seconds
        self.at = max(self.at, now)

    def as_of(self, now: float) -> float:
        if self.seconds <= 0 or now <= self.at:
            return self.seconds
        return self.seconds * 0.5 ** ((now - self.at) / self.half_life_s)


@dataclass
class Spread:
    """The log-standard deviation of positive durations seen one at a time (Welford's
    running variance of their logarithms): how widely a job's stalls vary about their
    mean, taken as lognormal (`JobView.stall_sigma`). Three numbers, however many."""

    n: int = 0
    mean: float = 0.0
    """Mean of the logarithms so far."""
    m2: float = 0.0
    """Sum of squared deviations of the logarithms from their mean."""

    def add(self, seconds: float) -> None:
        if seconds <= 0:
            return
        x = math.log(seconds)
        self.n += 1
        delta = x - self.mean
        self.mean += delta / self.n
        self.m2 += delta * (x - self.mean)

    @property
    def sigma(self) -> float:
        """The sample log-standard deviation; 0 until two durations are seen."""
        return math.sqrt(self.m2 / (self.n - 1)) if self.n > 1 else 0.0


@dataclass
class CallHistory:
    """One job's observed calls. Changes only through `arrived`, `observe` and `calls`."""

    durations: dict[Function, float] = field(default_factory=dict)
    """Running mean of each function's compute seconds (swaps excluded)."""
    first_seen: float | None = None
    """When it got its home (`homed`): the start of the span its duty cycle covers. Time
    spent waiting for admission is not the job's idleness; counted in, a job that waited
    would look idle and be packed on a full group."""
    busy_s: float = 0.0
    """Seconds (swap + compute) its calls have held a device."""
    queued_s: float = 0.0
    """Seconds its calls waited for a device (`Timings.queue_s`): time the job wanted
    the device and others had it, which is not the job's idleness."""
    step_calls: tuple[Function, ...] = ()
    """The calls of its last whole training step, sample first (empty until one step
    has been seen from one sample to the next)."""
    tail_s: float = 0.0
    """Running mean of the seconds its rollouts' stragglers decoded after the release
    (0: none seen)."""
    version: int = 0
    """Counts changes to `durations`, `step_calls` and `tail_s` (a cache key for their
    readers)."""
    _since_sample: list[Function] = field(default_factory=list)

    def homed(self, now: float) -> None:
        """The job got a home: its history's span starts."""
        self.first_seen = now

    def arrived(self, function: Function) -> None:
        """A call of the job arrived: it shows the job's loop."""
        if function == Function.SAMPLE:
            if self._since_sample and self._since_sample[0] == Function.SAMPLE:
                step = tuple(self._since_sample)
                if step != self.step_calls:
                    self.step_calls = step
                    self.version += 1
            self._since_sample = [function]
        elif self._since_sample:
            self._since_sample.append(function)

    def observe(
        self, function: Function, compute_s: float, swap_s: float = 0.0, queue_s: float = 0.0
    ) -> None:
        """A call of the job completed after `compute_s` (and `swap_s` of swaps first,
        and `queue_s` waiting for the device before them)."""
        old = self.durations.get(function)
        self.durations[function] = compute_s if old is None else old + EWMA * (compute_s - old)
        self.version += 1
        self.busy_s += compute_s + swap_s
        self.queued_s += queue_s

    def tail(self, seconds: float) -> None:
        """A rollout's stragglers, released, ended `seconds` after the release."""
        old = self.tail_s
        self.tail_s = seconds if old <= 0 else old + EWMA * (seconds - old)
        self.version += 1

    def has_history(self, now: float, min_history_s: float) -> bool:
        return self.first_seen is not None and now - self.first_seen >= min_history_s

    def duty_cycle(self, now: float, min_history_s: float) -> float:
        """Fraction of its own wall time the job kept a device busy (`UNKNOWN_DUTY` until
        it has a history). Its calls' queueing is taken out of the span: counted in, a
        job slowed by its neighbours would look idler the more it shares, and draw more
        neighbours still."""
        if self.first_seen is None or now - self.first_seen < min_history_s:
            return UNKNOWN_DUTY
        span = now - self.first_seen - self.queued_s
        return min(1.0, max(0.01, self.busy_s / span)) if span > 0 else 1.0


@quick_init
@dataclass(frozen=True)
class Prior:
    """What a job without a history is taken to look like: the mean of its kind's."""

    duty_cycle: float
    durations: dict[Function, float]
    step_calls: tuple[Function, ...] = ()
    tail_s: float = 0.0
    duty_high: float = 0.0
    """Its kind's duty cycle at `HIGH_DUTY_QUANTILE`: how busy a newcomer of the kind may
    well turn out, where its mean says little (a kind whose jobs' stalls vary widely)."""


def quantile(values: list[float], q: float) -> float:
    """The `q` quantile of `values` (nearest rank below; not empty)."""
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))]


def priors(
    histories: Iterable[tuple[Kind, CallHistory]], now: float, min_history_s: float
) -> dict[Kind, Prior]:
    """Per job kind, the mean duty cycle and call durations of the jobs with a history
    (and the step of the first of them whose loop is known), and the duty cycle at
    `HIGH_DUTY_QUANTILE`."""
    duties: dict[Kind, list[float]] = {}
    durations: dict[Kind, dict[Function, list[float]]] = {}
    steps: dict[Kind, tuple[Function, ...]] = {}
    tails: dict[Kind, list[float]] = {}
    for kind, history in histories:
        if not history.has_history(now, min_history_s):
            continue
        duties.setdefault(kind, []).append(history.duty_cycle(now, min_history_s))
        if history.tail_s > 0:
            tails.setdefault(kind, []).append(history.tail_s)
        by_function = durations.setdefault(kind, {})
        for function, seconds in history.durations.items():
            by_function.setdefault(function, []).append(seconds)
        if history.step_calls and kind not in steps:
            steps[kind] = history.step_calls
    return {
        kind: Prior(
            duty_cycle=sum(values) / len(values),
            durations={f: sum(v) / len(v) for f, v in durations[kind].items()},
            step_calls=steps.get(kind, ()),
            tail_s=sum(tails[kind]) / len(tails[kind]) if kind in tails else 0.0,
            duty_high=quantile(values, HIGH_DUTY_QUANTILE),
        )
        for kind, values in duties.items()
    }


@quick_init
@dataclass(frozen=True)
class Described:
    """A job's figures as the policy is to see them (`JobView`'s learned fields)."""

    duty_cycle: float
    durations: dict[Function, float]
    step_calls: tuple[Function, ...]
    tail_s: float = 0.0
    duty_bound: float = 0.0
    """While `duty_cycle` is its kind's mean (no history yet), its kind's `duty_high`;
    0: the duty cycle is the job's own."""


def describe(
    history: CallHistory, prior: Prior | None, now: float, min_history_s: float
) -> Described:
    """The job's own figures; its kind's (`prior`) for the duty cycle until it has a
    history, and for any function or step loop it has not shown yet (a job that has
    only sampled so far would otherwise look as if its training took no time)."""
    step, tail = history.step_calls, history.tail_s
    duty = duty_of(history, prior, now, min_history_s)
    if prior is None:
        return Described(duty, dict(history.durations), step, tail)
    bound = 0.0 if history.has_history(now, min_history_s) else prior.duty_high
    durations = prior.durations | history.durations
    return Described(duty, durations, step or prior.step_calls, tail or prior.tail_s, bound)


def duty_of(history: CallHistory, prior: Prior | None, now: float, min_history_s: float) -> float:
    """`describe`'s duty cycle: the job's own as of `now`, or its kind's (`prior`) until it
    has a history (`UNKNOWN_DUTY` with neither). The one figure of `describe`'s that
    changes with the clock alone."""
    if prior is None or history.has_history(now, min_history_s):
        return history.duty_cycle(now, min_history_s)
    return prior.duty_cycle
