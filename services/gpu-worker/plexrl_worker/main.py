"""The gpu-worker's entry point. The leader ingests dispatches from its topic; each
dispatch's calls are numbered and recovered, run on every rank, and recorded; the
heartbeat announces the group. See `components` for the parts."""

from __future__ import annotations

import asyncio
import logging

from plexrl.service import join_cluster
from plexrl.settings import WorkerSettings
from plexrl.topics import Topics
from plexrl_worker import components
from plexrl_worker.group import RankLostError

log = logging.getLogger("plexrl.worker")

GROUP_LOST_EXIT = 3
"""The worker's exit status when a rank of its group was lost."""


async def serve(settings: WorkerSettings, stop: asyncio.Event) -> None:
    own = Topics(settings.cluster_id)
    link = await join_cluster(
        settings,
        f"plexrl-worker-{settings.worker_id}",
        {own.dispatch(settings.worker_id): 1, own.control(settings.worker_id): 1},
    )
    worker = await components.build(settings, link)  # the ranks first, then the leader
    # Completions must go out: wait out a broker that is away rather than fail the call.
    link.publisher.retry_until(stop)
    await link.publisher.start()
    await worker.intake.start()
    await worker.health.start()
    running = [
        # ingest → number/recover → run → record, one dispatch at a time
        asyncio.create_task(worker.intake.run(stop)),
        asyncio.create_task(worker.heartbeat.run(stop)),
        asyncio.create_task(worker.executor.watch(stop)),  # a lost rank ends the worker
    ]
    log.info(
        "worker %s up: %d rank(s) on %s, models %s",
        settings.worker_id,
        worker.executor.ranks,
        settings.worker_device,
        worker.registry.names(),
    )
    stopped = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait([*running, stopped], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.set()
        outcomes = await asyncio.gather(*running, return_exceptions=True)
        await worker.close()
        log.info("worker %s stopped", settings.worker_id)
    for outcome in outcomes:
        if isinstance(outcome, RankLostError):
            # Heartbeats stop with the process: the scheduler re-homes the group's jobs.
            log.error("worker %s lost its group: %s", settings.worker_id, outcome)
            raise SystemExit(GROUP_LOST_EXIT)
