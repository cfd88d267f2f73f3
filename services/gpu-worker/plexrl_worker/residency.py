"""Where each job's state lives on this worker (device, host, disk), and moving it.

Device: the engine holds the job. Host: each rank's CPU copy of its shard, out of the
engine. Disk: the state in the state-store (a blob, or a blob set for a group). The
executor moves the shards, every rank its own at once; this records each move in Redis
with a compare-and-set on the state's version and announces it as a ResidencyChanged
event.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from plexrl.kafka import Publisher
from plexrl.messages import ResidencyChanged, ResidentState, StateComponent, Tier
from plexrl.state_store_client import StateStoreClient
from plexrl.stores import Residency, ResidencyStore
from plexrl_worker import metrics, stored
from plexrl_worker.executor import Executor

log = logging.getLogger(__name__)

_COMPONENTS = [StateComponent.WEIGHTS, StateComponent.OPTIMIZER, StateComponent.GRADIENTS]


class ResidencyConflictError(RuntimeError):
    """Another actor moved this job's state since we last looked."""


@dataclass
class _Held:
    tier: Tier
    bytes: int
    """The whole state's bytes (each rank holds its share, `Executor.rank_bytes`)."""
    version: int
    blob_key: str | None = None
    """Where the state is on the disk tier (a blob, or a blob set's manifest)."""


