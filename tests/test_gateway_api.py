"""The gateway's HTTP API end to end, with real Redis and only Kafka faked.

The publisher stand-in records the phase requests the gateway would send; results are
written the way a worker writes them (Redis, then a wake-up), so the routes, auth,
validation, sequencing, dedupe and rendering under test are the real ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
import tinker
from gateway_harness import ALICE, BOB, PROTO, Gw, gateway
from gateway_support import (
    TINY_MODEL,
    canned_output,
    completion_for,
    wait_until,
)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from tinker.proto import request_conv, response_conv

from plexrl import hf_cache, tracing
from plexrl.messages import (
    CreateInput,
    ErrorCode,
    ErrorInfo,
    ForwardBackwardInput,
    Function,
    IdleHint,
    JobOptions,
    LoadInput,
    PayloadRef,
    PhaseRequest,
    SampleInput,
    SaveInput,
    SaveKind,
)
from plexrl.stores import TimelineEntry
from plexrl_gateway.notices import CompletionNotices


@dataclass
class Harness(Gw):
    """`Gw` with the helpers these tests add: a full create_model, forward_backward in
    protobuf, completing a published call as a worker would."""

    async def model(self, who: dict[str, str] = ALICE, rank: int = 8) -> str:
        session = await self.session(who)
        body = {
            "session_id": session,
            "model_seq_id": 0,
            "base_model": TINY_MODEL,
            "lora_config": {"rank": rank, "train_unembed": True},
            "optimizer_config": {"type": "adamw"},
            "type": "create_model",
        }
        return str((await self.ok("create_model", body, who))["model_id"])

    async def forward_backward(
        self,
        model_id: str,
        seq_id: int,
        data: list[tinker.Datum],
        loss_fn: str = "cross_entropy",
        who: dict[str, str] = ALICE,
    ) -> httpx.Response:
        request = tinker.types.ForwardBackwardRequest(
            forward_backward_input=tinker.types.ForwardBackwardInput(data=data, loss_fn=loss_fn),  # type: ignore[arg-type]
            model_id=model_id,
            seq_id=seq_id,
        )
        body = request_conv.forward_backward_request_to_proto(request).SerializeToString()
        return await self.http.post(
            "/api/v1/forward_backward", content=body, headers={**who, **PROTO}
        )

    async def complete(self, request: PhaseRequest, error: ErrorInfo | None = None) -> None:
        """What a worker does: record the completion in Redis, then wake the gateway."""
        output = None if error else await canned_output(self.stores, request)
        await self.stores.calls.record_completion(completion_for(request, output, error))
        await self.gateway.futures.on_completion(completion_for(request, output, error))

    def published(self, function: Function | None = None) -> list[PhaseRequest]:
        return [r for r in self.publisher.requests() if function is None or r.function == function]


SPANS = InMemorySpanExporter()


@contextlib.asynccontextmanager
async def harness(infra: dict[str, str], models: Path, **overrides: Any) -> AsyncIterator[Harness]:
    tracing.setup_tracing("plexrl-gateway-test", exporter=SPANS)
    options = {"future_wait_s": 0.3, "sequence_gap_timeout_s": 0.3, **overrides}
    async with gateway(infra, models, harness=Harness, **options) as h:
        yield h


@pytest_asyncio.fixture
async def api(infra: dict[str, str], tiny_registry: Path) -> AsyncIterator[Harness]:
    async with harness(infra, tiny_registry) as h:
        yield h


def ce(tokens: list[int]) -> tinker.Datum:
    inputs: dict[str, Any] = {
        "target_tokens": [t + 1 for t in tokens],
        "weights": [1.0] * len(tokens),
    }
    return tinker.Datum(model_input=tinker.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)


def sample_request(session_id: str, seq_id: int, stop: Any = ("\n",)) -> dict[str, Any]:
    params: dict[str, Any] = {"max_tokens": 3, "seed": 1, "temperature": 0.7}
    if stop is not None:
        params["stop"] = list(stop)
    request = tinker.types.SampleRequest(
        prompt=tinker.ModelInput.from_ints([1, 2, 3]),
        sampling_params=tinker.SamplingParams(**params),
        num_samples=2,
        sampling_session_id=session_id,
        seq_id=seq_id,
        prompt_logprobs=False,
    )
    return request.model_dump(mode="json", exclude_none=True)


# Auth and bootstrap ---------------------------------------------------------------------


async def test_missing_or_unknown_key_is_401_with_a_message(api: Harness) -> None:
    missing = await api.http.post("/api/v1/client/config", json={"sdk_version": "0.38.0"})
    assert missing.status_code == 401 and "X-API-Key" in missing.json()["error"]
    unknown = await api.post("client/config", {}, {"X-API-Key": "tml-nobody"})
    assert unknown.status_code == 401 and "unknown API key" in unknown.json()["error"]
    plexrl = await api.http.get("/plexrl/v1/jobs")
    assert plexrl.status_code == 401


async def test_client_config_turns_off_jwt_pyqwest_and_server_side_extras(api: Harness) -> None:
    config = tinker.types.ClientConfigResponse.model_validate(
        await api.ok("client/config", {"sdk_version": "0.38.0"})
    )
    assert not config.pjwt_auth_enabled and not config.use_pyqwest_transport
    assert not config.sample_use_retrieve_futures and not config.custom_loss_server_side
    assert (await api.ok("telemetry", {"events": []})) == {"status": "accepted"}


async def test_capabilities_list_the_registry(api: Harness) -> None:
    response = await api.http.get("/api/v1/get_server_capabilities", headers=ALICE)
    caps = tinker.types.GetServerCapabilitiesResponse.model_validate(response.json())
    assert [m.model_name for m in caps.supported_models] == [TINY_MODEL]
    assert caps.supported_models[0].max_context_length == 512


# Create, info, isolation ----------------------------------------------------------------


async def test_create_model_publishes_create_with_the_spec(api: Harness) -> None:
    model_id = await api.model()
    session = model_id.split(":")[0]
    assert model_id == f"{session}:train:0"
    (create,) = api.published(Function.CREATE)
    assert create.job_id == model_id and create.tenant == "alice"
    assert isinstance(create.payload, CreateInput)
    spec = create.payload.spec
    assert create.spec == spec and spec.base_model == TINY_MODEL
    assert spec.lora is not None and spec.lora.rank == 8 and spec.lora.train_unembed
    expected = (await api.gateway.catalog.info(TINY_MODEL)).state_bytes(8, unembed=True)
    assert spec.state_bytes == expected > 0


async def test_get_info_names_the_model_and_its_local_tokenizer(
    api: Harness, tiny_registry: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    model_id = await api.model()

    async def tokenizer_id() -> str | None:
        info = tinker.types.GetInfoResponse.model_validate(
            await api.ok("get_info", {"model_id": model_id, "type": "get_info"})
        )
        assert info.model_id == model_id and info.is_lora and info.lora_rank == 8
        assert info.model_data.model_name == TINY_MODEL and info.model_data.arch == "qwen3"
        return info.model_data.tokenizer_id

    # Not in the HF cache: the model's directory (what a client on this machine can load).
    tokenizer = await tokenizer_id()
    assert tokenizer is not None and tokenizer.startswith("/") and ":" not in tokenizer
    assert tokenizer == str((tiny_registry / "tiny-qwen3").resolve())
    # Registered by name (`plexrl model init-tiny` / `cache`): the name, which a client
    # elsewhere (the host of a compose stack) resolves from its own cache.
    hf_cache.register(tiny_registry / "tiny-qwen3", TINY_MODEL)
    assert await tokenizer_id() == TINY_MODEL


async def test_unknown_base_model_lists_the_available_ones(api: Harness) -> None:
    session = await api.session()
    response = await api.post(
        "create_model", {"session_id": session, "model_seq_id": 0, "base_model": "Qwen/Qwen3-8B"}
    )
    assert response.status_code == 400
    assert "unknown base model 'Qwen/Qwen3-8B'" in response.json()["error"]
    assert TINY_MODEL in response.json()["error"]
    assert api.published() == []


async def test_another_tenants_objects_are_not_found(api: Harness) -> None:
    model_id = await api.model(ALICE)
    session = model_id.split(":")[0]
    future = api.published(Function.CREATE)[0].request_id
    for path, body in [
        ("get_info", {"model_id": model_id}),
        ("optim_step", {"model_id": model_id, "seq_id": 1, "adam_params": {}}),
        ("retrieve_future", {"request_id": future}),
        ("create_model", {"session_id": session, "model_seq_id": 1, "base_model": TINY_MODEL}),
        ("session_heartbeat", {"session_id": session}),
    ]:
        response = await api.post(path, body, BOB)
        assert response.status_code == 404, (path, response.text)
        assert "error" in response.json()
    runs = await api.http.get("/api/v1/training_runs", headers=BOB)
    assert runs.json()["training_runs"] == []
    mine = await api.http.get(f"/plexrl/v1/jobs/{model_id}", headers=BOB)
    assert mine.status_code == 404


# Training calls ---------------------------------------------------------------------------


async def test_forward_backward_is_validated_then_published_and_its_result_is_protobuf(
    api: Harness,
) -> None:
    model_id = await api.model()
    response = await api.forward_backward(model_id, 1, [ce([1, 2, 3]), ce([4, 5])])
    assert response.status_code == 200, response.text
    future = tinker.types.UntypedAPIFuture.model_validate(response.json())
    assert future.model_id == model_id
    (fb,) = api.published(Function.FORWARD_BACKWARD)
    assert fb.request_id == future.request_id and fb.job_id == model_id
    assert isinstance(fb.payload, ForwardBackwardInput) and fb.payload.backward
    assert [d.tokens for d in fb.payload.data] == [[1, 2, 3], [4, 5]]
    assert (fb.work.tokens, fb.work.sequences) == (5, 2)

    waiting = asyncio.create_task(api.post("retrieve_future", {"request_id": future.request_id}))
    await asyncio.sleep(0.05)
    assert not waiting.done()  # long-polls; no answer before the result
    await api.complete(fb)
    result = await waiting
    assert result.status_code == 200
    assert result.headers["content-type"] == "application/x-protobuf"
    output = response_conv.deserialize_forward_backward_output(result.content)
    assert output.metrics == {"loss:sum": 7.5}
    assert [d["logprobs"].tolist() for d in output.loss_fn_outputs] == [[-1.5] * 3, [-1.5] * 2]


async def test_a_call_polled_where_it_was_accepted_reads_nothing_from_redis(
    api: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the gateway's notices listened to, its own call's future record and
    completion are known to it: `retrieve_future` answers without a Redis read."""
    reads: list[str] = []
    for name in ("get_future", "get_completion"):
        real = getattr(api.stores.calls, name)

        async def counted(request_id: str, real: Any = real, name: str = name) -> Any:
            reads.append(name)
            return await real(request_id)

        monkeypatch.setattr(api.stores.calls, name, counted)
    calls = api.stores.calls
    notices = CompletionNotices(api.stores.keys.redis, calls.completed_channel, api.gateway.futures)
    stop = asyncio.Event()
    listening = asyncio.create_task(notices.run(stop))
    try:
        await asyncio.wait_for(notices.wait_subscribed(), 10)
        model_id = await api.model()
        (create,) = api.published(Function.CREATE)
        # Recorded and announced, as a worker does, before the client polls.
        await calls.record_completion(
            completion_for(create, await canned_output(api.stores, create))
        )
        await wait_until(lambda: api.gateway.futures.accepted.completion(create.request_id), 5)
        done = await api.ok("retrieve_future", {"request_id": create.request_id})
        assert done == {"type": "create_model", "model_id": model_id}
        assert reads == []
    finally:
        stop.set()
        await listening


