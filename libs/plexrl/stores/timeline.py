"""The timeline: every call as it ran, which job, on which worker, when."""

from __future__ import annotations

from typing import Any

import msgspec

from plexrl.messages import decode, encode
from plexrl.stores.redis import RedisStore, raw_bytes


class TimelineEntry(msgspec.Struct, frozen=True):
    """One call as it ran: which job, where, and when (wall-clock seconds)."""

    worker_id: str
    job_id: str
    request_id: str
    function: str
    started_at: float
    swap_s: float
    compute_s: float
    ok: bool
    tail_released_at: float | None = None
    """When the worker let its next dispatch in beside this sample call's straggling
    tail (wall clock); None if it never did."""
    preempted: bool = False
    """The release was the scheduler preempting the call (`PreemptBatch`), not its tail:
    it paused while the dispatch it yielded to ran."""
    slices: int = 0
    """The micro-batches a `forward_backward` ran in, paused or not between them
    (`Dispatch.sliceable`); 0: it ran whole."""
    queue_s: float = 0.0
    """Seconds from the call's arrival at the gateway to `started_at` (`Timings.queue_s`):
    the Kafka hops and the scheduler, and the wait while the device ran other calls."""


class TimelineStore(RedisStore):
    """The `timeline` stream, trimmed to about its last `max_len` entries."""

    async def append_timeline(self, entry: TimelineEntry, max_len: int = 100_000) -> None:
        await self._redis.xadd(
            self._k("timeline"), {"e": encode(entry)}, maxlen=max_len, approximate=True
        )

    def queue_timeline(self, pipe: Any, entry: TimelineEntry, max_len: int = 100_000) -> None:
        """`append_timeline` on a pipeline (`RedisStore.pipeline`)."""
        pipe.xadd(self._k("timeline"), {"e": encode(entry)}, maxlen=max_len, approximate=True)

    async def timeline(self, since: float = 0.0, limit: int = 1000) -> list[TimelineEntry]:
        """Entries whose call started at or after `since`, oldest first."""
        start = f"{int(since * 1000)}-0" if since > 0 else "-"
        rows: Any = await self._redis.xrange(self._k("timeline"), min=start, count=limit)
        return [decode(raw_bytes(fields[b"e"]), TimelineEntry) for _, fields in rows or []]
