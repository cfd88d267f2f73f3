"""PlexRL's wire contracts: one module per topic, msgspec structs, map-encoded msgpack.

`encode` / `decode` are the only way bytes enter or leave a topic. `decode` raises
`MessageError` (never anything else) on bytes it cannot accept, so consumers can
route them to the dead-letter topic and go on.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from plexrl.messages.common import (
    SCHEMA_VERSION,
    ErrorCode,
    ErrorInfo,
    Function,
    PayloadRef,
    StateComponent,
    TensorArray,
    Tier,
    Timings,
)
from plexrl.messages.completions import (
    CompletedCall,
    CompletionNotice,
    CompletionNoticeHead,
    CompletionStatus,
    CreateOutput,
    ForwardBackwardOutput,
    LoadOutput,
    NoopOutput,
    OptimStepOutput,
    PhaseCompletion,
    PhaseOutput,
    SampledSequence,
    SampleOutput,
    SaveOutput,
    StopReason,
    UnloadOutput,
)
from plexrl.messages.dispatch import Dispatch, Lease, PreemptBatch, StateMove
from plexrl.messages.dlq import DeadLetter, DeadLetterReason
from plexrl.messages.events import (
    Event,
    IdleHint,
    JobAdmitted,
    JobFinished,
    JobOptions,
    RankMemory,
    ReleaseReason,
    ResidencyChanged,
    ResidentState,
    SharingMeasured,
    TailReleased,
    WorkerHeartbeat,
)
from plexrl.messages.requests import (
    AdamParams,
    CreateInput,
    Datum,
    ExportOptions,
    ForwardBackwardInput,
    JobSpec,
    LoadInput,
    LoraSpec,
    LossFn,
    NoopInput,
    OptimStepInput,
    PhaseInput,
    PhaseRequest,
    SampleInput,
    SamplingParams,
    SaveInput,
    SaveKind,
    UnloadInput,
    WorkHint,
)

T = TypeVar("T")


class MessageError(ValueError):
    """Bytes that are not an acceptable message; `reason` is a DeadLetterReason."""

    def __init__(self, reason: DeadLetterReason, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


_encoder = msgspec.msgpack.Encoder()
_decoders: dict[Any, msgspec.msgpack.Decoder[Any]] = {}


def encode(message: msgspec.Struct | Any) -> bytes:
    """Serialise a contract struct (or a union member) to msgpack."""
    return _encoder.encode(message)


def decode(data: bytes, type_: type[T] | Any) -> T:
    """Parse bytes as `type_` (a struct or a union), checking the schema version."""
    decoder = _decoders.get(type_)
    if decoder is None:
        decoder = _decoders[type_] = msgspec.msgpack.Decoder(type_)
    try:
        message = decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MessageError(DeadLetterReason.UNDECODABLE, str(exc)) from exc
    version = getattr(message, "schema_version", SCHEMA_VERSION)
    if version > SCHEMA_VERSION:
        raise MessageError(
            DeadLetterReason.UNSUPPORTED_VERSION,
            f"schema_version {version} is newer than this reader's {SCHEMA_VERSION}",
        )
    return message


__all__ = [
    "SCHEMA_VERSION",
    "AdamParams",
    "CompletedCall",
    "CompletionNotice",
    "CompletionNoticeHead",
    "CompletionStatus",
    "CreateInput",
    "CreateOutput",
    "Datum",
    "DeadLetter",
    "DeadLetterReason",
    "Dispatch",
    "ErrorCode",
    "ErrorInfo",
    "Event",
    "ExportOptions",
    "ForwardBackwardInput",
    "ForwardBackwardOutput",
    "Function",
    "IdleHint",
    "JobAdmitted",
    "JobFinished",
    "JobOptions",
    "JobSpec",
    "Lease",
    "LoadInput",
    "LoadOutput",
    "LoraSpec",
    "LossFn",
    "MessageError",
    "NoopInput",
    "NoopOutput",
    "OptimStepInput",
    "OptimStepOutput",
    "PayloadRef",
    "PhaseCompletion",
    "PhaseInput",
    "PhaseOutput",
    "PhaseRequest",
    "PreemptBatch",
    "RankMemory",
    "ReleaseReason",
    "ResidencyChanged",
    "ResidentState",
    "SampleInput",
    "SampleOutput",
    "SampledSequence",
    "SamplingParams",
    "SaveInput",
    "SaveKind",
    "SaveOutput",
    "SharingMeasured",
    "StateComponent",
    "StateMove",
    "StopReason",
    "TailReleased",
    "TensorArray",
    "Tier",
    "Timings",
    "UnloadInput",
    "UnloadOutput",
    "WorkHint",
    "WorkerHeartbeat",
    "decode",
    "encode",
]