async def test_a_pending_future_answers_408_try_again(api: Harness) -> None:
    model_id = await api.model()
    (create,) = api.published(Function.CREATE)
    response = await api.post("retrieve_future", {"request_id": create.request_id})
    assert response.status_code == 408
    assert response.json() == {
        "type": "try_again",
        "request_id": create.request_id,
        "queue_state": "active",
    }
    await api.complete(create)
    done = await api.ok("retrieve_future", {"request_id": create.request_id})
    assert done == {"type": "create_model", "model_id": model_id}


async def test_a_resent_call_gets_the_same_future_and_runs_once(api: Harness) -> None:
    model_id = await api.model()
    body = {"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": 1e-3}}
    first, again = await api.ok("optim_step", body), await api.ok("optim_step", body)
    assert first["request_id"] == again["request_id"]
    assert len(api.published(Function.OPTIM_STEP)) == 1


async def test_chunks_arriving_out_of_order_are_published_in_seq_order(api: Harness) -> None:
    model_id = await api.model()
    sends = [api.forward_backward(model_id, s, [ce([s])]) for s in (3, 2)]
    later = asyncio.gather(*sends)
    await asyncio.sleep(0.05)
    assert api.published(Function.FORWARD_BACKWARD) == []
    first = await api.forward_backward(model_id, 1, [ce([1])])
    assert first.status_code == 200
    assert all(r.status_code == 200 for r in await later)
    fbs = api.published(Function.FORWARD_BACKWARD)
    assert [
        f.payload.data[0].tokens for f in fbs if isinstance(f.payload, ForwardBackwardInput)
    ] == [
        [1],
        [2],
        [3],
    ]


