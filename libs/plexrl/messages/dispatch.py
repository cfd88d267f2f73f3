"""Topic `plexrl.dispatch.<worker>` (key: job id): scheduler → that worker.

A Dispatch says which calls to run, in order, and which states to move first.
The worker applies `evict` before `onload`, then runs `calls`, then `prefetch`.
"""

from __future__ import annotations

import msgspec

from plexrl.messages.common import SCHEMA_VERSION, Tier
from plexrl.messages.requests import PhaseRequest


class StateMove(msgspec.Struct, frozen=True):
    """Move all of one job's states on this worker to a tier."""

    job_id: str
    to_tier: Tier


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
    issued_at: float = 0.0
    schema_version: int = SCHEMA_VERSION
