"""A worker recording sample calls that finished in one decode step: one at a time or together.

    .venv/bin/python bench/recorder.py [--calls 16,64] [--batches 100] [--rounds 3]

The worker's `ResultRecorder` on the Redis and Kafka of `scripts/infra.sh` (its
PLEXRL_REDIS_URL and PLEXRL_KAFKA_BOOTSTRAP), recording batches of `--calls` sample
completions that ended together (a co-batched group whose sequences all reached their
last token in the same step), two ways in alternating rounds:

- `one_at_a_time`: `record` per call, each awaited before the next (a record, its
  notice and its timeline entry in one Redis round trip per call);
- `together`: `record_together` for the whole batch (one round trip for all of them).

Each batch is then settled (its completions acknowledged by the broker), as a dispatch
is before its offset is committed. Reports, per batch size, this process's CPU per call
and the wall time from the step's end until the batch's last completion is recorded and
announced (the decode loop waits that long before its next step); ends with one JSON
line.
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

from plexrl.kafka import Publisher, ensure_topics
from plexrl.messages import (
    Function,
    PhaseRequest,
    SampledSequence,
    SampleInput,
    SampleOutput,
    SamplingParams,
    StopReason,
)
from plexrl.stores import Stores
from plexrl_worker.recorder import ResultRecorder
from plexrl_worker.runner import Ran


def output() -> SampleOutput:
    """A sample call's output of 4 sequences of 16 tokens, as a small model answers."""
    sequence = SampledSequence(list(range(16)), [-0.5] * 16, StopReason.LENGTH)
    return SampleOutput(sequences=[sequence] * 4)


def requests(n: int, job: str) -> list[PhaseRequest]:
    now = time.time()
    return [
        PhaseRequest(
            request_id=f"{job}-{uuid.uuid4().hex[:12]}",
            job_id=job,
            tenant="bench",
            function=Function.SAMPLE,
            payload=SampleInput([1, 2, 3], 4, SamplingParams(max_tokens=16)),
            arrival_time=now,
        )
        for _ in range(n)
    ]


async def batch(recorder: ResultRecorder, n: int, together: bool) -> tuple[float, float]:
    """One batch of `n` calls recorded and settled: its wall seconds until the last is
    recorded, and this process's CPU seconds for it all."""
    calls = requests(n, "bench-job")
    ran = Ran(output(), None, 0.0, 0.01, time.time())
    cpu, start = time.process_time(), time.perf_counter()
    if together:
        await recorder.record_together([(c, ran, i == n - 1) for i, c in enumerate(calls)], "d")
    else:
        for i, call in enumerate(calls):
            await recorder.record(call, ran, "d", i == n - 1)
    wall = time.perf_counter() - start
    await recorder.settle()
    return wall, time.process_time() - cpu


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    bootstrap = os.environ.get("PLEXRL_KAFKA_BOOTSTRAP", "127.0.0.1:9092")
    redis_url = os.environ.get("PLEXRL_REDIS_URL", "redis://127.0.0.1:6379/0")
    cluster = f"bench-recorder-{uuid.uuid4().hex[:6]}"
    topic = f"{cluster}.completions"
    await ensure_topics(bootstrap, {topic: 1})
    stores = Stores.from_url(redis_url, cluster, 600)
    publisher = Publisher(bootstrap, "bench-recorder")
    await publisher.start()
    recorder = ResultRecorder(
        worker_id="w0",
        calls=stores.calls,
        payloads=stores.payloads,
        timeline=stores.timeline,
        publisher=publisher,
        completions_topic=topic,
        inline_max_bytes=512 * 1024,
    )
    results: dict[str, Any] = {}
    try:
        for n in args.calls:
            await batch(recorder, n, True)  # warm up both ways
            await batch(recorder, n, False)
            runs: dict[str, list[tuple[float, float]]] = {"one_at_a_time": [], "together": []}
            for r in range(args.rounds):
                ways = ["together", "one_at_a_time"] if r % 2 else ["one_at_a_time", "together"]
                for way in ways:
                    for _ in range(args.batches):
                        runs[way].append(await batch(recorder, n, way == "together"))
            figures = {
                way: {
                    "wall_ms_per_batch_p50": round(statistics.median(w for w, _ in got) * 1e3, 3),
                    "cpu_ms_per_call": round(sum(c for _, c in got) / (len(got) * n) * 1e3, 4),
                }
                for way, got in runs.items()
            }
            one, both = figures["one_at_a_time"], figures["together"]
            figures["cpu_ratio"] = round(both["cpu_ms_per_call"] / one["cpu_ms_per_call"], 3)
            figures["wall_ratio"] = round(
                both["wall_ms_per_batch_p50"] / one["wall_ms_per_batch_p50"], 3
            )
            results[str(n)] = figures
            print(f"{n} calls ending together: {figures}")
    finally:
        await publisher.stop()
        await stores.close()
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--calls", default="16,64", help="calls per batch, comma separated")
    p.add_argument("--batches", type=int, default=100, help="batches per way per round")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    args.calls = [int(n) for n in args.calls.split(",")]
    load = os.getloadavg()
    results = asyncio.run(measure(args))
    print(
        json.dumps(
            {
                "benchmark": "recorder",
                "batches": args.batches,
                "rounds": args.rounds,
                "load_average": [round(v, 2) for v in (*load, *os.getloadavg())],
                "by_calls": results,
            }
        )
    )


if __name__ == "__main__":
    main()
