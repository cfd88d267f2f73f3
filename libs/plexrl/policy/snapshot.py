"""The frozen view of the cluster that every policy function reads.

The live scheduler builds a ClusterSnapshot from Kafka events and Redis; the
simulator builds one from its own event queue. Policies never see anything else,
so both run exactly the same decisions.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from plexrl.messages import Function, Tier
from plexrl.policy.costs import SharingCosts
from plexrl.policy.frozen import quick_init

_TIER_ORDER = {Tier.DEVICE: 0, Tier.HOST: 1, Tier.DISK: 2}


@dataclass(frozen=True)
class SwapCosts:
    """Tier bandwidths; the one switch-cost model the scheduler and the simulator share."""

    device_host_bytes_per_s: float = 50e9
    """Device ↔ host copy bandwidth (PCIe Gen5 x16 ≈ 50 GB/s effective on H200-class nodes)."""
    host_disk_bytes_per_s: float = 5e9
    """Host ↔ NVMe bandwidth of the state-store's disk tier."""
    fixed_s: float = 0.0
    """Per-move overhead (engine bookkeeping, allocator), seconds."""

    def __post_init__(self) -> None:
        if self.device_host_bytes_per_s <= 0 or self.host_disk_bytes_per_s <= 0:
            raise ValueError("SwapCosts bandwidths must be positive; set them in bytes/s")

    def move_s(self, nbytes: int, src: Tier | None, dst: Tier) -> float:
        """Seconds to move `nbytes` from `src` to `dst` (None: created fresh, free)."""
        if src is None or src == dst:
            return 0.0
        lo, hi = sorted((_TIER_ORDER[src], _TIER_ORDER[dst]))
        seconds = self.fixed_s
        if lo == 0 and hi >= 1:
            seconds += nbytes / self.device_host_bytes_per_s
        if hi == 2 and lo <= 1:
            seconds += nbytes / self.host_disk_bytes_per_s
        return seconds


@quick_init
@dataclass(frozen=True)
class WorkerView:
    """One worker group as the scheduler believes it is now."""

    worker_id: str
    device_bytes: int
    """Capacity of the device tier for job states (shared base weights excluded)."""
    host_bytes: int
    """Capacity of the host tier."""
    devices: int = 1
    """Accelerators in the group; a job needs a group at least its size."""
    base_models: frozenset[str] = frozenset()
    """Base models this group can serve (empty: any)."""
    running: str | None = None
    """The job whose calls are in flight here, if any."""
    busy_until: float = 0.0
    """Expected end of the in-flight work (snapshot clock)."""
    tail_until: float = 0.0
    """When the stragglers decoding on the group in the background (released rollouts,
    its jobs' or roaming ones') are expected to end, by their jobs' mean tails (snapshot
    clock); 0: none decoding (`plexrl.policy.defer`)."""
    tail_jobs: frozenset[str] = frozenset()
    """The jobs whose stragglers decode on the group in the background."""
    sliced: bool = False
    """The in-flight Run is an asynchronous job's training, which the worker runs in
    micro-batch slices and can pause between two: it yields to a waiting sample
    (`plexrl.policy.preempt`). The simulator sets it for its sliced runs, the live
    scheduler where the run's dispatch said the worker may slice it
    (`Dispatch.sliceable`)."""
    preemptible_since: float | None = None
    """When the in-flight Run began, if it is sample calls only and not yet asked to
    yield (`plexrl.policy.preempt`); None otherwise. Only the live scheduler sets it."""
    healthy: bool = True
    sharing: SharingCosts | None = None
    """What sharing costs on this group, where its own worker measured it apart from the
    pool (`plexrl.policy.costs.by_worker`); None: the pool's (`PolicyConfig.sharing`). Only the
    live scheduler sets it: the simulator's groups share one workload's costs."""

    def costs(self, pool: SharingCosts) -> SharingCosts:
        """The costs of sharing to predict this group with: its own, else `pool`."""
        return pool if self.sharing is None else self.sharing


@quick_init
@dataclass(frozen=True)
class CallEstimates:
    """Expected seconds of each function for one job (running means, or a profile)."""

    seconds: Mapping[Function, float] = field(default_factory=dict)
    default_s: float = 0.05
    """Used for a function the job has not run yet."""

    def expected_s(self, function: Function) -> float:
        return self.seconds.get(function, self.default_s)


