"""The leader's intake: where a worker's dispatches come from.

A `DispatchSource` hands each dispatch to a handler (the call pipeline) in its order,
and acknowledges it only after the handler returned: at least once, with the
pipeline's effects recorded first. Today's source is the worker's Kafka dispatch topic,
which the scheduler writes; beside it the worker's control topic carries preemption
asks for the sample batch running now. A source of calls the scheduler did not number
itself (say, a lease that lets a gateway write to this topic directly) plugs in here,
in front of the same pipeline.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Protocol

from plexrl.dead_letters import DeadLetters
from plexrl.kafka import Delivery, MessageConsumer, Publisher
from plexrl.messages import Dispatch, PreemptBatch
from plexrl.stores import Stores
from plexrl.topics import Topics
from plexrl_worker.preemption import Preemption

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
    ) -> None:
        self._dispatches: MessageConsumer[Dispatch] = MessageConsumer(
            bootstrap=bootstrap,
            topics=[topics.dispatch(worker_id)],
            group=topics.group(f"worker-{worker_id}"),
            message_type=Dispatch,
            handler=handler,
            dlq=(publisher, topics.dlq),
            name=f"worker-{worker_id}",
            answer=DeadLetters(stores.calls, stores.keys, publisher, topics.completions),
        )

        async def preempt(message: PreemptBatch, delivery: Delivery) -> None:
            await preemption.ask(message.dispatch_id)

        self._control: MessageConsumer[PreemptBatch] = MessageConsumer(
            bootstrap=bootstrap,
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
