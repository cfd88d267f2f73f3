"""The control plane's fast paths keep its contracts: each call published once and in
order, every completion in Kafka before a dispatch counts as done, none lost when the
broker refuses one.

Real Redis and Kafka; only the gateway's publisher and the worker's producer are
faked where a test must make a send slow or fail.
"""

from __future__ import annotations

import asyncio
import inspect
import time
import types
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, cast

import msgspec
import pytest
import pytest_asyncio
from aiokafka import AIOKafkaConsumer
from aiokafka.errors import KafkaConnectionError

from plexrl.direct import Route
from plexrl.kafka import Delivery, MessageConsumer, Publisher, ensure_topics
from plexrl.lease import SCHEDULER, lease_key
from plexrl.ledger import Ledger
from plexrl.messages import (
    CompletionStatus,
    Dispatch,
    Function,
    Lease,
    NoopInput,
    NoopOutput,
    PhaseRequest,
    decode,
)
from plexrl.stores import Stores
from plexrl.topics import Topics, core_topics
from plexrl_gateway import deps
from plexrl_gateway.outbox import Accept, Outbox
from plexrl_gateway.render import ResponseKind
from plexrl_gateway.sequencer import Sequencer
from plexrl_gateway.submitter import Call, Submission, Submitter, ready
from plexrl_worker.intake import PollIntake
from plexrl_worker.leader import LeaderFence
from plexrl_worker.numbering import NumberedCalls
from plexrl_worker.pipeline import DispatchPipeline
from plexrl_worker.recorder import ResultRecorder
from plexrl_worker.runner import Ran

pytestmark = pytest.mark.integration

NOOP = ResponseKind.NOOP

JOB = "plexrl-echo:alice"


@pytest_asyncio.fixture
async def stores(infra: dict[str, str], cluster_id: str) -> AsyncIterator[Stores]:
    store = Stores.from_url(infra["redis"], cluster_id, 3600)
    try:
        yield store
    finally:
        keys = [k async for k in store.keys.redis.scan_iter(match=f"{cluster_id}:*", count=1000)]
        if keys:
            await store.keys.redis.delete(*keys)
        await store.close()


def request(n: int) -> PhaseRequest:
    return PhaseRequest(
        request_id=f"req-{n}",
        job_id=JOB,
        tenant="alice",
        function=Function.NOOP,
        payload=NoopInput(),
        arrival_time=time.time(),
    )


def accept(n: int) -> Accept:
    return Accept(job_id=JOB, futures=[], requests=[request(n)])


@dataclass
class SlowPublisher:
    """Records what the gateway publishes; each send takes a while, so flushes overlap."""

    sent: list[str] = field(default_factory=list)

    async def publish(self, topic: str, key: str | bytes | None, message: Any) -> None:
        await asyncio.sleep(0.002)
        self.sent.append(message.request_id)

    async def publish_deferred(self, topic: str, key: str | bytes | None, message: Any) -> Any:
        await self.publish(topic, key, message)
        return acked()

    async def ping(self, timeout_s: float = 2.0) -> bool:
        return True


def acked() -> asyncio.Future[None]:
    """An acknowledgement already in."""
    ack: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    ack.set_result(None)
    return ack


async def test_acceptance_reads_the_outbox_head_and_the_flush_starts_from_it(
    stores: Stores,
) -> None:
    outbox = Outbox(stores.keys)
    sent: list[str] = []

    async def send(rs: list[PhaseRequest], routes: list[Route] | None) -> asyncio.Future[None]:
        sent.extend(r.request_id for r in rs)
        return acked()

    first = await outbox.accept(accept(1))  # left unpublished, as by a gateway that died
    second = await outbox.accept(accept(2))
    assert first.standing is None and second.standing is None
    assert second.head == first.head  # the oldest entry, not the one just written
    assert await outbox.flush(JOB, send, head=second.head) == 2
    assert sent == ["req-1", "req-2"]
    assert await outbox.depth(JOB) == 0 and await outbox.pending_jobs() == []


