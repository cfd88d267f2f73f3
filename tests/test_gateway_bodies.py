"""Hostile request bodies: every JSON route answers a 4xx that says what was wrong, never
a 5xx, and the connection it came on keeps serving.

The gateway is the real one over real Redis (Kafka faked: tests/gateway_harness.py);
the keep-alive test serves it on a real port through plexrl.health.HttpServer.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import socket
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from gateway_harness import ALICE, Gw, gateway
from gateway_support import FakePublisher, drop_cluster_keys, free_port, unique_cluster

from plexrl.health import HttpServer
from plexrl.limits import CallLimits
from plexrl.settings import GatewaySettings
from plexrl.stores import Stores
from plexrl_gateway.app import build_app
from plexrl_gateway.body_limit import INLINE_DECODE_BYTES, BodiesBusyError, BodyBudget, BodyParser
from plexrl_gateway.codec import CodecError
from plexrl_gateway.codec_json import forward_backward_from_json
from plexrl_gateway.components import Gateway

JSON = {"content-type": "application/json"}

# Every route that reads a JSON body.
JSON_ROUTES = [
    "forward_backward",
    "forward",
    "create_session",
    "session_heartbeat",
    "client/config",
    "create_model",
    "get_info",
    "optim_step",
    "save_weights",
    "save_weights_for_sampler",
    "load_weights",
    "unload_model",
    "create_sampling_session",
    "asample",
    "retrieve_future",
    "weights_info",
]

NOT_AN_OBJECT = {
    "an array": b"[]",
    "null": b"null",
    "a string": b'"forward_backward"',
    "a number": b"7",
    "true": b"true",
}
NOT_JSON = {
    "deep nesting": b"[" * 100_000 + b"]" * 100_000,
    "deep nesting in an object": b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
    "truncated": b'{"model_id": "m", "seq_id": ',
    "form data": b"model_id=m&seq_id=1",
    "NaN": b'{"model_id": NaN}',
    "trailing garbage": b'{"model_id": "m"} {}',
    "not UTF-8": b'{"model_id": "\xff"}',
    "a lone surrogate": b'{"model_id": "\\ud800"}',
}


@pytest_asyncio.fixture
async def gw(infra: dict[str, str], tiny_registry: Path) -> AsyncIterator[Gw]:
    async with gateway(infra, tiny_registry) as g:
        yield g


async def post_raw(gw: Gw, path: str, body: bytes) -> Any:
    response = await gw.http.post(f"/api/v1/{path}", content=body, headers={**ALICE, **JSON})
    assert 400 <= response.status_code < 500, (path, response.status_code, response.text[:300])
    error = response.json()["error"]
    assert isinstance(error, str) and error
    return response.status_code, error


async def test_a_body_that_is_not_an_object_is_a_4xx_on_every_json_route(gw: Gw) -> None:
    # client/config takes an optional body it does not read: any JSON value is a 200.
    for path in (p for p in JSON_ROUTES if p != "client/config"):
        for kind, body in NOT_AN_OBJECT.items():
            status, error = await post_raw(gw, path, body)
            assert status in (400, 422), (path, kind, error)


async def test_a_body_that_is_not_json_or_nests_too_deep_is_a_400_saying_so(gw: Gw) -> None:
    for path in JSON_ROUTES:
        for kind, body in NOT_JSON.items():
            status, error = await post_raw(gw, path, body)
            assert status == 400, (path, kind, error)
            if kind.startswith("deep"):
                assert "nests JSON arrays and objects too deeply" in error
            elif kind == "not UTF-8":
                assert "not UTF-8" in error
            else:
                assert "not JSON" in error, (path, kind, error)


OUT_OF_RANGE = 12345.678
"""Stands in for 1e400 (which json.dumps cannot write) in a body's bytes."""


def fb_body(model_id: str, datum: dict[str, Any], **input_fields: Any) -> dict[str, Any]:
    inp = {"data": [datum], "loss_fn": "cross_entropy", **input_fields}
    return {"model_id": model_id, "seq_id": 1, "forward_backward_input": inp}


def datum(tokens: list[Any], **loss_fn_inputs: Any) -> dict[str, Any]:
    inputs = {
        "target_tokens": {"data": [2] * len(tokens), "dtype": "int64"},
        "weights": {"data": [1.0] * len(tokens), "dtype": "float32"},
        **loss_fn_inputs,
    }
    return {"model_input": {"chunks": [{"tokens": tokens}]}, "loss_fn_inputs": inputs}