async def test_a_gap_that_never_fills_is_a_400_that_says_so(api: Harness) -> None:
    model_id = await api.model()
    response = await api.forward_backward(model_id, 2, [ce([1])])
    assert response.status_code == 400
    assert "waited 0.3s for seq_id 1, which never arrived" in response.json()["error"]


async def test_bad_training_input_is_refused_before_publishing(api: Harness) -> None:
    model_id = await api.model()
    mismatched = tinker.Datum(
        model_input=tinker.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": tinker.TensorData(data=[2, 3], dtype="int64", shape=[2])},
    )
    cases = [
        (await api.forward_backward(model_id, 1, [mismatched]), "the datum has 3 tokens"),
        (
            await api.forward_backward(model_id, 1, [ce([1, 5000])]),
            "outside the vocabulary [0, 768)",
        ),
        (await api.forward_backward(model_id, 1, [ce([1])], "dpo"), "use one of: cross_entropy"),
        (
            await api.http.post(
                "/api/v1/forward_backward", content=b"\x0a\xff", headers={**ALICE, **PROTO}
            ),
            "not a tinker_public.ForwardBackwardRequest",
        ),
    ]
    for response, message in cases:
        assert response.status_code == 400, response.text
        assert message in response.json()["error"]
    assert api.published(Function.FORWARD_BACKWARD) == []


