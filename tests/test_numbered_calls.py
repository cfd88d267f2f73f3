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
from plexrl.messages import ForwardBackwardInput, Function, LossFn, PhaseRequest
from plexrl_worker.recovery import NumberedCalls
from plexrl_worker.runner import Ran


class Ledger:
    def __init__(self) -> None:
        self.applied = 4

    async def head(self, job_id: str) -> LedgerState:
        return LedgerState(epoch=1, owner="worker-0", applied=self.applied)


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

    async def resolved(self, request: PhaseRequest) -> PhaseRequest:
        return request

    async def replay(self, request: PhaseRequest) -> None:
        pass

    async def run(self, request: PhaseRequest) -> Ran:
        self.recovery.events.append("run")
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


def test_a_call_whose_record_failed_is_restored_not_run_again_on_its_own_effect() -> None:
    ledger, recovery = Ledger(), Recovery()
    calls = NumberedCalls(
        ledger=ledger,  # type: ignore[arg-type]
        recovery=recovery,  # type: ignore[arg-type]
        runner=Runner(recovery),  # type: ignore[arg-type]
        recorder=Recorder(ledger),  # type: ignore[arg-type]
    )
    request = PhaseRequest(
        request_id="r5",
        job_id="job",
        tenant="t",
        function=Function.FORWARD_BACKWARD,
        payload=ForwardBackwardInput(data=[], loss_fn=LossFn.CROSS_ENTROPY),
        arrival_time=time.time(),
    )
    with pytest.raises(redis.exceptions.ConnectionError):
        asyncio.run(calls.run(request, 5, 1, "d1", True))
    assert recovery.events == ["run", "forget"]
    # The consumer delivers the dispatch again: the copy is rebuilt first.
    asyncio.run(calls.run(request, 5, 1, "d1", True))
    assert recovery.events == ["run", "forget", "restore", "run"]
    assert ledger.applied == 5 and calls.applied == 1
