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
  parser and with hiredis's;
- with `--uvloop-path DIR` (uvloop installed there; not a dependency), **the event
  loop**: the Redis round trip (hiredis) and a Kafka hop (an acknowledged send, then
  its record received by a consumer in the same process) on asyncio's loop and on
  uvloop's, alternating.

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
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
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


async def loop_ops(bootstrap: str, url: str, n: int) -> dict[str, float]:
    """CPU per Redis round trip and per Kafka hop on the running loop (best of three)."""
    client = aioredis.from_url(url, parser_class=_AsyncHiredisParser)
    key = f"bench-overheads-{uuid.uuid4().hex[:8]}"
    call = client.register_script("redis.call('SET', KEYS[1], ARGV[1], 'EX', 60)")
    topic = f"bench-overheads-{uuid.uuid4().hex[:8]}"
    await ensure_topics(bootstrap, {topic: 1})
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap, acks="all", enable_idempotence=True, linger_ms=0
    )
    consumer = AIOKafkaConsumer(
        topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest", fetch_max_wait_ms=500
    )
    await producer.start()
    await consumer.start()

    async def trip() -> None:
        await call(keys=[key], args=[PAYLOAD])

    async def hop() -> None:
        await producer.send_and_wait(topic, PAYLOAD, key=b"job")
        await consumer.getone()

    try:
        await hop()  # the consumer assigned and at the log's end
        redis_s = min([await cpu_per(trip, n) for _ in range(3)])
        kafka_s = min([await cpu_per(hop, max(1, n // 5)) for _ in range(3)])
    finally:
        await consumer.stop()
        await producer.stop()
        await client.aclose()
    return {"redis_script_us": round(redis_s * 1e6, 1), "kafka_hop_us": round(kafka_s * 1e6, 1)}


def loops(bootstrap: str, url: str, n: int, rounds: int) -> dict[str, dict[str, float]]:
    """`loop_ops` on asyncio's loop and on uvloop's, alternating; the best of each."""
    import uvloop

    runs: dict[str, list[dict[str, float]]] = {"asyncio": [], "uvloop": []}
    for r in range(rounds):
        for name in ("asyncio", "uvloop") if r % 2 == 0 else ("uvloop", "asyncio"):
            factory = uvloop.new_event_loop if name == "uvloop" else None
            with asyncio.Runner(loop_factory=factory) as runner:
                runs[name].append(runner.run(loop_ops(bootstrap, url, n)))
    return {name: {k: min(r[k] for r in got) for k in got[0]} for name, got in runs.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sends", type=int, default=3000)
    p.add_argument("--trips", type=int, default=3000, help="Redis script + pipeline pairs")
    p.add_argument("--instrumentation-path", default=None)
    p.add_argument("--uvloop-path", default=None, help="a directory with uvloop installed")
    args = p.parse_args()
    if args.instrumentation_path:
        sys.path.insert(0, args.instrumentation_path)
    if args.uvloop_path:
        sys.path.insert(0, args.uvloop_path)
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
    result: dict[str, Any] = {
        "benchmark": "client_overheads",
        "rounds": args.rounds,
        "kafka_send": kafka,
        "redis_script_and_pipeline": redis,
    }
    if args.uvloop_path:
        result["event_loop"] = loops(bootstrap, url, args.trips, args.rounds)
        print(f"on each event loop, CPU per operation: {result['event_loop']}")
    result["load_average"] = [round(v, 2) for v in (*load, *os.getloadavg())]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
