"""Control-plane latency and throughput: one NOOP call gateway → Kafka → scheduler → worker → back.

    .venv/bin/python bench/control_plane.py [--calls 300] [--clients 16]

Starts a local cluster (one worker), measures `POST /plexrl/v1/echo` one at a time
(p50/p99 latency) and with many concurrent clients (calls/s), and, side by side, a
plain HTTP round trip to the gateway (`POST /api/v1/client/config`, no I/O behind
it) so the Kafka path's added cost is visible. Ends with one JSON line of figures.
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

from plexrl.cluster import ClusterConfig, LocalCluster

KEY = "tml-bench"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def sequential(http: httpx.AsyncClient, method: str, path: str, n: int) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        response = await http.request(method, path)
        response.raise_for_status()
        out.append(time.perf_counter() - start)
    return out


async def concurrent(http: httpx.AsyncClient, clients: int, n: int) -> float:
    """Calls per second with `clients` callers issuing `n` echo calls in total."""
    remaining = n

    async def caller() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            (await http.post("/plexrl/v1/echo")).raise_for_status()

    start = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(clients)))
    return n / (time.perf_counter() - start)


async def measure(url: str, calls: int, clients: int) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(
        base_url=url, headers={"X-API-Key": KEY}, timeout=60, limits=limits
    ) as http:
        await sequential(http, "POST", "/plexrl/v1/echo", 20)  # warm up every hop
        http_rt = await sequential(http, "POST", "/api/v1/client/config", calls)
        echo = await sequential(http, "POST", "/plexrl/v1/echo", calls)
        rate = await concurrent(http, clients, calls * 2)
    ms = 1000.0
    return {
        "benchmark": "control_plane",
        "calls": calls,
        "echo_p50_ms": round(statistics.median(echo) * ms, 3),
        "echo_p99_ms": round(percentile(echo, 0.99) * ms, 3),
        "http_p50_ms": round(statistics.median(http_rt) * ms, 3),
        "added_p50_ms": round((statistics.median(echo) - statistics.median(http_rt)) * ms, 3),
        "clients": clients,
        "calls_per_s": round(rate, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--clients", type=int, default=16)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        from plexrl.models import init_tiny

        registry = Path(tmp) / "models"
        init_tiny(registry / "tiny-qwen3")
        config = ClusterConfig(
            model_registry=registry,
            state_dir=Path(tmp) / "state",
            cluster_id="bench-" + uuid.uuid4().hex[:8],
            api_keys=f"{KEY}=bench",
            worker_threads=1,
        )
        with LocalCluster(config):
            figures = asyncio.run(measure(config.gateway_url, args.calls, args.clients))
    print(
        f"echo p50 {figures['echo_p50_ms']} ms, p99 {figures['echo_p99_ms']} ms "
        f"(plain HTTP p50 {figures['http_p50_ms']} ms; added {figures['added_p50_ms']} ms); "
        f"{figures['calls_per_s']} calls/s with {args.clients} clients"
    )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