async def test_a_refused_call_uses_up_its_seq_id(api: Harness) -> None:
    """The SDK gives the next call the next seq_id even when this one got a 400."""
    model_id = await api.model()
    refused = await api.forward_backward(model_id, 1, [ce([1])], "no_such_loss")
    assert refused.status_code == 400
    bad_adam = {"model_id": model_id, "seq_id": 2, "adam_params": {"beta1": 2.0}}
    assert (await api.post("optim_step", bad_adam)).status_code == 400
    started = asyncio.get_running_loop().time()
    ok = await api.forward_backward(model_id, 3, [ce([1])])
    assert ok.status_code == 200 and asyncio.get_running_loop().time() - started < 0.25
    assert len(api.published(Function.FORWARD_BACKWARD)) == 1


async def test_a_json_schema_error_names_the_field(api: Harness) -> None:
    response = await api.post("optim_step", {"seq_id": 1, "adam_params": {}})
    assert response.status_code == 422
    assert "model_id: Field required" in response.json()["error"]


async def test_unknown_future_and_bad_path_are_4xx_with_bodies(api: Harness) -> None:
    missing = await api.post("retrieve_future", {"request_id": "req-nope"})
    assert missing.status_code == 404 and "unknown future" in missing.json()["error"]
    bad = await api.post("weights_info", {"tinker_path": "tinker://only-two/parts"})
    assert bad.status_code == 400 and "bad tinker path" in bad.json()["error"]


