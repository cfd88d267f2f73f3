"""The wire contracts: every message round-trips, decoding fails only with MessageError."""

from __future__ import annotations

import msgspec
import pytest

from plexrl.messages import (
    SCHEMA_VERSION,
    AdamParams,
    CompletionStatus,
    CreateInput,
    CreateOutput,
    Datum,
    DeadLetter,
    DeadLetterReason,
    Dispatch,
    ErrorCode,
    ErrorInfo,
    Event,
    ForwardBackwardInput,
    ForwardBackwardOutput,
    Function,
    IdleHint,
    JobAdmitted,
    JobFinished,
    JobSpec,
    LoadInput,
    LoraSpec,
    LossFn,
    MessageError,
    NoopInput,
    OptimStepInput,
    PayloadRef,
    PhaseCompletion,
    PhaseRequest,
    ResidencyChanged,
    ResidentState,
    SampledSequence,
    SampleInput,
    SampleOutput,
    SamplingParams,
    SaveInput,
    SaveKind,
    StateComponent,
    StateMove,
    StopReason,
    TensorArray,
    Tier,
    Timings,
    WorkerHeartbeat,
    decode,
    encode,
)

SPEC = JobSpec(base_model="plexrl/tiny-qwen3", lora=LoraSpec(rank=8), seed=3, state_bytes=1024)
DATUM = Datum(
    tokens=[1, 2, 3],
    loss_fn_inputs={
        "target_tokens": TensorArray.from_list([2, 3, 4], "int64"),
        "weights": TensorArray.from_list([0.0, 1.0, 0.5], "float32"),
    },
)
INPUTS = [
    CreateInput(spec=SPEC),
    ForwardBackwardInput(
        data=[DATUM], loss_fn=LossFn.PPO, loss_fn_config={"clip_low_threshold": 0.7}
    ),
    OptimStepInput(adam=AdamParams(learning_rate=3e-4, grad_clip_norm=1.0)),
    SampleInput(prompt=[1, 2], num_samples=2, params=SamplingParams(max_tokens=4, seed=7)),
    SaveInput(kind=SaveKind.SAMPLER, path="tinker://s:train:0/sampler_weights/a"),
    LoadInput(path="tinker://s:train:0/weights/a", with_optimizer=True),
    NoopInput(),
    PayloadRef(key="abc", size=10),
]


def request(payload: object) -> PhaseRequest:
    return PhaseRequest(
        request_id="r1",
        job_id="s:train:0",
        tenant="t",
        function=Function.FORWARD_BACKWARD,
        payload=payload,  # type: ignore[arg-type]
        arrival_time=1.5,
        spec=SPEC,
    )


@pytest.mark.parametrize("payload", INPUTS, ids=lambda p: type(p).__name__)
def test_request_round_trips_every_payload(payload: object) -> None:
    message = request(payload)
    assert decode(encode(message), PhaseRequest) == message