@quick_init
@dataclass(frozen=True)
class JobView:
    """One job: where it lives and what it costs to bring in."""

    job_id: str
    state_bytes: int
    """Bytes of the job's movable state (adapters or weights, optimizer, gradients)."""
    home: str | None = None
    """Its home worker group; None until admitted."""
    tier: Tier | None = None
    """Where its state is on the home group now; None until created."""
    devices: int = 1
    """The fewest devices (ranks) a group must have to run it."""
    replicated_bytes: int = 0
    """Of `state_bytes`, what every rank of a group holds whole (a LoRA adapter and its
    moments are replicated; the rest is sharded over the ranks): on a group of n ranks
    the job takes `group_bytes(n)` of its device tier."""
    base_model: str = ""
    last_active: float = 0.0
    """When its last call ended (snapshot clock): the LRU key for eviction."""
    idle_until: float = 0.0
    """From an idle hint: the job expects to make no call before this time."""
    estimates: CallEstimates = field(default_factory=CallEstimates)
    duty_cycle: float = 0.5
    """Estimated fraction of wall time the job keeps a device busy."""
    duty_bound: float = 0.0
    """While `duty_cycle` is borrowed from its kind (no history of its own yet), how
    busy it may well turn out (its kind's `history.Prior.duty_high`); admission guards
    the group's tail with it. 0: the duty cycle is the job's own, or nothing to say."""
    review: bool = False
    """Its home was chosen on its kind's figures (a newcomer) and it has figures of its
    own now: the plexrl policy reviews its home once (`plexrl.policy.rehome`) and the
    caller clears this on the answer (a `Rehome`)."""
    pinned: bool = False
    """Its device-tier state is in use outside any Run (e.g. a rollout's straggler
    sequences still decoding after the group was released); never evict it."""
    step_calls: tuple[Function, ...] = ()
    """The calls one training step of the job makes, in order, when known (from its
    profile or its observed loop); empty: unknown."""
    tenant: str = ""
    """Who owns the job: FIFO takes tenants in turns on a group (`policy.fifo`)."""
    last_gap_s: float = 0.0
    """Seconds between the end of its calls and its next call, the last time it had
    nothing queued (its client's round trip, or a stall); 0: not seen. The live
    scheduler holds a group for a job in a burst of calls (`policy.anticipate`)."""
    burst_s: float = 0.0
    """Seconds since the first call of its current burst (its calls since its last gap
    longer than the scheduler's hold); 0: not in one."""
    used_s: float = 0.0
    """Engine seconds (swap + compute) its calls used, each weighed by half for every
    `plexrl.policy.history.USAGE_HALF_LIFE_S` since it ended: its recent use of its
    group, which a tenant's share sums (`policy.share`)."""
    last_started: float = 0.0
    """When its latest Run began (snapshot clock; 0: none seen): one turn of its tenant
    on its group (`policy.share`)."""
    sampler_bytes: int = 0
    """Bytes a sampling engine on another group loads to sample its saved weights
    (`plexrl.policy.roam`); 0: nothing to load (a LoRA adapter's few MB count as none)."""
    staleness: int = 0
    """The steps its rollouts may lag its training (declared, `/plexrl/v1`): 0, a
    synchronous loop; k >= 1, it samples its next rollout while it trains on the last,
    so waits of its training calls up to about k steps are off its critical path."""
    train_slices: int = 1
    """Slices each of its `forward_backward` calls runs in on its group, at whose ends
    an asynchronous job's training yields to a neighbour's sample (the simulator's
    `Profile.fb_slices`); 1: whole, or not known (the live worker's slices are its
    micro-batches, which the scheduler does not count)."""
    tail_s: float = 0.0
    """Seconds its rollouts' stragglers go on decoding after the group is released to
    others (`TailReleased` to the last answer), as observed; 0: none seen. The plexrl
    policy predicts the costs of sharing from it (`plexrl.policy.costs`)."""
    stall_s: float = 0.0
    """Mean seconds of its reward / tool stalls, as its idle hints said them; 0: none
    seen. With `tail_s` and its sample's seconds it gives an asynchronous loop's rollout
    cycle alone, which its queueing does not bias (`plexrl.policy.plexrl_policy`)."""
    stall_sigma: float = 0.0
    """How widely its stalls vary: the log-standard deviation of the stalls seen (from
    an idle hint to the job's next call; `history.Spread`); 0: fewer than two seen. An
    asynchronous job's slack is a rollout cycle long, so a short stall leaves its
    training little room: the plexrl policy reads the slack as varying with its stalls
    (`plexrl.policy.plexrl_policy.two_lanes_s`)."""
    declared_steps: int = 0
    """The training steps the job declared it runs in all (`/plexrl/v1` job options);
    0: not declared. The plexrl policy admits the longest declared work first
    (`PolicyConfig.longest_first`)."""

    def group_bytes(self, devices: int) -> int:
        """Device bytes the job takes on a group of `devices` ranks, all ranks together:
        each holds its share of the sharded part and the whole replicated part."""
        return self.state_bytes + self.replicated_bytes * (devices - 1)


