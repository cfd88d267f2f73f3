"""Every service's /metrics carries its PlexRL metrics, and they move in a real small run.

Two LoRA jobs share one worker whose device tier holds one state (so the worker swaps),
one job saves and reloads its state (blobs through the state-store), and a garbage
message on the requests topic is dead-lettered by the scheduler.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tinker
from prometheus_client.parser import text_string_to_metric_families
from tinker import types

from plexrl.kafka import Publisher
from plexrl.topics import Topics
from plexrl_tools.cluster import ClusterConfig, LocalCluster

pytestmark = pytest.mark.integration

KEY = "tml-metrics"
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(port: int) -> Samples:
    response = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
    response.raise_for_status()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def raw(port: int) -> str:
    return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of `name` over every series whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def series(samples: Samples, name: str) -> list[dict[str, str]]:
    return [dict(ls) for (n, ls) in samples if n == name]


@pytest.fixture(scope="module")
def cluster(
    infra: dict[str, str], tiny_registry: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    config = ClusterConfig.on_free_ports(
        tiny_registry,
        tmp_path_factory.mktemp("metrics"),
        "met",
        workers=1,
        api_keys=f"{KEY}=t",
        worker_threads=1,
        # Room for one job state on the device tier: two jobs take turns, so they swap.
        worker_device_bytes=400_000,
    )
    with LocalCluster(config) as running:  # stopped on the way out
        yield running


def run_jobs(cluster: LocalCluster) -> list[str]:
    os.environ["HF_HUB_OFFLINE"] = "1"
    service = tinker.ServiceClient(base_url=cluster.config.gateway_url, api_key=KEY)
    clients = [
        service.create_lora_training_client(base_model="plexrl/tiny-qwen3", rank=4, seed=i).result()
        for i in range(2)
    ]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([5, 6, 7, 8]),
        loss_fn_inputs={
            "target_tokens": types.TensorData(data=[6, 7, 8, 9], dtype="int64"),
            "weights": types.TensorData(data=[1.0] * 4, dtype="float32"),
        },
    )
    for _ in range(2):
        for client in clients:
            client.forward_backward([datum], "cross_entropy").result()
            client.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    path = clients[0].save_state("metrics").result().path
    service.create_training_client_from_state(path).result()
    return [c.model_id for c in clients]


async def send_garbage(bootstrap: str, cluster_id: str) -> None:
    publisher = Publisher(bootstrap, "test-garbage")
    await publisher.start()
    try:
        await publisher.publish_raw(Topics(cluster_id).requests, b"j", b"\x93not a request")
    finally:
        await publisher.stop()


def test_every_service_exports_its_metrics_and_they_move(
    cluster: LocalCluster, infra: dict[str, str]
) -> None:
    c = cluster.config
    jobs = run_jobs(cluster)
    asyncio.run(send_garbage(infra["kafka"], c.cluster_id))

    scheduler = scrape(c.scheduler_port)
    assert ("plexrl_scheduler_queue_depth", frozenset()) in scheduler
    # A call goes through the scheduler, or straight to the worker under a direct lease
    # (granted each time a job's dispatch ends with nothing else queued): both counted.
    direct = total(scheduler, "plexrl_scheduler_direct_calls_total")
    assert total(scheduler, "plexrl_scheduler_dispatches_total", worker="worker-0") >= 4
    assert total(scheduler, "plexrl_scheduler_dispatch_latency_seconds_count") + direct >= 8
    steps = [
        total(scheduler, f"plexrl_scheduler_{kind}_calls_total", function="optim_step")
        for kind in ("dispatched", "direct")
    ]
    assert sum(steps) >= 4, steps
    assert total(scheduler, "plexrl_scheduler_direct_leases_total", worker="worker-0") >= 1
    assert total(scheduler, "plexrl_scheduler_jobs_admitted_total") >= 2
    assert "plexrl_scheduler_jobs_finished_total" in {n for n, _ in scheduler}
    assert total(scheduler, "plexrl_scheduler_workers_healthy") == 1

    worker = scrape(c.worker_port(0))
    assert total(worker, "plexrl_worker_busy_seconds_total", function="forward_backward") > 0
    # No series names a job: a tenant's job ids stay out of what anyone inside may scrape.
    assert not {k for _, labels in worker for k, _ in labels} & {"job", "job_id"}
    assert not [j for j in jobs for p in (c.worker_port(0), c.scheduler_port) if j in raw(p)]
    assert total(worker, "plexrl_worker_calls_total", function="forward_backward", status="ok") >= 4
    # Two jobs, one device slot: each turn moves a state off the device and one onto it.
    assert total(worker, "plexrl_worker_swap_bytes_total", tier="device", direction="out") > 0
    assert total(worker, "plexrl_worker_swap_bytes_total", tier="device", direction="in") > 0
    assert total(worker, "plexrl_worker_swap_seconds_count") > 0
    assert {s["tier"] for s in series(worker, "plexrl_worker_resident_bytes")} == {
        "device",
        "host",
        "disk",
    }
    assert total(worker, "plexrl_worker_resident_bytes", tier="device") > 0

    store = scrape(c.state_store_port)
    assert total(store, "plexrl_state_store_blob_written_bytes_total") > 0  # the save
    assert total(store, "plexrl_state_store_blob_read_bytes_total") > 0  # the load
    assert total(store, "plexrl_state_store_checkpoints_recorded_total") >= 1
    assert total(store, "plexrl_state_store_requests_total", endpoint="/v1/blobs/{key:path}") >= 2

    gateway = scrape(c.gateway_port)
    assert total(gateway, "plexrl_gateway_requests_total", endpoint="/api/v1/forward_backward") >= 4

    # The garbage message: dead-lettered by the scheduler's requests consumer.
    for _ in range(100):
        scheduler = scrape(c.scheduler_port)
        if total(scheduler, "plexrl_dlq_messages_total", reason="undecodable") >= 1:
            break
        asyncio.run(asyncio.sleep(0.1))
    assert total(scheduler, "plexrl_dlq_messages_total", reason="undecodable") >= 1, [
        ls for (n, ls) in scheduler if n.startswith("plexrl_dlq")
    ]
