"""Topic `plexrl.dispatch.<worker>` (key: job id): scheduler → that worker.

A Dispatch says which calls to run, in order, and which states to move first.
The worker drops the states of `drop`, applies `evict` before `onload`, then runs
`calls`, then `prefetch`.
"""

from __future__ import annotations

import msgspec

from plexrl.messages.common import SCHEMA_VERSION, Tier
from plexrl.messages.requests import PhaseRequest


class StateMove(msgspec.Struct, frozen=True):
    """Move all of one job's states on this worker to a tier."""

    job_id: str
    to_tier: Tier


class Lease(msgspec.Struct, frozen=True):
    """The dispatch's hold on its job: a fencing token and the numbers of its calls.

    A worker applies a numbered call only while `epoch` is the job's current epoch and
    only as the successor of the job's last applied call (see `plexrl.ledger`).
    """

    epoch: int
    """Bumped each time the job is (re-)homed; an older epoch is stale."""
    seqs: list[int]
    """Parallel to `calls`: each call's seq in its job; 0 for an unnumbered call."""


class Dispatch(msgspec.Struct, frozen=True):
    dispatch_id: str
    worker_id: str
    calls: list[PhaseRequest]
    """Run in order; all belong to jobs homed on this worker."""
    traceparents: list[str] = []
    """W3C traceparent of each call, parallel to `calls` (the Kafka header has the first)."""
    evict: list[StateMove] = []
    """Moves down (device → host/disk) that make room, applied first."""
    prefetch: list[StateMove] = []
    """Moves up for a job likely next, applied after the calls."""
    drop: list[str] = []
    """Jobs re-homed away from this worker between calls (`plexrl.policy.Rehome`): it
    drops its copies of their states first, leaving their records be (the new home
    restores each from its snapshot and logged calls)."""
    issued_at: float = 0.0
    lease: Lease | None = None
    """None (an older scheduler): the calls run unnumbered and unfenced."""
    leader_token: int = 0
    """The fencing token of the scheduler's term that sent it (`plexrl.lease`): a worker
    skips a dispatch whose token is below the latest leader's (its sender was deposed;
    the new leader dispatches those calls again). 0: no leader election (one scheduler,
    or an older one), never skipped."""
    sliceable: bool = False
    """Its last call, a numbered `forward_backward`, may be preempted between
    micro-batches (`PreemptBatch`): the worker runs it a micro-batch at a time. False
    (a synchronous job's training, which the scheduler never preempts, or an older
    scheduler): the worker runs it whole."""
    schema_version: int = SCHEMA_VERSION


class PreemptBatch(msgspec.Struct, frozen=True):
    """Scheduler → worker, on the worker's control topic (`Topics.control`): let the next
    dispatch in beside the running sample batch of `dispatch_id` now, without waiting for
    its tail, and pause that batch while the next dispatch's other calls run. The same
    for a numbered `forward_backward` on a worker that slices training
    (`WorkerHeartbeat.slices_training`): it pauses at its next micro-batch until the
    next dispatch ends. The worker answers with a TailReleased of reason PREEMPT (the
    scheduler then sends the next dispatch), or with nothing when the batch or call had
    already finished or was released."""

    worker_id: str
    dispatch_id: str
    for_job: str
    """The job whose pending calls the batch is preempted for (logged, traced)."""
    issued_at: float = 0.0
    schema_version: int = SCHEMA_VERSION
