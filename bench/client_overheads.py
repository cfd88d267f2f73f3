"""What the services' Kafka and Redis clients cost per operation, in one process.

    .venv/bin/python bench/client_overheads.py [--rounds 3] [--sends 3000] [--trips 3000]

On the Kafka and Redis of `scripts/infra.sh` (PLEXRL_KAFKA_BOOTSTRAP, PLEXRL_REDIS_URL),
tracing set up as the services set it (no exporter: nothing recorded, contexts travel),
best of `--rounds` alternating rounds, this process's CPU:

- **a Kafka send** on an idempotent producer, inside an unrecorded span as a worker's
  completion is sent: bare (no headers), with the trace headers the services attach
  (`tracing.record_headers`), and, where `opentelemetry-instrumentation-aiokafka` is
  installed (it is not a dependency: `pip install --target DIR
  opentelemetry-instrumentation-aiokafka` and `--instrumentation-path DIR`), through
  its wrapper, which the services used before;
- **a Redis round trip** (a Lua script, then a two-command pipeline: what a gateway's
  acceptance and a worker's record are made of) with redis-py's pure-Python RESP3
  parser and with hiredis's.

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer
from redis._parsers import _AsyncHiredisParser, _AsyncRESP3Parser

from plexrl import tracing
from plexrl.kafka import ensure_topics

PAYLOAD = b"x" * 300


async def cpu_per(op: Callable[[], Awaitable[Any]], n: int) -> float:
    """This process's CPU seconds per `op`, over `n` of them."""
    start = time.process_time()
    for _ in range(n):
        await op()
    return (time.process_time() - start) / n


async def sends(bootstrap: str, n: int, rounds: int, instrumented: bool) -> dict[str, float]:
    topic = f"bench-overheads-{uuid.uuid4().hex[:8]}"
    await ensure_topics(bootstrap, {topic: 1})
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap, acks="all", enable_idempotence=True, linger_ms=0
    )
    await producer.start()
    tracer = tracing.tracer("bench")
    acks: list[asyncio.Future[Any]] = []

    async def bare() -> None:
        acks.append(await producer.send(topic, PAYLOAD, key=b"job"))

    async def headed() -> None:
        headers = tracing.record_headers(topic)
        acks.append(await producer.send(topic, PAYLOAD, key=b"job", headers=headers))

    ways: dict[str, Callable[[], Awaitable[None]]] = {"bare": bare, "trace_headers": headed}
    best: dict[str, float] = {}
    try:
        for r in range(rounds):
            order = list(ways) if r % 2 == 0 else list(reversed(ways))
            if instrumented:
                order.append("instrumentation")
            for way in order:
                if way == "instrumentation":
                    from opentelemetry.instrumentation.aiokafka import AIOKafkaInstrumentor

                    AIOKafkaInstrumentor().instrument()
                    op: Callable[[], Awaitable[None]] = bare  # the wrapper adds its headers
                else:
                    op = ways[way]
                with tracer.start_as_current_span("worker.sample"):
                    spent = await cpu_per(op, n)
                await asyncio.gather(*acks)
                acks.clear()
                if way == "instrumentation":
                    AIOKafkaInstrumentor().uninstrument()
                best[way] = min(best.get(way, spent), spent)
    finally:
        await producer.stop()
    return {f"{way}_us": round(s * 1e6, 1) for way, s in best.items()}


async def trips(url: str, n: int, rounds: int) -> dict[str, float]:
    parsers = {"python_parser": _AsyncRESP3Parser, "hiredis": _AsyncHiredisParser}
    clients = {name: aioredis.from_url(url, parser_class=p) for name, p in parsers.items()}
    key = f"bench-overheads-{uuid.uuid4().hex[:8]}"
    script = "redis.call('SET', KEYS[1], ARGV[1], 'EX', 60); return redis.call('GET', KEYS[1])"
    best: dict[str, float] = {}
    try:
        for r in range(rounds):
            for name in parsers if r % 2 == 0 else list(reversed(parsers)):
                client = clients[name]
                call = client.register_script(script)

                async def trip(client: Any = client, call: Any = call) -> None:
                    await call(keys=[key], args=[PAYLOAD])
                    async with client.pipeline(transaction=False) as pipe:
                        pipe.set(key, PAYLOAD, ex=60)
                        pipe.get(key)
                        await pipe.execute()

                spent = await cpu_per(trip, n)
                best[name] = min(best.get(name, spent), spent)
    finally:
        for client in clients.values():
            await client.aclose()
    return {f"{name}_us": round(s * 1e6, 1) for name, s in best.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sends", type=int, default=3000)
    p.add_argument("--trips", type=int, default=3000, help="Redis script + pipeline pairs")
    p.add_argument("--instrumentation-path", default=None)
    args = p.parse_args()
    if args.instrumentation_path:
        sys.path.insert(0, args.instrumentation_path)
    try:
        import opentelemetry.instrumentation.aiokafka  # noqa: F401

        instrumented = True
    except ImportError:
        instrumented = False
    tracing.setup_tracing("bench")
    bootstrap = os.environ.get("PLEXRL_KAFKA_BOOTSTRAP", "127.0.0.1:9092")
    url = os.environ.get("PLEXRL_REDIS_URL", "redis://127.0.0.1:6379/0")
    load = os.getloadavg()
    kafka = asyncio.run(sends(bootstrap, args.sends, args.rounds, instrumented))
    print(f"Kafka send, CPU per send: {kafka}")
    redis = asyncio.run(trips(url, args.trips, args.rounds))
    print(f"Redis script + pipeline, CPU per pair: {redis}")
    result = {
        "benchmark": "client_overheads",
        "rounds": args.rounds,
        "load_average": [round(v, 2) for v in (*load, *os.getloadavg())],
        "kafka_send": kafka,
        "redis_script_and_pipeline": redis,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
