"""Workload replay: each job's client loop, replayed from its drawn steps.

A job arrives and asks to be created; once its calls of a step are done it decodes its
stragglers (in the background, once the engine released the group), waits out its
reward / tool stall, sends its training calls, waits out its host-side gap and begins
the next step. This module issues those calls at the right times and keeps what the
scheduler learns of the job from them (`plexrl.policy.history`); where the calls run
and what they cost is the group executor's (`executor.py`).

An asynchronous job (staleness k >= 1, `Profile.staleness`) runs two lanes. Its rollout
lane samples rollout r, decodes its stragglers and waits for its scores (the stall),
then samples rollout r + 1 at once, provided the weights of step r + 1 - k are saved
(else as soon as they are). Its training lane trains on rollout t once it is scored and
the lane is free (step t - 1 saved and its host-side gap over). So the job trains on one
rollout while it samples the next. Its samples read saved sampler weights only: they are
portable (`PendingCall.portable`), and may run on another group of its size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

from plexrl.messages import Function, Tier
from plexrl.policy import CallEstimates, JobView, PendingCall
from plexrl.policy.history import CallHistory, Prior, Spread, describe
from plexrl_sim.events import Attention, Event, EventQueue
from plexrl_sim.results import JobResult
from plexrl_sim.workload import JobSpec, Steps

_NAMES = {f: f.value for f in Function}
"""Each function's wire name, for request ids (an enum's `.value` is a slow property)."""
_CREATE, _SAMPLE, _SAVE = Function.CREATE, Function.SAMPLE, Function.SAVE
"""(Module constants: an enum member read off its class costs an attribute lookup, and
these are compared once per call.)"""


@dataclass
class SimJob:
    """One job: its drawn steps, where its state is, and what the scheduler knows of it."""

    spec: JobSpec
    steps: Steps
    devices: int
    state_bytes: int
    result: JobResult
    sampler_bytes: int = 0
    """Bytes another group loads to sample its saved weights (`Profile.sampler_bytes`)."""
    history: CallHistory = field(default_factory=CallHistory)
    """What the scheduler has learned of the job from its calls so far."""
    stalls_s: float = 0.0
    """Sum of its reward / tool stalls so far: the job's own idle hint is their mean."""
    stall_s: float = 0.0
    """The mean of its stalls before the latest: what its idle hints said."""
    stall_spread: Spread = field(default_factory=Spread)
    """Its stalls seen to their end (from the idle hint to its next call), as the live
    scheduler sees them: `JobView.stall_sigma`."""
    gaps_s: float = 0.0
    """Sum of its host-side gaps between steps so far."""
    home: str | None = None
    tier: Tier | None = None
    last_active: float = 0.0
    idle_until: float = 0.0
    pins: int = 0
    """Reasons its state must stay on the device outside a Run of its own: its
    stragglers decoding there, a sample batch of it paused or co-sampled in another
    job's Run (the worker reports them, as it reports a running job)."""
    running: int = 0
    """Runs with calls of it in flight."""
    last_gap_s: float = 0.0
    """Seconds from the end of its calls to its next call, the last time it had none
    queued or running (`JobView.last_gap_s`)."""
    burst_since: float = 0.0
    """When its current burst of calls began (0: none seen)."""
    ready_at: float = 0.0
    """When a prefetch in flight lands on the device."""
    step: int = 0
    """The training step (the one its training calls are of)."""
    sample_step: int = 0
    """The rollout its sample is of (the step's, in a synchronous job)."""
    scored: int = 0
    """Rollouts scored (asynchronous jobs): the training lane may train on each."""
    saves: int = 0
    """Training steps saved (asynchronous jobs): the rollout lane's weights."""
    training: bool = False
    """Its training lane has calls out or is in its host-side gap (asynchronous jobs)."""
    sample_blocked: bool = False
    """Its next rollout waits for the weights it may use to be saved (asynchronous)."""
    sample_group: str | None = None
    """Where its last sample ran (its home, or another group of its size)."""
    first_step_at: float = math.nan
    known_duty: float = 0.0
    """Its own duty cycle, given to the policy before it has a history of its own
    (`plexrl sim --known-duty`, a control: `MultiplexedSim`); 0: its kind's until then,
    as the live scheduler does."""
    provisional: bool = False
    """Its home is due for review (`plexrl.policy.rehome`): homed on its kind's figures,
    or left alone on its group (`PolicyConfig.rehome_lone`), and not reviewed since."""
    restore_s: float = 0.0
    """Seconds its next Run first spends replaying its logged calls (it was re-homed:
    its new home restores it from its snapshot and the calls logged since)."""
    pending: list[PendingCall] = field(default_factory=list)
    view: JobView | None = None
    trail: list[tuple[int, Function]] | None = None
    _described: tuple[int, Prior | None, CallEstimates, tuple[Function, ...], float] | None = None
    """(history version, prior, estimates, step calls) of the last view: rebuilt only when
    the history or the kind's figures changed."""
    _figures_of_step: tuple[int, int] = (-1, -1)
    """The (sample step, step) `_call_s` and `_useful` are for."""
    _call_s: dict[Function, float] = field(default_factory=dict)
    """Seconds of one call of each function in that step (`figures`), as Python floats:
    read once per call, millions of times a run, where indexing numpy arrays each time
    cost more than the rest of the lookup."""
    _useful: dict[Function, float] = field(default_factory=dict)
    """Group-seconds of useful work of one call of each function in that step."""
    job_id: str = field(init=False)

    def __post_init__(self) -> None:
        self.job_id = self.spec.job_id

    @classmethod
    def of(
        cls,
        spec: JobSpec,
        steps: Steps,
        devices: int,
        state_bytes: int,
        sampler_bytes: int = 0,
        alone_s: float | None = None,
    ) -> SimJob:
        """`alone_s`: its steps' seconds alone on a group of its own (default: a
        synchronous job's, their sum)."""
        result = JobResult(
            job_id=spec.job_id,
            profile=spec.profile,
            devices=devices,
            steps=spec.steps,
            arrival_s=spec.arrival_s,
            isolated_step_time_s=(
                alone_s if alone_s is not None else float(steps.isolated_step_s.sum())
            ),
            useful_device_s=float(steps.useful_work.sum()) * devices,
        )
        return cls(
            spec=spec,
            steps=steps,
            devices=devices,
            state_bytes=state_bytes,
            result=result,
            sampler_bytes=sampler_bytes,
        )

    @property
    def pinned(self) -> bool:
        return self.pins > 0

    def touch(self) -> None:
        self.view = None

    def bursting(self, hold_s: float) -> bool:
        """Whether its last gap between calls was within `hold_s` (its view's `burst_s`
        then moves with the clock: not cached)."""
        return 0 < self.last_gap_s <= hold_s

    def as_view(self, now: float, learned: dict[str, Prior], min_history_s: float) -> JobView:
        """The job as the live scheduler would describe it: its measured figures, or its
        kind's (`learned`, by profile) until it has a history. Cached until `touch`."""
        if self.view is None:
            h, prior = self.history, learned.get(self.spec.profile)
            cached = self._described
            if cached is None or cached[0] != h.version or cached[1] is not prior:
                seen = describe(h, prior, now, min_history_s)
                cached = (
                    h.version,
                    prior,
                    CallEstimates(seen.durations),
                    seen.step_calls,
                    seen.tail_s,
                )
                self._described = cached
                duty, bound = seen.duty_cycle, seen.duty_bound
            elif prior is None or h.has_history(now, min_history_s):
                duty, bound = h.duty_cycle(now, min_history_s), 0.0
            else:
                duty, bound = prior.duty_cycle, prior.duty_high
            if self.known_duty > 0 and not h.has_history(now, min_history_s):
                duty, bound = self.known_duty, 0.0
            self.view = JobView(
                job_id=self.spec.job_id,
                state_bytes=self.state_bytes,
                home=self.home,
                tier=self.tier,
                devices=self.devices,
                last_active=self.last_active,
                idle_until=self.idle_until,
                estimates=cached[2],
                duty_cycle=duty,
                duty_bound=bound,
                pinned=self.pins > 0,
                step_calls=cached[3],
                last_gap_s=self.last_gap_s,
                burst_s=now - self.burst_since if self.burst_since else 0.0,
                tail_s=cached[4],
                stall_s=self.stall_s,
                stall_sigma=self.stall_spread.sigma,
                sampler_bytes=self.sampler_bytes,
                staleness=self.steps.staleness,
                declared_steps=self.spec.declared_steps,
                train_slices=self.steps.fb_slices,
            )
        return self.view

    @property
    def asynchronous(self) -> bool:
        return self.steps.staleness > 0

    def _figures(self) -> None:
        """This step's figures of each call (recomputed when the step moves on)."""
        s, k, r = self.steps, min(self.step, self.steps.n - 1), self.sample_step
        fb = float(s.fb_s[k]) / s.fb_calls
        self._call_s = {
            Function.SAMPLE: float(s.dense_s[r]),
            Function.FORWARD_BACKWARD: fb,
            Function.OPTIM_STEP: s.optim_s,
            Function.SAVE: s.save_s,
            Function.CREATE: s.create_s,
        }
        self._useful = {
            Function.SAMPLE: float(s.dense_work[r]),
            Function.FORWARD_BACKWARD: fb * s.train_util,
            Function.OPTIM_STEP: s.optim_s * s.train_util,
            Function.SAVE: s.save_s * s.save_util,
        }
        self._figures_of_step = (r, self.step)

    def figures(self) -> tuple[dict[Function, float], dict[Function, float]]:
        """Seconds of one call of each function on the whole group (a sample: its
        rollout's; the rest: its training step's), and its group-seconds of useful work
        (absent: none)."""
        at = self._figures_of_step
        if at[0] != self.sample_step or at[1] != self.step:
            self._figures()
        return self._call_s, self._useful


