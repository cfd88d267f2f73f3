"""Phase results to Tinker future results: JSON for most, protobuf for forward and sample.

A future remembers (in its FutureRecord) how its result must be shown; `render` reads
that, the completion, and whether the poll accepts protobuf (SDKs before 0.19 read forward
and sample results as JSON, and say so by accepting only JSON).
"""

from __future__ import annotations

import enum
import json
from typing import Any

from fastapi import Response
from fastapi.responses import JSONResponse

from plexrl.messages import (
    CompletionStatus,
    CreateOutput,
    ForwardBackwardOutput,
    LoadOutput,
    OptimStepOutput,
    PhaseCompletion,
    PhaseOutput,
    SampleOutput,
    SaveOutput,
)
from plexrl.stores import FutureRecord
from plexrl_gateway.codec import PROTOBUF, encode_forward_backward_output, encode_sample_output
from plexrl_gateway.codec_json import forward_backward_output_json, sample_output_json
from plexrl_gateway.errors import Category, error_body

# The reductions the SDK knows how to merge across chunks; others are dropped by it.
KNOWN_REDUCTIONS = frozenset({"sum", "mean", "min", "max", "slack", "hash2", "unique"})


class ResponseKind(enum.StrEnum):
    """How a future's result is shown to the client."""

    CREATE_MODEL = "create_model"
    """`{"type":"create_model","model_id":...}`."""
    FORWARD = "forward"
    """Protobuf ForwardBackwardOutput (no gradients were taken)."""
    FORWARD_BACKWARD = "forward_backward"
    """Protobuf ForwardBackwardOutput."""
    OPTIM_STEP = "optim_step"
    """`{"type":"optim_step","metrics":{...}}`."""
    SAVE_WEIGHTS = "save_weights"
    """`{"type":"save_weights","path":...}`."""
    SAVE_WEIGHTS_FOR_SAMPLER = "save_weights_for_sampler"
    """`{"type":"save_weights_for_sampler","path":...}`, plus the sampling session when
    the save was the ephemeral kind (and then no path for SDKs before 0.20)."""
    SAVE_WEIGHTS_EXTERNAL = "save_weights_external"
    """`{"type":"save_weights_external","path":...,"size_bytes":...}`."""
    LOAD_WEIGHTS = "load_weights"
    """`{"type":"load_weights","path":...,"model_id":...}`."""
    SAMPLE = "sample"
    """Protobuf SampleResponse."""
    UNLOAD_MODEL = "unload_model"
    """`{"type":"unload_model","model_id":...}`."""
    NOOP = "noop"
    """`{"type":"noop"}`; PlexRL's echo calls."""


class ResultJSON(JSONResponse):
    """JSON that may carry NaN and infinities (a diverged loss is still a result).

    Starlette refuses them, which would turn a finished call into a 500 that the SDK
    retries forever; Python's json, which the SDK reads with, accepts them.
    """

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=False, separators=(",", ":")).encode()


# Keys of FutureRecord.response_context.
CTX_MODEL_ID = "model_id"
CTX_SAMPLING_SESSION = "sampling_session_id"
CTX_LAST_N = "prompt_logprobs_last_n"
# Set (to "1") when the ephemeral save's result must not carry its path (sdk.py).
CTX_NO_PATH = "no_path"


def try_again(request_id: str) -> JSONResponse:
    """Not done yet. 408 (not 200) so the SDK re-polls without a console warning."""
    body = {"type": "try_again", "request_id": request_id, "queue_state": "active"}
    return JSONResponse(body, status_code=408)


def render(
    future: FutureRecord,
    completion: PhaseCompletion,
    output: PhaseOutput | None,
    protobuf: bool = True,
) -> Response:
    """The HTTP answer to a finished future; `output` is the completion's result, resolved.

    `protobuf`: the poll accepts protobuf, so forward and sample results go as protobuf;
    else as JSON.
    """
    if completion.status != CompletionStatus.OK:
        error = completion.error
        if error is None:
            return JSONResponse(error_body("the call failed without a reason", Category.SERVER))
        category = Category.USER if error.user_error else Category.SERVER
        return JSONResponse(error_body(error.message, category))
    kind = ResponseKind(future.response_kind or ResponseKind.NOOP)
    ctx = future.response_context
    match output:
        case ForwardBackwardOutput() if kind in (
            ResponseKind.FORWARD,
            ResponseKind.FORWARD_BACKWARD,
        ):
            metrics = tinker_metrics(output.metrics, default_reduction="sum")
            if not protobuf:
                return ResultJSON(forward_backward_output_json(output, metrics))
            return Response(encode_forward_backward_output(output, metrics), media_type=PROTOBUF)
        case SampleOutput() if kind == ResponseKind.SAMPLE:
            last_n = int(ctx[CTX_LAST_N]) if CTX_LAST_N in ctx else None
            if not protobuf:
                return ResultJSON(sample_output_json(output, last_n))
            return Response(encode_sample_output(output, last_n), media_type=PROTOBUF)
        case OptimStepOutput() if kind == ResponseKind.OPTIM_STEP:
            metrics = tinker_metrics(output.metrics, default_reduction="mean")
            return ResultJSON({"type": "optim_step", "metrics": metrics})
        case CreateOutput() if kind == ResponseKind.CREATE_MODEL:
            return ResultJSON({"type": "create_model", "model_id": future.job_id})
        case SaveOutput() if kind in (
            ResponseKind.SAVE_WEIGHTS,
            ResponseKind.SAVE_WEIGHTS_FOR_SAMPLER,
        ):
            body: dict[str, Any] = {"type": str(kind)}
            if CTX_NO_PATH not in ctx:
                body["path"] = output.path
            if CTX_SAMPLING_SESSION in ctx:
                body["sampling_session_id"] = ctx[CTX_SAMPLING_SESSION]
            return ResultJSON(body)
        case SaveOutput() if kind == ResponseKind.SAVE_WEIGHTS_EXTERNAL:
            return ResultJSON(
                {"type": str(kind), "path": output.path, "size_bytes": output.size_bytes}
            )
        case LoadOutput() if kind == ResponseKind.LOAD_WEIGHTS:
            model_id = ctx.get(CTX_MODEL_ID, future.job_id)
            return ResultJSON({"type": "load_weights", "path": output.path, "model_id": model_id})
        case _ if kind == ResponseKind.UNLOAD_MODEL:
            return ResultJSON({"type": "unload_model", "model_id": future.job_id})
        case _ if kind == ResponseKind.NOOP:
            return ResultJSON({"type": "noop"})
    got = type(output).__name__ if output is not None else "nothing"
    message = f"the worker answered a {future.function} call with {got}, not a {kind} result"
    return JSONResponse(error_body(message, Category.SERVER))


def tinker_metrics(metrics: dict[str, float], default_reduction: str) -> dict[str, float]:
    """Metric keys as the SDK needs them: `name:reduction`, exactly one colon.

    The SDK splits every key on ':' and crashes on any other count. A bare name gets the
    default reduction; extra colons in the name become '/'.
    """
    out: dict[str, float] = {}
    for key, value in metrics.items():
        name, sep, reduction = key.rpartition(":")
        if not sep or not name or reduction not in KNOWN_REDUCTIONS:
            name, reduction = key, default_reduction
        out[f"{name.replace(':', '/')}:{reduction}"] = float(value)
    return out
