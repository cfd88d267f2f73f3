"""Tinker's JSON bodies, as SDKs before protobuf send and read them.

SDK 0.16 posts `/forward` and `/forward_backward` as JSON and reads every result as JSON;
SDKs 0.19 to 0.2x post JSON too unless the client config asks for protobuf. A JSON
request becomes the same `ForwardBackwardRequest` protobuf that newer SDKs send, so one
path (translate.py) checks and translates both; results leave as the JSON the SDK's
pydantic types read (`TensorData` is `{"data": [...], "dtype": ..., "shape": [...]}`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from plexrl.messages import ForwardBackwardOutput, SampleOutput, TensorArray
from plexrl_gateway.codec import CodecError
from plexrl_gateway.proto import tinker_public_pb2 as pb

_DTYPES = {"int64": (pb.DTYPE_INT64, "<i8"), "float32": (pb.DTYPE_FLOAT32, "<f4")}


def forward_backward_from_json(
    body: Mapping[str, Any], forward_only: bool
) -> pb.ForwardBackwardRequest:
    """A JSON `ForwardBackwardRequest` (`forward_backward_input`) or `ForwardRequest`
    (`forward_input`) as the protobuf request."""
    key = "forward_input" if forward_only else "forward_backward_input"
    inp = body.get(key)
    if not isinstance(inp, Mapping):
        raise CodecError(f"the body needs {key!r}: {{data, loss_fn, loss_fn_config}}")
    model_id, seq_id = body.get("model_id"), body.get("seq_id")
    if not isinstance(model_id, str):
        raise CodecError("the body needs model_id (a string)")
    if seq_id is not None and not isinstance(seq_id, int):
        raise CodecError("seq_id must be an integer")
    loss_fn = inp.get("loss_fn")
    if not isinstance(loss_fn, str):
        raise CodecError(f"{key}.loss_fn must be a string")
    request = pb.ForwardBackwardRequest(
        model_id=model_id, seq_id=seq_id or 0, loss_fn=loss_fn, forward_only=forward_only
    )
    for name, value in (inp.get("loss_fn_config") or {}).items():
        if isinstance(value, str):
            request.loss_fn_config_v2[name].text = value
        elif isinstance(value, int | float) and not isinstance(value, bool):
            request.loss_fn_config[name] = float(value)
            request.loss_fn_config_v2[name].number = float(value)
        else:
            raise CodecError(f"{key}.loss_fn_config[{name!r}] must be a number or a string")
    data = inp.get("data")
    if not isinstance(data, list):
        raise CodecError(f"{key}.data must be a list of datums")
    for i, datum in enumerate(data):
        request.data.append(_datum(f"datum {i}", datum))
    return request


def forward_backward_output_json(
    output: ForwardBackwardOutput, metrics: dict[str, float]
) -> dict[str, Any]:
    """`ForwardBackwardOutput` as JSON: per datum, a map of TensorData."""
    return {
        "loss_fn_output_type": "ArrayRecord",
        "loss_fn_outputs": [
            {name: _tensor_data(array) for name, array in datum.items()}
            for datum in output.loss_fn_outputs
        ],
        "metrics": metrics,
    }


def sample_output_json(output: SampleOutput, prompt_logprobs_last_n: int | None) -> dict[str, Any]:
    """`SampleResponse` as JSON; prompt logprobs outside the last n are null."""
    body: dict[str, Any] = {
        "type": "sample",
        "sequences": [
            {
                "stop_reason": str(seq.stop_reason),
                "tokens": list(seq.tokens),
                "logprobs": list(seq.logprobs) if len(seq.logprobs) == len(seq.tokens) else None,
            }
            for seq in output.sequences
        ],
    }
    if output.prompt_logprobs is not None:
        values: list[float | None] = [
            None if v is None or math.isnan(v) else v for v in output.prompt_logprobs
        ]
        if prompt_logprobs_last_n is not None:
            cut = max(0, len(values) - prompt_logprobs_last_n)
            values[:cut] = [None] * cut
        body["prompt_logprobs"] = values
    if output.topk_prompt_logprobs is not None:
        body["topk_prompt_logprobs"] = [
            None if row is None else [list(pair) for pair in row]
            for row in output.topk_prompt_logprobs
        ]
    return body


def _datum(where: str, datum: Any) -> pb.Datum:
    if not isinstance(datum, Mapping):
        raise CodecError(f"{where} must be an object with model_input and loss_fn_inputs")
    out = pb.Datum()
    model_input = datum.get("model_input")
    chunks = model_input.get("chunks") if isinstance(model_input, Mapping) else None
    if not isinstance(chunks, list):
        raise CodecError(f"{where}.model_input needs chunks (a list)")
    for j, chunk in enumerate(chunks):
        kind = chunk.get("type", "encoded_text") if isinstance(chunk, Mapping) else None
        if kind != "encoded_text":
            raise CodecError(
                f"{where} chunk {j} is a {kind} chunk, which is not supported: PlexRL serves "
                "text models only; send encoded_text chunks"
            )
        tokens = np.asarray(chunk.get("tokens", []), dtype="<i4")
        out.model_input.append(pb.Chunk(encoded_text=pb.EncodedTextChunk(tokens=tokens.tobytes())))
    inputs = datum.get("loss_fn_inputs") or {}
    if not isinstance(inputs, Mapping):
        raise CodecError(f"{where}.loss_fn_inputs must be an object of TensorData")
    for name, tensor in inputs.items():
        out.loss_fn_inputs[name].CopyFrom(_tensor(f"{where}.loss_fn_inputs[{name!r}]", tensor))
    return out


def _tensor(where: str, tensor: Any) -> pb.Tensor:
    if not isinstance(tensor, Mapping) or "data" not in tensor:
        raise CodecError(f"{where} must be TensorData: {{data, dtype, shape}}")
    dtype = _DTYPES.get(tensor.get("dtype", ""))
    if dtype is None:
        raise CodecError(f"{where} has dtype {tensor.get('dtype')!r}; send float32 or int64")
    try:
        values = np.asarray(tensor["data"], dtype=dtype[1])
    except (TypeError, ValueError) as exc:
        raise CodecError(f"{where} data is not a flat list of numbers ({exc})") from None
    shape = tensor.get("shape")
    if shape is not None and not (
        isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)
    ):
        raise CodecError(f"{where} has shape {shape!r}; send a list of sizes")
    return pb.Tensor(
        dense=values.tobytes(), dtype=dtype[0], shape=list(shape) if shape else [values.size]
    )


def _tensor_data(array: TensorArray) -> dict[str, Any]:
    wire = "<i8" if array.dtype == "int64" else "<f4"
    values = np.frombuffer(array.data, dtype=wire)
    return {"data": values.tolist(), "dtype": array.dtype, "shape": list(array.shape)}
