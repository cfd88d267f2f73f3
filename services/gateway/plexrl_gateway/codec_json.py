"""Tinker's JSON bodies, as SDKs before protobuf send and read them, and the one checked
path every JSON request body of the gateway is decoded by.

`decode_json` bounds what a body may cost before decoding it (its arrays, objects,
elements and members, counted from the bytes), then decodes it with msgspec, straight
into the route's Struct where it has one (schemas.py), checking every value's type and
range as it is read; anything it cannot take is a `CodecError` that says where and what
is allowed. FastAPI's pydantic bodies come through it too (body_limit.CheckedRequest).

SDK 0.16 posts `/forward` and `/forward_backward` as JSON and reads every result as JSON;
SDKs 0.19 to 0.2x post JSON too unless the client config asks for protobuf. A JSON
request becomes the same `ForwardBackwardRequest` protobuf that newer SDKs send, so one
path (translate.py) checks and translates both; results leave as the JSON the SDK's
pydantic types read (`TensorData` is `{"data": [...], "dtype": ..., "shape": [...]}`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any, TypeVar

import msgspec
import numpy as np

from plexrl.limits import DEFAULT_LIMITS, CallLimits
from plexrl.messages import ForwardBackwardOutput, SampleOutput, TensorArray
from plexrl_gateway.codec import CodecError
from plexrl_gateway.proto import tinker_public_pb2 as pb
from plexrl_gateway.schemas import (
    DatumBody,
    ForwardBackwardBody,
    ForwardBackwardInputBody,
    ForwardBody,
    TensorDataBody,
)

T = TypeVar("T")

_DTYPES = {"int64": (pb.DTYPE_INT64, "<i8"), "float32": (pb.DTYPE_FLOAT32, "<f4")}

_CHUNK = '{"type": "encoded_text", "tokens": [ids]}'
_TENSOR = '{"data": [numbers], "dtype": "int64" | "float32", "shape": [sizes]}'
# What each field of a forward / forward_backward body may hold, by its name: said after
# msgspec's own "Expected X, got Y - at $.path".
_ALLOWED = {
    "forward_backward_input": "{data: [datum], loss_fn, loss_fn_config}",
    "forward_input": "{data: [datum], loss_fn, loss_fn_config}",
    "data": "a list of datums, or for TensorData a flat list of numbers",
    "model_input": f'model_input needs chunks: {{"chunks": [{_CHUNK}]}}',
    "chunks": f"a list of {_CHUNK}",
    "tokens": "token ids, integers in [0, 2^31)",
    "loss_fn_inputs": f"an object of TensorData {_TENSOR}",
    "loss_fn_config": "an object of numbers (or strings)",
    "dtype": '"int64" or "float32"',
    "shape": "a list of sizes (integers >= 0)",
    "loss_fn": "a loss name such as cross_entropy",
    "model_id": "a string",
    "seq_id": "an integer in [0, 2^31)",
}
_TOO_DEEP = (
    "the body nests JSON arrays and objects too deeply; no Tinker request nests more "
    "than a few levels"
)
_PATH_FIELD = re.compile(r"\.([A-Za-z_]+)(?:\[[^\]]*\])*`?$")


def check_json_size(body: bytes, caps: CallLimits = DEFAULT_LIMITS) -> None:
    """Refuses a body whose decoding could build more objects than the caps allow.

    Counted over the raw bytes (C-speed, no copy), strings included, so the counts bound
    from above what any decoder makes: each array or object starts with '[' or '{', each
    element after the first follows a ',', each member has a ':'."""
    containers = body.count(b"[") + body.count(b"{")
    if containers > caps.max_json_containers:
        raise CodecError(
            f"the body holds up to {containers} JSON arrays and objects, more than the "
            f"{caps.max_json_containers} one request may; send fewer datums (or chunks) "
            "per call"
        )
    items = body.count(b",") + body.count(b":")
    if items > caps.max_json_items:
        raise CodecError(
            f"the body holds up to {items} JSON values, more than the {caps.max_json_items} "
            "one request may; split the data into several calls"
        )


def check_json(body: bytes, caps: CallLimits = DEFAULT_LIMITS) -> None:
    """Refuses a body that is not JSON, nests too deeply, or could decode into more
    objects than the caps allow, building no objects (every route's body passes here
    before the route decodes it: body_limit.BodySizeLimit)."""
    check_json_size(body, caps)
    if not body.isascii():  # skipping below does not look inside strings
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise CodecError(
                f"the body is not UTF-8 ({exc.reason} at byte {exc.start}); send JSON in UTF-8"
            ) from None
    try:
        msgspec.json.decode(body, type=msgspec.Raw)  # walks the syntax, keeps nothing
    except msgspec.DecodeError as exc:
        raise CodecError(f"the body is not JSON ({exc})") from None
    except RecursionError:
        raise CodecError(_TOO_DEEP) from None


def decode_json(body: bytes, into: type[T], caps: CallLimits = DEFAULT_LIMITS) -> T:
    """A JSON body as `into` (a Struct, or `Any` for plain JSON values), or a CodecError."""
    check_json_size(body, caps)
    try:
        decoded: T = _decoder(into).decode(body)
        return decoded
    except msgspec.ValidationError as exc:
        raise CodecError(_invalid(into, exc)) from None
    except msgspec.DecodeError as exc:
        raise CodecError(f"the body is not JSON ({exc})") from None
    except RecursionError:
        raise CodecError(_TOO_DEEP) from None


_DECODERS: dict[object, msgspec.json.Decoder[Any]] = {}


def _decoder(into: object) -> msgspec.json.Decoder[Any]:
    """One decoder per type: building one compiles the type's checks."""
    if (decoder := _DECODERS.get(into)) is None:
        decoder = _DECODERS[into] = msgspec.json.Decoder(into)
    return decoder


