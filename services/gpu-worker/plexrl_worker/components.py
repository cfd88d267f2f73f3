"""The worker's parts, each with one job, and the order they are built in.

The rank side (`executor`: the engine and each job's state in its tiers, on every
rank) is built first; the leader's parts speak only to it: `states` (residency
records), `runner` (each kind of call), `recorder`, `recovery` (restore, snapshots,
archives), `numbered` (exactly-once by the ledger), `pipeline` (one dispatch's calls
through all of them), `intake` (the dispatch source feeding the pipeline) and
`heartbeat`. Each `_init_*` builds one of them from what the earlier ones made.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from dataclasses import dataclass
from typing import Any

from plexrl.health import HttpServer, health_app
from plexrl.lease import SCHEDULER, lease_key
from plexrl.ledger import Ledger
from plexrl.messages import Tier
from plexrl.models import ModelRegistry
from plexrl.service import ClusterLink
from plexrl.settings import WorkerSettings
from plexrl.state_store_client import StateStoreClient
from plexrl_worker import metrics
from plexrl_worker.engine import EngineConfig, TorchEngine
from plexrl_worker.engine_thread import EngineThread
from plexrl_worker.executor import Executor, LocalExecutor
from plexrl_worker.group import GroupConfig, start_group
from plexrl_worker.group.blobs import BlobPlace
from plexrl_worker.group.executor import GroupExecutor
from plexrl_worker.heartbeat import Heartbeat
from plexrl_worker.intake import KafkaDispatches, PollIntake
from plexrl_worker.leader import LeaderFence
from plexrl_worker.numbering import NumberedCalls
from plexrl_worker.pipeline import DispatchPipeline
from plexrl_worker.preemption import Preemption
from plexrl_worker.recorder import ResultRecorder
from plexrl_worker.recovery import JobRecovery, SnapshotConfig
from plexrl_worker.residency import StateManager
from plexrl_worker.runner import CallRunner
from plexrl_worker.samplers import SGLangSampling
from plexrl_worker.tail import TailRelease

log = logging.getLogger(__name__)


@dataclass
class Worker:
    settings: WorkerSettings
    link: ClusterLink
    store: StateStoreClient
    registry: ModelRegistry
    executor: Executor
    states: StateManager
    sglang: SGLangSampling | None
    recovery: JobRecovery
    pipeline: DispatchPipeline
    intake: KafkaDispatches
    heartbeat: Heartbeat
    health: HttpServer

    async def close(self) -> None:
        await asyncio.gather(*self.pipeline.tails, return_exceptions=True)
        await self.intake.close()
        await self.recovery.drain()
        if self.sglang is not None:
            await asyncio.to_thread(self.sglang.stop)
        await self.health.stop()
        await self.link.publisher.stop()
        await self.executor.close()
        await self.store.close()
        await self.link.stores.close()


async def build(settings: WorkerSettings, link: ClusterLink) -> Worker:
    topics, stores, publisher = link
    store = StateStoreClient(
        settings.state_store_url,
        timeout_s=settings.state_store_timeout_s,
        token=settings.service_token,
    )
    registry = ModelRegistry(settings.model_registry)
    executor = await _init_ranks(settings, registry, store)
    states = StateManager(
        worker_id=settings.worker_id,
        executor=executor,
        residency=stores.residency,
        store=store,
        publisher=publisher,
        events_topic=topics.events,
    )
    sglang = await _init_sglang(settings, registry, executor)
    runner = CallRunner(
        executor=executor,
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
    ledger = Ledger(stores.keys.redis, settings.cluster_id, stores.keys.replicated)
    recovery = JobRecovery(
        worker_id=settings.worker_id,
        ledger=ledger,
        executor=executor,
        states=states,
        store=store,
        config=SnapshotConfig(
            every_calls=settings.snapshot_every_calls,
            archive_calls=settings.results_archive_calls,
        ),
        payloads=stores.payloads,
    )
    numbered = NumberedCalls(ledger=ledger, recovery=recovery, runner=runner, recorder=recorder)
    # A preempted training call resumes without asking SGLang for the device again: it
    # is sliced only where SGLang keeps its device (or the torch sampler samples).
    slices = (
        settings.slice_training
        and executor.slices_training
        and not (sglang is not None and sglang.yield_device)
    )
    heartbeat = Heartbeat(
        settings=settings,
        slices_training=slices,
        meter=runner.meter,
        base_models=registry.names(),
        rank_devices=rank_devices(settings),
        states=states,
        workers=stores.workers,
        publisher=publisher,
        events_topic=topics.events,
    )
    preemption = _init_preemption(sglang)
    tail = TailRelease(
        settings.tail_threshold,
        lambda event: publisher.publish(topics.events, settings.worker_id, event),
    )
    leader = LeaderFence(stores.keys.redis, lease_key(stores.keys.key, SCHEDULER) + ":token")
    poll = PollIntake(recorder, stores.calls, ledger, leader)
    pipeline = DispatchPipeline(
        states,
        runner,
        recorder,
        heartbeat,
        numbered,
        tail,
        preemption,
        poll,
        leader,
        slice_training=slices,
    )
    intake = KafkaDispatches(
        bootstrap=settings.kafka_bootstrap,
        security=settings.kafka_security(),
        worker_id=settings.worker_id,
        topics=topics,
        stores=stores,
        publisher=publisher,
        handler=pipeline,
        preemption=preemption,
        poll=pipeline,
    )
    metrics.watch(states, lambda: len(executor.installed_samplers()))
    health = HttpServer(
        health_app(
            f"worker-{settings.worker_id}",
            lambda: _status(states, pipeline, executor) | _fencing(numbered, leader),
            intake.consumers(),
        ),
        settings.worker_host,
        settings.worker_port,
    )
    return Worker(
        settings=settings,
        link=link,
        store=store,
        registry=registry,
        executor=executor,
        states=states,
        sglang=sglang,
        recovery=recovery,
        pipeline=pipeline,
        intake=intake,
        heartbeat=heartbeat,
        health=health,
    )


def _fencing(numbered: NumberedCalls, leader: LeaderFence) -> dict[str, Any]:
    """How often this worker found itself fenced off: calls of jobs re-homed while it was
    away (their commits refused), and dispatches of a deposed scheduler it skipped."""
    return {"fenced_calls": numbered.fenced, "deposed_dispatches": leader.skipped}


def _status(states: StateManager, pipeline: DispatchPipeline, executor: Executor) -> dict[str, Any]:
    return {
        "ok": True,
        "calls": pipeline.calls,
        # Counted per tier, never named: /healthz is open inside the cluster, and a job
        # id is its tenant's (the gateway names a tenant's own states to that tenant).
        "resident_jobs": {str(t): sum(s.tier == t for s in states.resident()) for t in Tier},
        "bases": executor.loaded_bases(),
        "ranks": executor.ranks,
        "rank_pids": executor.pids(),
    }


async def _init_ranks(
    settings: WorkerSettings, registry: ModelRegistry, store: StateStoreClient
) -> Executor:
    """The rank side: this process's engine on one device, or a group of ranks (this
    process is rank 0) joined over the rendezvous, each on its own device."""
    thread = EngineThread()
    if settings.worker_ranks == 1:
        engine = TorchEngine(registry, engine_config(settings))
        return LocalExecutor(engine, thread, store)
    config = group_config(settings)
    blobs = BlobPlace(url=settings.state_store_url, token=settings.service_token)
    log.info("starting a group of %d ranks (%s)", config.world_size, config.backend)
    # Rank 0 joins on the engine thread, where every later call of the group runs.
    leader = await thread.call(
        start_group, config, settings.model_registry, engine_config(settings), blobs
    )
    return GroupExecutor(leader, thread, ping_s=min(5.0, config.collective_timeout_s / 4))


def engine_config(settings: WorkerSettings) -> EngineConfig:
    return EngineConfig(
        device=settings.worker_device,
        num_threads=settings.worker_threads,
        max_batch_tokens=settings.worker_max_batch_tokens,
    )


def group_config(settings: WorkerSettings) -> GroupConfig:
    """The worker group the settings describe (the same on every rank's host)."""
    cuda = settings.worker_device.startswith("cuda")
    return GroupConfig(
        world_size=settings.worker_ranks,
        device_type="cuda" if cuda else "cpu",
        master_addr=settings.worker_rendezvous_host,
        master_port=settings.worker_rendezvous_port,
        collective_timeout_s=settings.worker_collective_timeout_s,
        # A rank imports torch and the model code before it joins: minutes on a busy host.
        rendezvous_timeout_s=600.0,
        # CUDA cannot be forked; on the CPU a fork of a clean server is seconds cheaper.
        start_method="spawn" if cuda else "forkserver",
        num_threads=settings.worker_threads,
        local_ranks=settings.worker_local_ranks,
    )


def rank_devices(settings: WorkerSettings) -> list[str]:
    """Each rank's device, as the heartbeat names it."""
    if settings.worker_ranks == 1:
        return [settings.worker_device]
    config = group_config(settings)
    return [config.device(r) for r in range(config.world_size)]


async def _init_sglang(
    settings: WorkerSettings, registry: ModelRegistry, executor: Executor
) -> SGLangSampling | None:
    if settings.sampler != "sglang":
        return None
    sglang = SGLangSampling(
        executor.sampler_weights,
        registry,
        settings.sglang_dir / settings.worker_id,
        device=settings.worker_device.split(":")[0],  # SGLang's own: "cuda", "cpu"
        yield_device=settings.sglang_yield == "training"
        or (settings.sglang_yield == "auto" and settings.worker_device != "cpu"),
        attach_url=settings.sglang_url,
        # Over the group's devices, tensor-parallel (SGLang's own ranks beside ours).
        tp_size=settings.worker_ranks,
    )
    await asyncio.to_thread(sglang.start)  # minutes on CPU
    return sglang


def _init_preemption(sglang: SGLangSampling | None) -> Preemption:
    if sglang is None:
        return Preemption()
    return Preemption(
        pause=functools.partial(asyncio.to_thread, sglang.pause),
        resume=functools.partial(asyncio.to_thread, sglang.resume),
    )