async def test_worker_errors_come_back_with_their_category(api: Harness) -> None:
    model_id = await api.model()
    await api.ok("optim_step", {"model_id": model_id, "seq_id": 1, "adam_params": {}})
    (optim,) = api.published(Function.OPTIM_STEP)
    await api.complete(optim, ErrorInfo(ErrorCode.BAD_REQUEST, "no gradients to apply"))
    body = await api.ok("retrieve_future", {"request_id": optim.request_id})
    assert body == {"error": "no gradients to apply", "category": "user"}


async def test_a_call_accepted_while_kafka_is_away_is_delivered_once_it_is_back(
    api: Harness,
) -> None:
    model_id = await api.model()
    api.publisher.fail = True
    body = {"model_id": model_id, "seq_id": 1, "adam_params": {}}
    accepted = await api.ok("optim_step", body)  # in Redis's outbox, not on Kafka yet
    assert api.published(Function.OPTIM_STEP) == []
    api.publisher.fail = False
    retried = await api.ok("optim_step", body)
    assert retried["request_id"] == accepted["request_id"]
    assert await api.gateway.submitter.deliver(min_age_s=0) == 1
    (optim,) = api.published(Function.OPTIM_STEP)
    assert optim.request_id == accepted["request_id"]
    # The model's next call is not held back by the one that waited in the outbox.
    await api.ok("optim_step", {**body, "seq_id": 2})
    assert len(api.published(Function.OPTIM_STEP)) == 2


# Weights and sampling -------------------------------------------------------------------


async def test_ephemeral_save_opens_a_sampling_session_that_samples_on_the_owner(
    api: Harness,
) -> None:
    model_id = await api.model()
    session = model_id.split(":")[0]
    save = await api.ok(
        "save_weights_for_sampler",
        {"model_id": model_id, "sampling_session_seq_id": 0, "kind": "snapshot", "seq_id": 1},
    )
    (saved,) = api.published(Function.SAVE)
    assert isinstance(saved.payload, SaveInput) and saved.payload.kind == SaveKind.SAMPLER
    assert saved.payload.path == f"tinker://{model_id}/sampler_weights/ephemeral-0"
    await api.complete(saved)
    result = await api.ok("retrieve_future", {"request_id": save["request_id"]})
    sampler = f"{session}:sample:0"
    assert result["sampling_session_id"] == sampler

    submitted = await api.ok("asample", sample_request(sampler, 0))
    assert submitted["sample_sequence_ids"] == [f"{sampler}:seq:0:0", f"{sampler}:seq:0:1"]
    (sample,) = api.published(Function.SAMPLE)
    # Same home worker, in order with the model's training calls.
    assert sample.job_id == model_id and sample.spec is None
    assert isinstance(sample.payload, SampleInput)
    assert sample.payload.weights_path == saved.payload.path
    assert sample.work.portable  # a checkpoint's sample may run on any worker serving the base
    assert sample.payload.params.stop_strings == ["\n"] and sample.payload.params.stop_at_eos
    await api.complete(sample)
    response = await api.post("retrieve_future", {"request_id": submitted["request_id"]})
    decoded = response_conv.deserialize_sample_response(response.content)
    assert [s.stop_reason for s in decoded.sequences] == ["length", "stop"]
    again = await api.ok("asample", sample_request(sampler, 0))
    assert again == submitted and len(api.published(Function.SAMPLE)) == 1


