"""One forward_backward through all four services, traced into a real Jaeger v2.

    scripts/jaeger.sh up                       # builds Jaeger v1.76.0 (v2) once, starts it
    .venv/bin/python bench/jaeger_trace.py     # prints the span tree Jaeger stored

Starts a LocalCluster (real Kafka and Redis, `scripts/infra.sh up`) whose services
export OTLP to Jaeger, creates a LoRA job, parks its state on the disk tier (so the call
onloads it through the state-store, as after an eviction), sends one forward_backward,
then reads the trace back from Jaeger's query API and prints it as a tree, plus the
`retrieve_future` trace that links to it. The last line is one JSON summary.
Recorded output: docs/tracing.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import tinker
from tinker import types

from plexrl.kafka import Publisher
from plexrl.messages import Dispatch, StateMove, Tier
from plexrl.models import init_tiny
from plexrl.stores import Stores
from plexrl.topics import Topics
from plexrl_tools.cluster import ClusterConfig, LocalCluster

KEY = "tml-jaeger"
KAFKA = os.environ.get("PLEXRL_KAFKA_BOOTSTRAP", "127.0.0.1:9092")
REDIS = os.environ.get("PLEXRL_REDIS_URL", "redis://127.0.0.1:6379/0")


async def park_on_disk(cluster_id: str, job_id: str) -> None:
    """A dispatch that only evicts the job to disk, as the scheduler would under pressure."""
    publisher = Publisher(KAFKA, "jaeger-trace")
    await publisher.start()
    stores = Stores.from_url(REDIS, cluster_id, 600)
    try:
        evict = Dispatch(
            dispatch_id=uuid.uuid4().hex,
            worker_id="worker-0",
            calls=[],
            evict=[StateMove(job_id, Tier.DISK)],
            issued_at=time.time(),
        )
        await publisher.publish(Topics(cluster_id).dispatch("worker-0"), job_id, evict)
        deadline = time.monotonic() + 60
        while (r := await stores.residency.get_residency(job_id)) is None or r.tier != Tier.DISK:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{job_id} never reached the disk tier")
            await asyncio.sleep(0.1)
    finally:
        await publisher.stop()
        await stores.close()


def find_trace(query: str, service: str, operation: str, since_us: int) -> dict[str, Any]:
    """The newest trace of `operation` that Jaeger holds (polls while spans arrive)."""
    deadline = time.monotonic() + 30
    while True:
        response = httpx.get(
            f"{query}/api/traces",
            params={
                "service": service,
                "operation": operation,
                "start": since_us,
                "limit": 20,
            },
            timeout=10,
        )
        response.raise_for_status()
        traces: list[dict[str, Any]] = response.json()["data"] or []
        if traces:
            return max(traces, key=lambda t: min(s["startTime"] for s in t["spans"]))
        if time.monotonic() > deadline:
            raise TimeoutError(f"Jaeger has no trace of {service} {operation!r}")
        time.sleep(1)


def get_trace(query: str, trace_id: str) -> dict[str, Any]:
    response = httpx.get(f"{query}/api/traces/{trace_id}", timeout=10)
    response.raise_for_status()
    data: dict[str, Any] = response.json()["data"][0]
    return data


def render(trace: dict[str, Any]) -> list[str]:
    services = {pid: p["serviceName"] for pid, p in trace["processes"].items()}
    spans = {s["spanID"]: s for s in trace["spans"]}
    children: dict[str | None, list[dict[str, Any]]] = {}
    for span in trace["spans"]:
        parents = [
            r["spanID"]
            for r in span.get("references", [])
            if r["refType"] == "CHILD_OF" and r["traceID"] == span["traceID"]
        ]
        parent = parents[0] if parents and parents[0] in spans else None
        children.setdefault(parent, []).append(span)
    lines: list[str] = []

    def walk(parent: str | None, depth: int) -> None:
        for span in sorted(children.get(parent, []), key=lambda s: s["startTime"]):
            kind = next((t["value"] for t in span["tags"] if t["key"] == "span.kind"), "internal")
            lines.append(
                f"{'  ' * depth}{services[span['processID']]}: {span['operationName']} "
                f"[{kind}] {span['duration'] / 1000:.1f} ms"
            )
            walk(span["spanID"], depth + 1)

    walk(None, 0)
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--query", default="http://127.0.0.1:16686", help="Jaeger query API")
    parser.add_argument("--otlp", default="http://127.0.0.1:4318", help="Jaeger OTLP/HTTP")
    args = parser.parse_args()
    try:
        httpx.get(f"{args.query}/api/services", timeout=5).raise_for_status()
    except httpx.HTTPError as exc:
        print(f"no Jaeger query API at {args.query} ({exc}); run scripts/jaeger.sh up")
        return 2

    work = Path(tempfile.mkdtemp(prefix="plexrl-jaeger-"))
    registry = work / "models"
    init_tiny(registry / "tiny-qwen3")
    config = ClusterConfig.on_free_ports(
        registry,
        work,
        "jg",
        workers=1,
        api_keys=f"{KEY}=jaeger",
        worker_threads=1,
        env={"OTEL_EXPORTER_OTLP_ENDPOINT": args.otlp, "OTEL_BSP_SCHEDULE_DELAY": "200"},
    )
    since_us = int(time.time() * 1e6)
    os.environ["HF_HUB_OFFLINE"] = "1"
    cluster = LocalCluster(config)
    cluster.start(timeout_s=600)  # four services importing torch: minutes on a busy machine
    try:
        service = tinker.ServiceClient(base_url=config.gateway_url, api_key=KEY)
        client = service.create_lora_training_client(base_model="plexrl/tiny-qwen3", rank=4)
        training = client.result()
        asyncio.run(park_on_disk(config.cluster_id, training.model_id))
        datum = types.Datum(
            model_input=types.ModelInput.from_ints([5, 6, 7, 8]),
            loss_fn_inputs={
                "target_tokens": types.TensorData(data=[6, 7, 8, 9], dtype="int64"),
                "weights": types.TensorData(data=[1.0] * 4, dtype="float32"),
            },
        )
        loss = training.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"]
        time.sleep(2)  # the services' batch exporters flush every 200 ms
    finally:
        cluster.stop()

    trace = find_trace(args.query, "plexrl-gateway", "POST /api/v1/forward_backward", since_us)
    trace = get_trace(args.query, trace["traceID"])
    root = next(s for s in trace["spans"] if not s.get("references"))
    print(f"forward_backward (loss:sum {loss:.4f}): trace {trace['traceID']}")
    for line in render(trace):
        print("  " + line)

    find_trace(args.query, "plexrl-gateway", "POST /api/v1/retrieve_future", since_us)
    polls: list[dict[str, Any]] = httpx.get(
        f"{args.query}/api/traces",
        params={
            "service": "plexrl-gateway",
            "operation": "POST /api/v1/retrieve_future",
            "start": since_us,
            "limit": 50,
        },
        timeout=10,
    ).json()["data"]
    # An OpenTelemetry link shows in Jaeger as a reference into another trace.
    linked = [
        poll["traceID"]
        for poll in polls
        for span in poll["spans"]
        for ref in span.get("references", [])
        if (ref["traceID"], ref["spanID"]) == (root["traceID"], root["spanID"])
    ]
    print(f"retrieve_future traces linked to it: {sorted(set(linked))}")

    services = sorted({p["serviceName"] for p in trace["processes"].values()})
    names = [s["operationName"] for s in trace["spans"]]
    summary = {
        "trace_id": trace["traceID"],
        "spans": len(trace["spans"]),
        "services": services,
        "state_store_hop": any(n.startswith("GET /v1/blobs/") for n in names),
        "retrieve_future_linked": bool(linked),
    }
    print(json.dumps(summary))
    ok = len(services) == 4 and summary["state_store_hop"] and summary["retrieve_future_linked"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
