"""A worker group's rank started on its own host (PLEXRL_WORKER_RANK > 0): it joins the
leader's rendezvous at PLEXRL_WORKER_RENDEZVOUS_HOST:PORT and runs each call the leader
broadcasts until the leader shuts the group down (or is lost)."""

from __future__ import annotations

import logging

from plexrl.settings import WorkerSettings
from plexrl_worker.components import engine_config, group_config
from plexrl_worker.group.blobs import BlobPlace
from plexrl_worker.group.launch import follow

log = logging.getLogger("plexrl.worker")


def follow_leader(settings: WorkerSettings) -> None:
    config = group_config(settings)
    if settings.worker_rank >= config.world_size:
        raise SystemExit(
            f"PLEXRL_WORKER_RANK is {settings.worker_rank}, but the group has "
            f"{config.world_size} ranks (PLEXRL_WORKER_RANKS): use 1 to {config.world_size - 1}"
        )
    log.info(
        "rank %d of %s's group: joining %s:%d",
        settings.worker_rank,
        settings.worker_id,
        config.master_addr,
        config.master_port,
    )
    blobs = BlobPlace(url=settings.state_store_url, token=settings.service_token)
    follow(
        settings.worker_rank,
        config,
        settings.model_registry,
        engine_config(settings),
        blobs,
        device=settings.worker_device if settings.worker_device != "cuda" else None,
    )
    log.info("rank %d: the leader closed the group", settings.worker_rank)
