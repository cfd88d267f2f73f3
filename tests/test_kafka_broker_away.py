"""One broker's host gone silent: the producer's health check counts any broker that
answers, in time, and no admin request waits out aiokafka's 40 s default."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import pytest

from plexrl import kafka
from plexrl.kafka import REQUEST_TIMEOUT_MS, Publisher

BOOTSTRAP = "127.0.0.1:9"  # never dialled by the tests of the check alone


class Brokers:
    """The edge of the producer: its client's known brokers, some of which never answer
    (a host cut off: no reset, only silence)."""

    def __init__(self, answering: set[int], silent: set[int]) -> None:
        self.asked: list[int] = []
        self._answering = answering
        self.cluster = SimpleNamespace(
            brokers=lambda: [SimpleNamespace(nodeId=n) for n in sorted(answering | silent)]
        )

    async def send(self, node_id: int, request: Any) -> object:
        self.asked.append(node_id)
        if node_id not in self._answering:
            await asyncio.sleep(3600)
        await asyncio.sleep(0.01)
        return object()


def publisher_over(client: Brokers) -> Publisher:
    publisher = Publisher(BOOTSTRAP, "ping-test")
    publisher._producer = SimpleNamespace(client=client)
    return publisher


async def test_one_silent_broker_of_three_does_not_fail_the_check() -> None:
    client = Brokers(answering={2, 3}, silent={1})
    start = time.perf_counter()
    assert await publisher_over(client).ping(timeout_s=2.0)
    assert time.perf_counter() - start < 0.5
    assert sorted(client.asked) == [1, 2, 3]  # asked at once, not one after another


async def test_no_broker_answering_fails_the_check_at_its_timeout() -> None:
    client = Brokers(answering=set(), silent={1, 2})
    start = time.perf_counter()
    assert not await publisher_over(client).ping(timeout_s=0.3)
    assert 0.25 < time.perf_counter() - start < 2.0


async def test_a_running_broker_answers(infra: dict[str, str]) -> None:
    publisher = Publisher(infra["kafka"], "ping-test")
    await publisher.start()
    try:
        assert await publisher.ping()
        assert await publisher.ping()  # now from the brokers the metadata named
    finally:
        await publisher.stop()


async def test_creating_topics_waits_no_longer_than_a_request_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made: list[dict[str, Any]] = []

    class Admin:  # the edge: what the admin client is built with
        def __init__(self, **options: Any) -> None:
            made.append(options)

        async def start(self) -> None:
            pass

        async def list_topics(self) -> list[str]:
            return ["t"]

        async def close(self) -> None:
            pass

    monkeypatch.setattr(kafka, "AIOKafkaAdminClient", Admin)
    await kafka.ensure_topics("10.0.0.1:9092", {"t": 1})
    assert made and made[0]["request_timeout_ms"] == REQUEST_TIMEOUT_MS