def test_completion_dispatch_and_events_round_trip() -> None:
    outputs: list[CreateOutput | ForwardBackwardOutput | SampleOutput] = [
        CreateOutput(trainable_params=10, state_bytes=80),
        ForwardBackwardOutput(
            loss_fn_outputs=[{"logprobs": TensorArray.from_list([-1.0], "float32")}],
            metrics={"loss:sum": 1.0},
        ),
        SampleOutput(
            sequences=[SampledSequence(tokens=[5], logprobs=[-0.5], stop_reason=StopReason.STOP)],
            prompt_logprobs=[None, -1.0],
        ),
    ]
    for output in outputs:
        completion = PhaseCompletion(
            request_id="r",
            job_id="j",
            tenant="t",
            worker_id="w",
            function=Function.SAMPLE,
            status=CompletionStatus.OK,
            timings=Timings(0.1, 0.2, 0.3),
            result=output,
        )
        assert decode(encode(completion), PhaseCompletion) == completion
    failed = PhaseCompletion(
        request_id="r",
        job_id="j",
        tenant="t",
        worker_id="",
        function=Function.CREATE,
        status=CompletionStatus.ERROR,
        timings=Timings(),
        error=ErrorInfo(ErrorCode.REJECTED, "no"),
    )
    assert decode(encode(failed), PhaseCompletion).error == ErrorInfo(ErrorCode.REJECTED, "no")
    assert failed.error is not None and failed.error.user_error

    dispatch = Dispatch(
        dispatch_id="d",
        worker_id="w",
        calls=[request(NoopInput())],
        traceparents=["00-x"],
        evict=[StateMove("a", Tier.HOST)],
        prefetch=[StateMove("b", Tier.DEVICE)],
        issued_at=2.0,
    )
    assert decode(encode(dispatch), Dispatch) == dispatch

    events: list[Event] = [
        WorkerHeartbeat(
            worker_id="w",
            device="cpu",
            device_bytes=1,
            host_bytes=2,
            base_models=["m"],
            resident=[ResidentState("j", Tier.DISK, 3, 4)],
            busy=False,
            started_at=0.0,
            sent_at=1.0,
        ),
        ResidencyChanged(
            worker_id="w",
            job_id="j",
            components=[StateComponent.WEIGHTS],
            from_tier=None,
            to_tier=Tier.DEVICE,
            bytes=1,
            version=1,
            seconds=0.0,
            at=0.0,
        ),
        JobAdmitted(job_id="j", tenant="t", home_worker="w", base_model="m", state_bytes=1, at=0.0),
        JobFinished(job_id="j", tenant="t", reason="unloaded", at=0.0),
        IdleHint(job_id="j", tenant="t", seconds=3.0, at=0.0),
    ]
    for event in events:
        assert decode(encode(event), Event) == event


def test_messages_are_maps_with_a_schema_version() -> None:
    raw = msgspec.msgpack.decode(encode(request(NoopInput())))
    assert raw["schema_version"] == SCHEMA_VERSION
    assert raw["payload"]["type"] == "noop"
    assert {"request_id", "job_id", "tenant", "function", "arrival_time"} <= set(raw)


def test_reader_ignores_unknown_fields_from_a_newer_minor_writer() -> None:
    raw = msgspec.msgpack.decode(encode(request(NoopInput())))
    raw["added_later"] = {"x": 1}
    assert decode(msgspec.msgpack.encode(raw), PhaseRequest).request_id == "r1"


def test_newer_schema_version_is_refused() -> None:
    raw = msgspec.msgpack.decode(encode(request(NoopInput())))
    raw["schema_version"] = SCHEMA_VERSION + 1
    with pytest.raises(MessageError) as err:
        decode(msgspec.msgpack.encode(raw), PhaseRequest)
    assert err.value.reason == DeadLetterReason.UNSUPPORTED_VERSION


@pytest.mark.parametrize(
    "data",
    [b"", b"\xc1", msgspec.msgpack.encode(42), msgspec.msgpack.encode({"request_id": "r"})],
)
def test_garbage_raises_message_error_only(data: bytes) -> None:
    with pytest.raises(MessageError) as err:
        decode(data, PhaseRequest)
    assert err.value.reason == DeadLetterReason.UNDECODABLE


def test_tensor_array_round_trips_values() -> None:
    ints = TensorArray.from_list([1, -2, 3], "int64")
    floats = TensorArray.from_list([0.5, -1.25], "float32")
    assert ints.to_list() == [1, -2, 3] and ints.numel == 3
    assert floats.to_list() == [0.5, -1.25] and len(floats.data) == 8


def test_dead_letter_round_trips() -> None:
    letter = DeadLetter(
        source_topic="t",
        partition=0,
        offset=5,
        key=b"k",
        reason=DeadLetterReason.UNDECODABLE,
        detail="bad",
        value=b"\x00",
        consumer="c",
        at=1.0,
    )
    assert decode(encode(letter), DeadLetter) == letter