async def test_an_acceptance_beside_a_running_flush_does_not_trust_its_head(
    stores: Stores,
) -> None:
    outbox = Outbox(stores.keys)
    sending = asyncio.Event()
    sent: list[str] = []

    async def send(rs: list[PhaseRequest], routes: list[Route] | None) -> asyncio.Future[None]:
        sent.extend(r.request_id for r in rs)
        await sending.wait()
        return acked()

    await outbox.accept(accept(1))
    flushing = asyncio.create_task(outbox.flush(JOB, send))
    while not sent:
        await asyncio.sleep(0.001)  # the flush is sending req-1 now
    accepted = await outbox.accept(accept(2))
    assert accepted.head is None  # the running flush goes to the end: it sends req-2
    sending.set()
    assert await flushing == 2
    assert await outbox.flush(JOB, send, head=accepted.head) == 0
    assert sent == ["req-1", "req-2"]


async def test_concurrent_calls_of_one_job_are_each_published_exactly_once(
    stores: Stores, cluster_id: str
) -> None:
    publisher = SlowPublisher()
    submitter = Submitter(
        stores.calls,
        stores.payloads,
        Outbox(stores.keys),
        publisher,
        Topics(cluster_id),
        Sequencer(stores.calls, gap_timeout_s=2.0),
        512 * 1024,
    )
    call = Call(Function.NOOP, NoopInput(), ResponseKind.NOOP)
    sub = Submission(JOB, "alice", sequenced=False)
    ids = await asyncio.gather(*(submitter.submit(sub, ready(call)) for _ in range(40)))
    assert sorted(publisher.sent) == sorted(ids)  # no call lost, none sent twice
    assert await Outbox(stores.keys).depth(JOB) == 0


class CountingOutbox(Outbox):
    """Counts the flushes the gateway runs (each reads the outbox at least once)."""

    flushes = 0

    async def flush(self, *args: Any, **kwargs: Any) -> int:
        self.flushes += 1
        return await super().flush(*args, **kwargs)


def echo_submitter(stores: Stores, cluster_id: str, outbox: Outbox, publisher: Any) -> Submitter:
    return Submitter(
        stores.calls,
        stores.payloads,
        outbox,
        publisher,
        Topics(cluster_id),
        Sequencer(stores.calls, gap_timeout_s=2.0),
        512 * 1024,
    )


async def test_requests_of_one_job_share_its_flushes_and_each_returns_once_published(
    stores: Stores, cluster_id: str
) -> None:
    publisher, outbox = SlowPublisher(), CountingOutbox(stores.keys)
    submitter = echo_submitter(stores, cluster_id, outbox, publisher)
    sub = Submission(JOB, "alice", sequenced=False)
    unpublished: list[str] = []

    async def one() -> str:
        request_id = await submitter.submit(sub, ready(Call(Function.NOOP, NoopInput(), NOOP)))
        if request_id not in publisher.sent:
            unpublished.append(request_id)
        return request_id

    ids = await asyncio.gather(*(one() for _ in range(40)))
    assert unpublished == []  # each answered only once its call was out
    assert sorted(publisher.sent) == sorted(ids)
    # One flush and the rounds that caught up with what came meanwhile, not one each.
    assert outbox.flushes <= 20, outbox.flushes  # 40 before: a flush per request
    assert await outbox.depth(JOB) == 0


async def test_a_stream_of_requests_does_not_hold_back_an_earlier_one(
    stores: Stores, cluster_id: str
) -> None:
    publisher = SlowPublisher()
    submitter = echo_submitter(stores, cluster_id, Outbox(stores.keys), publisher)
    sub = Submission(JOB, "alice", sequenced=False)
    call = ready(Call(Function.NOOP, NoopInput(), NOOP))
    streaming = asyncio.Event()

    async def stream() -> None:  # a new request every few milliseconds, for four seconds
        streaming.set()
        end = time.monotonic() + 4.0
        pending = []
        while time.monotonic() < end:
            pending.append(asyncio.create_task(submitter.submit(sub, call)))
            await asyncio.sleep(0.003)
        await asyncio.gather(*pending)

    streamer = asyncio.create_task(stream())
    await streaming.wait()
    start = time.monotonic()
    first = await submitter.submit(sub, call)
    waited = time.monotonic() - start
    assert first in publisher.sent
    assert not streamer.done() and waited < 2.0, waited  # not until the stream ends
    await streamer


