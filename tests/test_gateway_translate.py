"""Tinker requests to phase inputs, and phase outputs to what the SDK reads.

Requests are built the way the SDK builds them (its own converters), so the gateway is
checked against the real wire, not a hand-made one.
"""

from __future__ import annotations

from typing import Any

import pytest
import tinker
from tinker.proto import request_conv, response_conv

from plexrl.messages import (
    CompletionStatus,
    CreateOutput,
    ErrorCode,
    ErrorInfo,
    ForwardBackwardOutput,
    Function,
    LossFn,
    OptimStepOutput,
    PhaseCompletion,
    SaveOutput,
    TensorArray,
    Timings,
)
from plexrl.stores import FutureRecord
from plexrl_gateway.errors import ApiError
from plexrl_gateway.proto import tinker_public_pb2 as pb
from plexrl_gateway.render import CTX_SAMPLING_SESSION, ResponseKind, render, tinker_metrics
from plexrl_gateway.schemas import AdamParamsBody, CreateModelBody, OptimStepBody, SampleBody
from plexrl_gateway.translate import (
    ModelLimits,
    adam_params,
    forward_backward_input,
    job_spec,
    parse_tinker_path,
    sample_input,
)

LIMITS = ModelLimits(vocab_size=100, max_positions=32)


def fb_proto(
    data: list[tinker.Datum], loss_fn: str = "cross_entropy", **kw: Any
) -> pb.ForwardBackwardRequest:
    """The SDK's own encoding of a forward_backward call, read by our module."""
    request = tinker.types.ForwardBackwardRequest(
        forward_backward_input=tinker.types.ForwardBackwardInput(data=data, loss_fn=loss_fn, **kw),  # type: ignore[arg-type]
        model_id="s:train:0",
        seq_id=1,
    )
    ours = pb.ForwardBackwardRequest()
    ours.ParseFromString(
        request_conv.forward_backward_request_to_proto(request).SerializeToString()
    )
    return ours


def datum(tokens: list[int], **inputs: Any) -> tinker.Datum:
    """A datum as users write it: plain lists, which the SDK types itself."""
    return tinker.Datum(model_input=tinker.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)


def ce_datum(
    tokens: list[int], targets: list[int], weights: list[float] | None = None
) -> tinker.Datum:
    if weights is None:
        return datum(tokens, target_tokens=targets)
    return datum(tokens, target_tokens=targets, weights=weights)


def error_of(call: Any, *args: Any) -> str:
    with pytest.raises(ApiError) as info:
        call(*args)
    assert info.value.status == 400
    return info.value.message


# forward / forward_backward --------------------------------------------------------------


def test_cross_entropy_becomes_datums_with_typed_arrays() -> None:
    inp, work = forward_backward_input(
        fb_proto([ce_datum([1, 2, 3], [2, 3, 4], [1.0, 1.0, 0.0]), ce_datum([5], [6])]), LIMITS
    )
    assert inp.loss_fn == LossFn.CROSS_ENTROPY and inp.backward and inp.loss_fn_config is None
    first, second = inp.data
    assert first.tokens == [1, 2, 3]
    assert first.loss_fn_inputs["target_tokens"].dtype == "int64"
    assert first.loss_fn_inputs["target_tokens"].to_list() == [2, 3, 4]
    assert first.loss_fn_inputs["weights"].to_list() == [1.0, 1.0, 0.0]
    assert second.loss_fn_inputs.keys() == {"target_tokens"}
    assert (work.tokens, work.sequences) == (4, 2)


def test_forward_only_and_ppo_config_are_kept() -> None:
    rl = datum([1, 2], target_tokens=[2, 3], logprobs=[-1.0, -1.0], advantages=[1, -1])
    proto = fb_proto([rl], "ppo", loss_fn_config={"clip_low_threshold": 0.7})
    proto.forward_only = True
    inp, _ = forward_backward_input(proto, LIMITS)
    assert not inp.backward
    assert inp.loss_fn_config == pytest.approx({"clip_low_threshold": 0.7})
    # Integer advantages from a client become the float32 the losses read.
    assert inp.data[0].loss_fn_inputs["advantages"].dtype == "float32"


def test_unknown_loss_names_the_valid_ones() -> None:
    message = error_of(forward_backward_input, fb_proto([ce_datum([1], [2])], "dpo"), LIMITS)
    assert "'dpo' is not supported" in message
    assert "cross_entropy, importance_sampling, ppo, cispo, dro, gspo, stable_reinforce" in message
    message = error_of(forward_backward_input, fb_proto([ce_datum([1], [2])], "custom"), LIMITS)
    assert "forward_backward_custom" in message


def test_loss_inputs_whose_length_differs_from_the_tokens_are_refused() -> None:
    message = error_of(forward_backward_input, fb_proto([ce_datum([1, 2, 3], [2, 3])]), LIMITS)
    assert "data[0].loss_fn_inputs['target_tokens'] has shape [2]" in message
    assert "the datum has 3 tokens" in message


