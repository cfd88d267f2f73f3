"""Numbered calls, the rule alone, with the ledger, recovery, runner and recorder at the
edge stood in for. A call whose record fails under it (Redis or Kafka gone between
running it and committing it) is never applied twice: the worker's copy of the job is
dropped, so the redelivery restores from the ledger instead of running the call again
on top of itself (the fault suite's `redis` kill found this). A dispatch reads its
job's ledger head once; a job re-homed before or during the dispatch has none of its
later calls answered here."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any, cast

import pytest
import redis.exceptions

from plexrl.ledger import Committed, LedgerState
from plexrl.messages import (
    AdamParams,
    ErrorCode,
    ErrorInfo,
    ForwardBackwardInput,
    Function,
    LossFn,
    OptimStepInput,
    PhaseCompletion,
    PhaseRequest,
)
from plexrl.state_store_client import Fence
from plexrl_worker.numbering import LedgerMovedError, NumberedCalls
from plexrl_worker.runner import Ran


class Ledger:
    def __init__(self) -> None:
        self.applied = 4
        self.epoch = 1
        self.heads_read = 0
        self.results: dict[int, PhaseCompletion] = {}

    async def head(self, job_id: str) -> LedgerState:
        self.heads_read += 1
        return LedgerState(epoch=self.epoch, owner="worker-0", applied=self.applied)

    async def head_and_result(
        self, job_id: str, seq: int
    ) -> tuple[LedgerState, PhaseCompletion | None]:
        head = await self.head(job_id)
        return head, (self.results.get(seq) if seq <= head.applied else None)

    async def commit(
        self, job_id: str, epoch: int, seq: int, completion: PhaseCompletion, logged: Any
    ) -> Committed:
        if epoch != self.epoch:
            return Committed.FENCED
        self.applied = seq
        return Committed.OK


class Recovery:
    def __init__(self) -> None:
        self.copy_applied: int | None = 4  # this worker's copy is current
        self.events: list[str] = []

    async def ensure(
        self, job_id: str, function: Function, head: LedgerState, replay: Any
    ) -> float:
        if self.copy_applied != head.applied:
            self.events.append("restore")
            self.copy_applied = head.applied
        return 0.0

    async def forget(self, job_id: str) -> None:
        self.events.append("forget")
        self.copy_applied = None

    async def committed(self, request: PhaseRequest, seq: int, epoch: int, ok: bool) -> None:
        self.copy_applied = seq


class Runner:
    def __init__(self, recovery: Recovery) -> None:
        self.recovery = recovery
        self.fences: list[Fence | None] = []

    async def resolved(self, request: PhaseRequest) -> PhaseRequest:
        return request

    async def replay(self, request: PhaseRequest) -> None:
        pass

    async def run(
        self, request: PhaseRequest, fence: Fence | None = None, slicing: object = None
    ) -> Ran:
        self.recovery.events.append("run")
        self.fences.append(fence)
        return Ran(None, None, 0.0, 0.0, time.time())


class Recorder:
    """Redis is away for the first record: the commit raises under it."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.down = True

    async def record(self, request: PhaseRequest, ran: Ran, *args: Any, **kwargs: Any) -> bool:
        if self.down:
            self.down = False
            raise redis.exceptions.ConnectionError("Error 111 connecting to 127.0.0.1:6379")
        self.ledger.applied += 1
        return True


def _calls(ledger: Ledger, recovery: Recovery, recorder: Any) -> NumberedCalls:
    return NumberedCalls(
        ledger=ledger,  # type: ignore[arg-type]
        recovery=recovery,  # type: ignore[arg-type]
        runner=Runner(recovery),  # type: ignore[arg-type]
        recorder=recorder,
    )


def _forward_backward(request_id: str = "r5") -> PhaseRequest:
    return PhaseRequest(
        request_id=request_id,
        job_id="job",
        tenant="t",
        function=Function.FORWARD_BACKWARD,
        payload=ForwardBackwardInput(data=[], loss_fn=LossFn.CROSS_ENTROPY),
        arrival_time=time.time(),
    )


def _dispatch(calls: NumberedCalls, epoch: int, *numbered: tuple[PhaseRequest, int]) -> bool:
    """Run a dispatch's numbered calls as the pipeline does; False if its turn was stale."""

    async def run() -> bool:
        turn = await calls.open("job", epoch)
        if turn is None:
            return False
        for n, (request, seq) in enumerate(numbered):
            await calls.run(turn, request, seq, f"d{epoch}", n == len(numbered) - 1)
        return True

    return asyncio.run(run())


def test_a_call_whose_record_failed_is_restored_not_run_again_on_its_own_effect() -> None:
    ledger, recovery = Ledger(), Recovery()
    calls = _calls(ledger, recovery, Recorder(ledger))
    request = _forward_backward()
    with pytest.raises(redis.exceptions.ConnectionError):
        _dispatch(calls, 1, (request, 5))
    assert recovery.events == ["run", "forget"]
    # The consumer delivers the dispatch again: the copy is rebuilt first.
    _dispatch(calls, 1, (request, 5))
    assert recovery.events == ["run", "forget", "restore", "run"]
    assert ledger.applied == 5 and calls.applied == 1
    # What the call writes in the state-store carries its lease: the job and epoch 1.
    assert calls._runner.fences == [Fence("job", 1), Fence("job", 1)]  # type: ignore[attr-defined]