async def test_a_refused_round_leaves_its_calls_for_the_next_and_none_is_lost(
    stores: Stores, cluster_id: str
) -> None:
    sent: list[str] = []
    refuse = [True]

    class Refusing(SlowPublisher):
        async def publish_deferred(self, topic: str, key: str | bytes | None, message: Any) -> Any:
            await asyncio.sleep(0.002)
            if refuse[0]:
                raise KafkaConnectionError("the broker is away")
            sent.append(message.request_id)
            return acked()

    submitter = echo_submitter(stores, cluster_id, Outbox(stores.keys), Refusing())
    sub = Submission(JOB, "alice", sequenced=False)
    call = ready(Call(Function.NOOP, NoopInput(), NOOP))
    refused = await asyncio.gather(*(submitter.submit(sub, call) for _ in range(5)))
    assert sent == [] and await Outbox(stores.keys).depth(JOB) == 5  # accepted, kept
    refuse[0] = False
    last = await submitter.submit(sub, call)
    assert sorted(sent) == sorted([*refused, last])  # each once, the refused ones too
    assert await Outbox(stores.keys).depth(JOB) == 0


def test_gateway_dependencies_run_on_the_event_loop() -> None:
    # A plain `def` dependency runs in FastAPI's thread pool: a thread hop per request.
    providers = [f for name, f in vars(deps).items() if name.startswith("_") and callable(f)]
    providers = [f for f in providers if inspect.isfunction(f) and f.__module__ == deps.__name__]
    assert providers
    assert all(inspect.iscoroutinefunction(f) for f in providers), providers


@dataclass
class FlakyProducer:
    """Stands in for the worker's producer: queued sends are acknowledged (or refused)
    only when the test says so; patient publishes always go through."""

    acks: list[asyncio.Future[Any]] = field(default_factory=list)
    queued: list[str] = field(default_factory=list)
    published: list[str] = field(default_factory=list)

    async def publish_deferred(self, topic: str, key: str | bytes | None, message: Any) -> Any:
        self.queued.append(message.request_id)
        ack: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.acks.append(ack)
        return ack

    async def publish(self, topic: str, key: str | bytes | None, message: Any) -> None:
        self.published.append(message.request_id)


@dataclass
class Pipelines:
    """Counts the Redis pipelines (round trips) the call store makes."""

    made: int = 0


def count_pipelines(stores: Stores, monkeypatch: pytest.MonkeyPatch) -> Pipelines:
    counter, make = Pipelines(), stores.calls.pipeline

    def counted() -> Any:
        counter.made += 1
        return make()

    monkeypatch.setattr(stores.calls, "pipeline", counted)
    return counter


def ran() -> Ran:
    return Ran(NoopOutput(), None, 0.0, 0.001, time.time())


def flaky_recorder(stores: Stores) -> tuple[FlakyProducer, ResultRecorder]:
    """A worker's recorder whose completions go to a producer the test acknowledges."""
    producer = FlakyProducer()
    recorder = ResultRecorder(
        worker_id="w",
        calls=stores.calls,
        payloads=stores.payloads,
        timeline=stores.timeline,
        publisher=producer,  # type: ignore[arg-type]
        completions_topic="completions",
        inline_max_bytes=1024,
    )
    return producer, recorder


async def test_calls_that_finished_together_are_recorded_in_one_round_trip(
    stores: Stores, monkeypatch: pytest.MonkeyPatch
) -> None:
    producer, recorder = flaky_recorder(stores)
    # One of them was recorded before (a replay that ran again): that record stands.
    first = await recorder.record(request(1), ran(), "d0", last=True)
    assert first is not None
    producer.queued.clear()
    pipelines = count_pipelines(stores, monkeypatch)
    seen: list[Any] = []
    announce = stores.calls.announce

    async def told(completion: Any) -> None:
        seen.append(completion.request_id)
        await announce(completion)

    monkeypatch.setattr(stores.calls, "announce", told)
    finished = [(request(n), ran(), n == 4) for n in range(5)]
    together = await recorder.record_together(finished, "d1")
    stood = [c for c in together if c is not None]
    assert pipelines.made == 1  # five records, notices and timeline entries: one round trip
    assert [c.request_id for c in stood] == [f"req-{n}" for n in range(5)]
    assert [c.dispatch_id for c in stood] == ["d1", "d0", "d1", "d1", "d1"]
    assert stood[4].last_in_dispatch and not stood[3].last_in_dispatch
    assert seen == ["req-1"]  # the others were announced with their records
    assert producer.queued == [f"req-{n}" for n in range(5)]  # in order, back to back
    recorded = await stores.calls.get_completions(f"req-{n}" for n in range(5))
    assert recorded["req-1"].dispatch_id == "d0" and recorded["req-3"].dispatch_id == "d1"
    assert len(await stores.timeline.timeline()) == 6