async def test_a_base_model_sampling_session_is_a_job_of_its_own(api: Harness) -> None:
    session = await api.session()
    created = await api.ok(
        "create_sampling_session",
        {"session_id": session, "sampling_session_seq_id": 3, "base_model": TINY_MODEL},
    )
    sampler = created["sampling_session_id"]
    assert sampler == f"{session}:sample:3"
    info = await api.http.get(f"/api/v1/samplers/{sampler}", headers=ALICE)
    assert info.json() == {"sampler_id": sampler, "base_model": TINY_MODEL}
    await api.ok("asample", sample_request(sampler, 0, stop=None))
    (sample,) = api.published(Function.SAMPLE)
    assert sample.job_id == sampler and sample.spec is not None
    assert not sample.work.portable  # the base, under a job of its own
    assert sample.spec.lora is None and sample.spec.state_bytes == 0
    assert isinstance(sample.payload, SampleInput) and sample.payload.weights_path is None
    other = await api.post("asample", sample_request(sampler, 1), BOB)
    assert other.status_code == 404


async def test_save_state_then_create_a_model_from_it(api: Harness) -> None:
    model_id = await api.model()
    save = await api.ok(
        "save_weights", {"model_id": model_id, "path": "ckpt1", "seq_id": 1, "overwrite": False}
    )
    (saved,) = api.published(Function.SAVE)
    await api.complete(saved)
    path = f"tinker://{model_id}/weights/ckpt1"
    assert await api.ok("retrieve_future", {"request_id": save["request_id"]}) == {
        "type": "save_weights",
        "path": path,
    }
    again = await api.post("save_weights", {"model_id": model_id, "path": "ckpt1", "seq_id": 2})
    assert again.status_code == 400 and "overwrite=True" in again.json()["error"]

    info = await api.ok("weights_info", {"tinker_path": path})
    assert info["base_model"] == TINY_MODEL and info["is_lora"] and info["lora_rank"] == 8
    assert (await api.post("weights_info", {"tinker_path": path}, BOB)).status_code == 404

    session = await api.session()
    load = await api.ok(
        "load_weights",
        {"session_id": session, "model_seq_id": 4, "path": path, "optimizer": True},
    )
    new_model = f"{session}:train:4"
    assert load["model_id"] == new_model
    create, loaded = api.published()[-2:]
    assert create.function == Function.CREATE and create.job_id == new_model
    assert isinstance(create.payload, CreateInput) and create.payload.spec.lora is not None
    assert create.payload.spec.lora.train_unembed  # taken from the model that saved it
    assert isinstance(loaded.payload, LoadInput) and loaded.payload.with_optimizer
    assert loaded.request_id == load["request_id"]
    await api.complete(create)
    await api.complete(loaded)
    assert await api.ok("retrieve_future", {"request_id": load["request_id"]}) == {
        "type": "load_weights",
        "path": path,
        "model_id": new_model,
    }
    listed = await api.http.get(f"/api/v1/training_runs/{model_id}/checkpoints", headers=ALICE)
    (ckpt,) = listed.json()["checkpoints"]
    assert ckpt["checkpoint_id"] == "weights/ckpt1" and ckpt["checkpoint_type"] == "training"
    deleted = await api.http.delete(
        f"/api/v1/training_runs/{model_id}/checkpoints/weights/ckpt1", headers=ALICE
    )
    assert deleted.status_code == 200 and deleted.json()["deleted"]
    assert (await api.post("weights_info", {"tinker_path": path})).status_code == 404


