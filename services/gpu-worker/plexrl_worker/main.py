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

log = logging.getLogger("plexrl.worker")


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
    ]
    log.info(
        "worker %s up on %s with models %s",
        settings.worker_id,
        settings.worker_device,
        worker.registry.names(),
    )
    try:
        await stop.wait()
    finally:
        await asyncio.gather(*running, return_exceptions=True)
        await worker.close()
        log.info("worker %s stopped", settings.worker_id)