class Answers:
    """Records every answer the worker gives (Redis and Kafka up), committing first as
    the real recorder does."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.answered: list[str] = []
        self.before_commit: Any = None

    async def record(
        self, request: PhaseRequest, ran: Ran, *args: Any, commit: Any = None, **kwargs: Any
    ) -> bool:
        if self.before_commit is not None:
            self.before_commit()
        if commit is not None and not await commit(cast(PhaseCompletion, None)):
            return False
        self.answered.append(request.request_id)
        return True


def _optim(request_id: str = "r6") -> PhaseRequest:
    return PhaseRequest(
        request_id=request_id,
        job_id="job",
        tenant="t",
        function=Function.OPTIM_STEP,
        payload=OptimStepInput(adam=AdamParams()),
        arrival_time=time.time(),
    )


def test_a_dispatch_reads_its_jobs_ledger_head_once() -> None:
    ledger, recovery = Ledger(), Recovery()
    answers = Answers(ledger)
    calls = _calls(ledger, recovery, answers)
    assert _dispatch(calls, 1, (_forward_backward(), 5), (_optim(), 6))
    assert answers.answered == ["r5", "r6"] and ledger.applied == 6
    assert ledger.heads_read == 1


def test_calls_of_a_dispatch_re_homed_before_it_ran_are_left_to_the_new_home() -> None:
    # The fault suite (broker killed: both workers missed heartbeats and were re-homed)
    # saw call 6 answered with "arrived before call 5" by the old home, whose call 5 had
    # just been fenced: the later calls of a stale dispatch must not be answered at all.
    ledger, recovery = Ledger(), Recovery()
    answers = Answers(ledger)
    calls = _calls(ledger, recovery, answers)
    ledger.epoch = 2  # re-homed after the dispatch (epoch 1) was issued
    assert not _dispatch(calls, 1, (_forward_backward(), 5), (_optim(), 6))
    assert answers.answered == [] and "run" not in recovery.events
    assert calls.fenced == 1 and ledger.applied == 4
    # Under the current epoch (the new home) the same calls run in order.
    assert _dispatch(calls, 2, (_forward_backward(), 5), (_optim(), 6))
    assert answers.answered == ["r5", "r6"] and ledger.applied == 6


def test_calls_of_a_dispatch_re_homed_while_it_ran_are_left_to_the_new_home() -> None:
    ledger, recovery = Ledger(), Recovery()
    answers = Answers(ledger)
    calls = _calls(ledger, recovery, answers)

    def re_home() -> None:  # the job moves while call 5 runs, before it commits
        ledger.epoch = 2
        answers.before_commit = None

    answers.before_commit = re_home
    assert _dispatch(calls, 1, (_forward_backward(), 5), (_optim(), 6))
    # Call 5 ran on the old copy but its commit was refused; call 6 never ran.
    assert answers.answered == [] and recovery.events == ["run", "forget"]
    assert calls.fenced == 1 and ledger.applied == 4


def test_a_call_the_head_said_applied_but_a_failover_took_back_is_taken_again() -> None:
    """The turn's head was read from a Redis primary that a failover then replaced (it
    held call 5's commit, the promoted replica does not): call 5 is not answered with
    a made-up failure; the dispatch is taken again (a transient error) from the ledger,
    and this worker's copy, which may hold what the old primary held, goes."""
    ledger, recovery = Ledger(), Recovery()
    answers = Answers(ledger)
    calls = _calls(ledger, recovery, answers)

    async def run() -> None:
        ledger.applied = 5  # the old primary's head
        turn = await calls.open("job", 1)
        assert turn is not None
        ledger.applied = 4  # the promoted replica's ledger
        with pytest.raises(LedgerMovedError, match="a Redis failover"):
            await calls.run(turn, _forward_backward(), 5, "d1", False)

    asyncio.run(run())
    assert answers.answered == [] and recovery.events == ["forget"]
    assert isinstance(LedgerMovedError("x"), redis.exceptions.ConnectionError)  # transient
    # Taken again: call 5 runs from the ledger's head.
    assert _dispatch(calls, 1, (_forward_backward(), 5), (_optim(), 6))
    assert answers.answered == ["r5", "r6"] and ledger.applied == 6


class FencedOnce(Runner):
    """The state-store refuses the first write as fenced: its Redis is a demoted primary
    holding a deposed scheduler's re-homing that the ledger never confirmed."""

    def __init__(self, recovery: Recovery) -> None:
        super().__init__(recovery)
        self.refused = False

    async def run(
        self, request: PhaseRequest, fence: Fence | None = None, slicing: object = None
    ) -> Ran:
        ran = await super().run(request, fence)
        if self.refused:
            return ran
        self.refused = True
        error = ErrorInfo(ErrorCode.CANCELLED, "the lease of epoch 1 no longer stands")
        return dataclasses.replace(ran, error=error, fenced=True)


def test_a_write_fenced_by_a_stale_view_while_the_ledger_says_the_lease_stands_is_retried() -> None:
    ledger, recovery = Ledger(), Recovery()
    answers = Answers(ledger)
    calls = _calls(ledger, recovery, answers)
    calls._runner = FencedOnce(recovery)  # type: ignore[assignment]
    assert _dispatch(calls, 1, (_forward_backward(), 5))
    assert answers.answered == ["r5"] and ledger.applied == 5
    assert recovery.events.count("run") == 2  # refused once, then run again


def test_a_write_fenced_because_the_job_was_re_homed_is_not_retried() -> None:
    ledger, recovery = Ledger(), Recovery()
    answers = Answers(ledger)
    calls = _calls(ledger, recovery, answers)
    calls._runner = FencedOnce(recovery)  # type: ignore[assignment]

    async def run() -> None:
        turn = await calls.open("job", 1)
        assert turn is not None
        ledger.epoch = 2  # re-homed, and the ledger says so too
        await calls.run(turn, _forward_backward(), 5, "d1", True)

    asyncio.run(run())
    assert answers.answered == [] and recovery.events.count("run") == 1
