"""The scheduler's loop outlives a failed publish and a failed store call.

The real scheduler (`serve`) runs in this process against the real Kafka and Redis;
the test plays the worker (heartbeats, reads its dispatch topic, answers). Kafka
refuses the first dispatch once and Redis fails the first home write once: the loop
logs both, carries on, and both calls complete.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio
import redis.exceptions
from aiokafka import AIOKafkaConsumer
from aiokafka.errors import KafkaConnectionError

from plexrl.kafka import Publisher, ensure_topics
from plexrl.messages import (
    CompletionStatus,
    Dispatch,
    Function,
    JobSpec,
    NoopInput,
    NoopOutput,
    PhaseCompletion,
    PhaseRequest,
    Timings,
    WorkerHeartbeat,
    decode,
)
from plexrl.settings import SchedulerSettings
from plexrl.stores import JobStore, Stores
from plexrl.topics import Topics, core_topics
from plexrl_scheduler.main import Inbox, serve
from tests.conftest import free_port

pytestmark = pytest.mark.integration

WORKER = "w0"
SPEC = JobSpec(base_model="", lora=None, state_bytes=0)


class Faults:
    """Each fault fires once, the first time its target is called."""

    def __init__(self) -> None:
        self.fired: list[str] = []

    def once(self, name: str) -> bool:
        if name in self.fired:
            return False
        self.fired.append(name)
        return True


@pytest_asyncio.fixture
async def faults(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Faults]:
    faults = Faults()
    send = Publisher._send
    set_home = JobStore.set_home

    async def flaky_send(
        self: Publisher, topic: str, key: Any, message: Any, headers: Any = None
    ) -> None:
        if isinstance(message, Dispatch) and faults.once("publish"):
            raise KafkaConnectionError("the broker went away (injected)")
        await send(self, topic, key, message, headers)

    async def flaky_set_home(self: JobStore, job_id: str, worker_id: str) -> None:
        if faults.once("store"):
            raise redis.exceptions.ConnectionError("Redis went away (injected)")
        await set_home(self, job_id, worker_id)

    monkeypatch.setattr(Publisher, "_send", flaky_send)
    monkeypatch.setattr(JobStore, "set_home", flaky_set_home)
    yield faults


def request(rid: str) -> PhaseRequest:
    return PhaseRequest(
        request_id=rid,
        job_id="job-1",
        tenant="t",
        function=Function.NOOP,
        payload=NoopInput(),
        arrival_time=time.time(),
        spec=SPEC,
    )


async def test_a_failed_publish_and_a_failed_store_call_do_not_stop_the_loop(
    infra: dict[str, str], cluster_id: str, faults: Faults
) -> None:
    topics = Topics(cluster_id)
    await ensure_topics(infra["kafka"], {**core_topics(topics), topics.dispatch(WORKER): 1})
    settings = SchedulerSettings(
        cluster_id=cluster_id,
        kafka_bootstrap=infra["kafka"],
        redis_url=infra["redis"],
        scheduler_port=free_port(),
        policy="fifo",
    )
    stop = asyncio.Event()
    scheduler = asyncio.create_task(serve(settings, stop))
    worker = Publisher(infra["kafka"], "fake-worker")
    await worker.start()
    dispatches = AIOKafkaConsumer(
        topics.dispatch(WORKER), bootstrap_servers=infra["kafka"], auto_offset_reset="earliest"
    )
    await dispatches.start()
    beating = asyncio.create_task(heartbeats(worker, topics, stop))
    stores = Stores.from_url(infra["redis"], cluster_id, 3600)
    health = f"http://127.0.0.1:{settings.scheduler_port}/healthz"
    try:
        for rid in ("call-1", "call-2"):
            await worker.publish(topics.requests, "job-1", request(rid))
            dispatch = await next_dispatch(dispatches, scheduler)
            assert [c.request_id for c in dispatch.calls] == [rid]
            await answer(worker, stores, topics, dispatch)
        assert sorted(faults.fired) == ["publish", "store"]
        assert not scheduler.done()
        async with httpx.AsyncClient() as http:
            body = (await http.get(health)).json()
        assert body["ok"] and body["loop"]["step_failures"] == {"decide and act": 1}
        assert "Redis went away" in body["loop"]["last_error"]
    finally:
        stop.set()
        await asyncio.wait_for(scheduler, 30)
        await beating
        await dispatches.stop()
        await worker.stop()
        keys = [k async for k in stores.keys.redis.scan_iter(match=f"{cluster_id}:*", count=1000)]
        if keys:
            await stores.keys.redis.delete(*keys)
        await stores.close()


async def heartbeats(worker: Publisher, topics: Topics, stop: asyncio.Event) -> None:
    started = time.time()
    while not stop.is_set():
        beat = WorkerHeartbeat(
            worker_id=WORKER,
            device="cpu",
            device_bytes=1 << 30,
            host_bytes=1 << 30,
            base_models=[],
            resident=[],
            busy=False,
            started_at=started,
            sent_at=time.time(),
        )
        await worker.publish(topics.events, WORKER, beat)
        await asyncio.sleep(0.3)


async def next_dispatch(consumer: AIOKafkaConsumer, scheduler: asyncio.Task[None]) -> Dispatch:
    """The next dispatch carrying calls (prefetch-only ones are skipped)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if scheduler.done():
            scheduler.result()  # the scheduler died: show why
            raise AssertionError("the scheduler stopped")
        batches = await consumer.getmany(timeout_ms=200)
        for records in batches.values():
            for record in records:
                dispatch: Dispatch = decode(record.value or b"", Dispatch)
                if dispatch.calls:
                    return dispatch
    raise AssertionError("no dispatch within 60 s")


