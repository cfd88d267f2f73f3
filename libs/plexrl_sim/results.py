"""What a simulated deployment reports: one record per job, the cluster timeline, and
the figures derived from them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

HOUR = 3600.0


@dataclass
class JobResult:
    job_id: str
    profile: str
    devices: int
    steps: int
    arrival_s: float
    start_s: float = math.nan
    """When it got its pool or home group."""
    finish_s: float = math.nan
    step_time_s: float = 0.0
    """Sum of its step times (first step start to last step end)."""
    isolated_step_time_s: float = 0.0
    """The same steps on a dedicated group: the slowdown reference."""
    useful_device_s: float = 0.0
    """Device-seconds of useful work (identical in every deployment)."""
    used_device_s: float = 0.0
    """Device-seconds it is charged (the DESIGN's accounting, the paper's "user GPU-hour
    cost"): a dedicated pool for its whole run; on a shared group its calls, its
    stragglers' share of the group and its swaps."""
    occupied_gpu_s: float = 0.0
    """Cluster view of its cost: its pool, or its share (by use) of every second its
    group was held, idle time included."""
    call_queue_s: float = 0.0
    """Seconds it was ready to run (a call pending, its previous Run over) while its
    group ran something else, summed over its Runs."""
    swap_s: float = 0.0
    compute_s: float = 0.0
    swaps: int = 0
    swapped_bytes: float = 0.0
    group: str = ""
    rejected: str = ""
    learned_duty: float = math.nan
    """Its duty cycle as the scheduler had learned it by its last step
    (`CallHistory.duty_cycle`); NaN: it did not finish."""
    rehomed_from: str = ""
    """The group it left when its home was reviewed (`plexrl.policy.rehome`); empty:
    it kept its first home."""
    roamed: int = 0
    """Calls of it that ran on a group other than its home (`plexrl.policy.roam`)."""
    rollout_share: float = math.nan
    """Split-Async only: the share of its pool the job's rollouts got (searched per job)."""

    @property
    def admission_wait_s(self) -> float:
        return self.start_s - self.arrival_s

    @property
    def slowdown(self) -> float:
        """Step-time slowdown against the dedicated (Isolated) run of the same steps."""
        if self.isolated_step_time_s <= 0:
            return 0.0
        return self.step_time_s / self.isolated_step_time_s - 1.0

    @property
    def done(self) -> bool:
        return not math.isnan(self.finish_s)


@dataclass
class Timeline:
    """Per-hour sums of allocated and busy device-seconds."""

    bin_s: float = HOUR
    allocated: list[float] = field(default_factory=lambda: [0.0] * (24 * 30))
    busy: list[float] = field(default_factory=lambda: [0.0] * (24 * 30))
    # Python lists, not numpy arrays: a shared deployment adds to one bin millions of
    # times, and a numpy element costs more to update than a list's.

    def _grow(self, n: int) -> None:
        size = len(self.allocated)
        if n > size:
            more = [0.0] * (max(n, 2 * size) - size)
            self.allocated.extend(more)
            self.busy.extend(more)

    def add(self, which: str, start: float, end: float, device_s: float) -> None:
        """Spread `device_s` evenly over [start, end)."""
        if device_s <= 0:
            return
        bin_s = self.bin_s
        b0 = int(start // bin_s)
        b1 = int(end // bin_s) if end > start else b0
        if b1 >= len(self.allocated):
            self._grow(b1 + 1)
        arr = self.allocated if which == "allocated" else self.busy
        if b0 == b1:
            arr[b0] += device_s
            return
        rate = device_s / (end - start)
        lo = start
        for b in range(b0, b1):
            hi = (b + 1) * bin_s
            arr[b] += rate * (hi - lo)
            lo = hi
        arr[b1] += rate * (end - lo)

    def trimmed(self, end_s: float) -> tuple[np.ndarray, np.ndarray]:
        n = max(1, math.ceil(end_s / self.bin_s))
        self._grow(n)
        return np.array(self.allocated[:n], dtype=float), np.array(self.busy[:n], dtype=float)


@dataclass
class GroupUsage:
    group_id: str
    devices: int
    held_s: float = 0.0
    """Time the group had at least one job homed."""
    used_device_s: float = 0.0
    peak_jobs: int = 0


@dataclass
class DeploymentResult:
    name: str
    kind: str
    """'dedicated' or 'multiplexed'."""
    gpus: int
    jobs: list[JobResult]
    timeline: Timeline
    groups: list[GroupUsage] = field(default_factory=list)
    wall_s: float = 0.0
    """Seconds the simulation itself took."""
    events: int = 0
    plans: int = 0
    """Policy calls (multiplexed only)."""
    plan_s: float = 0.0
    """Seconds spent inside the policy."""
    counts: dict[str, int] = field(default_factory=dict)
    """What the live scheduler's extras did (multiplexed only): `preempted` sample batches,
    `cosampled` calls that rode in another job's batch, `held` groups (a hold decided)."""

    @property
    def finished(self) -> list[JobResult]:
        return [j for j in self.jobs if j.done]

    @property
    def makespan_s(self) -> float:
        done = self.finished
        if not done:
            return 0.0
        return max(j.finish_s for j in done) - min(j.arrival_s for j in self.jobs)

    def gpu_hours_per_step(self, profile: str | None = None, basis: str = "charged") -> float:
        """GPU-hours per training step: `charged` (what the jobs are billed) or
        `occupied` (what the cluster spent on them, idle included)."""
        sel = [j for j in self.finished if profile is None or j.profile == profile]
        steps = sum(j.steps for j in sel)
        if not steps:
            return math.nan
        if basis == "charged":
            return sum(j.used_device_s for j in sel) / HOUR / steps
        return sum(j.occupied_gpu_s for j in sel) / HOUR / steps

    def slowdowns(self, profile: str | None = None) -> np.ndarray:
        """Each finished job's slowdown (of `profile`'s jobs only, where given)."""
        return np.array(
            [j.slowdown for j in self.finished if profile is None or j.profile == profile]
        )

    def mean_slowdown(self) -> float:
        s = self.slowdowns()
        return float(s.mean()) if s.size else math.nan

    def bubble_ratio(self, profile: str | None = None) -> float:
        """Idle fraction of the device-seconds the jobs occupied (1 - useful / used)."""
        sel = [j for j in self.finished if profile is None or j.profile == profile]
        used = sum(j.used_device_s for j in sel)
        return 1 - sum(j.useful_device_s for j in sel) / used if used else math.nan

    def busy_fraction(self) -> float:
        """Useful device-seconds over the cluster's device-seconds until the makespan."""
        span = self.makespan_s
        if span <= 0:
            return math.nan
        return sum(j.useful_device_s for j in self.finished) / (self.gpus * span)
