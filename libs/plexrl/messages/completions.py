"""Topic `plexrl.completions` (key: job id): worker → scheduler.

A worker records the completion in Redis (the idempotency record and the future's
result) before it publishes here and before it commits its dispatch offset. Recorded,
it is also announced on the Redis channel `<cluster>:completed` (`CompletionNotice`),
which wakes the gateways' waiters.
"""

from __future__ import annotations

import enum

import msgspec

from plexrl.messages.common import (
    SCHEMA_VERSION,
    ErrorInfo,
    Function,
    PayloadRef,
    TensorArray,
    Timings,
)


class CompletionStatus(enum.StrEnum):
    """How a call ended."""

    OK = "ok"
    """The function ran; `result` holds its output."""
    ERROR = "error"
    """The function did not run to the end; `error` says why."""


class StopReason(enum.StrEnum):
    """Why a sampled sequence ended."""

    LENGTH = "length"
    """`max_tokens` was reached."""
    STOP = "stop"
    """A stop token or stop string (or end of sequence) was produced."""


class CreateOutput(msgspec.Struct, frozen=True, tag="create"):
    trainable_params: int
    state_bytes: int


class ForwardBackwardOutput(msgspec.Struct, frozen=True, tag="forward_backward"):
    loss_fn_outputs: list[dict[str, TensorArray]]
    """Per datum: at least `logprobs` of the target tokens, and `elementwise_loss`."""
    metrics: dict[str, float]


class OptimStepOutput(msgspec.Struct, frozen=True, tag="optim_step"):
    metrics: dict[str, float]


class SampledSequence(msgspec.Struct, frozen=True):
    tokens: list[int]
    logprobs: list[float]
    stop_reason: StopReason


class SampleOutput(msgspec.Struct, frozen=True, tag="sample"):
    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None


class SaveOutput(msgspec.Struct, frozen=True, tag="save"):
    path: str
    size_bytes: int


class LoadOutput(msgspec.Struct, frozen=True, tag="load"):
    path: str


class UnloadOutput(msgspec.Struct, frozen=True, tag="unload"):
    pass


class NoopOutput(msgspec.Struct, frozen=True, tag="noop"):
    pass


PhaseOutput = (
    CreateOutput
    | ForwardBackwardOutput
    | OptimStepOutput
    | SampleOutput
    | SaveOutput
    | LoadOutput
    | UnloadOutput
    | NoopOutput
)


class PhaseCompletion(msgspec.Struct, frozen=True):
    request_id: str
    job_id: str
    tenant: str
    worker_id: str
    function: Function
    status: CompletionStatus
    timings: Timings
    result: PhaseOutput | PayloadRef | None = None
    error: ErrorInfo | None = None
    finished_at: float = 0.0
    dispatch_id: str = ""
    """The dispatch this call came in; the scheduler frees the worker by it."""
    last_in_dispatch: bool = True
    schema_version: int = SCHEMA_VERSION


class CompletionNotice(msgspec.Struct, frozen=True):
    """Channel `<cluster>:completed` (Redis pub/sub): a completion recorded in Redis, as
    it stands there, announced to every gateway to wake the call's waiters. At most once:
    a gateway that was not subscribed reads Redis instead (`plexrl_gateway.notices`)."""

    completion: PhaseCompletion
    traceparent: str = ""
    """W3C traceparent of the span that recorded it (the gateway's span continues it)."""


class CompletedCall(msgspec.Struct, frozen=True):
    """Of a completion, only its call's id."""

    request_id: str


class CompletionNoticeHead(msgspec.Struct, frozen=True):
    """A `CompletionNotice` read only as far as its call's id: enough for a gateway to
    tell whether the call is one it waits for (the rest, a result that may run to
    megabytes, is skipped over, not built)."""

    completion: CompletedCall
