"""The gpu-worker's entry point: ingest dispatches → move states → run → record."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from typing import Any

from opentelemetry import trace

from plexrl import tracing
from plexrl.dead_letters import DeadLetters
from plexrl.health import HttpServer, health_app
from plexrl.kafka import Delivery, MessageConsumer
from plexrl.ledger import Ledger
from plexrl.messages import Dispatch, Function, PhaseCompletion
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
from plexrl_worker.recorder import ResultRecorder
from plexrl_worker.recovery import JobRecovery, NumberedCalls, SnapshotConfig
from plexrl_worker.residency import StateManager
from plexrl_worker.runner import CallRunner, Ran

log = logging.getLogger("plexrl.worker")
_tracer = tracing.tracer("plexrl.worker")


class DispatchHandler:
    """One dispatch: evictions, then each call (onload, run, record), then prefetches."""

    def __init__(
        self,
        states: StateManager,
        runner: CallRunner,
        recorder: ResultRecorder,
        heartbeat: Heartbeat,
        numbered: NumberedCalls,
    ) -> None:
        self._states = states
        self._runner = runner
        self._recorder = recorder
        self._heartbeat = heartbeat
        self._numbered = numbered
        self.calls = 0

    async def __call__(self, dispatch: Dispatch, delivery: Delivery) -> None:
        self._heartbeat.busy = True
        try:
            for move in dispatch.evict:
                await self._states.move(move.job_id, move.to_tier)
            lease = dispatch.lease
            # A dispatch holds calls of one job; a stale lease means it was re-homed.
            if (
                lease is not None
                and dispatch.calls
                and await self._numbered.stale(dispatch.calls[0].job_id, lease.epoch)
            ):
                return
            replayed = await self._recorder.recorded(dispatch.calls)
            seqs = [
                lease.seqs[i] if lease is not None and i < len(lease.seqs) else 0
                for i in range(len(dispatch.calls))
            ]
            for group in _groups(dispatch, seqs, replayed):
                await self._run_group(dispatch, delivery, group, seqs, replayed)
            for move in dispatch.prefetch:
                await self._states.move(move.job_id, move.to_tier)
        finally:
            self._heartbeat.busy = False

    async def _run_group(
        self,
        dispatch: Dispatch,
        delivery: Delivery,
        group: list[int],
        seqs: list[int],
        replayed: dict[str, PhaseCompletion],
    ) -> None:
        """Run calls `group` of the dispatch: one call, or several sample calls co-batched."""
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
            if dispatch.calls[group[0]].function == Function.SAMPLE:
                metrics.SAMPLE_BATCH_CALLS.observe(len(group))
            if len(group) > 1:
                rans = await self._runner.run_samples([dispatch.calls[i] for i in group])
                for i, ran in zip(group, rans, strict=True):
                    await self._record(dispatch, i, ran, i == last_i)
                return
            i = group[0]
            request = dispatch.calls[i]
            if lease is not None and seqs[i] > 0:  # exactly once by the job's ledger
                await self._numbered.run(
                    request, seqs[i], lease.epoch, dispatch.dispatch_id, i == last_i
                )
                self.calls += 1
                return
            done = replayed.get(request.request_id)
            if done is not None:  # a replay: answer with the recorded result
                await self._recorder.publish(done)
                metrics.REPLAYED_CALLS.inc()
                return
            await self._record(dispatch, i, await self._runner.run(request), i == last_i)

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


def _groups(
    dispatch: Dispatch, seqs: list[int], replayed: dict[str, PhaseCompletion]
) -> list[list[int]]:
    """The dispatch's calls in order, with each run of consecutive sample calls that are
    neither numbered nor replays in one group: they run co-batched."""
    groups: list[list[int]] = []
    joining = False
    for i, request in enumerate(dispatch.calls):
        joinable = (
            request.function == Function.SAMPLE
            and seqs[i] == 0
            and request.request_id not in replayed
        )
        if joinable and joining:
            groups[-1].append(i)
        else:
            groups.append([i])
        joining = joinable
    return groups


async def serve(settings: WorkerSettings, stop: asyncio.Event) -> None:
    name = f"plexrl-worker-{settings.worker_id}"
    own_topic = Topics(settings.cluster_id).dispatch(settings.worker_id)
    topics, meta, publisher = await join_cluster(settings, name, {own_topic: 1})
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
        meta=meta,
        store=store,
        publisher=publisher,
        events_topic=topics.events,
    )
    runner = CallRunner(engine=engine, thread=thread, states=states, meta=meta, store=store)
    recorder = ResultRecorder(
        worker_id=settings.worker_id,
        meta=meta,
        publisher=publisher,
        completions_topic=topics.completions,
        inline_max_bytes=settings.payload_inline_max_bytes,
    )
    heartbeat = Heartbeat(
        settings=settings,
        base_models=registry.names(),
        states=states,
        meta=meta,
        publisher=publisher,
        events_topic=topics.events,
    )
    ledger = Ledger(meta.redis, settings.cluster_id)
    recovery = JobRecovery(
        worker_id=settings.worker_id,
        ledger=ledger,
        engine=engine,
        thread=thread,
        states=states,
        store=store,
        config=SnapshotConfig(every_calls=settings.snapshot_every_calls),
    )
    numbered = NumberedCalls(ledger=ledger, recovery=recovery, runner=runner, recorder=recorder)
    handler = DispatchHandler(states, runner, recorder, heartbeat, numbered)
    metrics.watch(states)
    dispatches: MessageConsumer[Dispatch] = MessageConsumer(
        bootstrap=settings.kafka_bootstrap,
        topics=[topics.dispatch(settings.worker_id)],
        group=topics.group(f"worker-{settings.worker_id}"),
        message_type=Dispatch,
        handler=handler,
        dlq=(publisher, topics.dlq),
        name=f"worker-{settings.worker_id}",
        answer=DeadLetters(meta, publisher, topics.completions, settings.cluster_id),
    )
    # Completions must go out: wait out a broker that is away rather than fail the call.
    publisher.retry_until(stop)
    health = HttpServer(
        health_app(
            f"worker-{settings.worker_id}",
            lambda: status(states, handler, engine),
            [dispatches],
        ),
        settings.worker_host,
        settings.worker_port,
    )
    await publisher.start()
    await dispatches.start()
    await health.start()
    tasks = [asyncio.create_task(dispatches.run(stop)), asyncio.create_task(heartbeat.run(stop))]
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
        with contextlib.suppress(Exception):
            await dispatches.stop()
        await recovery.drain()
        await health.stop()
        await publisher.stop()
        await store.close()
        await meta.close()
        thread.shutdown()
        log.info("worker %s stopped", settings.worker_id)


def status(states: StateManager, handler: DispatchHandler, engine: TorchEngine) -> dict[str, Any]:
    return {
        "ok": True,
        "calls": handler.calls,
        "resident": {s.job_id: s.tier for s in states.resident()},
        "bases": engine.loaded_bases(),
    }
