"""The gateway's entry point: HTTP in → phase requests out; completion notices in →
answers out."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from plexrl.health import HttpServer
from plexrl.service import join_cluster
from plexrl.settings import GatewaySettings
from plexrl_gateway.app import build_app
from plexrl_gateway.components import Gateway
from plexrl_gateway.notices import CompletionNotices

log = logging.getLogger("plexrl.gateway")


async def serve(settings: GatewaySettings, stop: asyncio.Event) -> None:
    _, stores, publisher = await join_cluster(settings, "plexrl-gateway")
    gateway = Gateway.build(settings, stores, publisher)
    # Every gateway hears every completion announced; they only wake waiters (and
    # count off the pending-calls quota): Redis holds the results.
    notices = CompletionNotices(
        stores.keys.redis,
        stores.calls.completed_channel,
        gateway.futures,
        pending=gateway.pending.ids,
    )
    gateway.watch(notices)
    http = HttpServer(build_app(gateway), settings.gateway_host, settings.gateway_port)
    await publisher.start()
    listening = asyncio.create_task(notices.run(stop))
    subscribed = asyncio.create_task(notices.wait_subscribed())
    await asyncio.wait({listening, subscribed}, return_when=asyncio.FIRST_COMPLETED)
    if listening.done():  # it failed, or the gateway was stopped before Redis answered
        subscribed.cancel()
        listening.result()
    # Calls accepted but not yet on Kafka (a predecessor died, or Kafka was away).
    delivering = asyncio.create_task(gateway.submitter.run_outbox(stop))
    await http.start()
    log.info(
        "gateway up on %s:%s cluster=%s",
        settings.gateway_host,
        settings.gateway_port,
        settings.cluster_id,
    )
    try:
        await stop.wait()
    finally:
        stop.set()
        await http.stop()
        with contextlib.suppress(Exception):
            await listening
        with contextlib.suppress(Exception):
            await delivering
        await publisher.stop()
        await gateway.close()
        await stores.close()
        log.info("gateway stopped")