def test_tokens_outside_the_vocabulary_are_refused() -> None:
    message = error_of(forward_backward_input, fb_proto([ce_datum([1, 100], [2, 3])]), LIMITS)
    assert "data[0].model_input[1] is 100, outside the vocabulary [0, 100)" in message
    message = error_of(forward_backward_input, fb_proto([ce_datum([1, 2], [2, -1])]), LIMITS)
    assert "target_tokens'][1] is -1" in message


def test_missing_and_unknown_loss_inputs_are_named() -> None:
    rl = datum([1], target_tokens=[2], advantages=[1.0])
    assert "lacks ['logprobs']" in error_of(
        forward_backward_input, fb_proto([rl], "importance_sampling"), LIMITS
    )
    odd = datum([1], target_tokens=[2], advantages=[1.0])
    assert "has ['advantages'], which this loss does not read" in error_of(
        forward_backward_input, fb_proto([odd]), LIMITS
    )


def test_image_chunks_empty_data_and_long_datums_are_refused() -> None:
    proto = fb_proto([ce_datum([1], [2])])
    proto.data[0].model_input.add().image.data = b"png"
    assert "image chunk, which is not supported" in error_of(forward_backward_input, proto, LIMITS)
    assert "data is empty" in error_of(forward_backward_input, fb_proto([]), LIMITS)
    long = list(range(1, 34))
    assert "more than the model's 32 positions" in error_of(
        forward_backward_input, fb_proto([ce_datum(long, long)]), LIMITS
    )


def test_unknown_loss_config_keys_are_refused() -> None:
    proto = fb_proto([ce_datum([1], [2])], loss_fn_config={"clip_low_threshold": 0.5})
    assert "mean nothing to cross_entropy" in error_of(forward_backward_input, proto, LIMITS)


# create / optim ------------------------------------------------------------------------


def test_create_model_spec_keeps_lora_options_and_seed() -> None:
    body = CreateModelBody.model_validate(
        {
            "session_id": "s",
            "model_seq_id": 0,
            "base_model": "m",
            "lora_config": {"rank": 8, "seed": 3, "train_unembed": False},
            "optimizer_config": {"type": "adamw"},
        }
    )
    spec = job_spec(body, state_bytes=42)
    assert spec.lora is not None and spec.lora.rank == 8 and not spec.lora.train_unembed
    assert (spec.seed, spec.state_bytes) == (3, 42)
    full = job_spec(CreateModelBody(session_id="s", model_seq_id=1, base_model="m"), 7)
    assert full.lora is None


def test_other_optimizers_and_bad_adam_params_are_refused() -> None:
    dimuon = CreateModelBody.model_validate(
        {
            "session_id": "s",
            "model_seq_id": 0,
            "base_model": "m",
            "optimizer_config": {"type": "dimuon", "version": 1},
        }
    )
    assert "'dimuon' is not supported" in error_of(job_spec, dimuon, 0)
    bad = OptimStepBody(model_id="m", adam_params=AdamParamsBody(beta1=1.5, eps=0))
    message = error_of(adam_params, bad)
    assert "beta1 is 1.5" in message and "eps is 0" in message
    assert (
        adam_params(OptimStepBody(model_id="m", adam_params=AdamParamsBody())).learning_rate == 1e-4
    )


# sample --------------------------------------------------------------------------------


def sample_body(**params: Any) -> SampleBody:
    request = tinker.types.SampleRequest(
        prompt=tinker.ModelInput.from_ints([1, 2, 3]),
        sampling_params=tinker.SamplingParams(max_tokens=4, **params),
        num_samples=2,
        sampling_session_id="s:sample:0",
        seq_id=0,
    )
    return SampleBody.model_validate(request.model_dump(mode="json", exclude_none=True))


@pytest.mark.parametrize(
    ("stop", "strings", "tokens", "at_eos"),
    [
        (None, [], [], True),
        ([], [], [], False),
        ("\n", ["\n"], [], True),
        (["a", "b"], ["a", "b"], [], True),
        ([13, 14], [], [13, 14], True),
    ],
)
def test_stop_is_translated_faithfully(
    stop: Any, strings: list[str], tokens: list[int], at_eos: bool
) -> None:
    body = sample_body(stop=stop) if stop is not None else sample_body()
    inp, _ = sample_input(body, LIMITS, "tinker://s:train:0/sampler_weights/x")
    assert inp.params.stop_strings == strings
    assert inp.params.stop_tokens == tokens
    assert inp.params.stop_at_eos is at_eos
    assert (inp.prompt, inp.num_samples, inp.params.max_tokens) == ([1, 2, 3], 2, 4)
    assert inp.weights_path == "tinker://s:train:0/sampler_weights/x"


def test_sampling_limits_are_checked() -> None:
    assert "lower max_tokens to at most 29" in error_of(
        sample_input,
        sample_body().model_copy(
            update={
                "sampling_params": sample_body().sampling_params.model_copy(
                    update={"max_tokens": 40}
                )
            }
        ),
        LIMITS,
        None,
    )
    assert "stop[0] is 500" in error_of(sample_input, sample_body(stop=[500]), LIMITS, None)
    no_max = sample_body().model_copy(
        update={
            "sampling_params": sample_body().sampling_params.model_copy(update={"max_tokens": None})
        }
    )
    assert sample_input(no_max, LIMITS, None)[0].params.max_tokens == 29
    alt = sample_body().model_copy(update={"prompt_alt_tokens_k": 2})
    assert "prompt_alt_tokens_k: not supported" in error_of(sample_input, alt, LIMITS, None)