async def test_bad_values_in_a_json_forward_backward_are_400s_that_say_what_is_allowed(
    gw: Gw,
) -> None:
    model = await gw.model()
    ok = datum([1, 2, 3])
    cases: dict[str, tuple[dict[str, Any], str]] = {
        "a null token": (fb_body(model, datum([1, None])), "tokens takes token ids"),
        "a 2^40 token": (fb_body(model, datum([1, 2**40])), "<= 2147483647"),
        "a negative token": (fb_body(model, datum([-1])), ">= 0"),
        "a string token": (fb_body(model, datum(["1"])), "Expected `int`, got `str`"),
        "an array loss_fn_config": (
            fb_body(model, ok, loss_fn_config=[]),
            "loss_fn_config takes an object",
        ),
        "a string loss_fn_config": (
            fb_body(model, ok, loss_fn_config="x"),
            "loss_fn_config takes an object",
        ),
        "a nested loss_fn_config": (
            fb_body(model, ok, loss_fn_config={"clip": {"low": 1}}),
            "loss_fn_config",
        ),
        "a 2^70 target": (
            fb_body(model, datum([1], target_tokens={"data": [2**70], "dtype": "int64"})),
            "<= 9223372036854775807",
        ),
        "a 2^40 target": (
            fb_body(model, datum([1], target_tokens={"data": [2**40], "dtype": "int64"})),
            "vocab",
        ),
        "a float target": (
            fb_body(model, datum([1], target_tokens={"data": [1.5], "dtype": "int64"})),
            "holds a non-integer",
        ),
        "a weight past float range": (
            fb_body(model, datum([1], weights={"data": [OUT_OF_RANGE], "dtype": "float32"})),
            "out of range",
        ),
        "a weight past float32": (
            fb_body(model, datum([1], weights={"data": [1e39], "dtype": "float32"})),
            "NaN or infinity",
        ),
        "an unknown dtype": (
            fb_body(model, datum([1], weights={"data": [1.0], "dtype": "int8"})),
            "dtype takes",
        ),
        "a string shape": (
            fb_body(model, datum([1], weights={"data": [1.0], "dtype": "float32", "shape": "1"})),
            "shape takes a list of sizes",
        ),
        "a huge shape": (
            fb_body(
                model,
                datum([1], weights={"data": [1.0], "dtype": "float32", "shape": [2**40, 2**40]}),
            ),
            "shape",
        ),
        "tensor data that is not a list": (
            fb_body(model, datum([1], weights={"data": {"a": 1}, "dtype": "float32"})),
            "data takes",
        ),
        "a model_input list": (
            fb_body(model, {"model_input": [1, 2], "loss_fn_inputs": {}}),
            "model_input needs chunks",
        ),
        "an image chunk": (
            fb_body(model, {"model_input": {"chunks": [{"type": "image", "data": "AA=="}]}}),
            "image chunk, which is not supported",
        ),
        "data that is an object": (
            {
                "model_id": model,
                "seq_id": 1,
                "forward_backward_input": {"data": {}, "loss_fn": "x"},
            },
            "data takes a list of datums",
        ),
        "a number model_id": ({**fb_body(model, ok), "model_id": 5}, "model_id takes a string"),
        "a string seq_id": ({**fb_body(model, ok), "seq_id": "1"}, "seq_id takes an integer"),
        "a 2^70 seq_id": ({**fb_body(model, ok), "seq_id": 2**70}, "seq_id"),
        "a null input": ({"model_id": model, "forward_backward_input": None}, "Expected `object`"),
        "no input": ({"model_id": model, "seq_id": 1}, "forward_backward_input"),
        "a loss_fn that is a number": (fb_body(model, ok, loss_fn=3), "loss_fn takes"),
    }
    for kind, (body, says) in cases.items():
        raw = json.dumps(body).encode().replace(str(OUT_OF_RANGE).encode(), b"1e400")
        status, error = await post_raw(gw, "forward_backward", raw)
        assert status == 400, (kind, error)
        assert says in error, (kind, error)
    forward = {"model_id": model, "seq_id": 1, "forward_input": {"data": [ok], "loss_fn": 3}}
    status, error = await post_raw(gw, "forward", json.dumps(forward).encode())
    assert "forward_input.loss_fn" in error and "loss_fn takes" in error
    status, error = await post_raw(gw, "forward", json.dumps(fb_body(model, ok)).encode())
    assert "forward_input" in error
    # Nothing but the model's create went out.
    assert [str(r.function) for r in gw.publisher.requests()] == ["create"]


