"""What every service's entry point shares: logging, signals, the stop event."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable
from typing import NamedTuple

from plexrl import tracing
from plexrl.kafka import Publisher, ensure_topics, wait_for_kafka
from plexrl.settings import CommonSettings
from plexrl.stores import Stores
from plexrl.topics import Topics, core_topics


class ClusterLink(NamedTuple):
    """What every service opens first: its topics, the metadata stores, a (stopped) producer."""

    topics: Topics
    stores: Stores
    publisher: Publisher


async def join_cluster(
    settings: CommonSettings, name: str, extra_topics: dict[str, int] | None = None
) -> ClusterLink:
    """Tracing under `name`; wait for Kafka; create the topics; connect to Redis."""
    tracing.setup_tracing(name, ratio=settings.trace_ratio)
    topics = Topics(settings.cluster_id)
    security = settings.kafka_security()
    await wait_for_kafka(settings.kafka_bootstrap, security=security)
    await ensure_topics(
        settings.kafka_bootstrap,
        {**core_topics(topics), **(extra_topics or {})},
        settings.topic_replication(),
        security,
    )
    stores = Stores.from_settings(settings)
    publisher = Publisher(settings.kafka_bootstrap, name, security=security)
    return ClusterLink(topics, stores, publisher)


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("aiokafka").setLevel(logging.WARNING)
    logging.getLogger("kafka").setLevel(logging.WARNING)


def run_until_signalled(serve: Callable[[asyncio.Event], Awaitable[None]], event_loop: str) -> None:
    """Run `serve(stop)` on `event_loop` (`loop_factory`; a service passes its setting,
    `CommonSettings.event_loop`); SIGTERM or SIGINT sets `stop` so the service shuts
    down cleanly."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(stop)

    with asyncio.Runner(loop_factory=loop_factory(event_loop)) as runner:
        runner.run(main())


def loop_factory(event_loop: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """What makes a service's event loop (`CommonSettings.event_loop`): uvloop's where it
    is installed (a platform without it runs the standard one, and says so), or the
    standard library's (None)."""
    if event_loop != "uvloop":
        return None
    try:
        import uvloop
    except ImportError:
        logging.getLogger(__name__).warning(
            "PLEXRL_EVENT_LOOP is uvloop but uvloop is not installed: the standard event loop"
        )
        return None
    return uvloop.new_event_loop