async def answer(worker: Publisher, stores: Stores, topics: Topics, dispatch: Dispatch) -> None:
    """What a worker does: record the completion, then publish it."""
    for i, call in enumerate(dispatch.calls):
        completion = PhaseCompletion(
            request_id=call.request_id,
            job_id=call.job_id,
            tenant=call.tenant,
            worker_id=WORKER,
            function=call.function,
            status=CompletionStatus.OK,
            timings=Timings(),
            result=NoopOutput(),
            finished_at=time.time(),
            dispatch_id=dispatch.dispatch_id,
            last_in_dispatch=i == len(dispatch.calls) - 1,
        )
        await stores.calls.record_completion(completion)
        await worker.publish(topics.completions, call.job_id, completion)


async def test_a_terms_end_is_bounded_when_its_consumers_hang(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With a group's coordinator on a host that is gone, a consumer's loop and its stop
    can hang for minutes; a deposed leader still ends its term (so it can stand for the
    lease again), leaving what hangs to finish in the background."""
    from plexrl_scheduler import main

    monkeypatch.setattr(main, "_CONSUMERS_END_S", 0.2)
    forever = asyncio.Event()

    class Stuck:  # the edge: aiokafka's stop waiting on a coordinator that never answers
        name = "stuck"

        async def stop(self) -> None:
            await forever.wait()

    async def loop_in_a_commit() -> None:
        await forever.wait()

    tasks = [asyncio.create_task(loop_in_a_commit())]
    started = time.monotonic()
    await main._leave_groups(tasks, [Stuck(), Stuck()])
    assert time.monotonic() - started < 2
    assert tasks[0].cancelled()  # the loop past the bound was cancelled
    assert len(main._lingering) == 2  # the stops go on in the background

    # The lease cancels a term's end that outlasts its step-down time: the consumers
    # are still stopped.
    stopped: list[str] = []

    class Quick:
        name = "quick"

        async def stop(self) -> None:
            stopped.append(self.name)

    ending = asyncio.create_task(
        main._leave_groups([asyncio.create_task(loop_in_a_commit())], [Quick()])
    )
    await asyncio.sleep(0.05)
    ending.cancel()
    await asyncio.gather(ending, return_exceptions=True)
    await asyncio.sleep(0.05)
    assert stopped == ["quick"]
    for task in list(main._lingering):
        task.cancel()
    await asyncio.gather(*main._lingering, return_exceptions=True)


class _Consumer:
    """The edge of a term's inbox: a consumer whose start fails or not."""

    def __init__(self, name: str, fails: bool) -> None:
        self.name, self.fails, self.stopped = name, fails, False

    async def start(self) -> None:
        if self.fails:
            raise KafkaConnectionError("the broker is away")

    async def stop(self) -> None:
        self.stopped = True


async def test_a_term_whose_consumer_cannot_start_stops_those_that_did() -> None:
    """A term that fails while its consumers connect leaves none behind: one left
    started would keep its group's partitions from the next term."""
    inbox = Inbox.__new__(Inbox)  # the consumers alone: nothing else of a term is needed
    consumers = [_Consumer("requests", False), _Consumer("completions", True)]
    consumers.append(_Consumer("events", False))
    inbox.consumers = consumers  # type: ignore[assignment]
    with pytest.raises(KafkaConnectionError):
        await inbox.start()
    assert all(c.stopped for c in consumers)
