"""Numbered calls, applied once and recoverably: the worker's side of `plexrl.ledger`.

A numbered call (one a Dispatch's Lease gives a seq) runs only as its job's next
call under the dispatch's epoch; one that applied before is answered from the
ledger. Before running, the worker makes sure its copy of the job is the ledger's
latest: if it holds none (it restarted, or the job was re-homed here) or an older
one, it rebuilds the job from its snapshot plus the logged calls since, replayed in
order on the engine, which is deterministic, so the result is bit for bit the state
the dead worker had. After a mutating call commits, the job is snapshotted to the
disk tier every `SnapshotConfig.every_calls` logged calls (and after CREATE and
LOAD): the copy is taken before the next call runs, the upload goes on behind. Once a
snapshot is recorded (and when the job ends), the results of the calls it covers move
from Redis to an archive blob beside it, from which a call replayed later is answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec

from plexrl.direct import lease_of
from plexrl.failpoints import failpoint
from plexrl.ledger import MUTATING, Committed, Ledger, LedgerState, Verdict, verdict
from plexrl.messages import (
    ErrorCode,
    ErrorInfo,
    Function,
    PayloadRef,
    PhaseCompletion,
    PhaseOutput,
    PhaseRequest,
    decode,
    encode,
)
from plexrl.payloads import resolve
from plexrl.retry import is_transient
from plexrl.state_store_client import Fence, StateStoreClient, blob_tenant
from plexrl.stores.calls import PayloadStore
from plexrl_worker.engine import TorchEngine
from plexrl_worker.engine.state import JobTensors, StateStream, state_from_bytes, state_stream
from plexrl_worker.engine_thread import EngineThread
from plexrl_worker.recorder import ResultRecorder
from plexrl_worker.residency import StateManager
from plexrl_worker.runner import CallRunner, Ran

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
        engine: TorchEngine,
        thread: EngineThread,
        states: StateManager,
        store: StateStoreClient,
        config: SnapshotConfig,
        payloads: PayloadStore | None = None,
    ) -> None:
        self._worker_id = worker_id
        self._payloads = payloads
        self._ledger = ledger
        self._engine = engine
        self._thread = thread
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
            state = await asyncio.to_thread(
                state_from_bytes, await self._store.get_blob(point.state.snap_blob)
            )
            await self._thread.call(self._engine.onload, job_id, state)
            await self._states.restored(job_id, self._engine.state_bytes(job_id))
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
            state = await self._thread.call(
                self._engine.export_state, job_id, optimizer=True, gradients=True
            )
            task = asyncio.create_task(self._upload(job_id, epoch, seq, state))
            self._uploads.add(task)
            task.add_done_callback(self._uploads.discard)

    async def _upload(self, job_id: str, epoch: int, seq: int, state: JobTensors) -> None:
        key = f"snapshot/{job_id}/e{epoch}-s{seq}.safetensors"
        try:
            await self._put_named(job_id, epoch, key, state_stream(state))
            await self._ledger.record_snapshot(job_id, epoch, seq, key)
        except Exception:  # the log still holds every call: a later snapshot catches up
            log.exception("snapshot of %s at call %d failed", job_id, seq)
            return
        await self._archive_results(job_id, epoch, seq, self._config.archive_calls)
        await self._delete_unreferenced(job_id)

    async def _put_named(
        self, job_id: str, epoch: int, key: str, data: bytes | StateStream
    ) -> None:
        """Write a blob the ledger will record, named in its blob book first (so a kill
        before the record leaves it findable); a failed write is marked for deletion."""
        await self._ledger.writing(job_id, epoch, key)
        try:
            if isinstance(data, StateStream):
                await self._store.put_stream(key, data.chunks(), data.size)
            else:
                await self._store.put_blob(key, data)
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
                await self._store.delete_blob(key, blob_tenant(key))
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
            await self._put_named(job_id, epoch, key, msgspec.msgpack.encode(kept))
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


class NumberedCalls:
    """Runs one numbered call of a dispatch: verdict, restore, run, commit, answer."""

    def __init__(
        self,
        *,
        ledger: Ledger,
        recovery: JobRecovery,
        runner: CallRunner,
        recorder: ResultRecorder,
        retry_s: float = 60.0,
    ) -> None:
        self._ledger = ledger
        self._recovery = recovery
        self._runner = runner
        self._recorder = recorder
        # How long a call failing for a transient reason (a service away) is retried
        # before it is answered with that error (and counts as applied, without
        # effect): the worker, and every job homed on it, waits meanwhile.
        self._retry_s = retry_s
        self.applied = 0
        self.answered = 0
        self.fenced = 0

    async def _run_retrying(self, request: PhaseRequest, head: LedgerState, fence: Fence) -> Ran:
        """Restore if need be and run; a transient failure (the state-store or Redis away,
        say) is retried from a fresh restore until `retry_s` has passed, so the call is
        answered late rather than wrongly. Anything else (bad input, a request the
        state-store refuses, a full disk, a bug) fails at once: retrying cannot change
        it, and the worker must not be held for it."""
        deadline = time.monotonic() + self._retry_s
        pause_s = 0.5
        while True:
            try:
                restore_s = await self._recovery.ensure(
                    request.job_id, request.function, head, self._runner.replay
                )
                ran = await self._runner.run(request, fence)
                ran = dataclasses.replace(ran, swap_s=ran.swap_s + restore_s)
            except Exception as exc:
                log.warning("restoring %s failed", request.job_id, exc_info=True)
                ran = dataclasses.replace(
                    _failed(f"restoring {request.job_id} failed: {type(exc).__name__}: {exc}"),
                    transient=is_transient(exc),
                )
            if ran.error is None or not ran.transient:
                return ran
            if time.monotonic() + pause_s > deadline:
                return ran
            log.warning("call of %s failed (%s); retrying", request.job_id, ran.error.message)
            # The failed call may have changed the job halfway: start again from its ledger.
            with contextlib.suppress(Exception):
                await self._recovery.forget(request.job_id)
            await asyncio.sleep(pause_s)
            pause_s = min(2 * pause_s, 5.0)

    async def stale(self, job_id: str, epoch: int) -> bool:
        """True when the job was re-homed since this dispatch was issued: drop our copy."""
        return await self.current(job_id, epoch) is None

    async def current(self, job_id: str, epoch: int) -> LedgerState | None:
        """The job's ledger head, or None when the job was re-homed since `epoch` (our
        copy is dropped): read once per dispatch, and handed to its first numbered call."""
        head = await self._ledger.head(job_id)
        return None if await self._fenced(job_id, epoch, head) else head

    async def _fenced(self, job_id: str, epoch: int, head: LedgerState) -> bool:
        """True when the job was re-homed since `epoch`: the scheduler requeued its calls
        for the new home, which answers them; this worker drops its copy of the job."""
        if epoch >= head.epoch:
            return False
        self.fenced += 1
        log.warning(
            "calls of %s under epoch %d are stale (epoch %d, owner %r): left to the new home",
            job_id,
            epoch,
            head.epoch,
            head.owner,
        )
        await self._recovery.forget(job_id)
        return True

    async def run(
        self,
        request: PhaseRequest,
        seq: int,
        epoch: int,
        dispatch_id: str,
        last: bool,
        head: LedgerState | None = None,
    ) -> None:
        """`head`: the job's ledger head read for this dispatch just before (`current`);
        None reads it."""
        job_id = request.job_id
        if head is None:
            head = await self._ledger.head(job_id)
        # Checked per call, not only per dispatch: re-homed while this dispatch ran, a
        # later call answered here would race the new home (and be AHEAD of its fenced
        # predecessor).
        if await self._fenced(job_id, epoch, head):
            return
        match verdict(seq, head.applied):
            case Verdict.ANSWERED:
                stored = await self._ledger.result(job_id, seq)
                if stored is None:
                    stored = await self._recovery.archived_result(job_id, seq)
                if stored is not None:
                    self.answered += 1
                    await self._recorder.answer(stored)
                    return
                # Applied before results were kept in the ledger: nothing to answer with.
                ran = _failed(f"call {seq} of {job_id} applied before, its result is gone")
                await self._recorder.record(request, ran, dispatch_id, last)
                return
            case Verdict.AHEAD:
                log.error("call %d of %s came before call %d", seq, job_id, head.applied + 1)
                ran = _failed(
                    f"call {seq} of {job_id} arrived before call {head.applied + 1}; "
                    "the scheduler dispatches a job's calls in order, so this is a bug"
                )
                await self._recorder.record(request, ran, dispatch_id, last)
                return
            case Verdict.APPLY:
                pass
        resolved = await self._runner.resolved(request)
        ran = await self._run_retrying(resolved, head, Fence(job_id, epoch))
        ok = ran.error is None
        logged = resolved if ok and request.function in MUTATING else None

        async def commit(completion: PhaseCompletion) -> bool:
            outcome = await self._ledger.commit(job_id, epoch, seq, completion, logged)
            if outcome == Committed.OK:
                if lease_of(dispatch_id) is not None:
                    failpoint("worker.direct_committed")
                return True
            log.warning("call %d of %s not committed: %s", seq, job_id, outcome)
            self.fenced += 1
            await self._recovery.forget(job_id)
            return False

        try:
            recorded = await self._recorder.record(request, ran, dispatch_id, last, commit=commit)
        except BaseException:
            # The call ran on this worker's copy of the job, but whether it was committed
            # is unknown (Redis or Kafka went away under the record): the redelivery must
            # not run it again on top of itself, so the copy goes and the next attempt
            # restores from the ledger (snapshot + logged calls) and asks it again.
            if request.function in MUTATING:
                with contextlib.suppress(Exception):
                    await self._recovery.forget(job_id)
            raise
        if recorded:
            self.applied += 1
            await self._recovery.committed(request, seq, epoch, ok)


def _failed(message: str) -> Ran:
    return Ran(None, ErrorInfo(ErrorCode.INTERNAL, message), 0.0, 0.0, time.time())
