"""Admission caps: every oversized or overflowing input is a 4xx that says what to change,
refused before anything is allocated; a tenant over its pending-call quota gets 429.

The rules are plexrl.limits'; the gateway (tested over HTTP, real Redis, Kafka faked)
and the engine (its pure validation functions) both call them.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker
from gateway_harness import ALICE, BOB, PROTO, Gw, gateway
from gateway_support import completion_for
from tinker.proto import request_conv

from plexrl.limits import (
    CallLimits,
    InputError,
    ModelLimits,
    check_call_size,
    check_sample_size,
    default_max_tokens,
)
from plexrl.messages import (
    Datum,
    Function,
    LossFn,
    NoopOutput,
    PayloadRef,
    PhaseRequest,
    SampleInput,
    SamplingParams,
    TensorArray,
)
from plexrl_gateway.admission import PendingCalls, payload_bytes
from plexrl_gateway.errors import ApiError
from plexrl_gateway.proto import tinker_public_pb2 as pb
from plexrl_gateway.translate import forward_backward_input
from plexrl_worker.engine import EngineInputError
from plexrl_worker.engine.batch import prepare
from plexrl_worker.engine.sampling import validate

MODEL = ModelLimits(vocab_size=100, max_positions=32)
SMALL = CallLimits(max_datums=3, max_call_tokens=40, max_samples=4, max_stop=2, max_stop_chars=5)


def fb(data: list[tinker.Datum]) -> pb.ForwardBackwardRequest:
    request = tinker.types.ForwardBackwardRequest(
        forward_backward_input=tinker.types.ForwardBackwardInput(
            data=data, loss_fn="cross_entropy"
        ),
        model_id="s:train:0",
        seq_id=1,
    )
    ours = pb.ForwardBackwardRequest()
    ours.ParseFromString(
        request_conv.forward_backward_request_to_proto(request).SerializeToString()
    )
    return ours


def ce(tokens: list[int]) -> tinker.Datum:
    # Plain lists, as users write them; the SDK types them itself.
    inputs: dict[str, Any] = {"target_tokens": [min(t + 1, 99) for t in tokens]}
    return tinker.Datum(model_input=tinker.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)


def refused(call: Any, *args: Any) -> str:
    with pytest.raises(ApiError) as info:
        call(*args)
    assert 400 <= info.value.status < 500
    return info.value.message


# The rules, at the gateway and in the engine ---------------------------------------------


def test_datums_and_tokens_per_call_are_capped() -> None:
    four = fb([ce([1, 2])] * 4)
    assert "4 datums, more than the 3" in refused(forward_backward_input, four, MODEL, SMALL)
    heavy = fb([ce(list(range(1, 31)))] * 2)  # 60 tokens
    message = refused(forward_backward_input, heavy, MODEL, SMALL)
    assert "60 tokens in all, more than the 40" in message and "split it" in message
    inp, work = forward_backward_input(fb([ce([1, 2, 3])] * 3), MODEL, SMALL)
    assert work.tokens == 9 and len(inp.data) == 3


def test_a_huge_sparse_shape_is_refused_before_it_is_made_dense() -> None:
    request = fb([ce([1, 2])])
    tensor = request.data[0].loss_fn_inputs["target_tokens"]
    tensor.Clear()
    tensor.dtype = pb.DTYPE_INT64
    tensor.shape.extend([2**20, 2**20])
    tensor.sparse_csr.values = b""
    message = refused(forward_backward_input, request, MODEL, SMALL)
    assert "[1048576, 1048576]" in message and "one value per token" in message


def test_the_engine_applies_the_same_caps() -> None:
    datum = Datum(
        tokens=[1, 2], loss_fn_inputs={"target_tokens": TensorArray.from_list([2, 3], "int64")}
    )
    with pytest.raises(EngineInputError, match="4 datums, more than the 3"):
        prepare([datum] * 4, LossFn.CROSS_ENTROPY, MODEL, 1024, SMALL)
    assert len(prepare([datum] * 3, LossFn.CROSS_ENTROPY, MODEL, 1024, SMALL)) == 1
    too_many = SampleInput(prompt=[1, 2], num_samples=4, params=SamplingParams(max_tokens=20))
    with pytest.raises(EngineInputError, match="ask for at most 1 samples per call"):
        validate(too_many, MODEL, SMALL)
    for params, message in [
        (SamplingParams(max_tokens=4, seed=2**70), "does not fit in 64 bits"),
        (SamplingParams(max_tokens=4, stop_strings=["a", "b", "c"]), "at most 2"),
        (SamplingParams(max_tokens=4, stop_strings=["toolong"]), "at most 5"),
        (SamplingParams(max_tokens=0), "max_tokens is 0"),
    ]:
        with pytest.raises(EngineInputError, match=message):
            validate(SampleInput(prompt=[1], num_samples=1, params=params), MODEL, SMALL)
    with pytest.raises(EngineInputError, match=r"prompt\[0\] is 1180591620717411303424"):
        validate(SampleInput([2**70], 1, SamplingParams(max_tokens=1)), MODEL, SMALL)


def test_a_default_max_tokens_that_cannot_fit_names_the_samples_that_do() -> None:
    max_tokens = default_max_tokens(20, 4, MODEL, SMALL)
    assert max_tokens == 1
    with pytest.raises(InputError, match="ask for at most 1 samples per call"):
        check_sample_size(20, 4, max_tokens, MODEL, SMALL)
    assert default_max_tokens(3, 1, MODEL, SMALL) == 29  # the model's room, within the cap


def test_rules_and_their_config_say_what_to_change() -> None:
    with pytest.raises(InputError, match="data is empty"):
        check_call_size([], SMALL)
    with pytest.raises(ValueError, match="max_datums is 0; set it to an integer >= 1"):
        CallLimits(max_datums=0)


def test_pending_bytes_are_capped_per_tenant() -> None:
    pending = PendingCalls(CallLimits(max_pending_bytes=1000))
    pending.published("t", "r1", 600)
    pending.admit("t")
    pending.published("t", "r2", 400)
    with pytest.raises(ApiError, match="1000 bytes of calls pending") as info:
        pending.admit("t")
    assert info.value.status == 429
    pending.done("r1")
    pending.admit("t")
    big = PhaseRequest(
        request_id="r",
        job_id="j",
        tenant="t",
        function=Function.SAMPLE,
        payload=PayloadRef(key="k", size=5 << 20),
        arrival_time=0.0,
    )
    assert payload_bytes(big) == 5 << 20


def test_pending_calls_forget_what_never_completes() -> None:
    now = [0.0]
    pending = PendingCalls(CallLimits(max_pending_calls=1), forget_after_s=10, clock=lambda: now[0])
    pending.published("t", "r1")
    with pytest.raises(ApiError) as info:
        pending.admit("t")
    assert info.value.status == 429 and info.value.headers == {"Retry-After": "2"}
    pending.admit("u")  # other tenants are not affected
    now[0] = 11.0
    pending.admit("t")  # r1's completion was lost; the tenant is not locked out
    assert pending.count("t") == 0


# Over HTTP ----------------------------------------------------------------------------------


@pytest.fixture
async def gw(infra: dict[str, str], tiny_registry: Path) -> AsyncIterator[Gw]:
    limits = CallLimits(max_body_bytes=64 * 1024, max_pending_calls=2)
    async with gateway(infra, tiny_registry, limits) as g:
        yield g


def sample_body(session: str, seq: int, **changes: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
        "sampling_params": {"max_tokens": 4, "seed": 1},
        "num_samples": 1,
        "sampling_session_id": session,
        "seq_id": seq,
    }
    for key, value in changes.items():
        if key in ("max_tokens", "seed", "stop"):
            body["sampling_params"][key] = value
        elif key == "tokens":
            body["prompt"]["chunks"][0]["tokens"] = value
        else:
            body[key] = value
    return body


async def test_a_body_over_the_cap_is_413_before_it_is_read(gw: Gw) -> None:
    big = b"\0" * (64 * 1024 + 1)
    declared = await gw.http.post(
        "/api/v1/forward_backward", content=big, headers={**ALICE, **PROTO}
    )
    assert declared.status_code == 413
    assert "larger than 65536 bytes" in declared.json()["error"]

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(100):  # 100 x 8 KiB, no Content-Length
            yield b"\0" * 8192

    streamed = await gw.http.post("/api/v1/create_session", content=chunks(), headers=ALICE)
    assert streamed.status_code == 413 and "split the data" in streamed.json()["error"]
    assert gw.publisher.sent == []
    fine = await gw.post("create_session", {"tags": []})
    assert fine.status_code == 200


async def test_bad_sampling_input_is_4xx_saying_what_to_change(gw: Gw) -> None:
    session = await gw.sampler()
    cases = [
        (
            sample_body(session, 0, num_samples=10**7),
            "num_samples is 10000000; it must be in [1, 1024]",
        ),
        (sample_body(session, 1, tokens=[1, 2**70]), "prompt[1] is 1180591620717411303424"),
        (sample_body(session, 2, seed=2**70), "sampling_params.seed is 1180591620717411303424"),
        (sample_body(session, 3, stop=["x"] * 17), "send at most 16"),
        (sample_body(session, 4, stop=["y" * 300]), "use at most 256"),
        (sample_body(session, 5, max_tokens=10**9), "lower max_tokens to at most"),
        (sample_body(session, 6, num_samples=1024, max_tokens=200), "ask for at most"),
        (sample_body(session, 7, topk_prompt_logprobs=2**70), "topk_prompt_logprobs is"),
        (sample_body(session, 2**70), "seq_id is 1180591620717411303424"),
    ]
    for body, message in cases:
        answer = await gw.post("asample", body)
        assert answer.status_code == 400, (message, answer.text)
        assert message in answer.json()["error"]
    assert gw.publisher.requests() == []


async def test_overflowing_integers_at_creation_are_400_not_5xx(gw: Gw) -> None:
    session = await gw.session()

    def create(seq: int, **lora: Any) -> dict[str, Any]:
        return {
            "session_id": session,
            "model_seq_id": seq,
            "base_model": "plexrl/tiny-qwen3",
            "lora_config": {"rank": 8, **lora},
        }

    for body, message in [
        (create(0, rank=2**63), "use a rank between 1 and 1024"),
        (create(1, rank=2**64), "use a rank between 1 and 1024"),
        (create(2, seed=2**64), "does not fit in 64 bits"),
        (create(2**70), "model_seq_id is 1180591620717411303424"),
    ]:
        answer = await gw.post("create_model", body)
        assert answer.status_code == 400, (message, answer.text)
        assert message in answer.json()["error"]
    since = await gw.http.get("/plexrl/v1/timeline", params={"since": 2.2e307}, headers=ALICE)
    assert since.status_code == 422 and "since" in since.json()["error"]
    assert (
        await gw.http.get("/plexrl/v1/timeline", params={"since": time.time()}, headers=ALICE)
    ).status_code == 200


async def test_a_tenant_over_its_pending_quota_gets_429_with_retry_after(gw: Gw) -> None:
    session = await gw.sampler()
    for seq in range(2):
        assert (await gw.post("asample", sample_body(session, seq))).status_code == 200
    over = await gw.post("asample", sample_body(session, 2))
    assert over.status_code == 429 and over.headers["retry-after"] == "2"
    assert "2 calls pending" in over.json()["error"] and "retrieve_future" in over.json()["error"]
    # Another tenant is not held back by alice's queue.
    bobs = await gw.sampler(BOB)
    assert (await gw.post("asample", sample_body(bobs, 0), BOB)).status_code == 200
    # A completion frees a slot.
    first = gw.publisher.requests()[0]
    await gw.gateway.futures.on_completion(completion_for(first, NoopOutput()))
    assert (await gw.post("asample", sample_body(session, 2))).status_code == 200
    assert [r.function for r in gw.publisher.requests()] == [Function.SAMPLE] * 4


async def test_the_sdk_error_body_of_a_429_is_json(gw: Gw) -> None:
    session = await gw.sampler()
    for seq in range(3):
        answer = await gw.post("asample", sample_body(session, seq))
    assert answer.status_code == 429
    assert answer.json()["category"] == "user"
    assert isinstance(answer, httpx.Response)
