"""Tinker's protobuf bodies to PlexRL's messages and back; no validation of meaning here.

Requests arrive as `ForwardBackwardRequest`; forward/forward_backward and sample results
leave as `ForwardBackwardOutput` and `SampleResponse`. Arrays on this wire are raw
little-endian bytes, which numpy reads and writes without a copy per element.
"""

from __future__ import annotations

import math

import numpy as np
from google.protobuf.message import DecodeError

from plexrl.messages import ForwardBackwardOutput, SampleOutput, StopReason, TensorArray
from plexrl.messages.common import TensorDtype
from plexrl_gateway.proto import tinker_public_pb2 as pb

PROTOBUF = "application/x-protobuf"

# Tinker's filler for top-k cells a position does not have.
_TOPK_EMPTY_LOGPROB = -99999.0

_STOP_REASONS = {StopReason.STOP: pb.STOP_REASON_STOP, StopReason.LENGTH: pb.STOP_REASON_LENGTH}


class CodecError(ValueError):
    """A protobuf body that cannot be read; the message says where."""


def decode_forward_backward(body: bytes) -> pb.ForwardBackwardRequest:
    request = pb.ForwardBackwardRequest()
    try:
        request.ParseFromString(body)
    except DecodeError as exc:
        raise CodecError(
            f"body is not a tinker_public.ForwardBackwardRequest protobuf ({exc}); "
            "send it with Content-Type: application/x-protobuf"
        ) from exc
    return request


def chunk_tokens(where: str, chunk: pb.Chunk) -> list[int]:
    """The token ids of one model-input chunk; only encoded text carries tokens."""
    kind = chunk.WhichOneof("chunk")
    if kind == "encoded_text":
        return _array(where, chunk.encoded_text.tokens, "<i4").tolist()
    if kind is None:
        raise CodecError(f"{where} is an empty chunk; send an encoded_text chunk")
    raise CodecError(
        f"{where} is a {kind} chunk, which is not supported: PlexRL serves text models "
        "only; send encoded_text chunks"
    )


def tensor_array(where: str, tensor: pb.Tensor) -> np.ndarray:
    """A Tensor as a numpy array of its own dtype and shape (sparse CSR made dense)."""
    dtype = {
        pb.DTYPE_FLOAT32: "<f4",
        pb.DTYPE_INT64: "<i8",
        pb.DTYPE_INT32: "<i4",
        pb.DTYPE_BFLOAT16: "bf16",
    }.get(tensor.dtype)
    if dtype is None:
        raise CodecError(f"{where} has no dtype; send float32 or int64")
    shape = [int(d) for d in tensor.shape]
    if any(d < 0 for d in shape):
        raise CodecError(f"{where} has a negative dimension in shape {shape}")
    if tensor.WhichOneof("encoding") == "sparse_csr":
        return _dense_from_csr(where, tensor.sparse_csr, dtype, shape)
    values = _values(where, tensor.dense, dtype)
    if not shape:
        # The SDK sends no shape for a TensorData built without one (`shape=None`): the
        # values are a flat list, one per token.
        shape = [values.size]
    if values.size != math.prod(shape):
        raise CodecError(
            f"{where} carries {values.size} values, but its shape {shape} needs {math.prod(shape)}"
        )
    return values.reshape(shape)


def to_tensor_array(values: np.ndarray, dtype: TensorDtype) -> TensorArray:
    """A 1-D numpy array as a contract TensorArray ("int64" or "float32")."""
    wire = "<i8" if dtype == "int64" else "<f4"
    flat = np.ascontiguousarray(values, dtype=wire)
    return TensorArray(dtype=dtype, shape=list(flat.shape), data=flat.tobytes())


def encode_forward_backward_output(
    output: ForwardBackwardOutput, metrics: dict[str, float]
) -> bytes:
    """One ArrayRecord holding every datum's outputs, field by field."""
    record = pb.ArrayRecord(type_tag="ArrayRecord", num_datums=len(output.loss_fn_outputs))
    names = sorted({name for datum in output.loss_fn_outputs for name in datum})
    for name in names:
        arrays = [datum.get(name) for datum in output.loss_fn_outputs]
        present = [a for a in arrays if a is not None]
        if len(present) != len(arrays):
            continue  # a field missing for some datum cannot be batched; drop it
        record.fields[name].CopyFrom(_batched(present))
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    out.loss_fn_outputs.append(record)
    for key, value in metrics.items():
        out.metrics[key] = float(value)
    return out.SerializeToString()