class StateManager:
    """The leader's record of where each job's state is (tier, bytes, version) and of
    the moves that change it; the executor moves the shards themselves."""

    def __init__(
        self,
        *,
        worker_id: str,
        executor: Executor,
        residency: ResidencyStore,
        store: StateStoreClient,
        publisher: Publisher,
        events_topic: str,
    ) -> None:
        self._worker_id = worker_id
        self._executor = executor
        self._residency = residency
        self._store = store
        self._publisher = publisher
        self._events_topic = events_topic
        self._held: dict[str, _Held] = {}

    def tier(self, job_id: str) -> Tier | None:
        held = self._held.get(job_id)
        return held.tier if held else None

    def resident(self) -> list[ResidentState]:
        return [
            ResidentState(job_id, h.tier, h.bytes, h.version) for job_id, h in self._held.items()
        ]

    def bytes_in(self, tier: Tier) -> int:
        return sum(h.bytes for h in self._held.values() if h.tier == tier)

    def rank_bytes_in(self, tier: Tier) -> list[int]:
        """Each rank's bytes of job state in `tier`."""
        out = [0] * self._executor.ranks
        for job_id, held in self._held.items():
            if held.tier == tier:
                for rank, n in enumerate(self._executor.rank_bytes(job_id, held.bytes)):
                    out[rank] += n
        return out

    async def created(self, job_id: str, nbytes: int) -> None:
        """A job's state now exists on the device tier (after CREATE)."""
        # A re-created job (after a worker restart, say) continues its record's versions;
        # the record moves here whoever wrote it last (a former home back from a cut-off
        # may write it meanwhile: read it again). Failing, the engine's copy goes too, so
        # the engine and this record never disagree on whether the state is here.
        for attempt in range(3):
            current = await self._residency.get_residency(job_id)
            previous = _Held(current.tier, current.bytes, current.version) if current else None
            try:
                version = await self._record(job_id, previous, Tier.DEVICE, nbytes)
                break
            except ResidencyConflictError:
                if attempt == 2:
                    await self._executor.drop(job_id)
                    raise
        self._held[job_id] = _Held(Tier.DEVICE, nbytes, version)
        await self._announce(job_id, None, Tier.DEVICE, nbytes, version, 0.0)

    async def restored(self, job_id: str, nbytes: int) -> None:
        """A job's state was rebuilt on the device tier here (from its snapshot and log);
        its residency record moves here whichever worker it named before."""
        await self.created(job_id, nbytes)

    async def forget(self, job_id: str) -> None:
        """Drop this worker's copy of a job without touching its records: the copy is
        stale, or the job is another worker's now (whose residency record stands)."""
        held = self._held.pop(job_id, None)
        await self._executor.drop(job_id)
        if held is not None and held.blob_key:
            await stored.delete(self._store, held.blob_key)

    async def reannounce(self) -> int:
        """Write back the residency record of each state held here that Redis lacks (it
        restarted and lost it); returns how many. A record that exists is left alone:
        only an absent one is written (compare-and-set from version 0), at the version
        this worker holds, so its next move still finds the version it expects."""
        restored = 0
        for job_id, held in list(self._held.items()):
            if self._held.get(job_id) is not held:
                continue  # moved or dropped meanwhile: its own write stands
            record = Residency(self._worker_id, held.tier, held.bytes, held.version, time.time())
            if await self._residency.cas_residency(job_id, 0, record):
                restored += 1
        if restored:
            log.warning("wrote back %d residency records Redis had lost", restored)
        return restored

    async def dropped(self, job_id: str) -> None:
        held = self._held.pop(job_id, None)
        if held is None:
            return
        if held.blob_key:
            await stored.delete(self._store, held.blob_key)
        await self._residency.drop_residency(job_id)
        await self._announce(job_id, held.tier, None, 0, held.version + 1, 0.0)

    async def onload(self, job_id: str) -> float:
        """Bring the job onto the device tier; returns the seconds it took (0 if already there)."""
        held = self._held.get(job_id)
        if held is None or held.tier == Tier.DEVICE:
            return 0.0
        start = time.perf_counter()
        if held.tier == Tier.DISK:
            assert held.blob_key is not None
            await self._executor.fetch(job_id, held.blob_key)
        await self._executor.onload(job_id)
        return await self._moved(job_id, held, Tier.DEVICE, start, blob_key=None)

    async def move(self, job_id: str, to_tier: Tier) -> float:
        """Move a job's state down (or up, to device); returns seconds spent. A state
        the residency record gives to another worker (the job was re-homed while this
        one was cut off) is not this worker's to move: its copy is dropped instead."""
        held = self._held.get(job_id)
        if held is None or held.tier == to_tier:
            return 0.0
        current = await self._residency.get_residency(job_id)
        if current is not None and current.worker_id != self._worker_id:
            log.warning(
                "not moving %s: its state is %s's now (re-homed); this copy is dropped",
                job_id,
                current.worker_id,
            )
            await self.forget(job_id)
            return 0.0
        if to_tier == Tier.DEVICE:
            return await self.onload(job_id)
        start = time.perf_counter()
        if held.tier == Tier.DEVICE:
            await self._executor.offload(job_id)
        if to_tier == Tier.HOST:
            if held.tier == Tier.DISK:
                assert held.blob_key is not None
                await self._executor.fetch(job_id, held.blob_key)
            return await self._moved(job_id, held, Tier.HOST, start, blob_key=None)
        key = self._executor.stored_key(f"offload/{self._worker_id}/{job_id}/v{held.version + 1}")
        await self._executor.spill(job_id, key)
        if held.blob_key:
            await stored.delete(self._store, held.blob_key)
        return await self._moved(job_id, held, Tier.DISK, start, blob_key=key)

    async def _moved(
        self, job_id: str, held: _Held, to_tier: Tier, start: float, *, blob_key: str | None
    ) -> float:
        version = await self._record(job_id, held, to_tier, held.bytes)
        seconds = time.perf_counter() - start
        self._held[job_id] = _Held(to_tier, held.bytes, version, blob_key)
        await self._announce(job_id, held.tier, to_tier, held.bytes, version, seconds)
        metrics.swapped(held.tier, to_tier, held.bytes, seconds)
        log.debug("moved %s %s -> %s in %.3fs", job_id, held.tier, to_tier, seconds)
        return seconds

    async def _record(self, job_id: str, held: _Held | None, tier: Tier, nbytes: int) -> int:
        expected = held.version if held else 0
        record = Residency(self._worker_id, tier, nbytes, expected + 1, time.time())
        if not await self._residency.cas_residency(job_id, expected, record):
            current = await self._residency.get_residency(job_id)
            raise ResidencyConflictError(
                f"residency of {job_id} changed under us: expected version {expected}, "
                f"found {current}"
            )
        return expected + 1

    async def _announce(
        self,
        job_id: str,
        from_tier: Tier | None,
        to_tier: Tier | None,
        nbytes: int,
        version: int,
        seconds: float,
    ) -> None:
        event = ResidencyChanged(
            worker_id=self._worker_id,
            job_id=job_id,
            components=_COMPONENTS,
            from_tier=from_tier,
            to_tier=to_tier,
            bytes=nbytes,
            version=version,
            seconds=seconds,
            at=time.time(),
        )
        await self._publisher.publish_soon(self._events_topic, self._worker_id, event)