async def test_a_dispatch_settles_only_when_every_completion_is_acknowledged(
    stores: Stores,
) -> None:
    producer, recorder = flaky_recorder(stores)
    for n in range(3):
        done = await recorder.record(request(n), ran(), "d1", last=n == 2)
        assert done is not None and done.status == CompletionStatus.OK
    assert producer.queued == ["req-0", "req-1", "req-2"]  # all queued, none waited on
    # Recorded in Redis (the truth) and on the timeline before anything is acknowledged.
    assert set(await stores.calls.get_completions(["req-0", "req-1", "req-2"])) == {
        "req-0",
        "req-1",
        "req-2",
    }
    assert len(await stores.timeline.timeline()) == 3

    settle = asyncio.create_task(recorder.settle())
    await asyncio.sleep(0.01)
    assert not settle.done()  # nothing acknowledged yet: the offset must not be committed
    producer.acks[0].set_result(None)
    producer.acks[1].set_exception(KafkaConnectionError("broker went away"))
    producer.acks[2].set_result(None)
    await asyncio.wait_for(settle, 5)
    assert producer.published == ["req-1"]  # the refused one went out the patient way


async def test_deferred_publishes_keep_their_order_on_the_partition(
    infra: dict[str, str], cluster_id: str
) -> None:
    topics = Topics(cluster_id)
    await ensure_topics(infra["kafka"], core_topics(topics))
    publisher = Publisher(infra["kafka"], "test-worker")
    await publisher.start()
    try:
        acks = [
            await publisher.publish_deferred(topics.completions, JOB, request(n)) for n in range(20)
        ]
        await asyncio.gather(*acks)
    finally:
        await publisher.stop()
    consumer = AIOKafkaConsumer(
        topics.completions, bootstrap_servers=infra["kafka"], auto_offset_reset="earliest"
    )
    await consumer.start()
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 20
        while len(seen) < 20 and time.monotonic() < deadline:
            for records in (await consumer.getmany(timeout_ms=200)).values():
                seen += [decode(r.value or b"", PhaseRequest).request_id for r in records]
    finally:
        await consumer.stop()
    assert seen == [f"req-{n}" for n in range(20)]


async def test_usage_and_activity_are_recorded_in_one_write(stores: Stores) -> None:
    await stores.usage.add_usage("job", {"calls": 1.0, "device_s": 0.5}, active_at=100.0)
    await stores.usage.add_usage("job", {"calls": 1.0, "device_s": 0.25}, active_at=103.5)
    usage = await stores.usage.usage("job")
    assert usage == {"calls": 2.0, "device_s": 0.75, "first_at": 100.0, "last_at": 103.5}


async def test_a_polls_usage_of_many_jobs_is_one_script_that_adds_to_each(stores: Stores) -> None:
    await stores.usage.add_usage("a", {"calls": 1.0, "queue_s": 0.5}, active_at=90.0)
    await stores.usage.add_usages(
        {
            "a": ({"calls": 2.0, "queue_s": 1e-05, "device_s": 0.5}, 100.0, 103.5),
            "b": ({"calls": 1.0, "compute_s": 2.5e-06}, 101.0, 101.0),
        }
    )
    assert await stores.usage.usage("a") == {
        "calls": 3.0,
        "queue_s": 0.50001,
        "device_s": 0.5,
        "compute_s": 0.0,
        "first_at": 90.0,  # the first activity stays
        "last_at": 103.5,
    }
    b = await stores.usage.usage("b")
    assert b["calls"] == 1.0 and b["compute_s"] == 2.5e-06 and b["first_at"] == 101.0
    await stores.usage.add_usages({})  # nothing to write: no command


