"""The state-store's entry point."""

from __future__ import annotations

import asyncio
import logging

from plexrl import tracing
from plexrl.health import HttpServer
from plexrl.meta import MetaStore
from plexrl.settings import StateStoreSettings
from plexrl_state_store.app import build_app
from plexrl_state_store.blobs import BlobDir
from plexrl_state_store.records import CheckpointRecords

log = logging.getLogger("plexrl.state_store")


async def serve(settings: StateStoreSettings, stop: asyncio.Event) -> None:
    tracing.setup_tracing("plexrl-state-store")
    meta = MetaStore.from_url(settings.redis_url, settings.cluster_id, settings.record_ttl_s)
    blobs = BlobDir(settings.state_store_dir)
    app = build_app(blobs, meta)
    server = HttpServer(app, settings.state_store_host, settings.state_store_port)
    await server.start()
    # Checkpoint records Redis lost (a restart without its append-only file) come back.
    records: CheckpointRecords = app.state.records
    rebuilding = asyncio.create_task(records.run(stop, settings.state_store_rebuild_s))
    log.info("state-store up on :%d, blobs in %s", settings.state_store_port, blobs.root)
    try:
        await stop.wait()
    finally:
        await rebuilding
        await server.stop()
        await meta.close()
        log.info("state-store stopped")
