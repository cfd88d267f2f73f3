"""The leader's call pipeline: a dispatch's calls numbered and recovered, run, recorded.

What feeds it is a `plexrl_worker.intake.DispatchSource` (today the worker's dispatch
topic); it handles one dispatch at a time, and returns only once every completion of it
is in Kafka (or, given a `PollIntake`, leaves that to the intake's `settle` after the
poll's last dispatch), so the source may acknowledge the dispatch then.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from opentelemetry import trace

from plexrl import direct, tracing
from plexrl.failpoints import failpoint
from plexrl.kafka import Delivery
from plexrl.messages import (
    Dispatch,
    Function,
    PhaseCompletion,
    PhaseRequest,
    ReleaseReason,
    TailReleased,
)
from plexrl.retry import retrying
from plexrl.stores.calls import RecordFence
from plexrl_worker import metrics
from plexrl_worker.heartbeat import Heartbeat
from plexrl_worker.intake import PollIntake, numbered
from plexrl_worker.leader import LeaderFence
from plexrl_worker.numbering import NumberedCalls, Turn
from plexrl_worker.preemption import Preemption
from plexrl_worker.recorder import ResultRecorder
from plexrl_worker.residency import StateManager
from plexrl_worker.runner import CallRunner, Ran
from plexrl_worker.tail import TailRelease

log = logging.getLogger("plexrl.worker")
_tracer = tracing.tracer("plexrl.worker")


def _finished_tail(tails: set[asyncio.Task[None]]) -> Callable[[asyncio.Task[None]], None]:
    def done(task: asyncio.Task[None]) -> None:
        tails.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("a released call's tail failed", exc_info=task.exception())

    return done


class DispatchPipeline:
    """One dispatch at a time: its evictions, then each call — numbered and recovered
    (`NumberedCalls`), run (`CallRunner`), recorded (`ResultRecorder`) — then its
    prefetches. Consecutive sample calls run co-batched and may leave their tail running
    in the background (`TailRelease`, `Preemption`)."""

    def __init__(
        self,
        states: StateManager,
        runner: CallRunner,
        recorder: ResultRecorder,
        heartbeat: Heartbeat,
        numbered: NumberedCalls,
        tail: TailRelease,
        preemption: Preemption | None = None,
        intake: PollIntake | None = None,
        leader: LeaderFence | None = None,
        slice_training: bool = False,
    ) -> None:
        """`intake`: reads a poll's recorded completions ahead and settles its
        completions after its last dispatch (None: each dispatch reads and settles its
        own); `leader`: skips a deposed scheduler's dispatches; `slice_training`: a
        dispatch's last call, when a numbered `forward_backward`, runs a micro-batch at
        a time and may be preempted between them (`_run_training`; the executor must
        slice training)."""
        self._intake = intake
        self._leader = leader
        self._preemption = preemption or Preemption()
        self._slice_training = slice_training
        self._training_pause = Preemption()
        """Holds a preempted `forward_backward` at its next slice until the dispatch it
        yielded to ends (sample calls do not lift it: they would run beside it)."""
        self._states = states
        self._runner = runner
        self._recorder = recorder
        self._heartbeat = heartbeat
        self._numbered = numbered
        self._tail = tail
        self.calls = 0
        self.tails: set[asyncio.Task[None]] = set()
        """Sample batches left to finish their tails in the background, and preempted
        training calls left to finish there once their pause lifts."""

    async def read_ahead(self, dispatches: list[Dispatch]) -> None:
        """Before a poll's dispatches run (the consumer's hook): the intake reads their
        records, and their jobs' ledger heads unless a call runs in the background (it
        may commit before they are used)."""
        if self._intake is not None:
            await self._intake.read_ahead(dispatches, heads=not self.tails)

    async def settle(self) -> None:
        """After a poll's last dispatch (the consumer's hook): the intake's `settle`."""
        if self._intake is not None:
            await self._intake.settle()

    async def __call__(self, dispatch: Dispatch, delivery: Delivery) -> None:
        if direct.lease_of(dispatch.dispatch_id) is not None:
            failpoint("worker.direct_received")
        lease = dispatch.lease
        # Pure calls only (samples, echoes) that move nothing: they run at once, and
        # each is recorded only while its lease and its scheduler's term stand, or
        # answered by a record made before it (a replay runs again; the first stands).
        pure = (
            bool(dispatch.calls)
            and not numbered(dispatch)
            and not dispatch.evict
            and not dispatch.drop
        )
        if self._leader is not None and dispatch.leader_token and not pure:
            latest = self._intake.latest_token() if self._intake else None
            if await self._leader.deposed(dispatch, latest):
                return
        self._heartbeat.busy = True
        # A batch or training call preempted for this dispatch stays paused until it
        # lets go (below).
        claimed = self._preemption.claim() if dispatch.calls else None
        training = self._training_pause.claim() if dispatch.calls else None
        try:
            for job_id in dispatch.drop:
                await self._states.forget(job_id)
                log.info("dropped the copy of %s: re-homed to another worker", job_id)
            for move in dispatch.evict:
                await self._states.move(move.job_id, move.to_tier)
            fence: RecordFence | None = None
            turn: Turn | None = None
            replayed: dict[str, PhaseCompletion] = {}
            if lease is not None and numbered(dispatch):
                # A dispatch's numbered calls are of one job (its lease's): its ledger
                # head is read once, beside its other calls' records (one Redis round
                # trip's wait, read ahead with the poll's where the intake could).
                recorded = self._intake.recorded if self._intake else self._recorder.recorded
                read = self._intake.head(dispatch) if self._intake else None
                turn, replayed = await asyncio.gather(
                    self._numbered.open(dispatch.calls[0].job_id, lease.epoch, read),
                    recorded(dispatch.calls),
                )
                if turn is None:
                    return  # re-homed since it was issued: the new home answers its calls
            elif dispatch.calls:
                fence = self._fence(dispatch, pure)
            seqs = [
                lease.seqs[i] if lease is not None and i < len(lease.seqs) else 0
                for i in range(len(dispatch.calls))
            ]
            groups = _groups(dispatch, seqs, replayed)
            left = False
            for n, (group, cobatched) in enumerate(groups):
                # Only the last group may leave its tail running: calls after it would
                # otherwise overtake it.
                releasable = cobatched and n == len(groups) - 1
                left = not await self._run_group(
                    dispatch, delivery, group, cobatched, releasable, seqs, replayed, turn, fence
                )
                if left:
                    break  # re-homed or deposed while it ran: the rest is left to the new one
            # Every completion of the dispatch is in Kafka before its offset is committed
            # (with an intake, once the poll's last dispatch ran).
            if self._intake is None:
                await self._recorder.settle()
            for move in [] if left else dispatch.prefetch:
                await self._states.move(move.job_id, move.to_tier)
        finally:
            self._heartbeat.busy = False
            if claimed is not None:
                await self._preemption.open(claimed)
            if training is not None:
                await self._training_pause.open(training)

    def _fence(self, dispatch: Dispatch, pure: bool) -> RecordFence | None:
        """What the records of a dispatch of unnumbered calls stand on: its lease, and
        (`pure`: not checked before it ran) its scheduler's term."""
        lease, job_id = dispatch.lease, dispatch.calls[0].job_id
        fence = RecordFence() if lease is None else self._numbered.fence(job_id, lease.epoch)
        if pure and self._leader is not None and dispatch.leader_token:
            fence = dataclasses.replace(
                fence, token_key=self._leader.token_key, token=dispatch.leader_token
            )
        return fence if fence != RecordFence() else None

    async def _refused(self, dispatch: Dispatch, fence: RecordFence) -> None:
        """A record `fence` refused: the scheduler that sent the dispatch was deposed, or
        its job re-homed since (read again to tell which: it is rare), and the rest of
        the dispatch is left to the new leader or home."""
        if fence.token_key and self._leader is not None and await self._leader.deposed(dispatch):
            return
        await self._numbered.left_behind(dispatch.calls[0].job_id, fence.epoch)

    async def _run_group(
        self,
        dispatch: Dispatch,
        delivery: Delivery,
        group: list[int],
        cobatched: bool,
        releasable: bool,
        seqs: list[int],
        replayed: dict[str, PhaseCompletion],
        turn: Turn | None,
        fence: RecordFence | None,
    ) -> bool:
        """Run calls `group` of the dispatch: one call, or sample calls co-batched (and
        with `releasable`, left to finish in the background once down to their tail).
        False when `fence` refused a record: the job was re-homed meanwhile."""
        with contextlib.ExitStack() as spans:
            for i in group:
                request = dispatch.calls[i]
                # One dispatch batches calls of several API calls: each call's own
                # trace rides in the message, the Kafka header has only the first's.
                parent = (
                    tracing.context_of_traceparent(dispatch.traceparents[i])
                    if i < len(dispatch.traceparents)
                    else delivery.context
                )
                spans.enter_context(
                    _tracer.start_as_current_span(
                        f"worker.{request.function}",
                        context=parent,
                        kind=trace.SpanKind.CONSUMER,
                        attributes={
                            "plexrl.request_id": request.request_id,
                            "plexrl.job_id": request.job_id,
                            "plexrl.co_batched": len(group),
                        },
                    )
                )
            last_i = len(dispatch.calls) - 1
            if cobatched:
                metrics.SAMPLE_BATCH_CALLS.observe(len(group))
                # Sample calls join a preempted batch rather than wait for it.
                await self._preemption.open()
                await self._run_samples(dispatch, group, releasable, fence)
                return True
            i = group[0]
            request = dispatch.calls[i]
            if turn is not None and seqs[i] > 0:  # exactly once by the job's ledger
                if (
                    self._slice_training
                    and dispatch.sliceable
                    and i == last_i
                    and request.function == Function.FORWARD_BACKWARD
                ):
                    await self._run_training(dispatch, turn, request, seqs[i])
                else:
                    await self._numbered.run(
                        turn, request, seqs[i], dispatch.dispatch_id, i == last_i
                    )
                self.calls += 1
                return True
            done = replayed.get(request.request_id)
            if done is not None:  # a replay: answer with the recorded result
                await self._recorder.replay(done)
                metrics.REPLAYED_CALLS.inc()
                return True
            ran = await self._runner.run(request)
            return await self._record(dispatch, i, ran, i == last_i, fence)

    async def _run_samples(
        self, dispatch: Dispatch, group: list[int], releasable: bool, fence: RecordFence | None
    ) -> None:
        """Run a co-batched group and record its calls. When it is releasable, return as
        soon as the batch is down to its tail (with the tail release on) or the scheduler
        preempts it (announced on the events topic) and let it finish in the background:
        the consumer takes the next dispatch, whose calls run beside it (a preempted
        batch pauses meanwhile, `Preemption`)."""
        released = asyncio.Event()
        preemption = self._preemption
        asked = preemption.yieldable(dispatch.dispatch_id) if releasable else None

        async def on_tail(running: list[int], remaining: int, total: int) -> None:
            calls = [dispatch.calls[group[k]] for k in running]
            preempted = asked is not None and asked.is_set()
            preemption.finished(dispatch.dispatch_id)
            if preempted:
                await preemption.hold()
                metrics.PREEMPTED_BATCHES.inc()
            await self._tail.announce(
                TailReleased(
                    worker_id=dispatch.worker_id,
                    dispatch_id=dispatch.dispatch_id,
                    request_ids=[c.request_id for c in calls],
                    job_ids=sorted({c.job_id for c in calls}),
                    remaining=remaining,
                    total=total,
                    at=time.time(),
                    reason=ReleaseReason.PREEMPT if preempted else ReleaseReason.TAIL,
                )
            )
            if not preempted:
                metrics.TAIL_RELEASES.inc()
            released.set()

        last_i = len(dispatch.calls) - 1
        recorded: set[int] = set()
        left_behind: list[bool] = []  # told once that the fence refused a record

        async def record(ended: list[tuple[int, Ran]]) -> None:
            # Those that ended together are recorded together (one Redis round trip).
            finished = []
            for k, ran in ended:
                recorded.add(k)
                if ran.tail_released_at is not None and asked is not None and asked.is_set():
                    ran = dataclasses.replace(ran, preempted=True)
                finished.append((dispatch.calls[group[k]], ran, group[k] == last_i))
            stood = await retrying(
                functools.partial(
                    self._recorder.record_together, finished, dispatch.dispatch_id, fence
                ),
                what=f"recording {len(finished)} call(s) of {dispatch.dispatch_id}",
            )
            if fence is not None and None in stood and not left_behind:
                left_behind.append(True)
                await self._refused(dispatch, fence)

        async def run_and_record() -> None:
            try:
                rans = await self._runner.run_samples(
                    [dispatch.calls[i] for i in group],
                    tail_threshold=self._tail.threshold,
                    on_tail=on_tail if releasable else None,
                    on_done=record,
                    release=asked,
                    gate=preemption.wait_open,
                    paused_s=preemption.paused_seconds,
                )
            finally:
                preemption.finished(dispatch.dispatch_id)
            failed = [(k, ran) for k, ran in enumerate(rans) if k not in recorded]
            if failed:  # those that failed before running
                await record(failed)
            await self._recorder.settle()  # a tail left running settles its own

        await self._until_released(run_and_record(), released)

    async def _run_training(
        self, dispatch: Dispatch, turn: Turn, request: PhaseRequest, seq: int
    ) -> None:
        """Run the dispatch's last call, a numbered `forward_backward`, a slice (micro-
        batch) at a time. Preempted by the scheduler (for a neighbour's sample, while the
        job's training has slack: an asynchronous job's), it pauses at its next slice,
        the release is announced (`TailReleased` of reason PREEMPT) and this returns: the
        consumer takes the next dispatch while the call waits, and it goes on once that
        dispatch ends (or after the pause's grace if none comes), finishing in the
        background like a released tail. Its result is the whole call's."""
        slices = _TrainingSlices(
            dispatch, request, self._preemption, self._training_pause, self._tail
        )

        async def run() -> None:
            try:
                await self._numbered.run(
                    turn, request, seq, dispatch.dispatch_id, True, slicing=slices
                )
            except Exception:
                if not slices.released.is_set():
                    raise  # the dispatch is taken again: its offset is not committed
                # Released, its dispatch acknowledged: nothing brings the call back but
                # this. Taken again as a redelivered dispatch would be, from a fresh
                # turn (answered from the ledger if it committed), while Redis or
                # Kafka is away.
                log.warning("recording %s failed; taking it again", request.request_id)
                await retrying(
                    lambda: self._again(dispatch, request, seq, turn.epoch),
                    what=f"taking {request.request_id} again",
                )
            finally:
                self._preemption.finished(dispatch.dispatch_id)
            if slices.released.is_set():
                await self._recorder.settle()  # released: it settles its own

        await self._until_released(run(), slices.released)

    async def _again(self, dispatch: Dispatch, request: PhaseRequest, seq: int, epoch: int) -> None:
        """A released numbered call whose record failed, run as a redelivery runs it."""
        turn = await self._numbered.open(request.job_id, epoch)
        if turn is not None:  # None: re-homed since, the new home answers it
            await self._numbered.run(turn, request, seq, dispatch.dispatch_id, True)

    async def _until_released(
        self, work: Coroutine[Any, Any, None], released: asyncio.Event
    ) -> None:
        """Await `work` until it ends or sets `released`; then it goes on in the
        background (`tails`)."""
        task = asyncio.create_task(work)
        waiter = asyncio.create_task(released.wait())
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if task.done():
            task.result()
            return
        self.tails.add(task)
        task.add_done_callback(_finished_tail(self.tails))

    async def _record(
        self, dispatch: Dispatch, i: int, ran: Ran, last: bool, fence: RecordFence | None
    ) -> bool:
        """Record an unnumbered call; False when `fence` refused it (re-homed since)."""
        # Retried in place while Redis is away: the call ran, only its record is
        # missing, and running it again would apply it twice.
        request = dispatch.calls[i]
        stood = await retrying(
            functools.partial(
                self._recorder.record, request, ran, dispatch.dispatch_id, last, fence=fence
            ),
            what=f"recording {request.request_id}",
        )
        if stood is None and fence is not None:
            await self._refused(dispatch, fence)
            return False
        self.calls += 1
        return True