async def test_a_flush_queues_its_batch_at_once_and_a_refused_call_stays_with_those_after(
    stores: Stores,
) -> None:
    outbox = Outbox(stores.keys, batch=8)
    for n in range(1, 5):
        await outbox.accept(accept(n))
    acks: list[tuple[str, asyncio.Future[None]]] = []

    async def send(rs: list[PhaseRequest], routes: list[Route] | None) -> asyncio.Future[None]:
        ack: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        acks.append((rs[0].request_id, ack))  # to the scheduler: a record each
        return ack

    flushing = asyncio.create_task(outbox.flush(JOB, send))
    while len(acks) < 4:  # every one queued before any is acknowledged
        await asyncio.sleep(0.001)
    for n, (_, ack) in enumerate(acks):
        if n == 2:
            ack.set_exception(KafkaConnectionError("broker unreachable"))
        else:
            ack.set_result(None)
    with pytest.raises(KafkaConnectionError):
        await flushing
    assert await outbox.depth(JOB) == 2  # req-3 and req-4 wait for the next flush
    sent: list[str] = []

    async def resend(rs: list[PhaseRequest], routes: list[Route] | None) -> asyncio.Future[None]:
        sent.extend(r.request_id for r in rs)
        return acked()

    assert await outbox.flush(JOB, resend) == 2
    assert sent == ["req-3", "req-4"] and await outbox.depth(JOB) == 0


def dispatch(*ns: int) -> Dispatch:
    calls = [request(n) for n in ns]
    return Dispatch(dispatch_id=f"d{ns[0]}", worker_id="w", calls=calls)


async def test_the_intake_reads_a_polls_records_once_and_settles_after_its_last_dispatch(
    stores: Stores, cluster_id: str
) -> None:
    producer, recorder = flaky_recorder(stores)
    intake = PollIntake(recorder, stores.calls, Ledger(stores.keys.redis, cluster_id))
    await recorder.record(request(0), ran(), "d0", last=True)  # a replay in this poll
    producer.acks[0].set_result(None)
    await recorder.settle()
    first, second = dispatch(0, 1), dispatch(2)
    await intake.read_ahead([first, second])
    # The first dispatch runs call 1 and records it; what the poll read stands for it.
    assert set(await intake.recorded(first.calls)) == {"req-0"}
    await recorder.record(request(1), ran(), "d0", last=True)
    assert await intake.recorded(second.calls) == {}
    # A call delivered again in the same poll is read afresh (it ran since).
    assert set(await intake.recorded(dispatch(1).calls)) == {"req-1"}

    settle = asyncio.create_task(intake.settle())
    await asyncio.sleep(0.01)
    assert not settle.done()  # the poll's offsets wait for its completions
    producer.acks[1].set_result(None)
    await asyncio.wait_for(settle, 5)


def numbered(job_id: str, n: int, epoch: int = 1) -> Dispatch:
    call = msgspec.structs.replace(request(n), job_id=job_id)
    return Dispatch(dispatch_id=f"d{n}", worker_id="w", calls=[call], lease=Lease(epoch, [n]))


async def test_the_intake_reads_the_ledger_head_of_each_jobs_first_numbered_dispatch_ahead(
    stores: Stores, cluster_id: str
) -> None:
    """In the round trip of the poll's records: the head of each job whose first dispatch
    in the poll is numbered, handed to that dispatch once; a later dispatch of the same
    job (the first may commit before it runs) and an unnumbered one read their own."""
    _, recorder = flaky_recorder(stores)
    ledger = Ledger(stores.keys.redis, cluster_id)
    intake = PollIntake(recorder, stores.calls, ledger)
    await ledger.bump_epoch("a", "w")  # epoch 1
    await ledger.bump_epoch("b", "w")
    await ledger.bump_epoch("b", "w")  # epoch 2
    a1, b2, a3, plain = numbered("a", 1), numbered("b", 2, epoch=2), numbered("a", 3), dispatch(4)
    await intake.read_ahead([a1, b2, a3, plain])
    await ledger.bump_epoch("a", "v")  # after the read: the dispatch gets what was read
    head = intake.head(a1)
    assert head is not None and (head.epoch, head.owner) == (1, "w")
    assert intake.head(a1) is None  # once
    head = intake.head(b2)
    assert head is not None and head.epoch == 2
    assert intake.head(a3) is None and intake.head(plain) is None
    # Asked for no heads (a call commits in the background), it reads the records only.
    await intake.read_ahead([a1, b2], heads=False)
    assert intake.head(a1) is None and intake.head(b2) is None
    assert await intake.recorded(a1.calls) == {}


