"""PlexRL's tinker_public.proto must be byte-compatible with the SDK's own.

Messages are built with one module and read with the other in both directions, and the
SDK's own converters (what the client really runs) read what the gateway writes.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import tinker
from google.protobuf.descriptor import Descriptor, EnumDescriptor
from tinker.proto import request_conv, response_conv
from tinker.proto import tinker_public_pb2 as theirs

from plexrl.messages import ForwardBackwardOutput, SampledSequence, SampleOutput, StopReason
from plexrl.messages import TensorArray as Array
from plexrl_gateway.codec import (
    CodecError,
    chunk_tokens,
    decode_forward_backward,
    encode_forward_backward_output,
    encode_sample_output,
    tensor_array,
)
from plexrl_gateway.proto import tinker_public_pb2 as ours


def _fields(message: Descriptor) -> list[tuple[object, ...]]:
    return sorted(
        (
            f.name,
            f.number,
            f.type,
            f.is_repeated,
            f.has_presence,
            f.containing_oneof.name if f.containing_oneof else None,
            f.message_type.name if f.message_type else None,
            f.enum_type.name if f.enum_type else None,
        )
        for f in message.fields
    )


def _enum(enum: EnumDescriptor) -> list[tuple[str, int]]:
    return sorted((v.name, v.number) for v in enum.values)


def test_every_message_and_enum_matches_the_sdk_descriptor() -> None:
    mine, sdk = ours.DESCRIPTOR, theirs.DESCRIPTOR
    assert set(mine.message_types_by_name) == set(sdk.message_types_by_name)
    for name, message in sdk.message_types_by_name.items():
        assert _fields(mine.message_types_by_name[name]) == _fields(message), name
        for nested in message.nested_types:
            assert _fields(mine.message_types_by_name[name].nested_types_by_name[nested.name]) == (
                _fields(nested)
            )
    assert set(mine.enum_types_by_name) == set(sdk.enum_types_by_name)
    for name, enum in sdk.enum_types_by_name.items():
        assert _enum(mine.enum_types_by_name[name]) == _enum(enum), name


def _sdk_request() -> theirs.ForwardBackwardRequest:
    """What the real SDK sends for a PPO forward_backward with dense and CSR inputs."""
    import torch

    rl_inputs: dict[str, Any] = {
        "target_tokens": [2, 3, 4],
        "logprobs": [-0.5, -0.25, -1.0],
        "advantages": [1.0, 1.0, -1.0],
    }
    rl = tinker.Datum(model_input=tinker.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs=rl_inputs)
    top_k = torch.zeros(3, 4, dtype=torch.int64)
    top_k[1, 2] = 9
    sparse_inputs: dict[str, Any] = {
        "target_tokens": tinker.TensorData.from_torch_sparse(top_k),
        "weights": [0.0, 1.0, 1.0],
    }
    sparse = tinker.Datum(
        model_input=tinker.ModelInput.from_ints([5, 6]).append_int(7), loss_fn_inputs=sparse_inputs
    )
    request = tinker.types.ForwardBackwardRequest(
        forward_backward_input=tinker.types.ForwardBackwardInput(
            data=[rl, sparse],
            loss_fn="ppo",
            loss_fn_config={"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
        ),
        model_id="sess-1:train:0",
        seq_id=3,
    )
    return request_conv.forward_backward_request_to_proto(request)


def test_request_bytes_cross_both_ways_unchanged() -> None:
    sdk = _sdk_request()
    wire = sdk.SerializeToString(deterministic=True)
    mine = decode_forward_backward(wire)
    assert mine.SerializeToString(deterministic=True) == wire
    back = theirs.ForwardBackwardRequest()
    back.ParseFromString(mine.SerializeToString())
    assert back == sdk


def test_request_decodes_to_tokens_and_arrays() -> None:
    mine = decode_forward_backward(_sdk_request().SerializeToString())
    assert (mine.model_id, mine.seq_id, mine.loss_fn) == ("sess-1:train:0", 3, "ppo")
    assert dict(mine.loss_fn_config) == pytest.approx(
        {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    )
    first, second = mine.data
    assert chunk_tokens("c", first.model_input[0]) == [1, 2, 3]
    assert [t for c in second.model_input for t in chunk_tokens("c", c)] == [5, 6, 7]
    targets = tensor_array("t", first.loss_fn_inputs["target_tokens"])
    assert targets.dtype == np.int64 and targets.tolist() == [2, 3, 4]
    assert tensor_array("l", first.loss_fn_inputs["logprobs"]).tolist() == [-0.5, -0.25, -1.0]
    # The SDK chose CSR for the mostly-zero 2-D tensor; it comes back dense.
    sparse = second.loss_fn_inputs["target_tokens"]
    assert sparse.WhichOneof("encoding") == "sparse_csr"
    dense = tensor_array("s", sparse)
    assert dense.shape == (3, 4) and dense[1, 2] == 9 and dense.sum() == 9


def test_forward_only_flag_survives() -> None:
    sdk = theirs.ForwardBackwardRequest(
        model_id="m", seq_id=1, loss_fn="cross_entropy", forward_only=True
    )
    assert decode_forward_backward(sdk.SerializeToString()).forward_only


def test_garbage_body_is_a_codec_error() -> None:
    with pytest.raises(CodecError, match=r"not a tinker_public\.ForwardBackwardRequest"):
        decode_forward_backward(b"\xff\xff\xff\xff")


def test_image_chunk_is_refused_with_a_reason() -> None:
    chunk = ours.Chunk(image=ours.ImageChunk(data=b"png", format="png"))
    with pytest.raises(CodecError, match="image chunk, which is not supported"):
        chunk_tokens("data[0].model_input[0]", chunk)


def test_bfloat16_is_widened() -> None:
    bf16 = (np.array([1.5, -2.0], dtype="<f4").view("<u4") >> 16).astype("<u2")
    tensor = ours.Tensor(dense=bf16.tobytes(), dtype=ours.DTYPE_BFLOAT16, shape=[2])
    assert tensor_array("w", tensor).tolist() == [1.5, -2.0]


def test_a_tensor_sent_without_shape_is_a_flat_list() -> None:
    # tinker.TensorData(data=[...], dtype=...) with no shape goes out with shape [].
    values = np.array([1.0, 0.5, 0.0], dtype="<f4")
    tensor = ours.Tensor(dense=values.tobytes(), dtype=ours.DTYPE_FLOAT32)
    assert tensor_array("w", tensor).tolist() == [1.0, 0.5, 0.0]


def test_forward_backward_output_reads_back_through_the_sdk() -> None:
    output = ForwardBackwardOutput(
        loss_fn_outputs=[
            {"logprobs": Array.from_list([-1.5] * 4, "float32")},
            {"logprobs": Array.from_list([-0.5, -0.25], "float32")},
        ],
        metrics={"loss:sum": 9.0},
    )
    wire = encode_forward_backward_output(output, {"loss:sum": 9.0})
    decoded = response_conv.deserialize_forward_backward_output(wire)
    assert decoded.loss_fn_output_type == "ArrayRecord"
    assert decoded.metrics == {"loss:sum": 9.0}
    assert [d["logprobs"].tolist() for d in decoded.loss_fn_outputs] == [[-1.5] * 4, [-0.5, -0.25]]
    same = theirs.ForwardBackwardOutput()
    same.ParseFromString(wire)
    assert same.loss_fn_outputs[0].num_datums == 2


def test_sample_output_reads_back_through_the_sdk() -> None:
    output = SampleOutput(
        sequences=[
            SampledSequence(
                tokens=[10, 11, 12], logprobs=[-0.25] * 3, stop_reason=StopReason.LENGTH
            ),
            SampledSequence(tokens=[7], logprobs=[-1.0], stop_reason=StopReason.STOP),
        ],
        prompt_logprobs=[None, -2.0, -3.0],
        topk_prompt_logprobs=[None, [(4, -0.1), (5, -0.2)], [(6, -0.3)]],
    )
    decoded = response_conv.deserialize_sample_response(encode_sample_output(output))
    assert [s.stop_reason for s in decoded.sequences] == ["length", "stop"]
    assert [s.tokens for s in decoded.sequences] == [[10, 11, 12], [7]]
    assert decoded.sequences[0].logprobs == pytest.approx([-0.25] * 3)
    assert decoded.prompt_logprobs == [None, -2.0, -3.0]
    topk = decoded.topk_prompt_logprobs
    assert topk is not None and topk[0] is None and topk[2] == [(6, pytest.approx(-0.3))]


def test_prompt_logprobs_last_n_masks_the_head() -> None:
    output = SampleOutput(sequences=[], prompt_logprobs=[None, -1.0, -2.0, -3.0])
    decoded = response_conv.deserialize_sample_response(encode_sample_output(output, 2))
    assert decoded.prompt_logprobs is not None
    assert [None if v is None or math.isnan(v) else v for v in decoded.prompt_logprobs] == [
        None,
        None,
        -2.0,
        -3.0,
    ]
