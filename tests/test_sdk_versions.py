"""Tinker SDKs from 0.16 to 0.38 against PlexRL.

The unit tests pin the header rule (sdk.py) and the JSON forms older SDKs speak
(codec_json.py). The integration tests run one end-to-end loop (tests/sdk_loop.py: LoRA
training client, forward_backward, optim_step, save_weights_and_get_sampling_client,
sample) with each SDK version that scripts/sdk_matrix.sh installs side by side, in a
subprocess whose PYTHONPATH starts at that version, against all four services on the
real Kafka and Redis.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import tinker

from plexrl.messages import (
    CompletionStatus,
    ForwardBackwardOutput,
    Function,
    PhaseCompletion,
    SampledSequence,
    SampleOutput,
    SaveOutput,
    StopReason,
    TensorArray,
    Timings,
)
from plexrl.stores import FutureRecord
from plexrl_gateway.codec import CodecError
from plexrl_gateway.codec_json import forward_backward_from_json
from plexrl_gateway.proto import tinker_public_pb2 as pb
from plexrl_gateway.render import (
    CTX_LAST_N,
    CTX_NO_PATH,
    CTX_SAMPLING_SESSION,
    ResponseKind,
    render,
)
from plexrl_gateway.routes_futures import accepts_protobuf
from plexrl_gateway.sdk import (
    EPHEMERAL_SAVE_WITHOUT_PATH_BEFORE,
    SdkVersion,
    ephemeral_save_carries_path,
    parse_version,
    sdk_version,
)
from plexrl_gateway.translate import ModelLimits, forward_backward_input
from plexrl_tools.cluster import ClusterConfig
from tests.sdk_support import MIDDLE, NEWEST, OLDEST, loop_result, run_sdk_loop, side_install

# What each SDK sends -------------------------------------------------------------------


def headers(version: str) -> dict[str, str]:
    """The identifying headers every Stainless-built Tinker SDK sends (0.16.1 to 0.38.0)."""
    return {
        "user-agent": f"AsyncTinker/Python {version}",
        "x-stainless-package-version": version,
        "x-stainless-lang": "python",
    }


def test_the_installed_sdk_sends_the_headers_the_rule_reads() -> None:
    from tinker._client import AsyncTinker

    client = AsyncTinker(api_key="tml-x", base_url="http://127.0.0.1:9")
    sent = {k.lower(): v for k, v in client.default_headers.items() if isinstance(v, str)}
    assert sent["x-stainless-package-version"] == tinker.__version__
    assert sent["user-agent"] == f"AsyncTinker/Python {tinker.__version__}"
    assert sdk_version(sent) == parse_version(tinker.__version__)


def test_sdk_version_comes_from_the_package_header_then_the_user_agent() -> None:
    assert sdk_version(headers("0.16.1")) == SdkVersion(0, 16, 1)
    assert sdk_version({"user-agent": "AsyncTinker/Python 0.19.0"}) == SdkVersion(0, 19, 0)
    assert sdk_version({"user-agent": "Tinker/Python 0.38.0"}) == SdkVersion(0, 38, 0)
    # The package header wins over a user agent a proxy or wrapper rewrote.
    both = {"x-stainless-package-version": "0.30.4", "user-agent": "AsyncTinker/Python 0.16.1"}
    assert sdk_version(both) == SdkVersion(0, 30, 4)
    # A garbled package header falls back to the user agent.
    garbled = {"x-stainless-package-version": "unknown", "user-agent": "AsyncTinker/Python 0.18.2"}
    assert sdk_version(garbled) == SdkVersion(0, 18, 2)
    assert parse_version("0.21.0rc1") == SdkVersion(0, 21, 0)
    for anonymous in ({}, {"user-agent": "curl/8.5.0"}, {"user-agent": "python-httpx/0.28.1"}):
        assert sdk_version(anonymous) is None


def test_only_sdks_before_0_20_get_the_ephemeral_save_without_a_path() -> None:
    assert SdkVersion(0, 20, 0) == EPHEMERAL_SAVE_WITHOUT_PATH_BEFORE
    for old in ("0.16.0", "0.16.1", "0.18.2", "0.19.0"):
        assert not ephemeral_save_carries_path(sdk_version(headers(old)))
    for new in ("0.20.0", "0.22.7", "0.30.4", "0.38.0", "1.0.0"):
        assert ephemeral_save_carries_path(sdk_version(headers(new)))
    assert ephemeral_save_carries_path(None)  # a client that does not say: the newest answer


def test_forward_and_sample_results_are_json_only_for_a_poll_that_asks_for_json() -> None:
    # The Accept header of a forward_backward or sample result poll, by SDK version.
    assert not accepts_protobuf({"accept": "application/json"})  # 0.16, 0.18
    assert accepts_protobuf({"accept": "application/x-protobuf, application/json"})  # 0.19-0.2x
    assert accepts_protobuf({"accept": "application/x-protobuf"})  # 0.30 on
    assert accepts_protobuf({}) and accepts_protobuf({"accept": "*/*"})  # not said: the newest


# The JSON forms ------------------------------------------------------------------------


def _future(kind: ResponseKind, **context: str) -> FutureRecord:
    return FutureRecord(
        request_id="req-1",
        tenant="t",
        job_id="s:train:0",
        function="f",
        created_at=0,
        response_kind=str(kind),
        response_context=context,
    )


def _done(output: Any) -> PhaseCompletion:
    return PhaseCompletion(
        request_id="req-1",
        job_id="s:train:0",
        tenant="t",
        worker_id="w",
        function=Function.NOOP,
        status=CompletionStatus.OK,
        timings=Timings(),
        result=output,
    )


def _rendered(
    kind: ResponseKind, output: Any, ctx: dict[str, str] | None = None, protobuf: bool = True
) -> Any:
    response = render(_future(kind, **(ctx or {})), _done(output), output, protobuf=protobuf)
    return json.loads(bytes(response.body))


def test_a_json_forward_backward_reads_as_the_protobuf_one() -> None:
    from tinker.proto import request_conv

    # Plain lists, as users write them; the SDK types them.
    inputs: dict[str, Any] = {
        "target_tokens": [2, 3, 4],
        "logprobs": [-1.0, -0.5, -2.0],
        "advantages": [1.0, 0.5, 0.0],
    }
    data = [tinker.Datum(model_input=tinker.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs=inputs)]
    request = tinker.types.ForwardBackwardRequest(
        forward_backward_input=tinker.types.ForwardBackwardInput(
            data=data, loss_fn="ppo", loss_fn_config={"clip_low_threshold": 0.7}
        ),
        model_id="s:train:0",
        seq_id=3,
    )
    # What SDKs before protobuf post for the same call: their pydantic request dumped with
    # exclude_unset (so no chunk `type`), lists typed by the Datum validator.
    body: dict[str, Any] = {
        "forward_backward_input": {
            "data": [
                {
                    "loss_fn_inputs": {
                        "target_tokens": {"data": [2, 3, 4], "dtype": "int64", "shape": [3]},
                        "logprobs": {"data": [-1.0, -0.5, -2.0], "dtype": "float32", "shape": [3]},
                        "advantages": {"data": [1.0, 0.5, 0.0], "dtype": "float32", "shape": [3]},
                    },
                    "model_input": {"chunks": [{"tokens": [1, 2, 3]}]},
                }
            ],
            "loss_fn": "ppo",
            "loss_fn_config": {"clip_low_threshold": 0.7},
        },
        "model_id": "s:train:0",
        "seq_id": 3,
    }
    as_json = forward_backward_from_json(body, forward_only=False)
    as_proto = pb.ForwardBackwardRequest()
    as_proto.ParseFromString(
        request_conv.forward_backward_request_to_proto(request).SerializeToString()
    )
    limits = ModelLimits(vocab_size=100, max_positions=32)
    assert forward_backward_input(as_json, limits) == forward_backward_input(as_proto, limits)
    assert (as_json.model_id, as_json.seq_id, as_json.forward_only) == ("s:train:0", 3, False)

    forward = {"forward_input": {"data": [], "loss_fn": "cross_entropy"}, "model_id": "m"}
    assert forward_backward_from_json(forward, forward_only=True).forward_only
    with pytest.raises(CodecError, match="forward_backward_input"):
        forward_backward_from_json(forward, forward_only=False)
    image = {
        "forward_backward_input": {
            "data": [{"model_input": {"chunks": [{"type": "image"}]}, "loss_fn_inputs": {}}],
            "loss_fn": "cross_entropy",
        },
        "model_id": "m",
    }
    with pytest.raises(CodecError, match="image chunk"):
        forward_backward_from_json(image, forward_only=False)
    bad_shape = json.loads(json.dumps(body))
    bad_shape["forward_backward_input"]["data"][0]["loss_fn_inputs"]["logprobs"]["shape"] = "3"
    with pytest.raises(CodecError, match="shape"):
        forward_backward_from_json(bad_shape, forward_only=False)
    no_chunks = {**body, "forward_backward_input": {**body["forward_backward_input"]}}
    no_chunks["forward_backward_input"]["data"] = [{"model_input": [1, 2], "loss_fn_inputs": {}}]
    with pytest.raises(CodecError, match="model_input needs chunks"):
        forward_backward_from_json(no_chunks, forward_only=False)


def test_results_are_json_when_the_poll_does_not_accept_protobuf() -> None:
    output = ForwardBackwardOutput(
        loss_fn_outputs=[{"logprobs": TensorArray.from_list([-1.0, -2.0], "float32")}],
        metrics={"loss": 3.0},
    )
    # The shapes of SDK 0.16's pydantic ForwardBackwardOutput and SampleResponse (newer
    # SDKs read these results as protobuf only; the 0.16.1 loop below reads them for real).
    assert _rendered(ResponseKind.FORWARD_BACKWARD, output, protobuf=False) == {
        "loss_fn_output_type": "ArrayRecord",
        "loss_fn_outputs": [{"logprobs": {"data": [-1.0, -2.0], "dtype": "float32", "shape": [2]}}],
        "metrics": {"loss:sum": 3.0},
    }

    sample = SampleOutput(
        sequences=[
            SampledSequence(tokens=[5, 6], logprobs=[-0.5, -0.25], stop_reason=StopReason.STOP)
        ],
        prompt_logprobs=[None, -1.0, -2.0],
    )
    assert _rendered(ResponseKind.SAMPLE, sample, {CTX_LAST_N: "2"}, protobuf=False) == {
        "type": "sample",
        "sequences": [{"stop_reason": "stop", "tokens": [5, 6], "logprobs": [-0.5, -0.25]}],
        "prompt_logprobs": [None, -1.0, -2.0],
    }
    short = _rendered(ResponseKind.SAMPLE, sample, {CTX_LAST_N: "1"}, protobuf=False)
    assert short["prompt_logprobs"] == [None, None, -2.0]


def test_the_ephemeral_save_leaves_out_its_path_when_told() -> None:
    save = SaveOutput("tinker://s:train:0/sampler_weights/ephemeral-0", 1)
    ctx = {CTX_SAMPLING_SESSION: "s:sample:0"}
    assert _rendered(ResponseKind.SAVE_WEIGHTS_FOR_SAMPLER, save, ctx)["path"] == save.path
    old = _rendered(ResponseKind.SAVE_WEIGHTS_FOR_SAMPLER, save, {**ctx, CTX_NO_PATH: "1"})
    assert old == {"type": "save_weights_for_sampler", "sampling_session_id": "s:sample:0"}


# The same loop with each SDK version, against all four services ------------------------

KEY = "tml-sdk-versions"
MODEL = "plexrl/tiny-qwen3"


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest) -> ClusterConfig:
    side_install(f"tinker-{OLDEST}")  # skip (or fail in CI) before starting four services
    config: ClusterConfig = request.getfixturevalue("shared_cluster")  # tests/conftest.py
    return config


@pytest.mark.integration
@pytest.mark.parametrize("version", [OLDEST, *MIDDLE, NEWEST])
def test_the_same_loop_runs_with_each_sdk_version(
    version: str, cluster: ClusterConfig, tiny_registry: Path
) -> None:
    sdk = side_install(f"tinker-{version}")
    tokenizer_dir = tiny_registry / "tiny-qwen3"
    done = run_sdk_loop(sdk, cluster.gateway_url, KEY, MODEL, tokenizer_dir, timeout_s=600)
    assert done.returncode == 0, f"{sdk.name} failed:\n{done.stdout}\n{done.stderr[-6000:]}"
    result = loop_result(done)
    # The subprocess ran the side install, not .venv's SDK.
    assert result["sdk"] == version and result["file"].startswith(str(sdk)), result
    first, second = result["losses"]
    assert second < first, f"{version}: one optim_step did not lower the loss: {result}"