@quick_init
@dataclass(frozen=True)
class PendingCall:
    """A call waiting in the scheduler's queue."""

    request_id: str
    job_id: str
    function: Function
    arrival_time: float
    portable: bool = False
    """It reads nothing of the job's training state (a sample of saved sampler weights,
    or of the base): it may run before the job's earlier calls, on any group that
    serves the job's base model (`plexrl.policy.roam`)."""


def samples_first(calls: list[PendingCall]) -> list[PendingCall]:
    """One job's pending calls (in arrival order) in the order its Runs take them: its
    portable calls first, each kind in arrival order (`calls` itself where that is its
    order). An asynchronous job's rollout lane runs ahead of its training lane by up to
    its staleness, and its sample of saved weights needs nothing of the training calls
    sent before it: every rule of the policy (dispatch order, deferral, preemption,
    co-sampling) then sees that sample as the job's next call."""
    other = False
    for call in calls:
        if not call.portable:
            other = True
        elif other:
            return [c for c in calls if c.portable] + [c for c in calls if not c.portable]
    return calls


@dataclass(frozen=True)
class ClusterSnapshot:
    now: float
    workers: Mapping[str, WorkerView]
    jobs: Mapping[str, JobView]
    pending: tuple[PendingCall, ...]
    """In arrival order."""
    swap: SwapCosts = field(default_factory=SwapCosts)
    _homes: dict[str, list[JobView]] | None = field(
        default=None, init=False, repr=False, compare=False
    )
    """The jobs by home, built at the first question that needs it (`_by_home`): per-group
    questions then cost O(jobs on the group), not O(all jobs)."""
    _calls: dict[str, list[PendingCall]] | None = field(
        default=None, init=False, repr=False, compare=False
    )
    """The pending calls by job, likewise (`_pending_by_job`)."""

    def __post_init__(self) -> None:
        # (Here, not by `quick_init`: a compiled build's classes leave an `init=False`
        # field unset.)
        object.__setattr__(self, "_homes", None)
        object.__setattr__(self, "_calls", None)

    def _by_home(self) -> dict[str, list[JobView]]:
        index: dict[str, list[JobView]] = {}
        for job in self.jobs.values():
            home = job.home
            if home is not None:
                homed = index.get(home)
                if homed is None:
                    index[home] = [job]  # (not setdefault: no empty list per job)
                else:
                    homed.append(job)
        object.__setattr__(self, "_homes", index)  # a cache: the snapshot stays as built
        return index

    def _pending_by_job(self) -> dict[str, list[PendingCall]]:
        index: dict[str, list[PendingCall]] = {}
        ahead: list[str] = []
        for call in self.pending:
            calls = index.get(call.job_id)
            if calls is None:
                index[call.job_id] = [call]
            else:
                if call.portable and not calls[-1].portable:
                    ahead.append(call.job_id)
                calls.append(call)
        for job_id in ahead:
            index[job_id] = samples_first(index[job_id])
        object.__setattr__(self, "_calls", index)
        return index

    # The indexes' readers test the cache themselves: the policy asks them millions of
    # times a simulated run, and a property's call would cost more than the read.

    def callers(self) -> Iterable[str]:
        """The jobs with pending calls, each once, in the order of their oldest call."""
        index = self._calls
        return (index if index is not None else self._pending_by_job()).keys()

    def calls_of(self, job_id: str) -> list[PendingCall]:
        """The job's pending calls in the order its Runs take them (`samples_first`)."""
        return list(self.calls_view(job_id))

    def device_used(self, worker_id: str) -> int:
        return sum(j.state_bytes for j in self.homed_view(worker_id) if j.tier == Tier.DEVICE)

    def host_used(self, worker_id: str) -> int:
        return sum(j.state_bytes for j in self.homed_view(worker_id) if j.tier == Tier.HOST)

    def homed(self, worker_id: str) -> list[JobView]:
        return list(self.homed_view(worker_id))

    # Read-only views of the indexes, not copied: for the policy's own loops, which run
    # once per decision (the simulator makes millions) and never change what they read.

    def homed_view(self, worker_id: str) -> Sequence[JobView]:
        """`homed`, not copied: do not change it."""
        index = self._homes
        return (index if index is not None else self._by_home()).get(worker_id, ())

    def calls_view(self, job_id: str) -> Sequence[PendingCall]:
        """`calls_of`, not copied: do not change it."""
        index = self._calls
        return (index if index is not None else self._pending_by_job()).get(job_id, ())
