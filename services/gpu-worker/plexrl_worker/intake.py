"""The leader's intake: where a worker's dispatches come from.

A `DispatchSource` hands each dispatch to a handler (the call pipeline) in its order,
and acknowledges it only after the handler returned: at least once, with the
pipeline's effects recorded first. Today's source is the worker's Kafka dispatch topic,
which the scheduler writes (and the gateways, for a job under a direct lease,
`plexrl.direct`); beside it the worker's control topic carries preemption asks for the
sample batch running now.

Dispatches queue on the topic while the worker runs one, and the consumer fetches them
ahead. `PollIntake` takes what one poll brought together:

- before the first of them runs, the completions already recorded for any of their
  calls (a replay is answered, not run again) are read in one round trip for all of
  them, instead of one per dispatch;
- after the last, their completions are awaited together: each dispatch queues its
  completions on the producer and goes on to the next, and the poll's offsets are
  committed only once every completion of it is acknowledged (`settle`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Protocol

from plexrl.dead_letters import DeadLetters
from plexrl.kafka import Delivery, MessageConsumer, Publisher
from plexrl.kafka_security import PLAINTEXT, KafkaSecurity
from plexrl.messages import Dispatch, PhaseCompletion, PhaseRequest, PreemptBatch
from plexrl.stores import Stores
from plexrl.topics import Topics
from plexrl_worker.preemption import Preemption
from plexrl_worker.recorder import ResultRecorder

DispatchHandler = Callable[[Dispatch, Delivery], Awaitable[None]]


class DispatchSource(Protocol):
    async def start(self) -> None: ...
    async def run(self, stop: asyncio.Event) -> None:
        """Hand dispatches to the handler until `stop` is set."""
        ...

    async def close(self) -> None: ...
    def consumers(self) -> list[MessageConsumer[object]]:
        """Its consumers, for the health check."""
        ...


class PollIntake:
    """A poll's recorded completions read ahead, and its completions settled after it."""

    def __init__(self, recorder: ResultRecorder) -> None:
        self._recorder = recorder
        self._read: set[str] = set()
        """Calls of this poll whose record was read ahead and not asked for yet."""
        self._recorded: dict[str, PhaseCompletion] = {}

    async def read_ahead(self, dispatches: list[Dispatch]) -> None:
        """Before a poll's dispatches run: their calls' recorded completions, at once."""
        self._read, self._recorded = set(), {}
        calls = [c for d in dispatches for c in d.calls]
        if calls:
            self._recorded = await self._recorder.recorded(calls)
            self._read = {c.request_id for c in calls}

    async def recorded(self, calls: list[PhaseRequest]) -> dict[str, PhaseCompletion]:
        """Completions recorded for any of these calls: read ahead once per call (a call
        delivered twice in one poll is read again the second time, after the first ran),
        else from Redis."""
        ids = [c.request_id for c in calls]
        if not all(i in self._read for i in ids):
            return await self._recorder.recorded(calls)
        self._read.difference_update(ids)
        return {i: self._recorded[i] for i in ids if i in self._recorded}

    async def settle(self) -> None:
        """After a poll's dispatches ran: until each of their completions is in Kafka."""
        self._read, self._recorded = set(), {}
        await self._recorder.settle()


class KafkaDispatches:
    """The worker's dispatch topic (one dispatch at a time, in order; unreadable ones
    dead-lettered and their calls answered) and its control topic (preemptions)."""

    def __init__(
        self,
        *,
        bootstrap: str,
        worker_id: str,
        topics: Topics,
        stores: Stores,
        publisher: Publisher,
        handler: DispatchHandler,
        preemption: Preemption,
        poll: PollIntake | None = None,
        security: KafkaSecurity = PLAINTEXT,
    ) -> None:
        """`poll`: reads each poll's records ahead and settles its completions once
        (None: the handler settles each dispatch's own)."""
        self._dispatches: MessageConsumer[Dispatch] = MessageConsumer(
            bootstrap=bootstrap,
            security=security,
            topics=[topics.dispatch(worker_id)],
            group=topics.group(f"worker-{worker_id}"),
            message_type=Dispatch,
            handler=handler,
            dlq=(publisher, topics.dlq),
            name=f"worker-{worker_id}",
            answer=DeadLetters(stores.calls, stores.keys, publisher, topics.completions),
            before_batch=poll.read_ahead if poll is not None else None,
            after_batch=poll.settle if poll is not None else None,
        )

        async def preempt(message: PreemptBatch, delivery: Delivery) -> None:
            await preemption.ask(message.dispatch_id)

        self._control: MessageConsumer[PreemptBatch] = MessageConsumer(
            bootstrap=bootstrap,
            security=security,
            topics=[topics.control(worker_id)],
            group=None,  # a preempt is for the batch running now: none is replayed
            message_type=PreemptBatch,
            handler=preempt,
            dlq=(publisher, topics.dlq),
            name=f"worker-{worker_id}-control",
            from_latest=True,
        )

    async def start(self) -> None:
        await self._dispatches.start()
        await self._control.start()
        await self._control.wait_assigned()

    async def run(self, stop: asyncio.Event) -> None:
        await asyncio.gather(self._dispatches.run(stop), self._control.run(stop))

    async def close(self) -> None:
        for consumer in (self._dispatches, self._control):
            with contextlib.suppress(Exception):
                await consumer.stop()

    def consumers(self) -> list[MessageConsumer[object]]:
        return [self._dispatches, self._control]  # type: ignore[list-item]
