"""One trace per API call: gateway → Kafka → scheduler → worker → Kafka → gateway.

The four services run in this process (their `serve` coroutines), over the real
Kafka and Redis, so one in-memory exporter sees every span they make.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from plexrl import tracing
from plexrl.settings import GatewaySettings, SchedulerSettings, StateStoreSettings, WorkerSettings
from plexrl_gateway.main import serve as serve_gateway
from plexrl_scheduler.main import serve as serve_scheduler
from plexrl_state_store.main import serve as serve_state_store
from plexrl_worker.main import serve as serve_worker
from tests.conftest import free_port

pytestmark = pytest.mark.integration


async def wait_until(url: str, ok: object = None, timeout_s: float = 60.0) -> dict[str, object]:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=2) as http:
        while True:
            try:
                response = await http.get(url)
                body: dict[str, object] = response.json()
                if response.status_code == 200 and (ok is None or ok(body)):  # type: ignore[operator]
                    return body
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(url)
            await asyncio.sleep(0.1)


async def test_echo_is_one_trace_through_every_service(
    infra: dict[str, str], cluster_id: str, tiny_registry: Path, tmp_path: Path
) -> None:
    exporter = InMemorySpanExporter()
    tracing.setup_tracing("plexrl-test", exporter)
    common: dict[str, Any] = {
        "kafka_bootstrap": infra["kafka"],
        "redis_url": infra["redis"],
        "cluster_id": cluster_id,
    }
    store_port, sched_port, worker_port, gw_port = (free_port() for _ in range(4))
    store_url = f"http://127.0.0.1:{store_port}"
    sched_url = f"http://127.0.0.1:{sched_port}"
    stop = asyncio.Event()
    services = [
        serve_state_store(
            StateStoreSettings(
                **common, state_store_port=store_port, state_store_dir=tmp_path / "blobs"
            ),
            stop,
        ),
        serve_scheduler(SchedulerSettings(**common, scheduler_port=sched_port), stop),
        serve_worker(
            WorkerSettings(
                **common,
                worker_port=worker_port,
                state_store_url=store_url,
                model_registry=tiny_registry,
                worker_threads=1,
            ),
            stop,
        ),
        serve_gateway(
            GatewaySettings(
                **common,
                gateway_port=gw_port,
                api_keys="tml-trace=t",
                model_registry=tiny_registry,
                scheduler_url=sched_url,
            ),
            stop,
        ),
    ]
    tasks = [asyncio.create_task(s) for s in services]
    try:
        await wait_until(f"http://127.0.0.1:{gw_port}/healthz")
        await wait_until(f"{sched_url}/healthz", lambda b: b.get("workers"))
        exporter.clear()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gw_port}", timeout=30) as http:
            response = await http.post("/plexrl/v1/echo", headers={"X-API-Key": "tml-trace"})
        assert response.status_code == 200, response.text
        request_id = response.json()["request_id"]
        await asyncio.sleep(0.5)  # let the last spans end
    finally:
        stop.set()
        await asyncio.gather(*tasks)

    spans = exporter.get_finished_spans()
    tagged = [s for s in spans if (s.attributes or {}).get("plexrl.request_id") == request_id]
    trace_ids = {s.context.trace_id for s in tagged if s.context is not None}
    assert len(trace_ids) == 1, [(s.name, s.context) for s in tagged]
    (trace_id,) = trace_ids
    names = {s.name for s in spans if s.context is not None and s.context.trace_id == trace_id}
    assert any(n.startswith("gateway") and n != "gateway.completion" for n in names), names
    assert "scheduler.dispatch" in names, names
    assert "worker.noop" in names, names
    assert "gateway.completion" in names, names  # and back