class Tails(Protocol):
    """Where a job's stragglers decode: its home group (the executor)."""

    def start_tail(self, job: SimJob, tail_s: float, util: float) -> None:
        """Start the stragglers on the job's group (`tail_s` seconds alone, `util` of it);
        the job's `tail_done` follows when they end there."""
        ...

    def unhome(self, job: SimJob) -> None:
        """The job is done: its state leaves its group."""
        ...


class JobReplay:
    """Issues each job's calls as its client would, at the times its steps say."""

    def __init__(
        self, events: EventQueue, attention: Attention, tails: Tails, burst_gap_s: float = 0.0
    ) -> None:
        self.events = events
        self.attention = attention
        self.tails = tails
        self.burst_gap_s = burst_gap_s
        """A gap between a job's calls longer than this ends its burst (the policy's
        `hold_s`, as the live scheduler's `ClusterState` counts it)."""

    def _issue(self, job: SimJob, function: Function, index: int = 0) -> None:
        job.history.arrived(function)
        if job.last_active > 0 and not job.pending and not job.running:
            now = self.events.now
            job.last_gap_s = max(now - job.last_active, 1e-6)
            if job.last_gap_s > self.burst_gap_s or not job.burst_since:
                job.burst_since = now
        sample = function == _SAMPLE
        step = job.sample_step if sample else job.step
        job.pending.append(
            PendingCall(
                f"{job.spec.job_id}/{step}/{_NAMES[function]}{index}",
                job.spec.job_id,
                function,
                self.events.now,
                # A sample reads saved sampler weights (or the base), never the job's
                # training state: it may run on another group serving its base.
                sample,
            )
        )

    def arrive(self, job: SimJob) -> None:
        self._issue(job, Function.CREATE)
        self.attention.admission_due = True

    def calls_done(self, job: SimJob, calls: list[PendingCall]) -> None:
        """A Run of the job's `calls` ended: the loop moves on."""
        for call in calls:
            function = call.function
            if job.trail is not None:
                job.trail.append((job.sample_step if function == _SAMPLE else job.step, function))
            if function == _CREATE:
                self.begin_step(job)
            elif function == _SAMPLE:
                self._start_tail(job)
            elif function == _SAVE:
                if job.asynchronous:
                    self._saved(job)
                else:
                    self._step_done(job)

    def begin_step(self, job: SimJob) -> None:
        """Sample the step's rollout (the first of an asynchronous job: its lanes follow)."""
        if math.isnan(job.first_step_at):
            job.first_step_at = self.events.now
        job.idle_until = 0.0
        job.touch()
        if not job.asynchronous:
            job.sample_step = job.step
        self._issue(job, Function.SAMPLE)
        self.attention.group(job.home)

    def _start_tail(self, job: SimJob) -> None:
        s, k = job.steps, job.sample_step
        tail_s = float(s.tail_s[k])
        if tail_s <= 0:
            self._stall(job)
            return
        self.tails.start_tail(job, tail_s, float(s.tail_work[k]) / tail_s)
        job.touch()

    def tail_done(self, job: SimJob, seconds: float) -> None:
        """The job's stragglers ended `seconds` after the release (what the scheduler
        sees: the release, then the call's answer)."""
        job.history.tail(seconds)
        self._stall(job)

    def _stall(self, job: SimJob) -> None:
        """The rollout is done: its reward / tool stall begins."""
        k = job.sample_step
        # The job's idle hint, "reward / tool stall for about this long": the mean of its
        # own stalls so far (no hint before its first; none while its other lane runs).
        quiet = not job.asynchronous or (not job.pending and not job.running)
        job.idle_until = self.events.now + job.stalls_s / k if k and quiet else 0.0
        job.stall_s = job.stalls_s / k if k else 0.0
        job.touch()
        stall = float(job.steps.reward_s[k])
        job.stalls_s += stall
        self.events.push(self.events.now + stall, Event.TRAIN_CALLS, job)
        self.attention.group(job.home)

    def issue_train(self, job: SimJob) -> None:
        """The stall ended: a synchronous job trains on its rollout; an asynchronous one
        has it scored (`_scored`)."""
        job.stall_spread.add(float(job.steps.reward_s[job.sample_step]))
        if job.asynchronous:
            self._scored(job)
            return
        self._train(job)

    def _train(self, job: SimJob) -> None:
        for i in range(job.steps.fb_calls):
            self._issue(job, Function.FORWARD_BACKWARD, i)
        self._issue(job, Function.OPTIM_STEP)
        self._issue(job, Function.SAVE)
        job.idle_until = 0.0
        job.touch()
        self.attention.group(job.home)

    def _step_done(self, job: SimJob) -> None:
        now = self.events.now
        misc = float(job.steps.misc_s[job.step])
        hint = job.gaps_s / job.step if job.step else 0.0
        job.gaps_s += misc
        job.step += 1
        if job.step >= job.steps.n:
            self.events.push(now + misc, Event.FINISH, job)
            return
        job.idle_until = now + hint if hint else 0.0
        job.touch()
        self.events.push(now + misc, Event.NEXT_STEP, job)

    # The asynchronous loop -------------------------------------------------------------

    def next_step(self, job: SimJob) -> None:
        """A host-side gap ended: the next step's sample (synchronous), or the training
        lane free for the next rollout (asynchronous)."""
        if not job.asynchronous:
            self.begin_step(job)
            return
        job.step += 1
        job.training = False
        if job.scored > job.step:
            self._train_next(job)

    def _scored(self, job: SimJob) -> None:
        """Rollout `sample_step` is scored: the rollout lane samples the next one (as soon
        as its weights may be used), the training lane trains on this one if free."""
        k = job.sample_step
        job.scored = k + 1
        if k + 1 < job.steps.n:
            job.sample_step = k + 1
            if job.saves >= k + 1 - job.steps.staleness:
                self._issue(job, Function.SAMPLE)
            else:
                job.sample_blocked = True
        if not job.training and job.step == k:
            self._train_next(job)
        job.idle_until = 0.0
        job.touch()
        self.attention.group(job.home)

    def _train_next(self, job: SimJob) -> None:
        job.training = True
        self._train(job)

    def _saved(self, job: SimJob) -> None:
        """A training step is saved: its weights may be sampled; after its host-side gap
        the training lane is free (`next_step`), or the job is done."""
        now = self.events.now
        job.saves = job.step + 1
        misc = float(job.steps.misc_s[job.step])
        job.gaps_s += misc
        if job.sample_blocked and job.saves >= job.sample_step - job.steps.staleness:
            job.sample_blocked = False
            self._issue(job, Function.SAMPLE)
            self.attention.group(job.home)
        kind = Event.FINISH if job.saves >= job.steps.n else Event.NEXT_STEP
        self.events.push(now + misc, kind, job)

    def finish(self, job: SimJob) -> None:
        r = job.result
        r.finish_s = self.events.now
        r.step_time_s = self.events.now - job.first_step_at
        r.learned_duty = job.history.duty_cycle(self.events.now, 0.0)
        self.tails.unhome(job)
        self.attention.admission_due = True