class _TrainingSlices:
    """A sliced training call's pause point (`CallRunner.run`'s `Slicing`): once the
    scheduler asked its dispatch to yield, the next one holds the call, announces the
    release and sets `released`; a released call waits at each while the pause holds."""

    def __init__(
        self,
        dispatch: Dispatch,
        request: PhaseRequest,
        preemption: Preemption,
        pause: Preemption,
        tail: TailRelease,
    ) -> None:
        self._dispatch = dispatch
        self._request = request
        self._preemption = preemption
        self._pause = pause
        self._tail = tail
        self._asked = preemption.yieldable(dispatch.dispatch_id)
        self.released = asyncio.Event()
        self.released_at: float | None = None

    def paused_s(self) -> float:
        return self._pause.paused_seconds()

    async def between(self) -> None:
        if not self.released.is_set() and self._asked.is_set():
            dispatch, request = self._dispatch, self._request
            self._preemption.finished(dispatch.dispatch_id)
            await self._pause.hold()
            at = time.time()
            try:
                await self._tail.announce(
                    TailReleased(
                        worker_id=dispatch.worker_id,
                        dispatch_id=dispatch.dispatch_id,
                        request_ids=[request.request_id],
                        job_ids=[request.job_id],
                        remaining=1,
                        total=1,
                        at=at,
                        reason=ReleaseReason.PREEMPT,
                    )
                )
            except Exception:
                # Unannounced, the scheduler would not send the next dispatch: the call
                # goes on instead (its pause lifts after its grace).
                log.warning("announcing the release of %s failed", request.request_id)
                return
            metrics.PREEMPTED_TRAINING.inc()
            self.released_at = at
            self.released.set()
        if self.released.is_set():  # only a released call waits for the pause
            await self._pause.wait_open()


def _groups(
    dispatch: Dispatch, seqs: list[int], replayed: dict[str, PhaseCompletion]
) -> list[tuple[list[int], bool]]:
    """The dispatch's calls in order, in groups: each run of consecutive sample calls that
    are neither numbered nor replays is one co-batched group (flag True); every other
    call is a group of its own."""
    groups: list[tuple[list[int], bool]] = []
    for i, request in enumerate(dispatch.calls):
        joinable = (
            request.function == Function.SAMPLE
            and seqs[i] == 0
            and request.request_id not in replayed
        )
        if joinable and groups and groups[-1][1]:
            groups[-1][0].append(i)
        else:
            groups.append(([i], joinable))
    return groups
