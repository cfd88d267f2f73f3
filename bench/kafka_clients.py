"""Kafka client cost per message: aiokafka (what the services use) beside confluent-kafka.

    .venv/bin/python bench/kafka_clients.py [--messages 2000] [--rounds 2]
        [--confluent-path DIR]

confluent-kafka is not a dependency: install it beside the project to measure it
(`pip install --target DIR confluent-kafka`, then `--confluent-path DIR`); without it
only aiokafka is measured. Both run the same ping on the shared broker, in
alternating rounds, each on a fresh topic: a producer sends one small message (a NOOP
completion's size, key and idempotence as the services set them), a consumer in the
same process receives it, and the next is sent once it arrived (latency one at a
time); then `--messages` are sent back to back and received (throughput). Reports p50
latency, messages/s and this process's CPU per message (producer and consumer
together, librdkafka's threads included: what one hop costs a service's client); ends
with one JSON line.

confluent-kafka is measured twice: blocking (`confluent`: the producer and consumer
polled in turn on one thread, librdkafka's best case) and bridged to asyncio
(`confluent_asyncio`: what a service on an event loop would pay: a thread polls the
producer and hands its acknowledgements to the loop, another consumes and hands each
batch of records to it, one `call_soon_threadsafe` per poll each way; the loop awaits
them as the services await aiokafka's).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import uuid
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from plexrl.kafka import ensure_topics

PAYLOAD = b"x" * 300


def figures(
    latencies: list[float], one_at_a_time_cpu: float, n: int, start: float, c0: float
) -> dict[str, float]:
    """A round's figures, once its `n` streamed messages (sent from `start`, with
    `time.process_time()` at `c0`) have all arrived."""
    wall = time.perf_counter() - start
    return {
        "p50_ms": statistics.median(latencies) * 1000,
        "cpu_ms_per_message_one_at_a_time": one_at_a_time_cpu * 1000,
        "messages_per_s": n / wall,
        "cpu_ms_per_message_streaming": (time.process_time() - c0) / n * 1000,
    }


async def aiokafka_round(bootstrap: str, topic: str, n: int) -> dict[str, float]:
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap, acks="all", enable_idempotence=True, linger_ms=0
    )
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=None,
        auto_offset_reset="earliest",
        fetch_max_wait_ms=500,
    )
    await producer.start()
    await consumer.start()
    try:
        latencies = []
        c0 = time.process_time()
        for _ in range(min(n, 300)):
            start = time.perf_counter()
            await producer.send_and_wait(topic, PAYLOAD, key=b"job")
            await consumer.getone()
            latencies.append(time.perf_counter() - start)
        one_at_a_time_cpu = (time.process_time() - c0) / len(latencies)
        c0, start = time.process_time(), time.perf_counter()
        acks = [await producer.send(topic, PAYLOAD, key=b"job") for _ in range(n)]
        got = 0
        while got < n:
            batch = await consumer.getmany(timeout_ms=1000)
            got += sum(len(v) for v in batch.values())
        await asyncio.gather(*acks)
        return figures(latencies, one_at_a_time_cpu, n, start, c0)
    finally:
        await consumer.stop()
        await producer.stop()


def confluent_pair(bootstrap: str, topic: str) -> tuple[Any, Any]:
    """A confluent-kafka producer (as the services' producers are set) and a consumer of
    `topic` from its start, once the consumer has its partition."""
    from confluent_kafka import Consumer, Producer

    producer = Producer(
        {"bootstrap.servers": bootstrap, "acks": "all", "enable.idempotence": True, "linger.ms": 0}
    )
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"bench-{uuid.uuid4().hex[:8]}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            "fetch.wait.max.ms": 500,
        }
    )
    consumer.subscribe([topic])
    deadline = time.monotonic() + 30
    while not consumer.assignment() and time.monotonic() < deadline:
        consumer.poll(0.1)
    return producer, consumer


def confluent_round(bootstrap: str, topic: str, n: int) -> dict[str, float]:
    producer, consumer = confluent_pair(bootstrap, topic)
    try:
        latencies = []
        delivered: list[Any] = []
        c0 = time.process_time()
        for _ in range(min(n, 300)):
            start = time.perf_counter()
            delivered.clear()
            producer.produce(
                topic, PAYLOAD, key=b"job", on_delivery=lambda e, m: delivered.append(e)
            )
            while not delivered:
                producer.poll(0.01)
            while consumer.poll(1.0) is None:
                pass
            latencies.append(time.perf_counter() - start)
        one_at_a_time_cpu = (time.process_time() - c0) / len(latencies)
        c0, start = time.process_time(), time.perf_counter()
        for _ in range(n):
            producer.produce(topic, PAYLOAD, key=b"job")
            producer.poll(0)
        got = 0
        while got < n:
            got += len(consumer.consume(num_messages=500, timeout=1.0))
        producer.flush(10)
        return figures(latencies, one_at_a_time_cpu, n, start, c0)
    finally:
        consumer.close()


async def confluent_asyncio_round(bootstrap: str, topic: str, n: int) -> dict[str, float]:
    import threading

    from confluent_kafka import KafkaException

    loop = asyncio.get_running_loop()
    producer, consumer = confluent_pair(bootstrap, topic)
    received: asyncio.Queue[list[Any]] = asyncio.Queue()
    stop = threading.Event()

    delivered: list[tuple[asyncio.Future[None], Any]] = []

    def poll_producer() -> None:  # delivery callbacks run on this thread, within `poll`
        while not stop.is_set():
            producer.poll(0.05)
            if delivered:  # one hand-over per poll, however many acknowledgements
                batch = delivered.copy()
                delivered.clear()
                loop.call_soon_threadsafe(settle_all, batch)

    def consume() -> None:  # the first record as soon as it comes, then what is there
        while not stop.is_set():
            first = consumer.poll(0.05)
            if first is not None:
                records = [first, *consumer.consume(num_messages=499, timeout=0)]
                loop.call_soon_threadsafe(received.put_nowait, records)

    def settle_all(batch: list[tuple[asyncio.Future[None], Any]]) -> None:
        for ack, error in batch:
            if ack.done():
                continue
            if error is None:
                ack.set_result(None)
            else:
                ack.set_exception(KafkaException(error))

    def send() -> asyncio.Future[None]:
        ack: asyncio.Future[None] = loop.create_future()
        producer.produce(
            topic,
            PAYLOAD,
            key=b"job",
            on_delivery=lambda error, _: delivered.append((ack, error)),
        )
        return ack

    threads = [threading.Thread(target=t, daemon=True) for t in (poll_producer, consume)]
    for thread in threads:
        thread.start()
    try:
        latencies = []
        c0 = time.process_time()
        for _ in range(min(n, 300)):
            start = time.perf_counter()
            await send()
            await received.get()
            latencies.append(time.perf_counter() - start)
        one_at_a_time_cpu = (time.process_time() - c0) / len(latencies)
        c0, start = time.process_time(), time.perf_counter()
        acks = [send() for _ in range(n)]
        got = 0
        while got < n:
            got += len(await received.get())
        await asyncio.gather(*acks)
        return figures(latencies, one_at_a_time_cpu, n, start, c0)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        producer.flush(10)
        consumer.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--messages", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--confluent-path", default=None, help="where confluent-kafka is installed")
    args = p.parse_args()
    bootstrap = os.environ.get("PLEXRL_KAFKA_BOOTSTRAP", "127.0.0.1:9092")
    if args.confluent_path:
        sys.path.insert(0, args.confluent_path)
    try:
        import confluent_kafka  # noqa: F401

        clients = ["aiokafka", "confluent", "confluent_asyncio"]
    except ImportError:
        clients = ["aiokafka"]
    load = os.getloadavg()
    runs: dict[str, list[dict[str, float]]] = {c: [] for c in clients}
    for n in range(args.rounds):
        for client in clients if n % 2 == 0 else list(reversed(clients)):
            topic = f"bench-kafka-{uuid.uuid4().hex[:8]}"  # empty: read from its start
            asyncio.run(ensure_topics(bootstrap, {topic: 1}))
            if client == "aiokafka":
                runs[client].append(asyncio.run(aiokafka_round(bootstrap, topic, args.messages)))
            elif client == "confluent":
                runs[client].append(confluent_round(bootstrap, topic, args.messages))
            else:
                round_ = confluent_asyncio_round(bootstrap, topic, args.messages)
                runs[client].append(asyncio.run(round_))
    result: dict[str, Any] = {
        "benchmark": "kafka_clients",
        "messages": args.messages,
        "rounds": args.rounds,
        "load_average": [round(v, 2) for v in (*load, *os.getloadavg())],
    }
    for client, rounds in runs.items():
        result[client] = {k: round(statistics.median(r[k] for r in rounds), 3) for k in rounds[0]}
        print(client, result[client])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