async def test_finishing_a_session_unloads_its_models(api: Harness) -> None:
    model_id = await api.model()
    session = model_id.split(":")[0]
    response = await api.post(f"sessions/{session}/finish", {"reason": {"type": "success"}})
    assert response.status_code == 204
    (unload,) = api.published(Function.UNLOAD)
    assert unload.job_id == model_id
    gone = await api.post("get_info", {"model_id": model_id})
    assert gone.status_code == 404 and "unloaded" in gone.json()["error"]


async def test_sdk_methods_of_organizations_are_refused_with_what_to_use_instead(
    api: Harness,
) -> None:
    search = await api.http.post("/api/v1/sessions/search", json={"limit": 5}, headers=ALICE)
    project = await api.http.put(
        "/api/v1/sessions/s1/project", json={"project_id": "p"}, headers=ALICE
    )
    audit = await api.http.get("/api/v1/audit", params={"event_type": "all"}, headers=ALICE)
    for refused, hint in ((search, "list_sessions"), (project, "no projects"), (audit, "trace")):
        assert refused.status_code == 400, refused.text
        assert hint in refused.json()["error"]
    assert (await api.http.get("/api/v1/audit")).status_code == 401  # a key first


# PlexRL's own API -------------------------------------------------------------------------


async def test_idle_hint_and_job_views(api: Harness) -> None:
    model_id = await api.model()
    hint = await api.http.post(
        f"/plexrl/v1/jobs/{model_id}/idle", json={"seconds": 12}, headers=ALICE
    )
    assert hint.status_code == 200
    ((topic, key, message),) = [s for s in api.publisher.sent if isinstance(s[2], IdleHint)]
    assert topic == api.gateway.topics.events and key == model_id
    assert message.seconds == 12 and message.tenant == "alice"
    jobs = (await api.http.get("/plexrl/v1/jobs", headers=ALICE)).json()
    assert [j["job_id"] for j in jobs] == [model_id]
    view = (await api.http.get(f"/plexrl/v1/jobs/{model_id}", headers=ALICE)).json()
    assert view["job"]["job_id"] == model_id and view["accounting"]["device_s"] == 0.0
    cluster = (await api.http.get("/plexrl/v1/cluster", headers=ALICE)).json()
    assert cluster["scheduler"] == {"reachable": False} and cluster["workers"] == []


async def test_a_job_declares_its_staleness(api: Harness) -> None:
    model_id = await api.model()
    declared = await api.http.post(
        f"/plexrl/v1/jobs/{model_id}/options", json={"staleness": 2}, headers=ALICE
    )
    assert declared.json() == {"job_id": model_id, "staleness": 2, "steps": 0}
    ((topic, key, message),) = [s for s in api.publisher.sent if isinstance(s[2], JobOptions)]
    assert topic == api.gateway.topics.events and key == model_id
    assert message.staleness == 2 and message.tenant == "alice" and message.steps == 0
    record = await api.gateway.registry.find_job("alice", model_id)
    assert record is not None and record.staleness == 2  # a scheduler that starts later
    # Its length, declared on its own: the staleness declared before stands.
    lengthy = await api.http.post(
        f"/plexrl/v1/jobs/{model_id}/options", json={"steps": 1500}, headers=ALICE
    )
    assert lengthy.json() == {"job_id": model_id, "staleness": 2, "steps": 1500}
    last = [s[2] for s in api.publisher.sent if isinstance(s[2], JobOptions)][-1]
    assert (last.staleness, last.steps) == (2, 1500)
    record = await api.gateway.registry.find_job("alice", model_id)
    assert record is not None and (record.staleness, record.steps) == (2, 1500)
    for bad in ({"steps": -1}, {"steps": 10**8}, {"steps": "many"}):
        refused = await api.http.post(
            f"/plexrl/v1/jobs/{model_id}/options", json=bad, headers=ALICE
        )
        assert refused.status_code in (400, 422) and "steps" in refused.text, bad
    too_stale = await api.http.post(
        f"/plexrl/v1/jobs/{model_id}/options", json={"staleness": 9}, headers=ALICE
    )
    assert too_stale.status_code in (400, 422) and "staleness" in too_stale.text
    unknown = await api.http.post(
        "/plexrl/v1/jobs/nobody/options", json={"staleness": 1}, headers=ALICE
    )
    assert unknown.status_code == 404


