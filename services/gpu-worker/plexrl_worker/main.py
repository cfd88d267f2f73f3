"""The gpu-worker's entry point: ingest dispatches → move states → run → record."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace

from plexrl import direct, tracing
from plexrl.dead_letters import DeadLetters
from plexrl.failpoints import failpoint
from plexrl.health import HttpServer, health_app
from plexrl.kafka import Delivery, MessageConsumer
from plexrl.ledger import Ledger, LedgerState
from plexrl.messages import (
    Dispatch,
    Function,
    PhaseCompletion,
    PreemptBatch,
    ReleaseReason,
    TailReleased,
    Tier,
)
from plexrl.models import ModelRegistry
from plexrl.retry import retrying
from plexrl.service import join_cluster
from plexrl.settings import WorkerSettings
from plexrl.state_store_client import StateStoreClient
from plexrl.topics import Topics
from plexrl_worker import metrics
from plexrl_worker.engine import EngineConfig, TorchEngine
from plexrl_worker.engine_thread import EngineThread
from plexrl_worker.heartbeat import Heartbeat
from plexrl_worker.intake import DispatchIntake
from plexrl_worker.preemption import Preemption
from plexrl_worker.recorder import ResultRecorder
from plexrl_worker.recovery import JobRecovery, NumberedCalls, SnapshotConfig
from plexrl_worker.residency import StateManager
from plexrl_worker.runner import CallRunner, Ran
from plexrl_worker.samplers import SGLangSampling

log = logging.getLogger("plexrl.worker")
_tracer = tracing.tracer("plexrl.worker")


@dataclass(frozen=True)
class TailRelease:
    """The rollout-tail release: the fraction of a batch's sequences still decoding below
    which the worker takes its next dispatch (0: never), and how it tells the scheduler."""

    threshold: float
    announce: Callable[[TailReleased], Awaitable[None]]


def _finished_tail(tails: set[asyncio.Task[None]]) -> Callable[[asyncio.Task[None]], None]:
    def done(task: asyncio.Task[None]) -> None:
        tails.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("a sample batch's tail failed", exc_info=task.exception())

    return done


class DispatchHandler:
    """One dispatch: evictions, then each call (onload, run, record), then prefetches."""

    def __init__(
        self,
        states: StateManager,
        runner: CallRunner,
        recorder: ResultRecorder,
        heartbeat: Heartbeat,
        numbered: NumberedCalls,
        tail: TailRelease,
        preemption: Preemption | None = None,
        intake: DispatchIntake | None = None,
    ) -> None:
        """`intake`: reads a poll's recorded completions ahead and settles its
        completions after its last dispatch (None: each dispatch reads and settles its
        own)."""
        self._intake = intake
        self._preemption = preemption or Preemption()
        self._states = states
        self._runner = runner
        self._recorder = recorder
        self._heartbeat = heartbeat
        self._numbered = numbered
        self._tail = tail
        self.calls = 0
        self.tails: set[asyncio.Task[None]] = set()
        """Sample batches left to finish their tails in the background."""

    async def __call__(self, dispatch: Dispatch, delivery: Delivery) -> None:
        if direct.lease_of(dispatch.dispatch_id) is not None:
            failpoint("worker.direct_received")
        self._heartbeat.busy = True
        # A batch preempted for this dispatch stays paused until it lets go (below).
        claimed = self._preemption.claim() if dispatch.calls else None
        try:
            for move in dispatch.evict:
                await self._states.move(move.job_id, move.to_tier)
            lease = dispatch.lease
            seqs = [
                lease.seqs[i] if lease is not None and i < len(lease.seqs) else 0
                for i in range(len(dispatch.calls))
            ]
            # A dispatch holds calls of one job; a stale lease means it was re-homed. The
            # job's ledger head is read only for numbered calls (unnumbered ones are pure:
            # run twice, the first record wins) and goes to the first of them; with the
            # replay read, one round trip's wait.
            recorded = self._intake.recorded if self._intake else self._recorder.recorded
            head, replayed = await asyncio.gather(
                self._numbered.current(dispatch.calls[0].job_id, lease.epoch)
                if lease is not None and any(seqs)
                else _unread(),
                recorded(dispatch.calls),
            )
            if head is None:
                return
            groups = _groups(dispatch, seqs, replayed)
            for n, (group, cobatched) in enumerate(groups):
                # Only the last group may leave its tail running: calls after it would
                # otherwise overtake it.
                releasable = cobatched and n == len(groups) - 1
                head = await self._run_group(
                    dispatch, delivery, group, cobatched, releasable, seqs, replayed, head
                )
            # Every completion of the dispatch is in Kafka before its offset is committed
            # (with an intake, once the poll's last dispatch ran).
            if self._intake is None:
                await self._recorder.settle()
            for move in dispatch.prefetch:
                await self._states.move(move.job_id, move.to_tier)
        finally:
            self._heartbeat.busy = False
            if claimed is not None:
                await self._preemption.open(claimed)

    async def _run_group(
        self,
        dispatch: Dispatch,
        delivery: Delivery,
        group: list[int],
        cobatched: bool,
        releasable: bool,
        seqs: list[int],
        replayed: dict[str, PhaseCompletion],
        head: LedgerState | bool,
    ) -> LedgerState | bool:
        """Run calls `group` of the dispatch: one call, or sample calls co-batched (and
        with `releasable`, left to finish in the background once down to their tail).
        `head`: the job's ledger head as the dispatch read it, for its first numbered
        call (False once used, or never read); returns what is left of it."""
        lease = dispatch.lease
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
                await self._run_samples(dispatch, group, releasable)
                return head
            i = group[0]
            request = dispatch.calls[i]
            if lease is not None and seqs[i] > 0:  # exactly once by the job's ledger
                await self._numbered.run(
                    request,
                    seqs[i],
                    lease.epoch,
                    dispatch.dispatch_id,
                    i == last_i,
                    head=head if isinstance(head, LedgerState) else None,
                )
                self.calls += 1
                return False
            done = replayed.get(request.request_id)
            if done is not None:  # a replay: answer with the recorded result
                await self._recorder.publish(done)
                metrics.REPLAYED_CALLS.inc()
                return head
            await self._record(dispatch, i, await self._runner.run(request), i == last_i)
            return head

    async def _run_samples(self, dispatch: Dispatch, group: list[int], releasable: bool) -> None:
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

        async def record(k: int, ran: Ran) -> None:
            recorded.add(k)
            if ran.tail_released_at is not None and asked is not None and asked.is_set():
                ran = dataclasses.replace(ran, preempted=True)
            await self._record(dispatch, group[k], ran, group[k] == last_i)

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
            for k, ran in enumerate(rans):  # those that failed before running
                if k not in recorded:
                    await record(k, ran)
            await self._recorder.settle()  # a tail left running settles its own

        task = asyncio.create_task(run_and_record())
        waiter = asyncio.create_task(released.wait())
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if task.done():
            task.result()
            return
        self.tails.add(task)
        task.add_done_callback(_finished_tail(self.tails))

    async def _record(self, dispatch: Dispatch, i: int, ran: Ran, last: bool) -> None:
        # Retried in place while Redis is away: the call ran, only its record is
        # missing, and running it again would apply it twice.
        await retrying(
            functools.partial(
                self._recorder.record, dispatch.calls[i], ran, dispatch.dispatch_id, last
            ),
            what=f"recording {dispatch.calls[i].request_id}",
        )
        self.calls += 1


async def _unread() -> bool:
    """No numbered call: the ledger head is not read (a stand-in, never None)."""
    return False


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


async def serve(settings: WorkerSettings, stop: asyncio.Event) -> None:
    name = f"plexrl-worker-{settings.worker_id}"
    own = Topics(settings.cluster_id)
    topics, stores, publisher = await join_cluster(
        settings, name, {own.dispatch(settings.worker_id): 1, own.control(settings.worker_id): 1}
    )
    store = StateStoreClient(settings.state_store_url, token=settings.service_token)
    registry = ModelRegistry(settings.model_registry)
    engine = TorchEngine(
        registry,
        EngineConfig(device=settings.worker_device, num_threads=settings.worker_threads),
    )
    thread = EngineThread()
    states = StateManager(
        worker_id=settings.worker_id,
        engine=engine,
        thread=thread,
        residency=stores.residency,
        store=store,
        publisher=publisher,
        events_topic=topics.events,
    )
    sglang = (
        SGLangSampling(
            engine,
            registry,
            settings.sglang_dir / settings.worker_id,
            device=settings.worker_device.split(":")[0],  # SGLang's own: "cuda", "cpu"
            yield_device=settings.sglang_yield == "training"
            or (settings.sglang_yield == "auto" and settings.worker_device != "cpu"),
            attach_url=settings.sglang_url,
        )
        if settings.sampler == "sglang"
        else None
    )
    if sglang is not None:
        log.info("starting SGLang for %s (minutes on CPU)", registry.models())
        await asyncio.to_thread(sglang.start)
    runner = CallRunner(
        engine=engine,
        thread=thread,
        states=states,
        payloads=stores.payloads,
        checkpoints=stores.checkpoints,
        jobs=stores.jobs,
        store=store,
        sglang=sglang,
        ephemeral_keep=settings.ephemeral_keep,
    )
    recorder = ResultRecorder(
        worker_id=settings.worker_id,
        calls=stores.calls,
        payloads=stores.payloads,
        timeline=stores.timeline,
        publisher=publisher,
        completions_topic=topics.completions,
        inline_max_bytes=settings.payload_inline_max_bytes,
    )
    heartbeat = Heartbeat(
        settings=settings,
        base_models=registry.names(),
        states=states,
        workers=stores.workers,
        publisher=publisher,
        events_topic=topics.events,
    )
    ledger = Ledger(stores.keys.redis, settings.cluster_id)
    recovery = JobRecovery(
        worker_id=settings.worker_id,
        ledger=ledger,
        engine=engine,
        thread=thread,
        states=states,
        store=store,
        config=SnapshotConfig(
            every_calls=settings.snapshot_every_calls,
            archive_calls=settings.results_archive_calls,
        ),
        payloads=stores.payloads,
    )
    numbered = NumberedCalls(ledger=ledger, recovery=recovery, runner=runner, recorder=recorder)
    tail = TailRelease(
        settings.tail_threshold,
        lambda event: publisher.publish(topics.events, settings.worker_id, event),
    )
    preemption = (
        Preemption(
            pause=functools.partial(asyncio.to_thread, sglang.pause),
            resume=functools.partial(asyncio.to_thread, sglang.resume),
        )
        if sglang is not None
        else Preemption()
    )
    intake = DispatchIntake(recorder)
    handler = DispatchHandler(
        states, runner, recorder, heartbeat, numbered, tail, preemption, intake
    )
    metrics.watch(states, lambda: len(engine.installed_samplers()))
    dispatches: MessageConsumer[Dispatch] = MessageConsumer(
        bootstrap=settings.kafka_bootstrap,
        topics=[topics.dispatch(settings.worker_id)],
        group=topics.group(f"worker-{settings.worker_id}"),
        message_type=Dispatch,
        handler=handler,
        dlq=(publisher, topics.dlq),
        name=f"worker-{settings.worker_id}",
        answer=DeadLetters(stores.calls, stores.keys, publisher, topics.completions),
        before_batch=intake.read_ahead,
        after_batch=intake.settle,
    )

    async def preempt(message: PreemptBatch, delivery: Delivery) -> None:
        await preemption.ask(message.dispatch_id)

    control: MessageConsumer[PreemptBatch] = MessageConsumer(
        bootstrap=settings.kafka_bootstrap,
        topics=[topics.control(settings.worker_id)],
        group=None,  # a preempt is for the batch running now: none is replayed
        message_type=PreemptBatch,
        handler=preempt,
        dlq=(publisher, topics.dlq),
        name=f"worker-{settings.worker_id}-control",
        from_latest=True,
    )
    # Completions must go out: wait out a broker that is away rather than fail the call.
    publisher.retry_until(stop)
    health = HttpServer(
        health_app(
            f"worker-{settings.worker_id}",
            lambda: status(states, handler, engine),
            [dispatches, control],
        ),
        settings.worker_host,
        settings.worker_port,
    )
    await publisher.start()
    await dispatches.start()
    await control.start()
    await control.wait_assigned()
    await health.start()
    tasks = [
        asyncio.create_task(dispatches.run(stop)),
        asyncio.create_task(control.run(stop)),
        asyncio.create_task(heartbeat.run(stop)),
    ]
    log.info(
        "worker %s up on %s with models %s",
        settings.worker_id,
        settings.worker_device,
        registry.names(),
    )
    try:
        await stop.wait()
    finally:
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*handler.tails, return_exceptions=True)
        with contextlib.suppress(Exception):
            await dispatches.stop()
        with contextlib.suppress(Exception):
            await control.stop()
        await recovery.drain()
        if sglang is not None:
            await asyncio.to_thread(sglang.stop)
        await health.stop()
        await publisher.stop()
        await store.close()
        await stores.close()
        thread.shutdown()
        log.info("worker %s stopped", settings.worker_id)


def status(states: StateManager, handler: DispatchHandler, engine: TorchEngine) -> dict[str, Any]:
    return {
        "ok": True,
        "calls": handler.calls,
        # Counted per tier, never named: /healthz is open inside the cluster, and a job
        # id is its tenant's (the gateway names a tenant's own states to that tenant).
        "resident_jobs": {str(t): sum(s.tier == t for s in states.resident()) for t in Tier},
        "bases": engine.loaded_bases(),
    }
