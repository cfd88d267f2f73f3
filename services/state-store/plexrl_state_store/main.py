"""The state-store's entry point."""

from __future__ import annotations

import asyncio
import logging
import socket

from plexrl import tracing
from plexrl.health import HttpLimits, HttpServer
from plexrl.lease import STATE_STORE, Leadership, Lease, Term, lease_key
from plexrl.service_auth import is_loopback
from plexrl.settings import StateStoreSettings
from plexrl.stores import Stores
from plexrl_state_store.app import build_app
from plexrl_state_store.blobs import BlobDir, BlobStore
from plexrl_state_store.expiry import ExpirySweeper
from plexrl_state_store.records import CheckpointRecords
from plexrl_state_store.s3 import S3Blobs, S3Config

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


def open_blobs(settings: StateStoreSettings) -> BlobStore:
    """The object store when one is set (shared by every replica), else the directory."""
    if settings.state_store_s3_endpoint:
        return S3Blobs(
            S3Config(
                endpoint=settings.state_store_s3_endpoint,
                bucket=settings.state_store_s3_bucket,
                prefix=settings.state_store_s3_prefix,
                region=settings.state_store_s3_region,
                access_key=settings.state_store_s3_access_key,
                secret_key=settings.state_store_s3_secret_key,
            )
        )
    return BlobDir(settings.state_store_dir)


async def serve(settings: StateStoreSettings, stop: asyncio.Event) -> None:
    check_exposure(settings)
    tracing.setup_tracing("plexrl-state-store", ratio=settings.trace_ratio)
    stores = Stores.from_settings(settings)
    blobs = open_blobs(settings)
    if isinstance(blobs, S3Blobs):
        await asyncio.to_thread(blobs.ensure_bucket)
    else:
        # Only this process writes here: a temp file now is a write that died with the last.
        blobs.sweep_temp(0.0)
    app = build_app(blobs, stores.checkpoints, stores.residency, settings.service_token)
    limits = HttpLimits.from_settings(settings)
    server = HttpServer(app, settings.state_store_host, settings.state_store_port, limits)
    records: CheckpointRecords = app.state.records
    replica = settings.state_store_id or (
        f"{socket.gethostname()}@{settings.state_store_host}:{settings.state_store_port}"
    )
    # Every replica serves; one at a time runs the background rounds (two rebuilding and
    # sweeping the same bucket would only race each other).
    rounds = Leadership(
        Lease(
            stores.keys.redis,
            lease_key(stores.keys.key, STATE_STORE),
            holder=replica,
            replicated=stores.keys.replicated,
        )
    )
    app.state.rounds = rounds

    async def sweep(term: Term, ended: asyncio.Event) -> None:
        # Checkpoint records Redis lost (a restart without its append-only file) come
        # back; checkpoints past their TTL are deleted (they read as gone already).
        await asyncio.gather(
            records.run(ended, settings.state_store_rebuild_s, TEMP_FILE_AGE_S),
            ExpirySweeper(stores.checkpoints, records).run(
                ended, settings.state_store_expiry_sweep_s
            ),
        )

    await server.start()
    sweeping = asyncio.create_task(rounds.run(stop, sweep))
    log.info(
        "state-store %s up on %s:%d, blobs in %s",
        replica,
        settings.state_store_host,
        settings.state_store_port,
        blobs.describe(),
    )
    try:
        await stop.wait()
    finally:
        await sweeping
        await server.stop()
        await stores.close()
        log.info("state-store stopped")