async def test_a_good_json_forward_backward_and_forward_still_run(gw: Gw) -> None:
    model = await gw.model()
    body = fb_body(model, datum([1, 2, 3]), loss_fn_config=None)
    fb = await gw.http.post("/api/v1/forward_backward", json=body, headers=ALICE)
    assert fb.status_code == 200, fb.text
    forward = {"model_id": model, "seq_id": 2, "forward_input": body["forward_backward_input"]}
    fwd = await gw.http.post("/api/v1/forward", json=forward, headers=ALICE)
    assert fwd.status_code == 200, fwd.text
    functions = [str(r.function) for r in gw.publisher.requests()]
    assert functions[-2:] == ["forward_backward", "forward"]


async def test_bad_values_on_the_other_json_routes_are_4xx(gw: Gw) -> None:
    session = await gw.session()
    model = await gw.model()
    cases = {
        "create_model": {"session_id": session, "model_seq_id": 2**70, "base_model": "x"},
        "optim_step": {"model_id": model, "seq_id": 2**70, "adam_params": {}},
        "save_weights": {"model_id": model, "seq_id": [1], "path": {"a": 1}},
        "create_sampling_session": {"session_id": 5, "sampling_session_seq_id": None},
        "asample": {
            "sampling_session_id": "x",
            "prompt": {"chunks": [{"tokens": [2**70, None]}]},
            "sampling_params": [],
        },
        "retrieve_future": {"request_id": ["a"]},
        "weights_info": {"tinker_path": None},
        "create_session": {"tags": "a", "user_metadata": [1]},
        "load_weights": {"model_id": model, "seq_id": 2**70, "path": 1},
    }
    for path, body in cases.items():
        await post_raw(gw, path, json.dumps(body).encode())


async def test_a_body_over_the_json_caps_is_refused_before_it_is_decoded(
    infra: dict[str, str], tiny_registry: Path
) -> None:
    limits = CallLimits(max_json_items=1000, max_json_containers=100)
    async with gateway(infra, tiny_registry, limits) as small:
        many = json.dumps({"tags": ["t"] * 2000}).encode()
        status, error = await post_raw(small, "create_session", many)
        assert status == 400 and "more than the 1000 one request may" in error
        nested = json.dumps({"tags": [[]] * 200}).encode()
        status, error = await post_raw(small, "create_session", nested)
        assert status == 400 and "more than the 100 one request may" in error
        # The same cap through the forward_backward decoder.
        with pytest.raises(CodecError, match="JSON values"):
            forward_backward_from_json(
                json.dumps(fb_body("m", datum([1] * 600))).encode(), False, limits
            )


async def test_decoding_slots_bound_bodies_at_once_and_the_rest_get_a_503() -> None:
    parser = BodyParser(CallLimits(max_parsing_bodies=1, parse_wait_s=1, retry_after_s=3))
    release = threading.Event()
    big = b"x" * (INLINE_DECODE_BYTES + 1)  # decoded in a thread

    def blocked(body: bytes) -> int:
        release.wait(10)
        return len(body)

    holding = asyncio.create_task(parser.parse(big, blocked))
    await asyncio.sleep(0.1)
    with pytest.raises(Exception) as busy:
        await parser.parse(b"{}", len)
    assert getattr(busy.value, "status_code", None) == 503
    assert getattr(busy.value, "headers", None) == {"Retry-After": "3"}
    release.set()
    assert await holding == len(big)

    def refused(body: bytes) -> int:
        raise CodecError("bad body")

    with pytest.raises(Exception) as bad:
        await parser.parse(b"{}", refused)
    assert getattr(bad.value, "status_code", None) == 400
    assert await parser.parse(b"{}", len) == 2  # the slot came back after the error