def _invalid(into: Any, exc: msgspec.ValidationError) -> str:
    what = getattr(into, "__name__", "JSON")
    message = f"the body is not a valid {what}: {exc}"
    if field := _PATH_FIELD.search(str(exc)):
        if allowed := _ALLOWED.get(field.group(1)):
            message += f"; {field.group(1)} takes {allowed}"
    elif str(exc).startswith("Expected `object`"):
        message += "; send a JSON object"
    return message


def forward_backward_from_json(
    body: bytes | Mapping[str, Any], forward_only: bool, caps: CallLimits = DEFAULT_LIMITS
) -> pb.ForwardBackwardRequest:
    """A JSON `ForwardBackwardRequest` (`forward_backward_input`) or `ForwardRequest`
    (`forward_input`) as the protobuf request: `body` as it came off the wire, or already
    decoded to plain objects (converted against the same Structs)."""
    into: type[ForwardBody | ForwardBackwardBody] = (
        ForwardBody if forward_only else ForwardBackwardBody
    )
    parsed: ForwardBody | ForwardBackwardBody
    if isinstance(body, bytes):
        parsed = decode_json(body, into, caps)
    else:
        try:
            parsed = msgspec.convert(body, into)
        except msgspec.ValidationError as exc:
            raise CodecError(_invalid(into, exc)) from None
    inp: ForwardBackwardInputBody = (
        parsed.forward_input if isinstance(parsed, ForwardBody) else parsed.forward_backward_input
    )
    key = "forward_input" if forward_only else "forward_backward_input"
    request = pb.ForwardBackwardRequest(
        model_id=parsed.model_id,
        seq_id=parsed.seq_id or 0,
        loss_fn=inp.loss_fn,
        forward_only=forward_only,
    )
    for name, value in (inp.loss_fn_config or {}).items():
        if isinstance(value, str):
            request.loss_fn_config_v2[name].text = value
        else:
            request.loss_fn_config[name] = float(value)
            request.loss_fn_config_v2[name].number = float(value)
    for i, datum in enumerate(inp.data):
        request.data.append(_datum(f"{key}.data[{i}]", datum))
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


def _datum(where: str, datum: DatumBody) -> pb.Datum:
    out = pb.Datum()
    for j, chunk in enumerate(datum.model_input.chunks):
        if chunk.type != "encoded_text":
            raise CodecError(
                f"{where} chunk {j} is a {chunk.type} chunk, which is not supported: PlexRL "
                "serves text models only; send encoded_text chunks"
            )
        tokens = np.asarray(chunk.tokens, dtype="<i4")  # in int32 range: checked at decode
        out.model_input.append(pb.Chunk(encoded_text=pb.EncodedTextChunk(tokens=tokens.tobytes())))
    for name, tensor in (datum.loss_fn_inputs or {}).items():
        out.loss_fn_inputs[name].CopyFrom(_tensor(f"{where}.loss_fn_inputs[{name!r}]", tensor))
    return out


def _tensor(where: str, tensor: TensorDataBody) -> pb.Tensor:
    wire, dtype = _DTYPES[tensor.dtype]
    if tensor.dtype == "int64" and not all(isinstance(v, int) for v in tensor.data):
        raise CodecError(f"{where} is int64 but holds a non-integer; send integer values")
    # int64 values are in range (checked at decode); float32 ones may overflow to inf,
    # which translate.py refuses with a message.
    with np.errstate(over="ignore"):
        values = np.asarray(tensor.data, dtype=dtype)
    shape = tensor.shape
    return pb.Tensor(dense=values.tobytes(), dtype=wire, shape=shape or [values.size])


def _tensor_data(array: TensorArray) -> dict[str, Any]:
    wire = "<i8" if array.dtype == "int64" else "<f4"
    values = np.frombuffer(array.data, dtype=wire)
    return {"data": values.tolist(), "dtype": array.dtype, "shape": list(array.shape)}
