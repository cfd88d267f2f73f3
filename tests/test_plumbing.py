"""Kafka and Redis helpers against the real broker and Redis (scripts/infra.sh)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import msgspec
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from plexrl import tracing
from plexrl.kafka import Delivery, MessageConsumer, Publisher, ensure_topics
from plexrl.messages import (
    CompletionStatus,
    DeadLetter,
    DeadLetterReason,
    Function,
    JobSpec,
    NoopInput,
    PayloadRef,
    PhaseCompletion,
    PhaseRequest,
    SampledSequence,
    SampleOutput,
    StopReason,
    Tier,
    Timings,
)
from plexrl.payloads import inline_or_ref, resolve
from plexrl.stores import (
    CheckpointRecord,
    FutureRecord,
    JobKind,
    JobRecord,
    Residency,
    SessionRecord,
    Stores,
    TimelineEntry,
)
from plexrl.topics import Topics, core_topics
from plexrl_state_store.app import build_app
from plexrl_state_store.blobs import BlobDir

pytestmark = pytest.mark.integration


def noop(rid: str) -> PhaseRequest:
    return PhaseRequest(
        request_id=rid,
        job_id="j",
        tenant="t",
        function=Function.NOOP,
        payload=NoopInput(),
        arrival_time=time.time(),
    )


async def test_publish_consume_carries_trace_and_dead_letters_garbage(
    infra: dict[str, str], cluster_id: str
) -> None:
    exporter = InMemorySpanExporter()
    tracing.setup_tracing("test", exporter)
    topics = Topics(cluster_id)
    await ensure_topics(infra["kafka"], core_topics(topics))
    publisher = Publisher(infra["kafka"], "test")
    await publisher.start()
    got: asyncio.Queue[tuple[PhaseRequest, Delivery]] = asyncio.Queue()
    letters: asyncio.Queue[DeadLetter] = asyncio.Queue()

    async def on_request(message: PhaseRequest, delivery: Delivery) -> None:
        await got.put((message, delivery))

    async def on_letter(message: DeadLetter, delivery: Delivery) -> None:
        await letters.put(message)

    consumers: list[MessageConsumer[PhaseRequest] | MessageConsumer[DeadLetter]] = [
        MessageConsumer(
            bootstrap=infra["kafka"],
            topics=[topics.requests],
            group=topics.group("t"),
            message_type=PhaseRequest,
            handler=on_request,
            dlq=(publisher, topics.dlq),
            name="t-requests",
        ),
        MessageConsumer(
            bootstrap=infra["kafka"],
            topics=[topics.dlq],
            group=None,
            message_type=DeadLetter,
            handler=on_letter,
            dlq=(publisher, topics.dlq),
            name="t-dlq",
        ),
    ]
    stop = asyncio.Event()
    for c in consumers:
        await c.start()
    tasks = [asyncio.create_task(c.run(stop)) for c in consumers]
    try:
        with tracing.tracer("test").start_as_current_span("api-call") as span:
            await publisher.publish(topics.requests, "j", noop("r1"))
        await publisher.publish_raw(topics.requests, b"j", b"\x93not a request")
        await publisher.publish(topics.requests, "j", noop("r2"))

        first, delivery = await asyncio.wait_for(got.get(), 30)
        second, _ = await asyncio.wait_for(got.get(), 30)
        assert (first.request_id, second.request_id) == ("r1", "r2")  # the consumer went on
        carried = trace.get_current_span(delivery.context).get_span_context()
        assert carried.trace_id == span.get_span_context().trace_id

        letter = await asyncio.wait_for(letters.get(), 30)
        assert letter.reason == DeadLetterReason.UNDECODABLE
        assert letter.source_topic == topics.requests and letter.value == b"\x93not a request"
    finally:
        stop.set()
        await asyncio.gather(*tasks)
        for c in consumers:
            await c.stop()
        await publisher.stop()


async def test_the_split_stores_keep_the_key_names(stores: Stores, cluster_id: str) -> None:
    """Key names are a wire format: records an older version wrote must still be found."""
    now = time.time()
    spec = JobSpec(base_model="m")
    await stores.jobs.put_job(JobRecord("j", "t", JobKind.TRAINING, spec, now))
    await stores.jobs.set_home("j", "w")
    await stores.calls.put_future(FutureRecord("r", "t", "j", "noop", now))
    await stores.calls.claim_request("k", "r")
    await stores.calls.set_next_seq("j", 3)
    ref = await stores.payloads.put_payload(b"x")
    await stores.residency.cas_residency("j", 0, Residency("w", Tier.HOST, 1, 1, now))
    await stores.workers.put_worker("w", b"beat", ttl_s=60)
    await stores.sessions.put_session(SessionRecord("s", "t", now, now))
    ckpt = CheckpointRecord("tinker://j/weights/a", "t", "j", "weights", "b", 1, now, "m")
    await stores.checkpoints.put_checkpoint(ckpt)
    await stores.timeline.append_timeline(TimelineEntry("w", "j", "r", "noop", now, 0, 0, True))
    await stores.usage.add_usage("j", {"calls": 1.0})
    redis = stores.keys.redis
    found = {k.decode() async for k in redis.scan_iter(match=f"{cluster_id}:*", count=1000)}
    names = {k.removeprefix(f"{cluster_id}:") for k in found}
    assert names == {
        "job:j",
        "tenant:t:jobs",
        "home:j",
        "future:r",
        "idem:k",
        "seq:j",
        f"payload:{ref.key}",
        "residency:j",
        "worker:w",
        "workers",
        "session:s",
        "tenant:t:sessions",
        "ckpt:tinker://j/weights/a",
        "tenant:t:ckpts",
        "tenant:t:ckpt-bytes",
        "tenant:t:ckpt-sizes",
        "timeline",
        "usage:j",
        # What each tenant holds, counted as its records are written (quotas).
        "tenant:t:live:training",
        "tenant:t:live:session",
    }
    await redis.delete(*found)


async def test_completion_is_recorded_once_first_wins(stores: Stores) -> None:
    first = PhaseCompletion(
        request_id="r",
        job_id="j",
        tenant="t",
        worker_id="w0",
        function=Function.NOOP,
        status=CompletionStatus.OK,
        timings=Timings(),
    )
    replay = msgspec.structs.replace(first, worker_id="w1")
    assert await stores.calls.record_completion(first) == first
    assert await stores.calls.record_completion(replay) == first
    assert (await stores.calls.get_completions(["r", "missing"])) == {"r": first}


async def test_residency_moves_are_compare_and_set(stores: Stores) -> None:
    a = Residency("w0", Tier.DEVICE, 10, 1, 0.0)
    assert await stores.residency.cas_residency("j", 0, a)
    assert not await stores.residency.cas_residency("j", 0, a)  # someone already created it
    b = Residency("w0", Tier.HOST, 10, 2, 1.0)
    assert await stores.residency.cas_residency("j", 1, b)
    assert not await stores.residency.cas_residency("j", 1, Residency("w1", Tier.DISK, 10, 2, 2.0))
    assert await stores.residency.get_residency("j") == b


async def test_large_payloads_go_by_reference(stores: Stores) -> None:
    small = SampleOutput(sequences=[SampledSequence([1], [-0.1], StopReason.STOP)])
    big = SampleOutput(
        sequences=[SampledSequence(list(range(50_000)), [0.0] * 50_000, StopReason.LENGTH)]
    )
    assert await inline_or_ref(stores.payloads, small, 1024) is small
    ref = await inline_or_ref(stores.payloads, big, 1024)
    assert isinstance(ref, PayloadRef) and ref.size > 1024
    assert await resolve(stores.payloads, ref, SampleOutput) == big


async def test_timeline_keeps_calls_in_order(stores: Stores) -> None:
    for i in range(3):
        await stores.timeline.append_timeline(
            TimelineEntry("w0", "j", f"r{i}", "noop", float(i), 0.0, 0.1, True)
        )
    assert [e.request_id for e in await stores.timeline.timeline()] == ["r0", "r1", "r2"]


async def test_state_store_blobs_and_checkpoints(stores: Stores, tmp_path: Path) -> None:
    app = build_app(BlobDir(tmp_path), stores.checkpoints, stores.residency)
    transport = httpx.ASGITransport(app=app)
    # Checkpoint blobs are served acting for their tenant (tests/test_isolation.py).
    t = {"x-plexrl-tenant": "t"}
    async with httpx.AsyncClient(transport=transport, base_url="http://store") as http:
        stored = await http.put("/v1/blobs/ckpt/t/a.bin", content=b"abc", headers=t)
        assert stored.json()["size_bytes"] == 3
        assert (await http.get("/v1/blobs/ckpt/t/a.bin", headers=t)).content == b"abc"
        assert (await http.get("/v1/blobs/nope")).status_code == 404
        bad = await http.put("/v1/blobs/../../etc/passwd", content=b"x")
        assert bad.status_code in (400, 404)
        record = CheckpointRecord(
            path="tinker://j/weights/a",
            tenant="t",
            job_id="j",
            kind="weights",
            blob_key="ckpt/t/a.bin",
            size_bytes=3,
            created_at=0.0,
            base_model="m",
        )
        missing_blob = msgspec.structs.replace(record, blob_key="ckpt/t/none")
        assert (
            await http.post("/v1/checkpoints", content=msgspec.json.encode(missing_blob), headers=t)
        ).status_code == 400
        assert (
            await http.post("/v1/checkpoints", content=msgspec.json.encode(record), headers=t)
        ).status_code == 200
        listed = (await http.get("/v1/checkpoints", headers={"x-plexrl-tenant": "t"})).json()
        assert [c["path"] for c in listed] == ["tinker://j/weights/a"]
        other = await http.delete(
            "/v1/checkpoints", params={"path": record.path}, headers={"x-plexrl-tenant": "u"}
        )
        assert other.status_code == 404  # another tenant cannot see it
        gone = await http.delete(
            "/v1/checkpoints", params={"path": record.path}, headers={"x-plexrl-tenant": "t"}
        )
        assert gone.json()["deleted"] and not (tmp_path / "ckpt/t/a.bin").exists()