def keep_alive_exchange(port: int, model_id: str) -> list[tuple[int, str, int]]:
    """Hostile bodies then a good call, all on one HTTP/1.1 connection: (status, error,
    socket id) per request; a server that dropped the connection breaks the socket id."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    headers = {"X-API-Key": "tml-alice", "content-type": "application/json"}
    sent = [
        ("/api/v1/forward_backward", b"[]"),
        ("/api/v1/forward_backward", json.dumps(fb_body(model_id, datum([None]))).encode()),
        ("/api/v1/forward", b"[" * 10_000 + b"]" * 10_000),
        ("/api/v1/create_session", b"null"),
        ("/api/v1/create_session", b"{}"),
    ]
    seen = []
    try:
        for path, body in sent:
            conn.request("POST", path, body=body, headers=headers)
            response = conn.getresponse()
            text = response.read().decode()
            seen.append((response.status, text, id(conn.sock)))
    finally:
        conn.close()
    return seen


@contextlib.asynccontextmanager
async def served_gateway(
    infra: dict[str, str], models: Path, limits: CallLimits | None = None
) -> AsyncIterator[int]:
    """The gateway on a real port, through the HttpServer every service runs."""
    settings = GatewaySettings(
        cluster_id=unique_cluster("gwbody"),
        kafka_bootstrap=infra["kafka"],
        redis_url=infra["redis"],
        api_keys="tml-alice=alice",
        model_registry=models,
    )
    stores = Stores.from_url(settings.redis_url, settings.cluster_id, 600)
    gateway_ = Gateway.build(settings, stores, FakePublisher(), limits or CallLimits())
    port = free_port()
    server = HttpServer(build_app(gateway_), "127.0.0.1", port)
    await server.start()
    try:
        yield port
    finally:
        await server.stop()
        await gateway_.close()
        await drop_cluster_keys(stores, settings.cluster_id)
        await stores.close()


async def test_the_connection_keeps_serving_after_a_4xx(
    infra: dict[str, str], tiny_registry: Path
) -> None:
    async with served_gateway(infra, tiny_registry) as port:
        seen = await asyncio.to_thread(keep_alive_exchange, port, "s:train:0")
    assert [status for status, _, _ in seen] == [400, 400, 400, 422, 200], seen
    assert len({sock for _, _, sock in seen}) == 1  # one connection throughout
    assert "send a JSON object" in seen[0][1]


async def test_body_bytes_held_at_once_are_bounded_and_given_back() -> None:
    limits = CallLimits(max_body_bytes=100, max_held_body_bytes=100, parse_wait_s=1)
    budget = BodyBudget(limits)
    await budget.take(60)
    waiting = asyncio.create_task(budget.take(60))
    await asyncio.sleep(0.1)
    assert not waiting.done()  # waits for room
    await budget.give_back(60)
    await waiting
    assert budget.held == 60
    with pytest.raises(BodiesBusyError) as busy:
        await budget.take(41)  # no room comes within parse_wait_s
    assert busy.value.status_code == 503 and busy.value.headers == {"Retry-After": "2"}
    await budget.give_back(60)
    assert budget.held == 0


def held_then_refused(port: int, size: int) -> tuple[int, dict[str, str], str]:
    """One client sends most of a body and holds it; another's body finds no room."""
    holder = socket.create_connection(("127.0.0.1", port))
    head = (
        f"POST /api/v1/create_session HTTP/1.1\r\nHost: gw\r\nX-API-Key: tml-alice\r\n"
        f"Content-Type: application/json\r\nContent-Length: {size}\r\n\r\n"
    )
    holder.sendall(head.encode() + b'{"tags": ["' + b"a" * (size - 100))
    time.sleep(0.3)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    body = json.dumps({"tags": ["b" * (size - 100)]}).encode()
    conn.request(
        "POST",
        "/api/v1/create_session",
        body=body,
        headers={"X-API-Key": "tml-alice", "content-type": "application/json"},
    )
    response = conn.getresponse()
    answer = (response.status, dict(response.getheaders()), response.read().decode())
    conn.close()
    holder.close()
    return answer


async def test_a_body_finding_no_room_among_those_held_gets_a_503(
    infra: dict[str, str], tiny_registry: Path
) -> None:
    limits = CallLimits(max_body_bytes=64 * 1024, max_held_body_bytes=64 * 1024, parse_wait_s=1)
    async with served_gateway(infra, tiny_registry, limits) as port:
        status, headers, text = await asyncio.to_thread(held_then_refused, port, 40_000)
    assert status == 503, text
    assert headers.get("retry-after") == "2"
    assert "bytes of request bodies already" in json.loads(text)["error"]
