"""Fuzzing the gateway from its own OpenAPI schema: no input makes it answer 5xx.

Schemathesis generates requests for every operation of the schema FastAPI builds (the
gateway does not serve /openapi.json; the test reads `app.openapi()`), and sends them
over real HTTP to a gateway on real Redis with Kafka faked (tests/gateway_support.py).
Each operation is fuzzed twice: with data its schema rejects, and with data it accepts
whose ids are replaced by live ones of the caller (a session, a training model, a
sampling session), so the generated numbers reach the rules behind the id lookups.
Bounded: a fixed number of examples per operation, no shrinking, derandomised, well
under a minute.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from gateway_support import TINY_MODEL, FakePublisher, drop_cluster_keys, free_port, unique_cluster
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.generation.case import Case

from plexrl.health import HttpServer
from plexrl.settings import GatewaySettings
from plexrl.stores import Stores
from plexrl_gateway.app import build_app
from plexrl_gateway.components import Gateway

KEY = "tml-fuzz"
EXAMPLES_PER_OPERATION = 4
# The bodies decoded into msgspec Structs (the big token arrays) get more examples.
MORE_EXAMPLES = {"POST /api/v1/forward_backward": 30, "POST /api/v1/forward": 30}
# Operations whose body the schema must describe, so that they are fuzzed at all.
DOCUMENTED_BODIES = ["POST /api/v1/forward_backward", "POST /api/v1/forward"]
SKIPPED = {
    # Waits for a worker's answer to a NOOP and says 504 when none comes: with Kafka
    # faked there is no worker, so its 504 is the truth. The e2e tests run it for real.
    "POST /plexrl/v1/echo",
}
# Each operation is fuzzed with data the schema rejects (wrong types, missing fields),
# and with data it accepts sent with the caller's live ids.
PASSES = [(GenerationMode.NEGATIVE, False), (GenerationMode.POSITIVE, True)]
# Body fields that name an object of the caller, and which live id each gets.
LIVE_IDS = {
    "session_id": "session",
    "model_id": "model",
    "sampling_session_id": "sampler",
}


@dataclass
class Served:
    url: str
    app_schema: dict[str, Any]
    live: dict[str, str]


class _Loop:
    """An event loop on its own thread, for a gateway served while sync tests call it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Any) -> Any:
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result(timeout=60)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)


@pytest.fixture(scope="module")
def served(infra: dict[str, str], tiny_registry: Path) -> Iterator[Served]:
    loop = _Loop()
    settings_ = GatewaySettings(
        cluster_id=unique_cluster("gwfuzz"),
        kafka_bootstrap=infra["kafka"],
        redis_url=infra["redis"],
        api_keys=f"{KEY}=fuzz",
        model_registry=tiny_registry,
        future_wait_s=0.05,
        sequence_gap_timeout_s=0.05,
        scheduler_url="http://127.0.0.1:9",
        state_store_url="http://127.0.0.1:9",
    )
    port = free_port()

    async def start() -> tuple[Stores, Gateway, HttpServer, dict[str, Any]]:
        stores = Stores.from_url(settings_.redis_url, settings_.cluster_id, 600)
        gateway = Gateway.build(settings_, stores, FakePublisher())
        app = build_app(gateway)
        server = HttpServer(app, "127.0.0.1", port)
        await server.start()
        return stores, gateway, server, app.openapi()

    stores, gateway, server, schema = loop.run(start())
    url = f"http://127.0.0.1:{port}"
    try:
        yield Served(url, schema, live_ids(url))
    finally:

        async def stop() -> None:
            await server.stop()
            await gateway.close()
            await drop_cluster_keys(stores, settings_.cluster_id)
            await stores.close()

        loop.run(stop())
        loop.close()


def live_ids(url: str) -> dict[str, str]:
    with httpx.Client(base_url=url, headers={"X-API-Key": KEY}, timeout=30) as http:
        session = http.post("/api/v1/create_session", json={"tags": []}).json()["session_id"]
        model = http.post(
            "/api/v1/create_model",
            json={
                "session_id": session,
                "model_seq_id": 0,
                "base_model": TINY_MODEL,
                "lora_config": {"rank": 4},
            },
        ).json()["model_id"]
        sampler = http.post(
            "/api/v1/create_sampling_session",
            json={"session_id": session, "sampling_session_seq_id": 0, "base_model": TINY_MODEL},
        ).json()["sampling_session_id"]
    return {"session": session, "model": model, "sampler": sampler}


def takes_input(operation: Any) -> bool:
    """Whether the operation has a body or query to make invalid (a string path parameter or
    optional header accepts anything; asking for invalid ones only burns time)."""
    return len(operation.body) > 0 or len(operation.query) > 0


def with_live_ids(case: Case, live: dict[str, str]) -> None:
    if isinstance(case.body, dict):
        for field, kind in LIVE_IDS.items():
            if field in case.body:
                case.body[field] = live[kind]
    for field, kind in LIVE_IDS.items():
        if case.path_parameters and field in case.path_parameters:
            case.path_parameters[field] = live[kind]


def fuzz(
    operation: Any,
    mode: GenerationMode,
    live: dict[str, str] | None,
    url: str,
    http: requests.Session,
) -> tuple[list[int], list[str]]:
    """Send EXAMPLES_PER_OPERATION generated requests (MORE_EXAMPLES for some); returns
    their statuses and the 5xx."""
    sent: list[int] = []
    failures: list[str] = []

    @settings(
        max_examples=MORE_EXAMPLES.get(operation.label, EXAMPLES_PER_OPERATION),
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(mode))
    def probe(case: Case) -> None:
        if live is not None:
            with_live_ids(case, live)
        headers = {**dict(case.headers or {}), "X-API-Key": KEY}
        response = case.call(base_url=url, session=http, headers=headers, timeout=30)
        sent.append(response.status_code)
        if response.status_code >= 500:
            failures.append(
                f"{case.method} {case.formatted_path} {case.body!r:.300} -> "
                f"{response.status_code} {response.text[:300]}"
            )

    try:
        probe()
    except Unsatisfiable:  # nothing in this operation's schema can be made invalid
        assert mode == GenerationMode.NEGATIVE, operation.label
    return sent, failures


def test_no_generated_request_gets_a_5xx(served: Served) -> None:
    schema = schemathesis.openapi.from_dict(served.app_schema)
    operations = [r.ok() for r in schema.get_all_operations()]  # type: ignore[union-attr]
    assert len(operations) > 30  # the whole API is in the schema
    with_body = {o.label for o in operations if len(o.body) > 0}
    assert set(DOCUMENTED_BODIES) <= with_body, set(DOCUMENTED_BODIES) - with_body
    failures: list[str] = []
    statuses: Counter[int] = Counter()
    started = time.monotonic()
    with requests.Session() as http:
        for operation in operations:
            if operation.label in SKIPPED:
                continue
            for mode, live in PASSES:
                if mode == GenerationMode.NEGATIVE and not takes_input(operation):
                    continue
                ids = served.live if live else None
                if live and operation.label in MORE_EXAMPLES:
                    # A model of its own: an earlier operation may have unloaded the shared one.
                    ids = live_ids(served.url)
                sent, failed = fuzz(operation, mode, ids, served.url, http)
                if operation.label in MORE_EXAMPLES:
                    print(f"fuzz: {operation.label} {mode.value}: {Counter(sent)}")
                statuses.update(sent)
                failures += failed
    elapsed = time.monotonic() - started
    total = sum(statuses.values())
    print(f"fuzz: {total} requests, {len(operations)} operations, {elapsed:.1f}s: {statuses}")
    assert not failures, "\n".join(failures)