async def test_the_pipeline_reads_no_heads_ahead_while_a_call_runs_in_the_background(
    stores: Stores, cluster_id: str
) -> None:
    """A preempted training call finishing in the background commits to its job's
    ledger whenever it ends: a head read ahead meanwhile could miss it."""
    _, recorder = flaky_recorder(stores)
    ledger = Ledger(stores.keys.redis, cluster_id)
    intake = PollIntake(recorder, stores.calls, ledger)
    unused: Any = None  # the parts a poll's read-ahead does not touch
    pipeline = DispatchPipeline(unused, unused, recorder, unused, unused, unused, intake=intake)
    background = asyncio.create_task(asyncio.sleep(60))
    pipeline.tails.add(background)
    await pipeline.read_ahead([numbered("a", 1)])
    assert intake.head(numbered("a", 1)) is None
    background.cancel()
    pipeline.tails.clear()
    await pipeline.read_ahead([numbered("a", 1)])
    assert intake.head(numbered("a", 1)) is not None


class Forgets:
    """The worker's recovery, where a re-homed job's copy is dropped."""

    def __init__(self) -> None:
        self.forgotten: list[str] = []

    async def forget(self, job_id: str) -> None:
        self.forgotten.append(job_id)


@dataclass
class Runs:
    """Runs NOOPs, counting them."""

    ran: list[str] = field(default_factory=list)

    async def run(self, request: PhaseRequest, *args: Any) -> Ran:
        self.ran.append(request.request_id)
        return ran()


@dataclass
class Worker:
    """A worker's dispatch pipeline on the real Redis: its recorder's producer, recovery
    and runner stood in for (`FlakyProducer`, `Forgets`, `Runs`)."""

    producer: FlakyProducer
    ledger: Ledger
    recovery: Forgets
    runs: Runs
    calls: NumberedCalls
    intake: PollIntake
    pipeline: DispatchPipeline

    @classmethod
    def on(cls, stores: Stores, cluster_id: str, leader: LeaderFence | None = None) -> Worker:
        producer, recorder = flaky_recorder(stores)
        ledger = Ledger(stores.keys.redis, cluster_id)
        recovery, runs = Forgets(), Runs()
        runner: Any = runs
        calls = NumberedCalls(
            ledger=ledger, recovery=cast(Any, recovery), runner=runner, recorder=recorder
        )
        intake = PollIntake(recorder, stores.calls, ledger, leader)
        unused: Any = None
        beat: Any = types.SimpleNamespace(busy=False)
        pipeline = DispatchPipeline(
            unused, runner, recorder, beat, calls, unused, intake=intake, leader=leader
        )
        return cls(producer, ledger, recovery, runs, calls, intake, pipeline)