async def test_echo_waits_for_its_noop(api: Harness) -> None:
    echo = asyncio.create_task(api.http.post("/plexrl/v1/echo", headers=ALICE))
    for _ in range(100):
        if api.published(Function.NOOP):
            break
        await asyncio.sleep(0.01)
    (noop,) = api.published(Function.NOOP)
    assert noop.spec is not None and noop.spec.base_model == "" and noop.spec.state_bytes == 0
    await api.complete(noop)
    body = (await echo).json()
    assert body["request_id"] == noop.request_id and body["latency_s"] > 0


async def test_health_and_metrics(api: Harness) -> None:
    health = await api.http.get("/healthz")
    assert health.status_code == 200 and health.json()["ok"]
    await api.model()
    text = (await api.http.get("/metrics")).text
    assert 'plexrl_gateway_requests_total{endpoint="/api/v1/create_model"' in text
    assert "plexrl_gateway_publish_seconds_bucket" in text
    api.publisher.fail = True
    assert (await api.http.get("/healthz")).status_code == 503


async def test_one_trace_runs_from_the_http_call_into_kafka(api: Harness) -> None:
    model_id = await api.model()
    SPANS.clear()
    await api.ok("optim_step", {"model_id": model_id, "seq_id": 1, "adam_params": {}})
    (headers,) = api.publisher.headers[-1:]
    trace_id = headers["traceparent"].split("-")[1]
    spans = {s.name: s for s in SPANS.get_finished_spans()}
    root = spans["POST /api/v1/optim_step"]
    publish = spans["gateway.publish"]
    assert f"{root.context.trace_id:032x}" == trace_id
    # The HTTP span starts the trace; the publish (and the Kafka header) continue it.
    assert publish.context.trace_id == root.context.trace_id
    assert publish.attributes is not None and publish.attributes["plexrl.function"] == "optim_step"


async def test_big_payloads_go_by_reference(infra: dict[str, str], tiny_registry: Path) -> None:
    async with harness(infra, tiny_registry, payload_inline_max_bytes=64) as api:
        model_id = await api.model()
        response = await api.forward_backward(model_id, 1, [ce(list(range(1, 60)))])
        assert response.status_code == 200
        (fb,) = api.published(Function.FORWARD_BACKWARD)
        assert isinstance(fb.payload, PayloadRef)
        await api.complete(fb)  # the fake worker resolves the reference like a real one
        result = await api.post("retrieve_future", {"request_id": fb.request_id})
        output = response_conv.deserialize_forward_backward_output(result.content)
        assert len(output.loss_fn_outputs[0]["logprobs"].tolist()) == 59


async def test_timeline_shows_only_the_tenants_calls(api: Harness) -> None:
    mine, theirs = await api.model(ALICE), await api.model(BOB)
    for job_id in (mine, theirs):
        entry = TimelineEntry(
            worker_id="w0",
            job_id=job_id,
            request_id=f"r-{job_id}",
            function="forward_backward",
            started_at=time.time(),
            swap_s=0.1,
            compute_s=0.5,
            ok=True,
        )
        await api.stores.timeline.append_timeline(entry)
    timeline = (await api.http.get("/plexrl/v1/timeline", headers=ALICE)).json()
    assert [e["job_id"] for e in timeline] == [mine]
    later = await api.http.get(
        "/plexrl/v1/timeline", params={"since": time.time() + 60}, headers=ALICE
    )
    assert later.json() == []