def encode_sample_output(output: SampleOutput, prompt_logprobs_last_n: int | None = None) -> bytes:
    response = pb.SampleResponse()
    for seq in output.sequences:
        sequence = pb.SampledSequence(
            stop_reason=_STOP_REASONS[seq.stop_reason],
            tokens=np.asarray(seq.tokens, dtype="<i4").tobytes(),
        )
        if len(seq.logprobs) == len(seq.tokens):
            sequence.logprobs = np.asarray(seq.logprobs, dtype="<f4").tobytes()
        response.sequences.append(sequence)
    if output.prompt_logprobs is not None:
        values = [math.nan if v is None else v for v in output.prompt_logprobs]
        if prompt_logprobs_last_n is not None:
            cut = max(0, len(values) - prompt_logprobs_last_n)
            values[:cut] = [math.nan] * cut
        response.prompt_logprobs = np.asarray(values, dtype="<f4").tobytes()
    if output.topk_prompt_logprobs is not None:
        response.topk_prompt_logprobs.CopyFrom(_topk(output.topk_prompt_logprobs))
    return response.SerializeToString()


def _batched(arrays: list[TensorArray]) -> pb.BatchedTensor:
    dtype = arrays[0].dtype
    trailing = arrays[0].shape[1:]
    datas = [a.data for a in arrays]
    offsets = np.zeros(len(datas) + 1, dtype="<i8")
    np.cumsum([len(d) for d in datas], out=offsets[1:])
    return pb.BatchedTensor(
        data=b"".join(datas),
        offsets=offsets.tobytes(),
        dtype=pb.DTYPE_INT64 if dtype == "int64" else pb.DTYPE_FLOAT32,
        trailing_shape=trailing,
    )


def _topk(rows: list[list[tuple[int, float]] | None]) -> pb.TopkLogprobs:
    k = max((len(r) for r in rows if r), default=0)
    ids = np.zeros((len(rows), k), dtype="<i4")
    logprobs = np.full((len(rows), k), _TOPK_EMPTY_LOGPROB, dtype="<f4")
    for i, row in enumerate(rows):
        for j, (token, logprob) in enumerate(row or ()):
            ids[i, j] = token
            logprobs[i, j] = logprob
    return pb.TopkLogprobs(
        token_ids=ids.tobytes(), logprobs=logprobs.tobytes(), k=k, length=len(rows)
    )


def _array(where: str, data: bytes, dtype: str) -> np.ndarray:
    width = np.dtype(dtype).itemsize
    if len(data) % width:
        raise CodecError(f"{where} has {len(data)} bytes, not a whole number of {dtype} values")
    return np.frombuffer(data, dtype=dtype)


def _values(where: str, data: bytes, dtype: str) -> np.ndarray:
    if dtype == "bf16":
        # bfloat16 is the top half of a float32: widen by shifting the bits up.
        halves = _array(where, data, "<u2").astype("<u4") << 16
        return halves.view("<f4")
    return _array(where, data, dtype)


def _dense_from_csr(where: str, csr: pb.SparseCsr, dtype: str, shape: list[int]) -> np.ndarray:
    if len(shape) != 2:
        raise CodecError(f"{where} is sparse CSR with shape {shape}; CSR needs 2 dimensions")
    rows, cols = shape
    values = _values(where, csr.values, dtype)
    crow = _array(where, csr.crow_indices, "<i8")
    col = _array(where, csr.col_indices, "<i8")
    if len(crow) != rows + 1 or len(col) != len(values) or (len(crow) and crow[-1] != len(values)):
        raise CodecError(f"{where} has inconsistent CSR indices for shape {shape}")
    if len(col) and (col.min() < 0 or col.max() >= cols):
        raise CodecError(f"{where} has a CSR column index outside [0, {cols})")
    dense = np.zeros(shape, dtype=values.dtype)
    row_of = np.repeat(np.arange(rows), np.diff(crow))
    dense[row_of, col] = values
    return dense
