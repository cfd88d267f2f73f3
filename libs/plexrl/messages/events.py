"""Topic `plexrl.events` (key: worker id): workers and state-store → scheduler, dashboards.

One tagged union, so a consumer decodes any event with one decoder and a
`match` on the type.
"""

from __future__ import annotations

import enum

import msgspec

from plexrl.messages.common import SCHEMA_VERSION, StateComponent, Tier


class ResidentState(msgspec.Struct, frozen=True):
    """One job's state components on a worker, as the worker last saw them."""

    job_id: str
    tier: Tier
    bytes: int
    version: int


class RankMemory(msgspec.Struct, frozen=True):
    """One rank of a worker group and the job-state memory on it."""

    rank: int
    device: str
    """`cpu`, `cuda:0`, ... (the rank's own)."""
    device_bytes: int
    """Capacity of this rank's device tier for job states (its share of each)."""
    device_used: int
    """Bytes of job state (this rank's shards) on the device now."""
    host_used: int
    """Bytes of job state (this rank's shards) in host memory now."""


class SharingMeasured(msgspec.Struct, frozen=True):
    """What sharing a worker costs, as it measured on its own calls
    (`plexrl_worker.sharing`): each of the costs the plexrl policy predicts with
    (`plexrl.policy.costs.SharingCosts`) and the samples it rests on (0: not measured)."""

    switch_s: float = 0.0
    """Seconds a compute call spends when the engine's previous call was of another job
    (beyond moving its state onto the device, which is not the call's compute)."""
    switches: int = 0
    tail_share: float = 0.0
    """The share of the device a released tail took from a compute call beside it."""
    shared_calls: int = 0
    tail_contention: float = 1.0
    """How many times longer a released tail's decode step took beside a compute call."""
    tail_steps: int = 0
    """Steps it rests on (the fewer of those beside a call and those not)."""


class WorkerHeartbeat(msgspec.Struct, frozen=True, tag="heartbeat"):
    worker_id: str
    device: str
    """`cpu`, `cuda:0`, ..."""
    device_bytes: int
    """Capacity of the device tier for job states, the group's ranks together (base
    models excluded); each rank holds its share (`ranks`)."""
    host_bytes: int
    base_models: list[str]
    resident: list[ResidentState]
    busy: bool
    started_at: float
    sent_at: float
    devices: int = 1
    """Accelerators in this worker group (its ranks, one device each)."""
    sampler: str = "torch"
    """What runs its `sample` calls: `torch` (the engine's co-batching loop) or `sglang`."""
    ranks: list[RankMemory] = msgspec.field(default_factory=list)
    """Each rank's device and memory (empty from a worker that does not say)."""
    slices_training: bool = False
    """Whether it runs a numbered `forward_backward` a micro-batch at a time, so that
    the scheduler may preempt it between two (`PreemptBatch`)."""
    sharing: SharingMeasured | None = None
    """What sharing it costs, measured (None from a worker that does not measure)."""
    schema_version: int = SCHEMA_VERSION


class ResidencyChanged(msgspec.Struct, frozen=True, tag="residency"):
    worker_id: str
    job_id: str
    components: list[StateComponent]
    from_tier: Tier | None
    """None when the state was just created."""
    to_tier: Tier | None
    """None when the state was dropped."""
    bytes: int
    version: int
    seconds: float
    at: float
    schema_version: int = SCHEMA_VERSION


class JobAdmitted(msgspec.Struct, frozen=True, tag="job_admitted"):
    job_id: str
    tenant: str
    home_worker: str
    base_model: str
    state_bytes: int
    at: float
    schema_version: int = SCHEMA_VERSION


class JobFinished(msgspec.Struct, frozen=True, tag="job_finished"):
    job_id: str
    tenant: str
    reason: str
    at: float
    schema_version: int = SCHEMA_VERSION


class IdleHint(msgspec.Struct, frozen=True, tag="idle_hint"):
    """A job says it will make no call for about `seconds` (tool or reward stall)."""

    job_id: str
    tenant: str
    seconds: float
    at: float
    schema_version: int = SCHEMA_VERSION


class JobOptions(msgspec.Struct, frozen=True, tag="job_options"):
    """A job declares how its loop runs (`POST /plexrl/v1/jobs/{id}/options`); kept in
    its record too, for a scheduler that starts later."""

    job_id: str
    tenant: str
    staleness: int
    """0: synchronous; k: it samples its next rollouts with sampler weights up to k steps
    older than its newest, while it trains (`JobView.staleness`)."""
    at: float
    steps: int = 0
    """The training steps it expects to run in all; 0: not declared
    (`JobView.declared_steps`: the plexrl policy admits the longest work first)."""
    schema_version: int = SCHEMA_VERSION


class ReleaseReason(enum.StrEnum):
    """Why a worker let its next dispatch in beside a running sample batch."""

    TAIL = "tail"
    """Fewer than the tail threshold of the batch's sequences still decode."""
    PREEMPT = "preempt"
    """The scheduler preempted the batch for a waiting job's calls (`PreemptBatch`); the
    batch pauses while the next dispatch's non-sample calls run, then goes on."""


class TailReleased(msgspec.Struct, frozen=True, tag="tail_released"):
    """A worker's running sample batch is down to its straggling tail: fewer than the
    threshold fraction of its sequences still decode (the simulator's `tail_threshold`
    means the same). The worker takes its next dispatch now, co-batched beside the tail;
    the scheduler may send one, and keeps the straggling jobs' states pinned on the
    device until their calls complete."""

    worker_id: str
    dispatch_id: str
    request_ids: list[str]
    """The dispatch's calls still running in the tail."""
    job_ids: list[str]
    remaining: int
    """Sequences still decoding."""
    total: int
    """Sequences the released calls sample in all."""
    at: float
    reason: ReleaseReason = ReleaseReason.TAIL
    """Why: down to its tail, or preempted by the scheduler (`PreemptBatch`)."""
    schema_version: int = SCHEMA_VERSION


Event = (
    WorkerHeartbeat
    | ResidencyChanged
    | JobAdmitted
    | JobFinished
    | IdleHint
    | TailReleased
    | JobOptions
)
