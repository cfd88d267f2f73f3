"""Waiting for a Redis replica, per write and shared: what group commit saves.

    .venv/bin/python bench/replica_wait.py [--writes 2000] [--rounds 2] [--concurrency 1,16,64]

Starts a Redis primary, two replicas and three Sentinels on loopback (the Sentinel
tests' group, `plexrl_tools.private_infra.RedisGroup`), then at each concurrency runs
`--writes` writes, each a `SET` followed by a wait for one replica (what a gateway
request or a completion does before it is shown outside Redis), two ways in alternating
rounds:

- `shared`: one `ReplicaWait` for the process, as the services hold it (concurrent
  waits share a round);
- `own`: a `ReplicaWait` per write, so every write sends its own mark and `WAIT` (each
  caller its own round trip, as before group commit).

Reports writes/s, p50 / p99 of a write and its wait, the rounds sent per write and
this process's CPU per write; ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from plexrl.redis_target import ReplicaWait
from plexrl_tools.private_infra import RedisGroup

TIMEOUT_MS = 1000


async def run(
    client: aioredis.Redis, writes: int, concurrency: int, shared: bool
) -> dict[str, Any]:
    one = ReplicaWait(client, "bench:replicated", 1, TIMEOUT_MS)
    rounds = 0
    latencies: list[float] = []
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(writes):
        queue.put_nowait(i)

    async def writer() -> None:
        nonlocal rounds
        while not queue.empty():
            i = queue.get_nowait()
            wait = one if shared else ReplicaWait(client, "bench:replicated", 1, TIMEOUT_MS)
            started = time.perf_counter()
            await client.set(f"bench:w:{i % 1000}", i)
            await wait()
            latencies.append(time.perf_counter() - started)
            if not shared:
                rounds += wait.waits

    began, cpu0 = time.perf_counter(), time.process_time()
    await asyncio.gather(*(writer() for _ in range(concurrency)))
    wall, spent = time.perf_counter() - began, time.process_time() - cpu0
    rounds = one.waits if shared else rounds
    latencies.sort()
    return {
        "writes_per_s": round(writes / wall, 1),
        "p50_ms": round(statistics.median(latencies) * 1e3, 3),
        "p99_ms": round(latencies[int(0.99 * (len(latencies) - 1))] * 1e3, 3),
        "rounds_per_write": round(rounds / writes, 3),
        "cpu_ms_per_write": round(spent / writes * 1e3, 3),
    }


async def measure(group: RedisGroup, args: argparse.Namespace) -> dict[str, Any]:
    client = aioredis.Redis(port=group.primary(), max_connections=256)
    results: dict[str, Any] = {}
    try:
        for concurrency in args.concurrency:
            rows: dict[str, list[dict[str, Any]]] = {"shared": [], "own": []}
            for _ in range(args.rounds):
                for way in ("own", "shared"):
                    rows[way].append(await run(client, args.writes, concurrency, way == "shared"))
            results[str(concurrency)] = {
                way: {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]}
                for way, runs in rows.items()
            }
    finally:
        await client.aclose()
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--writes", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds of each way")
    p.add_argument("--concurrency", default="1,16,64", help="comma list of concurrent writers")
    args = p.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    with tempfile.TemporaryDirectory(prefix="replica-wait-") as root:
        group = RedisGroup(Path(root), down_after_ms=5000)
        group.up()
        try:
            results = asyncio.run(measure(group, args))
        finally:
            group.down()
    print(
        f"{'writers':>8} {'way':>7} {'writes/s':>9} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'rounds/write':>12} {'CPU ms/write':>12}"
    )
    for concurrency, ways in results.items():
        for way, r in ways.items():
            print(
                f"{concurrency:>8} {way:>7} {r['writes_per_s']:>9} {r['p50_ms']:>8} "
                f"{r['p99_ms']:>8} {r['rounds_per_write']:>12} {r['cpu_ms_per_write']:>12}"
            )
    print(
        json.dumps(
            {
                "benchmark": "replica-wait",
                "writes": args.writes,
                "rounds": args.rounds,
                "results": results,
            }
        )
    )


if __name__ == "__main__":
    main()
