"""A numbered call whose record fails under it (Redis or Kafka gone between running it
and committing it) is never applied twice: the worker's copy of the job is dropped, so
the redelivery restores from the ledger instead of running the call again on top of
itself. The fault suite (tests/test_faults.py, the `redis` kill) found this; here the
rule alone, with the ledger, recovery, runner and recorder at the edge stood in for."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import redis.exceptions

from plexrl.ledger import LedgerState
from plexrl.messages import (
    AdamParams,
    ForwardBackwardInput,
    Function,
    LossFn,
    OptimStepInput,
    PhaseRequest,
)
from plexrl.state_store_client import Fence
from plexrl_worker.recovery import NumberedCalls
from plexrl_worker.runner import Ran


class Ledger:
    def __init__(self) -> None:
        self.applied = 4
        self.epoch = 1

    async def head(self, job_id: str) -> LedgerState:
        return LedgerState(epoch=self.epoch, owner="worker-0", applied=self.applied)


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

    async def run(self, request: PhaseRequest, fence: Fence | None = None) -> Ran:
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


def test_a_call_whose_record_failed_is_restored_not_run_again_on_its_own_effect() -> None:
    ledger, recovery = Ledger(), Recovery()
    calls = _calls(ledger, recovery, Recorder(ledger))
    request = _forward_backward()
    with pytest.raises(redis.exceptions.ConnectionError):
        asyncio.run(calls.run(request, 5, 1, "d1", True))
    assert recovery.events == ["run", "forget"]
    # The consumer delivers the dispatch again: the copy is rebuilt first.
    asyncio.run(calls.run(request, 5, 1, "d1", True))
    assert recovery.events == ["run", "forget", "restore", "run"]
    assert ledger.applied == 5 and calls.applied == 1
    # What the call writes in the state-store carries its lease: the job and epoch 1.
    assert calls._runner.fences == [Fence("job", 1), Fence("job", 1)]  # type: ignore[attr-defined]


class Answers:
    """Records every answer the worker gives (Redis and Kafka up)."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.answered: list[str] = []

    async def record(self, request: PhaseRequest, ran: Ran, *args: Any, **kwargs: Any) -> bool:
        self.answered.append(request.request_id)
        if ran.error is None:
            self.ledger.applied += 1
        return True


def test_calls_of_a_dispatch_re_homed_under_it_are_left_to_the_new_home() -> None:
    # The fault suite (broker killed: both workers missed heartbeats and were re-homed)
    # saw call 6 answered with "arrived before call 5" by the old home, whose call 5 had
    # just been fenced: the later calls of a stale dispatch must not be answered at all.
    ledger, recovery = Ledger(), Recovery()
    answers = Answers(ledger)
    calls = _calls(ledger, recovery, answers)
    ledger.epoch = 2  # re-homed after the dispatch (epoch 1) was issued
    optim = PhaseRequest(
        request_id="r6",
        job_id="job",
        tenant="t",
        function=Function.OPTIM_STEP,
        payload=OptimStepInput(adam=AdamParams()),
        arrival_time=time.time(),
    )
    asyncio.run(calls.run(_forward_backward(), 5, 1, "d1", False))
    asyncio.run(calls.run(optim, 6, 1, "d1", True))
    assert answers.answered == [] and "run" not in recovery.events
    assert calls.fenced == 2 and ledger.applied == 4
    # Under the current epoch (the new home) the same calls run in order.
    asyncio.run(calls.run(_forward_backward(), 5, 2, "d2", False))
    asyncio.run(calls.run(optim, 6, 2, "d2", True))
    assert answers.answered == ["r5", "r6"] and ledger.applied == 6
