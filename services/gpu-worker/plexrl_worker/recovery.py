"""A job's recovery: restore from the ledger, snapshot after commits, archive results.

Before a numbered call runs (`plexrl_worker.numbering`), the worker makes sure its copy
of the job is the ledger's latest: if it holds none (it restarted, or the job was
re-homed here) or an older one, it rebuilds the job from its snapshot plus the logged
calls since, replayed in order on the engine, which is deterministic, so the result is
bit for bit the state the dead worker had. The snapshot may come from a group of any
size (`plexrl_worker.stored`). After a mutating call commits, the job is snapshotted
to the disk tier every `SnapshotConfig.every_calls` logged calls (and after CREATE and
LOAD): the copy is taken before the next call runs, the write goes on behind (on a
group every rank writes its own shard). Once a snapshot is recorded (and when the job
ends), the results of the calls it covers move from Redis to an archive blob beside
it, from which a call replayed later is answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec

from plexrl.ledger import MUTATING, Ledger, LedgerState
from plexrl.messages import (
    Function,
    PayloadRef,
    PhaseCompletion,
    PhaseOutput,
    PhaseRequest,
    decode,
    encode,
)
from plexrl.payloads import resolve
from plexrl.state_store_client import StateStoreClient, blob_tenant
from plexrl.stores.calls import PayloadStore
from plexrl_worker import stored
from plexrl_worker.executor import Executor, HeldSnapshot
from plexrl_worker.residency import StateManager

log = logging.getLogger(__name__)

Replay = Callable[[PhaseRequest], Awaitable[None]]


@dataclass(frozen=True)
class SnapshotConfig:
    """When a job's state is written to the disk tier for recovery."""

    every_calls: int = 4
    """Snapshot after this many logged (mutating) calls since the last snapshot. A
    restore replays at most this many calls; lower it for big, slow calls, raise it
    when snapshots (a full copy of the job's state) cost more than replaying."""
    archive_calls: int = 64
    """Move the job's results from Redis to an archive blob at a snapshot once at least
    this many are there (and all of them when the job ends)."""

    def __post_init__(self) -> None:
        if self.every_calls < 1:
            raise ValueError(
                f"SnapshotConfig.every_calls is {self.every_calls}; it must be at least 1 "
                "(1 snapshots after every mutating call)"
            )


@dataclass
class _Copy:
    """What this worker's copy of a job has applied, and under which epoch."""

    applied: int
    epoch: int
    snap_seq: int
    logged_since_snap: int = 0


