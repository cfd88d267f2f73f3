"""What one tenant's stored records cost another tenant's dashboard.

A gateway runs in this process over the real Redis (Kafka is not needed: nothing here is
published). Alice holds two models and polls `/plexrl/v1/cluster` as every dashboard
does; then Bob stores `--models` job records with `--metadata-mb` of user metadata each
(written straight to Redis, as a gateway without quotas accepted them), and Alice polls
again. Prints the median latency of her `/cluster` and this process's peak resident
memory while she polls, before and after, as one JSON line.

    .venv/bin/python bench/cluster_view.py                   # 20 records x 5 MB
    .venv/bin/python bench/cluster_view.py --models 10000 --metadata-mb 0.01

Run it with PYTHONPATH pointing at another checkout's `libs` and `services/*` to measure
that checkout's gateway (the figures in the commit that added this were taken so).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from plexrl.messages import JobSpec
from plexrl.settings import GatewaySettings
from plexrl.stores import JobKind, JobRecord, Stores
from plexrl_gateway.app import build_app
from plexrl_gateway.components import Gateway

ALICE = {"X-API-Key": "tml-alice"}


class NoKafka:
    """The gateway's Kafka edge, for a run that publishes nothing it waits on."""

    async def publish(self, topic: str, key: str | bytes | None, message: Any) -> None:
        return None

    async def ping(self, timeout_s: float = 2.0) -> bool:
        return True


def peak_rss_mb() -> float:
    """This process's peak resident memory since the last `reset_peak_rss` (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")


async def poll(http: httpx.AsyncClient, n: int) -> tuple[float, float]:
    """Median seconds of `n` calls of Alice's /cluster, and the peak memory meanwhile."""
    reset_peak_rss()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        response = await http.get("/plexrl/v1/cluster", headers=ALICE)
        times.append(time.perf_counter() - start)
        response.raise_for_status()
    return statistics.median(times), peak_rss_mb()


def job(job_id: str, tenant: str, metadata: dict[str, str]) -> JobRecord:
    spec = JobSpec(base_model="plexrl/tiny-qwen3")
    return JobRecord(job_id, tenant, JobKind.TRAINING, spec, time.time(), "s", metadata=metadata)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    settings = GatewaySettings(
        cluster_id=f"bench-view-{uuid.uuid4().hex[:8]}",
        redis_url=args.redis,
        api_keys="tml-alice=alice,tml-bob=bob",
        model_registry=Path(tempfile.mkdtemp()),
        scheduler_url="http://127.0.0.1:9",
    )
    stores = Stores.from_url(settings.redis_url, settings.cluster_id, settings.record_ttl_s)
    gateway = Gateway.build(settings, stores, NoKafka())
    transport = httpx.ASGITransport(app=build_app(gateway))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
            for i in range(2):
                await stores.jobs.put_job(job(f"sess-alice:train:{i}", "alice", {}))
            await poll(http, 3)  # warm: imports, connections, the job count's first read
            before_s, before_mb = await poll(http, args.requests)
            notes = {"notes": "x" * int(args.metadata_mb * 1024 * 1024)}
            for i in range(args.models):
                await stores.jobs.put_job(job(f"sess-bob:train:{i}", "bob", notes))
            del notes
            after_s, after_mb = await poll(http, args.requests)
    finally:
        await gateway.close()
        keys = [k async for k in stores.keys.redis.scan_iter(match=f"{settings.cluster_id}:*")]
        if keys:
            await stores.keys.redis.delete(*keys)
        await stores.close()
    return {
        "bob_records": args.models,
        "metadata_mb_each": args.metadata_mb,
        "cluster_ms_before": round(before_s * 1000, 1),
        "cluster_ms_after": round(after_s * 1000, 1),
        "peak_rss_mb_before": round(before_mb),
        "peak_rss_mb_after": round(after_mb),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=20, help="Bob's job records")
    parser.add_argument("--metadata-mb", type=float, default=5.0, help="metadata per record")
    parser.add_argument("--requests", type=int, default=30, help="/cluster calls measured")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    print(json.dumps(asyncio.run(run(parser.parse_args()))))


if __name__ == "__main__":
    main()