# paths ---------------------------------------------------------------------------------


def test_tinker_paths_parse_and_bad_ones_say_why() -> None:
    path = parse_tinker_path("tinker://s:train:0/weights/ckpt1")
    assert (path.model_id, path.kind, path.name, path.checkpoint_id) == (
        "s:train:0",
        "weights",
        "ckpt1",
        "weights/ckpt1",
    )
    assert str(path) == "tinker://s:train:0/weights/ckpt1"
    assert "must start with tinker://" in error_of(parse_tinker_path, "s3://x/weights/y")
    assert "expected three parts" in error_of(parse_tinker_path, "tinker://x/weights/a/b")
    assert "unknown type 'blobs'" in error_of(parse_tinker_path, "tinker://x/blobs/a")


# results -------------------------------------------------------------------------------


def future(kind: ResponseKind, **context: str) -> FutureRecord:
    return FutureRecord(
        request_id="req-1",
        tenant="t",
        job_id="s:train:0",
        function="f",
        created_at=0,
        response_kind=str(kind),
        response_context=context,
    )


def done(output: Any = None, error: ErrorInfo | None = None) -> PhaseCompletion:
    return PhaseCompletion(
        request_id="req-1",
        job_id="s:train:0",
        tenant="t",
        worker_id="w",
        function=Function.NOOP,
        status=CompletionStatus.OK if error is None else CompletionStatus.ERROR,
        timings=Timings(),
        result=output,
        error=error,
    )


def test_metric_keys_always_have_exactly_one_colon() -> None:
    assert tinker_metrics({"loss": 1.0, "loss:sum": 2.0, "a:b:mean": 3.0, "x:odd": 4.0}, "sum") == {
        "loss:sum": 2.0,
        "a/b:mean": 3.0,
        "x/odd:sum": 4.0,
    }
    assert tinker_metrics({"grad_norm": 0.5}, "mean") == {"grad_norm:mean": 0.5}


def test_forward_backward_result_is_protobuf_the_sdk_reads() -> None:
    output = ForwardBackwardOutput(
        loss_fn_outputs=[{"logprobs": TensorArray.from_list([-1.0, -2.0], "float32")}],
        metrics={"loss": 3.0},
    )
    response = render(future(ResponseKind.FORWARD_BACKWARD), done(output), output)
    assert response.media_type == "application/x-protobuf"
    decoded = response_conv.deserialize_forward_backward_output(bytes(response.body))
    assert decoded.metrics == {"loss:sum": 3.0}
    assert decoded.loss_fn_outputs[0]["logprobs"].tolist() == [-1.0, -2.0]


def test_json_results_have_the_shapes_the_sdk_validates() -> None:
    import json

    def body(kind: ResponseKind, output: Any, **ctx: str) -> Any:
        return json.loads(bytes(render(future(kind, **ctx), done(output), output).body))

    assert body(ResponseKind.CREATE_MODEL, CreateOutput(1, 2)) == {
        "type": "create_model",
        "model_id": "s:train:0",
    }
    optim = body(ResponseKind.OPTIM_STEP, OptimStepOutput({"grad_norm": 0.5}))
    assert tinker.types.OptimStepResponse.model_validate(optim).metrics == {"grad_norm:mean": 0.5}
    save = body(
        ResponseKind.SAVE_WEIGHTS_FOR_SAMPLER,
        SaveOutput("tinker://p", 1),
        **{CTX_SAMPLING_SESSION: "s:sample:0"},
    )
    assert save == {
        "type": "save_weights_for_sampler",
        "path": "tinker://p",
        "sampling_session_id": "s:sample:0",
    }


def test_errors_carry_their_category() -> None:
    import json

    user = render(
        future(ResponseKind.OPTIM_STEP),
        done(error=ErrorInfo(ErrorCode.BAD_REQUEST, "no grads")),
        None,
    )
    assert json.loads(bytes(user.body)) == {"error": "no grads", "category": "user"}
    server = render(
        future(ResponseKind.OPTIM_STEP), done(error=ErrorInfo(ErrorCode.INTERNAL, "oom")), None
    )
    assert json.loads(bytes(server.body))["category"] == "server"


def test_a_nan_metric_is_still_a_result_the_sdk_can_read() -> None:
    import json

    output = OptimStepOutput({"grad_norm": float("nan")})
    response = render(future(ResponseKind.OPTIM_STEP), done(output), output)
    assert response.status_code == 200
    metrics = json.loads(bytes(response.body))["metrics"]
    assert (
        metrics.keys() == {"grad_norm:mean"}
        and metrics["grad_norm:mean"] != metrics["grad_norm:mean"]
    )
