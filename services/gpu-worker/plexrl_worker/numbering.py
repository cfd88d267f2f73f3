"""Numbered calls, applied once: the worker's side of `plexrl.ledger`.

A numbered call (one a Dispatch's Lease gives a seq) runs only as its job's next call
under the dispatch's epoch; one that applied before is answered from the ledger, never
run again. A dispatch opens one `Turn` for its job: the ledger's head is read once,
and the turn keeps it current as its calls commit. A commit the ledger refuses (the job
was re-homed under a newer epoch since, or another writer got there first) ends the
turn: the dispatch's later calls of the job are left to the new home, unanswered here.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass

import redis.exceptions

from plexrl.direct import lease_of
from plexrl.failpoints import failpoint
from plexrl.ledger import MUTATING, Committed, Ledger, LedgerState, Verdict, verdict
from plexrl.messages import ErrorCode, ErrorInfo, PhaseCompletion, PhaseRequest
from plexrl.retry import is_transient
from plexrl.state_store_client import Fence
from plexrl.stores.calls import RecordFence
from plexrl_worker.recorder import ResultRecorder
from plexrl_worker.recovery import JobRecovery
from plexrl_worker.runner import CallRunner, Ran, Slicing

log = logging.getLogger(__name__)


class LedgerMovedError(redis.exceptions.ConnectionError):
    """The ledger went back under a turn (a Redis failover replaced the primary its head
    was read from): transient, the dispatch is taken again from a fresh head."""


@dataclass
class Turn:
    """One dispatch's numbered calls of one job."""

    job_id: str
    epoch: int
    """The epoch the dispatch was issued under."""
    head: LedgerState
    """The job's ledger head, read when the turn opened and moved on by its commits."""
    over: bool = False
    """A commit was refused: no later call of the turn runs or is answered here."""


class NumberedCalls:
    """Opens a dispatch's turn, then runs each numbered call: verdict, restore if need
    be, run, commit, answer."""

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

    async def open(self, job_id: str, epoch: int, head: LedgerState | None = None) -> Turn | None:
        """The turn of a dispatch issued under `epoch`; None when the job was re-homed
        since (the scheduler requeued its calls for the new home, which answers them;
        this worker drops its copy of the job). `head`: the job's ledger head read ahead
        (`PollIntake`) with nothing committed to it since; None reads it."""
        if head is None:
            head = await self._ledger.head(job_id)
        if epoch >= head.epoch:
            return Turn(job_id, epoch, head)
        await self.left_behind(job_id, epoch, f"epoch {head.epoch}, owner {head.owner!r}")
        return None

    def fence(self, job_id: str, epoch: int) -> RecordFence:
        """The fence of a dispatch's unnumbered calls issued under `epoch`: each is
        recorded only while the job's ledger holds no newer epoch (they run before any
        read of it: `ResultRecorder.record`)."""
        return RecordFence(self._ledger.head_key(job_id), epoch)

    async def left_behind(self, job_id: str, epoch: int, why: str = "a newer epoch") -> None:
        """The job was re-homed since a dispatch under `epoch` was issued: its calls are
        left to the new home (the scheduler requeued them there), and this worker drops
        its copy of the job."""
        self.fenced += 1
        log.warning(
            "calls of %s under epoch %d are stale (%s): left to the new home", job_id, epoch, why
        )
        await self._recovery.forget(job_id)

    async def run(
        self,
        turn: Turn,
        request: PhaseRequest,
        seq: int,
        dispatch_id: str,
        last: bool,
        slicing: Slicing | None = None,
    ) -> None:
        """`slicing`: a sliced `forward_backward`'s (`CallRunner.run`)."""
        if turn.over:
            return
        job_id = turn.job_id
        match verdict(seq, turn.head.applied):
            case Verdict.ANSWERED:
                await self._answer(request, seq, dispatch_id, last)
                return
            case Verdict.AHEAD:
                log.error("call %d of %s came before call %d", seq, job_id, turn.head.applied + 1)
                ran = _failed(
                    f"call {seq} of {job_id} arrived before call {turn.head.applied + 1}; "
                    "the scheduler dispatches a job's calls in order, so this is a bug"
                )
                await self._recorder.record(request, ran, dispatch_id, last)
                return
            case Verdict.APPLY:
                pass
        resolved = await self._runner.resolved(request)
        ran = await self._run_retrying(resolved, turn.head, Fence(job_id, turn.epoch), slicing)
        ok = ran.error is None
        logged = resolved if ok and request.function in MUTATING else None

        async def commit(completion: PhaseCompletion) -> bool:
            outcome = await self._ledger.commit(job_id, turn.epoch, seq, completion, logged)
            if outcome == Committed.OK:
                if lease_of(dispatch_id) is not None:
                    failpoint("worker.direct_committed")
                if slicing is not None and slicing.released_at is not None:
                    failpoint("worker.released_committed")
                return True
            log.warning("call %d of %s not committed: %s", seq, job_id, outcome)
            self.fenced += 1
            turn.over = True
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
            turn.head = dataclasses.replace(turn.head, applied=seq)
            await self._recovery.committed(request, seq, turn.epoch, ok)

    async def _answer(self, request: PhaseRequest, seq: int, dispatch_id: str, last: bool) -> None:
        """A call applied before: answered with the result it had, never run again."""
        job_id = request.job_id
        head, stored = await self._ledger.head_and_result(job_id, seq)
        if head.applied < seq:
            # The head this turn began with said applied, the ledger now says not: it was
            # read from a primary that a Redis failover has since replaced. Start over,
            # from the ledger (this worker's copy may hold what the old primary held).
            await self._recovery.forget(job_id)
            raise LedgerMovedError(
                f"call {seq} of {job_id} was applied by the head read before, not by the "
                f"ledger now (applied {head.applied}): a Redis failover; the dispatch "
                "is taken again"
            )
        if stored is None:
            stored = await self._recovery.archived_result(job_id, seq)
        if stored is not None:
            self.answered += 1
            await self._recorder.answer(stored)
            return
        # Applied before results were kept in the ledger: nothing to answer with.
        ran = _failed(f"call {seq} of {job_id} applied before, its result is gone")
        await self._recorder.record(request, ran, dispatch_id, last)

    async def _run_retrying(
        self,
        request: PhaseRequest,
        head: LedgerState,
        fence: Fence,
        slicing: Slicing | None = None,
    ) -> Ran:
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
                ran = await self._runner.run(request, fence, slicing)
                ran = dataclasses.replace(ran, swap_s=ran.swap_s + restore_s)
                if ran.fenced and (await self._ledger.head(request.job_id)).epoch == fence.epoch:
                    # The state-store read a newer epoch than the ledger holds: its Redis
                    # is a primary a failover replaced (a deposed scheduler's unconfirmed
                    # re-homing on it). The lease stands; the call is tried again.
                    ran = dataclasses.replace(ran, transient=True)
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


def _failed(message: str) -> Ran:
    return Ran(None, ErrorInfo(ErrorCode.INTERNAL, message), 0.0, 0.0, time.time())
