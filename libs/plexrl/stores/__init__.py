"""Metadata in Redis, one narrow store per concern over one shared connection.

A component takes only the stores it uses (a worker's residency tracker gets a
`ResidencyStore`, not everything); a service's `main` builds them all at once with
`Stores.from_url`. Key names and record encodings are unchanged from the single store
they were split from, so data written by an older version reads the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from plexrl.redis_target import RedisTarget
from plexrl.stores.calls import CallStore, FutureRecord, PayloadStore
from plexrl.stores.checkpoints import (
    CheckpointFile,
    CheckpointRecord,
    CheckpointStore,
    FencedWriteError,
    is_ephemeral,
)
from plexrl.stores.jobs import JobKind, JobRecord, JobStore
from plexrl.stores.redis import RedisKeys, RedisStore
from plexrl.stores.residency import Residency, ResidencyStore
from plexrl.stores.sessions import SessionRecord, SessionStore
from plexrl.stores.timeline import TimelineEntry, TimelineStore
from plexrl.stores.usage import UsageStore
from plexrl.stores.workers import WorkerStore

if TYPE_CHECKING:
    from plexrl.settings import CommonSettings

__all__ = [
    "CallStore",
    "CheckpointFile",
    "CheckpointRecord",
    "CheckpointStore",
    "FencedWriteError",
    "FutureRecord",
    "JobKind",
    "JobRecord",
    "JobStore",
    "PayloadStore",
    "RedisKeys",
    "RedisStore",
    "Residency",
    "ResidencyStore",
    "SessionRecord",
    "SessionStore",
    "Stores",
    "TimelineEntry",
    "TimelineStore",
    "UsageStore",
    "WorkerStore",
    "is_ephemeral",
]


@dataclass(frozen=True)
class Stores:
    """Every store over one connection: for a service's `main` (and tests) to hand out."""

    keys: RedisKeys
    """The connection and key namespace (closed by `close`)."""
    jobs: JobStore
    calls: CallStore
    payloads: PayloadStore
    residency: ResidencyStore
    workers: WorkerStore
    sessions: SessionStore
    checkpoints: CheckpointStore
    timeline: TimelineStore
    usage: UsageStore

    @classmethod
    def over(cls, keys: RedisKeys) -> Stores:
        return cls(
            keys=keys,
            jobs=JobStore(keys),
            calls=CallStore(keys),
            payloads=PayloadStore(keys),
            residency=ResidencyStore(keys),
            workers=WorkerStore(keys),
            sessions=SessionStore(keys),
            checkpoints=CheckpointStore(keys),
            timeline=TimelineStore(keys),
            usage=UsageStore(keys),
        )

    @classmethod
    def from_url(cls, url: str, cluster_id: str, ttl_s: int) -> Stores:
        """Over one Redis at `url` (tools, tests)."""
        return cls.over(RedisKeys.from_url(url, cluster_id, ttl_s))

    @classmethod
    def from_settings(cls, settings: CommonSettings) -> Stores:
        """A service's stores: its Redis as the settings say (a URL, or Sentinels), the
        replicas its durable writes wait for, its cluster's keys and record TTL."""
        target = RedisTarget.from_settings(settings)
        return cls.over(RedisKeys.connect(target, settings.cluster_id, settings.record_ttl_s))

    async def close(self) -> None:
        await self.keys.close()
