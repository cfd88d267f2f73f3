"""Time the gateway's accept path: a training call's futures, retry claim, cursor and
publish, against the real Redis, with Kafka replaced by a publisher that returns at once
(so only the Redis writes and the gateway's own work are measured).

    .venv/bin/python bench/gateway_accept.py [--calls 400]

Ends with one JSON line: p50 / p99 of `Submitter.submit` in milliseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
import uuid
from typing import Any

from plexrl.messages import AdamParams, Function, OptimStepInput
from plexrl.stores import Stores
from plexrl.topics import Topics
from plexrl_gateway.outbox import Outbox
from plexrl_gateway.render import ResponseKind
from plexrl_gateway.sequencer import Sequencer
from plexrl_gateway.submitter import Call, Submission, Submitter, ready


class Instant:
    """Kafka's acknowledgement, without Kafka."""

    async def publish(self, topic: str, key: str | bytes | None, message: Any) -> None:
        return None

    async def ping(self, timeout_s: float = 2.0) -> bool:
        return True


async def run(calls: int) -> dict[str, Any]:
    cluster = "bench-" + uuid.uuid4().hex[:8]
    url = os.environ.get("PLEXRL_REDIS_URL", "redis://127.0.0.1:6379/0")
    stores = Stores.from_url(url, cluster, 600)
    submitter = Submitter(
        stores.calls,
        stores.payloads,
        Outbox(stores.keys),
        Instant(),
        Topics(cluster),
        Sequencer(stores.calls, 30.0),
        512 * 1024,
    )
    call = Call(Function.OPTIM_STEP, OptimStepInput(adam=AdamParams()), ResponseKind.OPTIM_STEP)
    times: list[float] = []
    before = await _commands(stores)
    try:
        for seq in range(calls):
            sub = Submission("model-1", "bench", seq, retry_key=f"model-1:{seq}")
            start = time.perf_counter()
            await submitter.submit(sub, ready(call))
            times.append((time.perf_counter() - start) * 1000)
        # Exact on a Redis of its own (PLEXRL_REDIS_URL); others' commands count too.
        per_call = (await _commands(stores) - before - 1) / calls
    finally:
        keys = [k async for k in stores.keys.redis.scan_iter(match=f"{cluster}:*", count=1000)]
        if keys:
            await stores.keys.redis.delete(*keys)
        await stores.close()
    times.sort()
    return {
        "benchmark": "gateway_accept",
        "calls": calls,
        "p50_ms": round(statistics.median(times), 3),
        "p99_ms": round(times[int(0.99 * (len(times) - 1))], 3),
        "redis_commands_per_call": round(per_call, 2),
    }


async def _commands(stores: Stores) -> int:
    stats: dict[str, Any] = await stores.keys.redis.info("stats")
    return int(stats["total_commands_processed"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=400)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(run(args.calls))))


if __name__ == "__main__":
    main()
