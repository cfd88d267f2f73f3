"""One trace per API call: gateway → Kafka → scheduler → worker → state-store → gateway.

The four services run in this process (their `serve` coroutines), over the real
Kafka and Redis, so one in-memory exporter sees every span they make.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from tinker.proto import request_conv

from plexrl import tracing
from plexrl.kafka import Publisher
from plexrl.messages import Dispatch, StateMove, Tier
from plexrl.settings import GatewaySettings, SchedulerSettings, StateStoreSettings, WorkerSettings
from plexrl.stores import Stores
from plexrl.topics import Topics
from plexrl_gateway.main import serve as serve_gateway
from plexrl_scheduler.main import serve as serve_scheduler
from plexrl_state_store.main import serve as serve_state_store
from plexrl_worker.main import serve as serve_worker
from tests.conftest import free_port

pytestmark = pytest.mark.integration

KEY = {"X-API-Key": "tml-trace"}
EXPORTER = InMemorySpanExporter()


async def wait_until(url: str, ok: object = None, timeout_s: float = 60.0) -> dict[str, object]:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=2) as http:
        while True:
            try:
                response = await http.get(url)
                body: dict[str, object] = response.json()
                if response.status_code == 200 and (ok is None or ok(body)):  # type: ignore[operator]
                    return body
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(url)
            await asyncio.sleep(0.1)


@dataclass
class Services:
    gateway: httpx.AsyncClient
    settings: WorkerSettings


@contextlib.asynccontextmanager
async def four_services(
    infra: dict[str, str], cluster_id: str, registry: Path, blobs: Path
) -> AsyncIterator[Services]:
    tracing.setup_tracing("plexrl-test", EXPORTER)
    common: dict[str, Any] = {
        "kafka_bootstrap": infra["kafka"],
        "redis_url": infra["redis"],
        "cluster_id": cluster_id,
    }
    store_port, sched_port, worker_port, gw_port = (free_port() for _ in range(4))
    store_url = f"http://127.0.0.1:{store_port}"
    sched_url = f"http://127.0.0.1:{sched_port}"
    worker = WorkerSettings(
        **common,
        worker_port=worker_port,
        state_store_url=store_url,
        model_registry=registry,
        worker_threads=1,
    )
    stop = asyncio.Event()
    services = [
        serve_state_store(
            StateStoreSettings(**common, state_store_port=store_port, state_store_dir=blobs),
            stop,
        ),
        serve_scheduler(SchedulerSettings(**common, scheduler_port=sched_port), stop),
        serve_worker(worker, stop),
        serve_gateway(
            GatewaySettings(
                **common,
                gateway_port=gw_port,
                api_keys="tml-trace=t",
                model_registry=registry,
                scheduler_url=sched_url,
                state_store_url=store_url,
            ),
            stop,
        ),
    ]
    tasks = [asyncio.create_task(s) for s in services]
    try:
        await wait_until(f"http://127.0.0.1:{gw_port}/healthz")
        await wait_until(f"{sched_url}/healthz", lambda b: b.get("workers"))
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gw_port}", timeout=30) as http:
            yield Services(http, worker)
        await asyncio.sleep(0.5)  # let the last spans end
    finally:
        stop.set()
        await asyncio.gather(*tasks)


async def test_echo_is_one_trace_through_every_service(
    infra: dict[str, str], cluster_id: str, tiny_registry: Path, tmp_path: Path
) -> None:
    async with four_services(infra, cluster_id, tiny_registry, tmp_path / "blobs") as cluster:
        EXPORTER.clear()
        response = await cluster.gateway.post("/plexrl/v1/echo", headers=KEY)
        assert response.status_code == 200, response.text
        request_id = response.json()["request_id"]

    spans = EXPORTER.get_finished_spans()
    tagged = [s for s in spans if (s.attributes or {}).get("plexrl.request_id") == request_id]
    trace_ids = {s.context.trace_id for s in tagged if s.context is not None}
    assert len(trace_ids) == 1, [(s.name, s.context) for s in tagged]
    (trace_id,) = trace_ids
    names = {s.name for s in spans if s.context is not None and s.context.trace_id == trace_id}
    assert "POST /plexrl/v1/echo" in names, names
    assert "scheduler.dispatch" in names, names
    assert "worker.noop" in names, names
    assert "gateway.completion" in names, names  # and back


class Tree:
    """The finished spans of one trace, navigable by parent."""

    def __init__(self, spans: list[ReadableSpan], trace_id: int) -> None:
        self.spans = [s for s in spans if s.context is not None and s.context.trace_id == trace_id]
        self._by_id = {s.context.span_id: s for s in self.spans if s.context is not None}

    def parent(self, span: ReadableSpan) -> ReadableSpan | None:
        return self._by_id.get(span.parent.span_id) if span.parent is not None else None

    def one(self, test: Callable[[ReadableSpan], bool], what: str) -> ReadableSpan:
        found = [s for s in self.spans if test(s)]
        assert len(found) == 1, (what, [s.name for s in found], self.render())
        return found[0]

    def below(self, span: ReadableSpan, ancestor: ReadableSpan) -> bool:
        node: ReadableSpan | None = self.parent(span)
        while node is not None:
            if node is ancestor:
                return True
            node = self.parent(node)
        return False

    def render(self) -> str:
        def depth(s: ReadableSpan) -> int:
            parent = self.parent(s)
            return 0 if parent is None else 1 + depth(parent)

        ordered = sorted(self.spans, key=lambda s: s.start_time or 0)
        return "\n".join("  " * depth(s) + f"{s.name} [{s.kind.name}]" for s in ordered)


async def finished(http: httpx.AsyncClient, request_id: str) -> dict[str, Any]:
    for _ in range(60):
        response = await http.post(
            "/api/v1/retrieve_future", json={"request_id": request_id}, headers=KEY
        )
        if response.status_code == 200:
            # A call sent as protobuf is answered as protobuf: look for the bytes then.
            if "json" not in response.headers.get("content-type", ""):
                return {"content": response.content}
            body: dict[str, Any] = response.json()
            assert body.get("type") != "RequestFailedResponse", body
            return body
        assert response.status_code == 408, response.text
    raise TimeoutError(request_id)


async def test_forward_backward_is_one_tree_down_to_the_state_store(
    infra: dict[str, str], cluster_id: str, tiny_registry: Path, tmp_path: Path
) -> None:
    async with four_services(infra, cluster_id, tiny_registry, tmp_path / "blobs") as cluster:
        http = cluster.gateway
        session = (
            await http.post(
                "/api/v1/create_session",
                json={"tags": [], "user_metadata": {}, "sdk_version": "0.38.0"},
                headers=KEY,
            )
        ).json()["session_id"]
        created = await http.post(
            "/api/v1/create_model",
            json={
                "session_id": session,
                "model_seq_id": 0,
                "base_model": "plexrl/tiny-qwen3",
                "lora_config": {"rank": 4},
                "type": "create_model",
            },
            headers=KEY,
        )
        assert created.status_code == 200, created.text
        model_id = created.json()["model_id"]
        await finished(http, created.json()["request_id"])

        # Park the job's state on the disk tier, as an eviction under memory pressure
        # would, so that its next call onloads it through the state-store.
        await park_on_disk(infra, cluster_id, cluster.settings.worker_id, model_id)

        EXPORTER.clear()
        body = request_conv.forward_backward_request_to_proto(
            tinker.types.ForwardBackwardRequest(
                forward_backward_input=tinker.types.ForwardBackwardInput(
                    data=[datum([5, 6, 7, 8, 9])],
                    loss_fn="cross_entropy",
                ),
                model_id=model_id,
                seq_id=1,
            )
        ).SerializeToString()
        response = await http.post(
            "/api/v1/forward_backward",
            content=body,
            headers={**KEY, "content-type": "application/x-protobuf"},
        )
        assert response.status_code == 200, response.text
        request_id = response.json()["request_id"]
        result = await finished(http, request_id)
        assert b"loss:sum" in result["content"], result

    spans = list(EXPORTER.get_finished_spans())
    assert not [s for s in spans if "healthz" in s.name or "/metrics" in s.name]
    root = next(s for s in spans if s.name == "POST /api/v1/forward_backward")
    assert root.context is not None and root.parent is None and root.kind == SpanKind.SERVER
    tree = Tree(spans, root.context.trace_id)
    print(tree.render())
    # One server span per request: the FastAPI instrumentation's, no second one.
    tree.one(lambda s: s.name.endswith("/api/v1/forward_backward"), "server span")

    publish = tree.one(lambda s: s.name == "gateway.publish", "gateway publish")
    assert tree.parent(publish) is root
    produce = tree.one(lambda s: s.name == f"{cluster_id}.requests send", "Kafka produce")
    assert produce.kind == SpanKind.PRODUCER and tree.parent(produce) is publish
    dispatch = tree.one(lambda s: s.name == "scheduler.dispatch", "scheduler")
    assert tree.below(dispatch, produce)
    # The dispatch message's own send is under the call's dispatch span. No consumer
    # makes a `receive` span: each handler's span (the scheduler's dispatch, the worker's
    # call, the gateway's completion) marks the receipt.
    worker_topic = f"{cluster_id}.dispatch.{cluster.settings.worker_id}"
    sent = tree.one(lambda s: s.name == f"{worker_topic} send", "the dispatch's send")
    assert tree.parent(sent) is dispatch
    assert not [s for s in tree.spans if s.name.endswith(" receive")], tree.render()
    work = tree.one(lambda s: s.name == "worker.forward_backward", "worker")
    assert tree.parent(work) is dispatch
    fetch = tree.one(
        lambda s: s.kind == SpanKind.CLIENT and "/v1/blobs/" in str(s.attributes), "blob GET"
    )
    assert tree.below(fetch, work), tree.render()
    served = tree.one(lambda s: s.name == "GET /v1/blobs/{key:path}", "state-store server")
    assert tree.parent(served) is fetch  # the state-store continued the worker's trace
    assert any(s.name == "gateway.completion" for s in tree.spans), tree.render()

    # The poll that returned the result is a trace of its own, linked to the call.
    polls = [
        s
        for s in spans
        if s.name == "POST /api/v1/retrieve_future"
        and any(link.context.span_id == root.context.span_id for link in s.links)
    ]
    assert polls, [s.name for s in spans]
    assert all(p.context is not None and p.context.trace_id != root.context.trace_id for p in polls)


def datum(tokens: list[int]) -> tinker.Datum:
    return tinker.Datum(
        model_input=tinker.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tinker.TensorData(data=tokens[1:], dtype="int64"),
            "weights": tinker.TensorData(data=[1.0] * (len(tokens) - 1), dtype="float32"),
        },
    )


async def park_on_disk(infra: dict[str, str], cluster_id: str, worker_id: str, job_id: str) -> None:
    """Send the worker a dispatch that only evicts `job_id` to disk; wait until it is there."""
    topics = Topics(cluster_id)
    publisher = Publisher(infra["kafka"], "test-evict")
    await publisher.start()
    stores = Stores.from_url(infra["redis"], cluster_id, 60)
    try:
        evict = Dispatch(
            dispatch_id=uuid.uuid4().hex,
            worker_id=worker_id,
            calls=[],
            evict=[StateMove(job_id, Tier.DISK)],
            issued_at=time.time(),
        )
        await publisher.publish(topics.dispatch(worker_id), job_id, evict)
        deadline = time.monotonic() + 30
        while (residency := await stores.residency.get_residency(job_id)) is None or (
            residency.tier != Tier.DISK
        ):
            assert time.monotonic() < deadline, f"{job_id} never reached the disk tier"
            await asyncio.sleep(0.1)
    finally:
        await publisher.stop()
        await stores.close()


def test_server_spans_are_named_by_their_route_templates() -> None:
    from fastapi import APIRouter, FastAPI
    from fastapi.testclient import TestClient
    from opentelemetry.trace import StatusCode

    exporter = InMemorySpanExporter()
    tracing.setup_tracing("test", exporter)
    app = FastAPI(telemetry=tracing.NATIVE_TELEMETRY_OFF)
    inner = APIRouter(prefix="/inner")  # included, as the services' routes are

    @app.get("/things/{thing_id}")
    async def thing(thing_id: str) -> dict[str, str]:
        return {"id": thing_id}

    @app.post("/echo")
    async def echo() -> dict[str, str]:
        return {}

    @inner.get("/fails")
    async def fails() -> dict[str, str]:
        raise RuntimeError("broken")

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {}

    app.include_router(inner)
    tracing.instrument_app(app)
    caller = "00-0000000000000000000000000000abcd-00000000000000ef-01"
    with TestClient(app, raise_server_exceptions=False) as client:
        for method, path in [
            ("GET", "/things/a"),
            ("GET", "/things/b"),
            ("POST", "/echo"),
            ("GET", "/echo"),  # 405: the route matches partially
            ("GET", "/nowhere"),
            ("GET", "/inner/fails"),
            ("GET", "/healthz"),  # never traced
        ]:
            client.request(method, path, headers={"traceparent": caller})
    server = [s for s in exporter.get_finished_spans() if s.kind == SpanKind.SERVER]
    assert [s.name for s in server] == [
        "GET /things/{thing_id}",
        "GET /things/{thing_id}",
        "POST /echo",
        "GET /echo",
        "GET",
        "GET /inner/fails",
    ]
    attributes = [dict(s.attributes or {}) for s in server]
    assert [a.get("http.route") for a in attributes] == [
        "/things/{thing_id}",
        "/things/{thing_id}",
        "/echo",
        "/echo",
        None,
        "/inner/fails",
    ]
    assert [a["http.status_code"] for a in attributes] == [200, 200, 200, 405, 404, 500]
    assert attributes[0]["http.target"] == "/things/a" and attributes[0]["http.method"] == "GET"
    # Each continues the caller's trace; the failure is an error with its exception.
    assert all(s.context is not None and s.context.trace_id == 0xABCD for s in server)
    assert all(s.parent is not None and s.parent.span_id == 0xEF for s in server)
    assert server[-1].status.status_code == StatusCode.ERROR
    assert server[-1].status.description == "RuntimeError: broken"
    assert any(e.name == "exception" for e in server[-1].events)


def test_a_kafka_record_carries_a_send_span_only_inside_a_sampled_trace() -> None:
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, use_span

    exporter = InMemorySpanExporter()
    tracing.setup_tracing("test", exporter)
    tracer = tracing.tracer("test")

    def carried(headers: tracing.Headers) -> Any:
        assert [k for k, _ in headers] == ["traceparent"]
        context = tracing.context_of_headers(headers)
        from opentelemetry import trace

        return trace.get_current_span(context).get_span_context()

    exporter.clear()
    with tracer.start_as_current_span("work") as work:
        inside = carried(tracing.record_headers("jobs.requests"))
    sent, parent = exporter.get_finished_spans()
    # Inside a sampled span: a PRODUCER span under it, ended at once, whose context the
    # record carries.
    assert sent.name == "jobs.requests send" and sent.kind == SpanKind.PRODUCER
    assert sent.parent is not None and sent.parent.span_id == work.get_span_context().span_id
    assert dict(sent.attributes or {})["messaging.destination.name"] == "jobs.requests"
    assert sent.context is not None and inside.span_id == sent.context.span_id
    assert inside.trace_id == parent.context.trace_id and inside.trace_flags.sampled
    # A trace not sampled: no span, the context travels as it is.
    exporter.clear()
    quiet = SpanContext(0xABC, 0xDEF, False, TraceFlags(TraceFlags.DEFAULT))
    with use_span(NonRecordingSpan(quiet)):
        carried_quiet = carried(tracing.record_headers("jobs.requests"))
    assert (carried_quiet.trace_id, carried_quiet.span_id) == (0xABC, 0xDEF)
    assert not carried_quiet.trace_flags.sampled
    # Outside any span (a heartbeat): a fresh trace each time, not sampled, so what the
    # consumers do with it records nothing either.
    bare = [carried(tracing.record_headers("jobs.events")) for _ in range(2)]
    assert all(c.is_valid and not c.trace_flags.sampled for c in bare)
    assert bare[0].trace_id != bare[1].trace_id
    assert exporter.get_finished_spans() == ()


def test_an_unrecorded_span_is_made_from_the_header_as_the_tracer_would_make_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from opentelemetry import trace
    from opentelemetry.trace import use_span

    tracing.setup_tracing("test")
    monkeypatch.setattr(tracing, "_exporters", [])  # nowhere to send spans
    tracer = tracing.tracer("test")
    parent = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    headers = [("traceparent", parent)]
    fast = tracing.unrecorded_child(headers)
    slow = tracer.start_span("s", context=tracing.context_of_headers(headers))
    assert fast is not None and not fast.is_recording() and not slow.is_recording()
    made, expected = fast.get_span_context(), slow.get_span_context()
    assert (made.trace_id, made.trace_flags, made.trace_state, made.is_remote) == (
        expected.trace_id,
        expected.trace_flags,
        expected.trace_state,
        expected.is_remote,
    )
    assert made.span_id not in (0, 0xB7AD6B7169203331, expected.span_id)
    # A record sent inside it carries what the propagator would have written.
    with use_span(fast):
        assert tracing.unrecorded_headers(fast) == tracing.record_headers("t.dispatch.w0")
    assert tracing.span_traceparent(fast).endswith("-00")
    # Anything but one plain version-00 traceparent goes the tracer's way.
    for odd in (
        [],
        [("traceparent", parent), ("tracestate", b"k=v")],
        [("traceparent", b"01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")],
        [("traceparent", b"00-00000000000000000000000000000000-b7ad6b7169203331-01")],
        [("traceparent", b"00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01")],
        [("traceparent", b"00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01")],
        [("Traceparent", parent)],
    ):
        assert tracing.unrecorded_child(odd) is None, odd
    # A sampled span's record gets its producer span: no shortcut there.
    sampled = trace.NonRecordingSpan(
        trace.SpanContext(1, 2, False, trace.TraceFlags(trace.TraceFlags.SAMPLED))
    )
    assert tracing.unrecorded_headers(sampled) is None
    # Baggage in the context travels in its own header: the propagator writes it.
    from opentelemetry import baggage
    from opentelemetry import context as otel_context

    token = otel_context.attach(baggage.set_baggage("k", "v"))
    try:
        assert tracing.unrecorded_headers(fast) is None
    finally:
        otel_context.detach(token)
    # A process told to propagate another format (OTEL_PROPAGATORS) goes its way.
    from opentelemetry import propagate

    class B3Like:
        fields = frozenset({"b3"})

    monkeypatch.setattr(propagate, "get_global_textmap", lambda: B3Like())
    assert tracing.unrecorded_child(headers) is None
    assert tracing.unrecorded_headers(fast) is None
    monkeypatch.undo()
    # Where spans are exported, every span is started by the tracer.
    monkeypatch.setattr(tracing, "_exporters", [InMemorySpanExporter()])
    assert tracing.unrecorded_child(headers) is None


def test_a_trace_is_recorded_only_where_spans_go_and_for_the_ratio_of_trace_ids() -> None:
    from opentelemetry.sdk.trace.sampling import Decision, ParentBased
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, set_span_in_context

    def decision(sampler: Any, trace_id: int, kind: SpanKind = SpanKind.SERVER, parent=None):
        return sampler.should_sample(parent, trace_id, "POST /api/v1/echo", kind).decision

    def remote(sampled: bool) -> Any:
        flags = TraceFlags(TraceFlags.SAMPLED if sampled else 0)
        return set_span_in_context(NonRecordingSpan(SpanContext(5, 6, True, flags)))

    exporting = [False]
    every = tracing._WhileExporting(
        ParentBased(root=tracing._WorkStartsTraces(1.0)), lambda: exporting[0]
    )
    # Nowhere to send spans: nothing is recorded, even under a sampled parent (the ids
    # and headers still travel).
    assert decision(every, 1 << 63) == Decision.DROP
    assert decision(every, 5, SpanKind.CONSUMER, remote(True)) == Decision.DROP
    exporting[0] = True
    assert decision(every, 1 << 63) == Decision.RECORD_AND_SAMPLE
    assert decision(every, 1 << 63, SpanKind.PRODUCER) == Decision.DROP  # bare plumbing
    assert decision(every, 5, SpanKind.CONSUMER, remote(True)) == Decision.RECORD_AND_SAMPLE
    assert decision(every, 5, SpanKind.CONSUMER, remote(False)) == Decision.DROP
    # A ratio keeps the traces whose low 64 bits fall under it, in every service alike.
    half = tracing._WorkStartsTraces(0.5)
    high = (0xABC << 64) | (3 << 62)
    assert decision(half, 1) == Decision.RECORD_AND_SAMPLE
    assert decision(half, high) == Decision.DROP
    assert decision(tracing._WorkStartsTraces(0.0), 0) == Decision.DROP
    draws = random.Random(7)
    ids = [draws.getrandbits(128) for _ in range(2000)]  # as the SDK draws trace ids
    kept = sum(decision(half, i) == Decision.RECORD_AND_SAMPLE for i in ids)
    assert 850 < kept < 1150


def test_the_trace_ratio_is_a_share_every_service_reads() -> None:
    import pydantic

    from plexrl.settings import GatewaySettings, StateStoreSettings

    assert GatewaySettings().trace_ratio == 1.0
    assert StateStoreSettings(trace_ratio=0.01).trace_ratio == 0.01
    bad: Any
    for bad in (2, -0.1, "ten percent"):
        with pytest.raises(pydantic.ValidationError, match="trace_ratio"):
            GatewaySettings(trace_ratio=bad)
