"""The gateway's entry point: HTTP in → phase requests out; completions in → answers out."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from plexrl.health import HttpServer
from plexrl.kafka import MessageConsumer
from plexrl.messages import PhaseCompletion
from plexrl.service import join_cluster
from plexrl.settings import GatewaySettings
from plexrl_gateway.app import build_app
from plexrl_gateway.components import Gateway

log = logging.getLogger("plexrl.gateway")


async def serve(settings: GatewaySettings, stop: asyncio.Event) -> None:
    topics, stores, publisher = await join_cluster(settings, "plexrl-gateway")
    gateway = Gateway.build(settings, stores, publisher)
    # Every gateway sees every completion (no group, from now on): they only wake
    # waiters; Redis holds the results.
    completions = MessageConsumer[PhaseCompletion](
        bootstrap=settings.kafka_bootstrap,
        security=settings.kafka_security(),
        topics=[topics.completions],
        group=None,
        message_type=PhaseCompletion,
        handler=gateway.futures.on_completion,
        dlq=(publisher, topics.dlq),
        name="gateway-completions",
        from_latest=True,
        answer=gateway.dead_letters,
    )
    gateway.watch(completions)
    http = HttpServer(build_app(gateway), settings.gateway_host, settings.gateway_port)
    await publisher.start()
    await completions.start()
    await completions.wait_assigned()
    consuming = asyncio.create_task(completions.run(stop))
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
            await consuming
        with contextlib.suppress(Exception):
            await delivering
        with contextlib.suppress(Exception):
            await completions.stop()
        await publisher.stop()
        await gateway.close()
        await stores.close()
        log.info("gateway stopped")
