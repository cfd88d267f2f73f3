"""The leader's intake: where a worker's dispatches come from.

A `DispatchSource` hands each dispatch to a handler (the call pipeline) in its order,
and acknowledges it only after the handler returned: at least once, with the
pipeline's effects recorded first. Today's source is the worker's Kafka dispatch topic,
which the scheduler writes (and the gateways, for a job under a direct lease,
`plexrl.direct`); beside it the worker's control topic carries preemption asks for the
sample batch running now.

Dispatches queue on the topic while the worker runs one, and the consumer fetches them
ahead. `PollIntake` takes what one poll brought together:

- before the first of them runs, the completions already recorded for the calls of
  its numbered dispatches (a replay is answered, not run again) are read in one round
  trip for all of them, instead of one per dispatch, and in the same round trip the
  ledger head of each job whose first dispatch in the poll is numbered (its stale-epoch
  check and its calls' verdicts), instead of one more round trip when that dispatch
  runs; a dispatch of unnumbered calls only reads nothing (`DispatchPipeline`: their
  epoch and replay checks ride in their records);
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
from plexrl.ledger import Ledger, LedgerState
from plexrl.messages import Dispatch, PhaseCompletion, PhaseRequest, PreemptBatch
from plexrl.stores import CallStore, Stores
from plexrl.stores.calls import completions_of
from plexrl.topics import Topics
from plexrl_worker.leader import LeaderFence
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
    """A poll's recorded completions and ledger heads read ahead, and its completions
    settled after it."""

    def __init__(
        self,
        recorder: ResultRecorder,
        calls: CallStore,
        ledger: Ledger,
        leader: LeaderFence | None = None,
    ) -> None:
        """`calls`, `ledger` and `leader` on one Redis client (read in one round trip)."""
        self._recorder = recorder
        self._calls = calls
        self._ledger = ledger
        self._leader = leader
        self._latest: int | None = None
        """The scheduler lease's latest token, read ahead for this poll's numbered
        dispatches from a leader (`LeaderFence.deposed`)."""
        self._read: set[str] = set()
        """Calls of this poll whose record was read ahead and not asked for yet."""
        self._recorded: dict[str, PhaseCompletion] = {}
        self._heads: dict[str, LedgerState] = {}
        """By dispatch id: the head of its job's ledger, for a numbered dispatch that is
        its job's first in this poll, until it is asked for."""

    async def read_ahead(self, dispatches: list[Dispatch], heads: bool = True) -> None:
        """Before a poll's dispatches run: for those with numbered calls, their calls'
        recorded completions and, with `heads`, the ledger head of each job whose first
        dispatch in the poll is one of them, in one round trip. (A dispatch of unnumbered
        calls only reads nothing before it runs: `DispatchPipeline`.)

        A head read here is as good as one read when its dispatch runs only if nothing
        commits to that ledger in between: not the poll's earlier dispatches (they are
        of other jobs), and not a call running in the background, which the caller
        rules out by asking for no heads while one runs. A job re-homed in between is
        fenced at its commit, as one re-homed after `NumberedCalls.open` is."""
        self._read, self._recorded, self._heads, self._latest = set(), {}, {}, None
        firsts: dict[str, Dispatch] = {}
        for dispatch in dispatches:
            for call in dispatch.calls:
                firsts.setdefault(call.job_id, dispatch)
        calls = [c for d in dispatches if numbered(d) for c in d.calls]
        if not calls:
            return
        ahead = [
            (job_id, d)
            for job_id, d in firsts.items()
            if heads and numbered(d) and d.calls[0].job_id == job_id
        ]
        ids = [c.request_id for c in calls]
        led = any(d.leader_token for d in dispatches if numbered(d))
        leader = self._leader if led else None
        async with self._calls.pipeline() as pipe:
            self._calls.queue_get_completions(pipe, ids)
            for job_id, _ in ahead:
                self._ledger.queue_head(pipe, job_id)
            if leader is not None:
                leader.queue_latest(pipe)
            replies = await pipe.execute()
        self._recorded = completions_of(ids, replies[0])
        self._read = set(ids)
        self._heads = {
            d.dispatch_id: self._ledger.head_of(reply)
            for (_, d), reply in zip(ahead, replies[1 : 1 + len(ahead)], strict=True)
        }
        if leader is not None:
            self._latest = leader.latest_of(replies[-1])

    async def recorded(self, calls: list[PhaseRequest]) -> dict[str, PhaseCompletion]:
        """Completions recorded for any of these calls: read ahead once per call (a call
        delivered twice in one poll is read again the second time, after the first ran),
        else from Redis."""
        ids = [c.request_id for c in calls]
        if not all(i in self._read for i in ids):
            return await self._calls.get_completions(ids)
        self._read.difference_update(ids)
        return {i: self._recorded[i] for i in ids if i in self._recorded}

    def latest_token(self) -> int | None:
        """The scheduler lease's latest token read ahead for this poll (None: not read).
        It only grows: one read at the poll's start skips no fewer dispatches than a
        read before each would have, but for a term that began in between."""
        return self._latest

    def head(self, dispatch: Dispatch) -> LedgerState | None:
        """Its job's ledger head read ahead for this dispatch, once (None: not read)."""
        return self._heads.pop(dispatch.dispatch_id, None)

    async def settle(self) -> None:
        """After a poll's dispatches ran: until each of their completions is in Kafka."""
        self._read, self._recorded, self._heads, self._latest = set(), {}, {}, None
        await self._recorder.settle()


def numbered(dispatch: Dispatch) -> bool:
    """Whether the dispatch holds a numbered call (run in its job's ledger order)."""
    return dispatch.lease is not None and any(dispatch.lease.seqs)


class PollHooks(Protocol):
    """What a dispatch consumer runs around each poll (`PollIntake`'s, through the
    pipeline that knows what runs in the background)."""

    async def read_ahead(self, dispatches: list[Dispatch]) -> None: ...
    async def settle(self) -> None: ...


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
        poll: PollHooks | None = None,
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
