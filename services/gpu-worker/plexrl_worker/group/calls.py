"""What the leader tells every rank to run, and what each rank answers.

These travel only inside one group (leader to ranks over the command channel), between
processes of one build: msgpack-encoded msgspec structs, never pickle. Every call is
executed by every rank, in the order the leader broadcasts them.
"""

from __future__ import annotations

import msgspec

from plexrl.messages import (
    ErrorCode,
    ForwardBackwardInput,
    JobSpec,
    OptimStepInput,
    TensorArray,
)


class CreateCall(msgspec.Struct, frozen=True, tag="create"):
    job_id: str
    spec: JobSpec


class ForwardBackwardCall(msgspec.Struct, frozen=True, tag="forward_backward"):
    job_id: str
    inp: ForwardBackwardInput


class OptimStepCall(msgspec.Struct, frozen=True, tag="optim_step"):
    job_id: str
    inp: OptimStepInput


class OffloadCall(msgspec.Struct, frozen=True, tag="offload"):
    """Each rank copies its shard of the job to host memory and frees it on the device."""

    job_id: str


class OnloadCall(msgspec.Struct, frozen=True, tag="onload"):
    """Each rank rebuilds the job from the shard its `offload` left in host memory."""

    job_id: str


class SaveCall(msgspec.Struct, frozen=True, tag="save"):
    """A sharded snapshot: each rank writes its own blob of the set `key` names
    (`plexrl_worker.stored`); the leader writes the manifest after."""

    job_id: str
    key: str


class RestoreCall(msgspec.Struct, frozen=True, tag="restore"):
    """Make `job_id` from a state stored under `key` by a group of any size."""

    job_id: str
    key: str


class GatherCall(msgspec.Struct, frozen=True, tag="gather"):
    """The job's full state, assembled on the leader (a test and debugging aid: it holds
    the whole state in the leader's memory)."""

    job_id: str


class DropCall(msgspec.Struct, frozen=True, tag="drop"):
    job_id: str


class ShutdownCall(msgspec.Struct, frozen=True, tag="shutdown"):
    """Every follower leaves its loop and its process group."""


Call = (
    CreateCall
    | ForwardBackwardCall
    | OptimStepCall
    | OffloadCall
    | OnloadCall
    | SaveCall
    | RestoreCall
    | GatherCall
    | DropCall
    | ShutdownCall
)


class CreateReply(msgspec.Struct, frozen=True, tag="create"):
    trainable_params: int
    """Trainable parameters of the whole job (the same on every rank)."""
    shard_bytes: int
    """This rank's peak state bytes: its shard of weights, gradients and both moments."""


class ForwardBackwardReply(msgspec.Struct, frozen=True, tag="forward_backward"):
    first: int
    """Index in the call's data of this rank's first datum."""
    outputs: list[dict[str, TensorArray]]
    loss: float
    tokens: int


class OptimStepReply(msgspec.Struct, frozen=True, tag="optim_step"):
    metrics: dict[str, float]


class SwapReply(msgspec.Struct, frozen=True, tag="swap"):
    """One rank's side of an offload or onload: bytes it moved and the copy's time."""

    nbytes: int
    seconds: float
    digest: str
    """sha256 of the shard's safetensors bytes: a round trip must not change it."""


class SavedReply(msgspec.Struct, frozen=True, tag="saved"):
    file: str
    nbytes: int
    digest: str
    metadata: str
    """The shard's metadata (JSON: the job's, and the whole shapes) for the manifest."""


class StateReply(msgspec.Struct, frozen=True, tag="state"):
    data: bytes
    """The rank's shard as safetensors bytes (`plexrl_worker.engine.state`)."""


class DoneReply(msgspec.Struct, frozen=True, tag="done"):
    pass


class RestoredReply(msgspec.Struct, frozen=True, tag="restored"):
    shard_bytes: int
    """This rank's peak state bytes of the restored job."""


class ErrorReply(msgspec.Struct, frozen=True, tag="error"):
    code: ErrorCode
    message: str


Reply = (
    CreateReply
    | ForwardBackwardReply
    | OptimStepReply
    | SwapReply
    | SavedReply
    | StateReply
    | DoneReply
    | RestoredReply
    | ErrorReply
)

_call_encoder = msgspec.msgpack.Encoder()
_call_decoder = msgspec.msgpack.Decoder(Call)
_reply_decoder = msgspec.msgpack.Decoder(Reply)


def encode(message: Call | Reply) -> bytes:
    return _call_encoder.encode(message)


def decode_call(data: bytes) -> Call:
    return _call_decoder.decode(data)


def decode_reply(data: bytes) -> Reply:
    return _reply_decoder.decode(data)