class JobRecovery:
    """Restores jobs from the ledger and snapshots them after their calls commit."""

    def __init__(
        self,
        *,
        worker_id: str,
        ledger: Ledger,
        executor: Executor,
        states: StateManager,
        store: StateStoreClient,
        config: SnapshotConfig,
        payloads: PayloadStore | None = None,
    ) -> None:
        self._worker_id = worker_id
        self._payloads = payloads
        self._ledger = ledger
        self._executor = executor
        self._states = states
        self._store = store
        self._config = config
        self._copies: dict[str, _Copy] = {}
        self._uploads: set[asyncio.Task[None]] = set()
        self.restores = 0

    def is_current(self, job_id: str, head: LedgerState) -> bool:
        copy = self._copies.get(job_id)
        return (
            copy is not None
            and copy.applied == head.applied
            and copy.epoch == head.epoch
            and self._states.tier(job_id) is not None
        )

    async def ensure(
        self, job_id: str, function: Function, head: LedgerState, replay: Replay
    ) -> float:
        """Make this worker's copy of the job the ledger's latest; returns seconds spent."""
        if self.is_current(job_id, head):
            return 0.0
        start = time.perf_counter()
        await self.forget(job_id)
        if head.applied == 0 or function == Function.UNLOAD:
            # Nothing applied yet (its CREATE comes next), or nothing worth restoring.
            self._copies[job_id] = _Copy(head.applied, head.epoch, 0)
            return 0.0
        point = await self._ledger.recovery_point(job_id)
        if point.state.snap_blob:
            nbytes = await self._executor.restore(job_id, point.state.snap_blob)
            await self._states.restored(job_id, nbytes)
        for request in point.log:
            await replay(request)
        self._copies[job_id] = _Copy(
            point.state.applied, head.epoch, point.state.snap_seq, len(point.log)
        )
        seconds = time.perf_counter() - start
        self.restores += 1
        log.info(
            "restored %s at call %d (snapshot %d + %d replayed) in %.3fs",
            job_id,
            point.state.applied,
            point.state.snap_seq,
            len(point.log),
            seconds,
        )
        return seconds

    async def forget(self, job_id: str) -> None:
        """Drop this worker's copy of a job (stale, or no longer ours), leaving Redis be."""
        self._copies.pop(job_id, None)
        await self._states.forget(job_id)

    async def committed(self, request: PhaseRequest, seq: int, epoch: int, ok: bool) -> None:
        """Call `seq` is the job's last applied one: snapshot the job when it is time."""
        job_id = request.job_id
        copy = self._copies.setdefault(job_id, _Copy(seq - 1, epoch, 0))
        copy.applied, copy.epoch = seq, epoch
        if request.function == Function.UNLOAD:
            self._copies.pop(job_id, None)
            await self._ledger.close(job_id)
            await self._archive_results(job_id, epoch, seq, at_least=1)
            await self._delete_unreferenced(job_id)
            return
        if not ok or request.function not in MUTATING:
            return
        copy.logged_since_snap += 1
        due = copy.logged_since_snap >= self._config.every_calls
        if due or request.function in (Function.CREATE, Function.LOAD):
            copy.logged_since_snap = 0
            copy.snap_seq = seq
            # The copy is taken now, before the next call can change the job.
            held = await self._executor.snapshot(job_id)
            task = asyncio.create_task(self._upload(job_id, epoch, seq, held))
            self._uploads.add(task)
            task.add_done_callback(self._uploads.discard)

    async def _upload(self, job_id: str, epoch: int, seq: int, copy: HeldSnapshot) -> None:
        key = self._executor.stored_key(f"snapshot/{job_id}/e{epoch}-s{seq}")
        try:
            await self._put_named(job_id, epoch, key, lambda: copy.write(key))
            await self._ledger.record_snapshot(job_id, epoch, seq, key)
        except Exception:  # the log still holds every call: a later snapshot catches up
            log.exception("snapshot of %s at call %d failed", job_id, seq)
            return
        await self._archive_results(job_id, epoch, seq, self._config.archive_calls)
        await self._delete_unreferenced(job_id)

    async def _put_named(
        self, job_id: str, epoch: int, key: str, write: Callable[[], Awaitable[object]]
    ) -> None:
        """Write a blob (or blob set) the ledger will record, named in its blob book first
        (so a kill before the record leaves it findable); a failed write is marked for
        deletion."""
        await self._ledger.writing(job_id, epoch, key)
        try:
            await write()
        except BaseException:
            with contextlib.suppress(Exception):
                await self._ledger.abandon(job_id, key)
            raise

    async def _delete_unreferenced(self, job_id: str) -> None:
        """Delete the job's blobs its ledger's book says nothing needs (a replaced or
        refused snapshot or archive, or one a killed worker wrote and never recorded)."""
        try:
            keys = await self._ledger.unreferenced(job_id)
            for key in keys:
                # A checkpoint blob a fenced or killed save left is its tenant's to delete.
                await stored.delete(self._store, key, blob_tenant(key))
            await self._ledger.deleted(job_id, keys)
        except Exception:  # they stay in the book: the next sweep deletes them
            log.warning("deleting unreferenced blobs of %s failed", job_id, exc_info=True)

    async def _archive_results(self, job_id: str, epoch: int, upto: int, at_least: int) -> None:
        """Move the job's results up to call `upto` from Redis to an archive blob (payload
        refs resolved: they expire) if there are `at_least` calls to move. Best effort:
        what is not moved now stays in Redis and goes with the next archive."""
        try:
            lo, results = await self._ledger.archive_range(job_id, upto, at_least)
            if not results:
                return
            kept = {s: await self._inlined(raw) for s, raw in results.items()}
            # Unique per attempt: a refused one deletes its own blob, never one recorded.
            key = f"results/{job_id}/e{epoch}-s{lo}-{upto}-{uuid.uuid4().hex[:8]}.msgpack"
            data = msgspec.msgpack.encode(kept)
            await self._put_named(job_id, epoch, key, lambda: self._store.put_blob(key, data))
            # Refused (fenced, or archived meanwhile): the book marks it for deletion.
            await self._ledger.record_archive(job_id, epoch, lo, upto, key)
        except Exception:
            log.exception("archiving the results of %s up to call %d failed", job_id, upto)

    async def _inlined(self, raw: bytes) -> bytes:
        completion: PhaseCompletion = decode(raw, PhaseCompletion)
        if not isinstance(completion.result, PayloadRef) or self._payloads is None:
            return raw
        result = await resolve(self._payloads, completion.result, PhaseOutput)
        return encode(msgspec.structs.replace(completion, result=result))

    async def archived_result(self, job_id: str, seq: int) -> PhaseCompletion | None:
        """Call `seq`'s result from the job's archives (None: not archived)."""
        key = await self._ledger.archive_of(job_id, seq)
        if key is None:
            return None
        archive = msgspec.msgpack.decode(await self._store.get_blob(key), type=dict[int, bytes])
        raw = archive.get(seq)
        return None if raw is None else decode(raw, PhaseCompletion)

    async def drain(self) -> None:
        """Wait for snapshot uploads in flight (at shutdown, and in tests)."""
        if self._uploads:
            await asyncio.gather(*list(self._uploads), return_exceptions=True)
