"""The state-store's entry point."""

from __future__ import annotations

import asyncio
import logging

from plexrl import tracing
from plexrl.health import HttpLimits, HttpServer
from plexrl.service_auth import is_loopback
from plexrl.settings import StateStoreSettings
from plexrl.stores import Stores
from plexrl_state_store.app import build_app
from plexrl_state_store.blobs import BlobDir
from plexrl_state_store.expiry import ExpirySweeper
from plexrl_state_store.records import CheckpointRecords

log = logging.getLogger("plexrl.state_store")

TEMP_FILE_AGE_S = 900.0
"""A temp file this old is a blob write that died (a write takes seconds): removed."""


class NoTokenError(RuntimeError):
    """The state-store was asked to serve a network without a service token."""


def check_exposure(settings: StateStoreSettings) -> None:
    """Without a service token the store holds every tenant's checkpoints open to anyone
    who can reach it: it may then serve this machine only (docs/security.md)."""
    if settings.service_token:
        return
    host = settings.state_store_host
    if not is_loopback(host):
        raise NoTokenError(
            f"the state-store would serve {host} without authentication: set "
            "PLEXRL_SERVICE_TOKEN (the same value for every service of the cluster), or bind "
            "it to 127.0.0.1 (PLEXRL_STATE_STORE_HOST)"
        )
    log.warning(
        "state-store on %s without PLEXRL_SERVICE_TOKEN: any local process may call it", host
    )


async def serve(settings: StateStoreSettings, stop: asyncio.Event) -> None:
    check_exposure(settings)
    tracing.setup_tracing("plexrl-state-store")
    stores = Stores.from_settings(settings)
    blobs = BlobDir(settings.state_store_dir)
    # Only this process writes here: a temp file now is a write that died with the last.
    blobs.sweep_temp(0.0)
    app = build_app(blobs, stores.checkpoints, stores.residency, settings.service_token)
    limits = HttpLimits.from_settings(settings)
    server = HttpServer(app, settings.state_store_host, settings.state_store_port, limits)
    await server.start()
    # Checkpoint records Redis lost (a restart without its append-only file) come back.
    records: CheckpointRecords = app.state.records
    rebuilding = asyncio.create_task(
        records.run(stop, settings.state_store_rebuild_s, TEMP_FILE_AGE_S)
    )
    # Checkpoints past their TTL are deleted (they read as gone already).
    expiring = asyncio.create_task(
        ExpirySweeper(stores.checkpoints, records).run(stop, settings.state_store_expiry_sweep_s)
    )
    log.info("state-store up on :%d, blobs in %s", settings.state_store_port, blobs.root)
    try:
        await stop.wait()
    finally:
        await rebuilding
        await expiring
        await server.stop()
        await stores.close()
        log.info("state-store stopped")
