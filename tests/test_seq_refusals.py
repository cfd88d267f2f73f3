"""A refused training call leaves its model's seq_id sequence usable.

Through the real gateway app on real Redis (only Kafka is a stand-in): whatever refuses
a call — a route the gateway does not serve, a body its schema refuses, a body it cannot
read or that is too large, the pending-calls quota — the model's next call runs
at once instead of waiting out the gap timeout (20 s here) for the refused seq_id.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from gateway_harness import ALICE, BOB, PROTO, Gw, gateway

from plexrl.limits import CallLimits
from plexrl_gateway.proto import tinker_public_pb2 as pb
from plexrl_gateway.seq_release import model_call

pytestmark = pytest.mark.integration

JSON = "application/json"
GAP_S = 20.0
"""The gap timeout: a call still waiting on a refused seq_id would take this long."""


def optim(model_id: str, seq_id: int) -> dict[str, object]:
    return {"model_id": model_id, "seq_id": seq_id, "adam_params": {}, "type": "optim_step"}


async def runs_at_once(gw: Gw, model_id: str, seq_id: int) -> None:
    start = time.monotonic()
    await gw.ok("optim_step", optim(model_id, seq_id))
    took = time.monotonic() - start
    assert took < 5, f"seq_id {seq_id} waited {took:.1f}s for a refused seq_id"


async def test_every_kind_of_refusal_uses_up_its_seq_id(
    infra: dict[str, str], tiny_registry: Path
) -> None:
    limits = CallLimits(max_body_bytes=256 * 1024)
    async with gateway(infra, tiny_registry, limits, sequence_gap_timeout_s=GAP_S) as gw:
        model = await gw.model()
        await gw.ok("optim_step", optim(model, 1))

        # A route the gateway does not serve (a method of a newer SDK).
        body = {"model_id": model, "seq_id": 2, "path": "x", "type": "save_weights_in_2030"}
        assert (await gw.post("save_weights_in_2030", body)).status_code == 404
        await runs_at_once(gw, model, 3)

        # A body the route's schema refuses.
        wrong = {**optim(model, 4), "adam_params": "fast"}
        assert (await gw.post("optim_step", wrong)).status_code in (400, 422)
        await runs_at_once(gw, model, 5)

        # A body that is not JSON to its end.
        cut = json.dumps(optim(model, 6)).encode()[:-9]
        response = await gw.http.post(
            "/api/v1/optim_step",
            content=cut,
            headers={**ALICE, "content-type": "application/json"},
        )
        assert response.status_code == 400, response.text
        await runs_at_once(gw, model, 7)

        # A body over the cap, refused by its declared size before a byte is read.
        big = json.dumps({**optim(model, 8), "pad": "x" * (300 * 1024)}).encode()
        response = await gw.http.post(
            "/api/v1/optim_step",
            content=big,
            headers={**ALICE, "content-type": "application/json"},
        )
        assert response.status_code == 413, response.text
        await runs_at_once(gw, model, 9)

        # A protobuf forward_backward that names its model and seq_id, then breaks.
        head = pb.ForwardBackwardRequest(model_id=model, seq_id=10).SerializeToString()
        response = await gw.http.post(
            "/api/v1/forward_backward",
            content=head + b"\xff\xff\xff\xff",
            headers={**ALICE, **PROTO},
        )
        assert response.status_code == 400, response.text
        await runs_at_once(gw, model, 11)

        # Another tenant's key naming this model moves nothing.
        assert (await gw.post("save_weights_in_2030", {**body, "seq_id": 12}, BOB)).status_code
        assert await gw.stores.calls.get_next_seq(model) == 12


async def test_a_call_over_the_pending_quota_uses_up_its_seq_id(
    infra: dict[str, str], tiny_registry: Path
) -> None:
    limits = CallLimits(max_pending_calls=2)
    async with gateway(infra, tiny_registry, limits, sequence_gap_timeout_s=GAP_S) as gw:
        model = await gw.model()
        await gw.ok("optim_step", optim(model, 1))  # with the create: two pending, never answered
        assert (await gw.post("optim_step", optim(model, 2))).status_code == 429
        assert await gw.stores.calls.get_next_seq(model) == 3


def test_model_and_seq_are_read_from_json_whole_or_cut_and_from_protobuf() -> None:
    whole = json.dumps({"model_id": "m-1", "seq_id": 7, "x": [1, 2]}).encode()
    assert model_call(whole, JSON) == ("m-1", 7)
    assert model_call(whole[:-6], JSON) == ("m-1", 7)
    assert model_call(b'{"model_id": "m-1"}', JSON) is None
    assert model_call(b'{"model_id": "m-1", "seq_id": -1}', JSON) is None
    proto = pb.ForwardBackwardRequest(model_id="m-2", seq_id=300).SerializeToString()
    assert model_call(proto + b"\x00garbage", PROTO["content-type"]) == ("m-2", 300)
    assert model_call(proto[:3], PROTO["content-type"]) is None
    assert model_call(b"", JSON) is None