async def test_unnumbered_calls_run_before_any_read_and_their_lease_is_checked_at_the_record(
    stores: Stores, cluster_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Echoes and samples (pure, unnumbered) of a leased job: nothing is read before they
    run; each record stands only while the lease does (re-homed, the rest of the
    dispatch is left to the new home), and a replay runs again but is answered with the
    record that stood."""
    w = Worker.on(stores, cluster_id)
    producer, ledger, recovery, runs, calls = w.producer, w.ledger, w.recovery, w.runs, w.calls
    pipeline, delivery = w.pipeline, Delivery("t", 0, 0)
    await ledger.bump_epoch(JOB, "w")  # epoch 1
    pipelines = count_pipelines(stores, monkeypatch)
    first = Dispatch("d1", "w", calls=[request(1), request(2)], lease=Lease(1, [0, 0]))
    await pipeline.read_ahead([first])
    assert pipelines.made == 0  # nothing to read ahead
    await pipeline(first, delivery)
    assert pipelines.made == 2 and runs.ran == ["req-1", "req-2"]  # one record each
    assert (await stores.calls.get_completion("req-2")) is not None
    # A replay: run again, answered with the first record.
    stored = await stores.calls.get_completion("req-1")
    await pipeline(Dispatch("d9", "w", calls=[request(1)], lease=Lease(1, [0])), delivery)
    assert runs.ran[-1] == "req-1" and producer.queued[-1] == "req-1"
    assert await stores.calls.get_completion("req-1") == stored
    # Re-homed (epoch 2) before a dispatch under epoch 1 ran: its first call runs, its
    # record is refused, the rest is left to the new home.
    await ledger.bump_epoch(JOB, "v")
    queued = len(producer.queued)
    await pipeline(
        Dispatch("d3", "w", calls=[request(3), request(4)], lease=Lease(1, [0, 0])), delivery
    )
    assert runs.ran[-1] == "req-3" and "req-4" not in runs.ran
    assert await stores.calls.get_completion("req-3") is None
    assert len(producer.queued) == queued  # nothing published
    assert calls.fenced == 1 and recovery.forgotten == [JOB]
    # Under the current epoch the same calls are recorded.
    await pipeline(Dispatch("d4", "w", calls=[request(3)], lease=Lease(2, [0])), delivery)
    assert await stores.calls.get_completion("req-3") is not None


async def test_a_deposed_schedulers_pure_calls_run_but_are_not_recorded(
    stores: Stores, cluster_id: str
) -> None:
    """A dispatch of pure calls is checked against the scheduler's term as each call is
    recorded, not before it runs; a numbered one before, with the token read ahead."""
    leader = LeaderFence(stores.keys.redis, lease_key(stores.keys.key, SCHEDULER) + ":token")
    w = Worker.on(stores, cluster_id, leader)
    producer, ledger, recovery, runs, calls = w.producer, w.ledger, w.recovery, w.runs, w.calls
    intake, pipeline, delivery = w.intake, w.pipeline, Delivery("t", 0, 0)
    await ledger.bump_epoch(JOB, "w")
    await stores.keys.redis.set(leader.token_key, 5)

    def pure(n: int, token: int) -> Dispatch:
        return Dispatch(f"d{n}", "w", calls=[request(n)], lease=Lease(1, [0]), leader_token=token)

    await pipeline(pure(1, 5), delivery)
    assert await stores.calls.get_completion("req-1") is not None
    await stores.keys.redis.set(leader.token_key, 6)  # a newer term began
    await pipeline(pure(2, 5), delivery)
    assert runs.ran == ["req-1", "req-2"]  # it ran ...
    assert await stores.calls.get_completion("req-2") is None  # ... and is not answered here
    assert leader.skipped == 1 and recovery.forgotten == [] and calls.fenced == 0
    # A numbered dispatch is skipped before it runs, by the token read with the poll's.
    numbered_one = msgspec.structs.replace(numbered(JOB, 1), leader_token=5)
    await pipeline.read_ahead([numbered_one])
    assert intake.latest_token() == 6
    await pipeline(numbered_one, delivery)
    assert runs.ran == ["req-1", "req-2"] and leader.skipped == 2
    assert producer.queued == ["req-1"]


async def test_a_consumer_hands_a_whole_poll_ahead_before_handling_its_first_message(
    infra: dict[str, str], cluster_id: str
) -> None:
    topics = Topics(cluster_id)
    await ensure_topics(infra["kafka"], core_topics(topics))
    publisher = Publisher(infra["kafka"], "test-intake")
    await publisher.start()
    seen: list[str] = []

    async def ahead(requests: list[PhaseRequest]) -> None:
        seen.append("ahead " + ",".join(r.request_id for r in requests))
        raise RuntimeError("reading ahead is only an optimisation")

    async def handle(r: PhaseRequest, delivery: Delivery) -> None:
        seen.append(r.request_id)

    consumer = MessageConsumer[PhaseRequest](
        bootstrap=infra["kafka"],
        topics=[topics.requests],
        group=topics.group("intake"),
        message_type=PhaseRequest,
        handler=handle,
        dlq=(publisher, topics.dlq),
        name="intake",
        before_batch=ahead,
    )
    stop = asyncio.Event()
    try:
        for n in range(3):
            await publisher.publish(topics.requests, JOB, request(n))
        await consumer.start()
        running = asyncio.create_task(consumer.run(stop))
        deadline = time.monotonic() + 30
        while len([s for s in seen if not s.startswith("ahead")]) < 3:
            assert time.monotonic() < deadline, seen
            await asyncio.sleep(0.05)
        stop.set()
        await running
    finally:
        await consumer.stop()
        await publisher.stop()
    assert seen[0] == "ahead req-0,req-1,req-2" and seen[1:] == ["req-0", "req-1", "req-2"]
