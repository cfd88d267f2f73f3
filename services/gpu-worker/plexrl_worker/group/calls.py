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
    SampleInput,
    SampleOutput,
    TensorArray,
)

# ---- training -----------------------------------------------------------------------


class CreateCall(msgspec.Struct, frozen=True, tag="create"):
    job_id: str
    spec: JobSpec


class ForwardBackwardCall(msgspec.Struct, frozen=True, tag="forward_backward"):
    job_id: str
    inp: ForwardBackwardInput


class BeginTrainingCall(msgspec.Struct, frozen=True, tag="begin_training"):
    """A `forward_backward` to run a micro-batch at a time (`TrainingSliceCall`), other
    calls between; every rank answers how many micro-batches each rank runs (the most
    any rank has: one with fewer runs empty ones, so their collectives pair up)."""

    job_id: str
    inp: ForwardBackwardInput


class TrainingSliceCall(msgspec.Struct, frozen=True, tag="training_slice"):
    """The next micro-batch of the job's `BeginTrainingCall` on every rank."""

    job_id: str


class FinishTrainingCall(msgspec.Struct, frozen=True, tag="finish_training"):
    """The job's sliced `forward_backward` after its last micro-batch: gradients summed
    over the ranks, each rank's outputs (a `ForwardBackwardReply`)."""

    job_id: str


class OptimStepCall(msgspec.Struct, frozen=True, tag="optim_step"):
    job_id: str
    inp: OptimStepInput


class ImportCall(msgspec.Struct, frozen=True, tag="import"):
    """Replace a job's weights (and AdamW state with `optimizer`) by a checkpoint's:
    each rank reads its rows of the checkpoint blob `key` (its tenant's)."""

    job_id: str
    key: str
    tenant: str
    optimizer: bool


class GatherCall(msgspec.Struct, frozen=True, tag="gather"):
    """The job's whole state, assembled on the leader from every rank's shard (a save
    or an export: it holds the whole state in the leader's memory)."""

    job_id: str
    optimizer: bool = True
    gradients: bool = True


class DropCall(msgspec.Struct, frozen=True, tag="drop"):
    """Forget a job on every rank, on the device and in host memory."""

    job_id: str


# ---- a job's shards in the tiers --------------------------------------------------------


class OffloadCall(msgspec.Struct, frozen=True, tag="offload"):
    """Each rank copies its shard of the job to host memory and frees it on the device."""

    job_id: str


class OnloadCall(msgspec.Struct, frozen=True, tag="onload"):
    """Each rank rebuilds the job from the shard its `offload` left in host memory."""

    job_id: str


class SpillCall(msgspec.Struct, frozen=True, tag="spill"):
    """Each rank writes its host copy as its blob of the set `key` names, then drops
    the copy; the leader writes the manifest after."""

    job_id: str
    key: str


class FetchCall(msgspec.Struct, frozen=True, tag="fetch"):
    """Each rank reads its rows of the state stored under `key` into host memory."""

    job_id: str
    key: str


class SnapshotCall(msgspec.Struct, frozen=True, tag="snapshot"):
    """Each rank copies its shard (weights, moments, gradients) to host memory now,
    held as `token` until `WriteSnapshotCall` writes it."""

    job_id: str
    token: str


class WriteSnapshotCall(msgspec.Struct, frozen=True, tag="write_snapshot"):
    """Each rank writes the copy held as `token` as its blob of the set `key` names."""

    token: str
    key: str


class SaveCall(msgspec.Struct, frozen=True, tag="save"):
    """A sharded snapshot now: each rank writes its own blob of the set `key` names
    (`plexrl_worker.stored`); the leader writes the manifest after."""

    job_id: str
    key: str


class RestoreCall(msgspec.Struct, frozen=True, tag="restore"):
    """Make `job_id` from a state stored under `key` by a group of any size."""

    job_id: str
    key: str


# ---- sampling -------------------------------------------------------------------------


class InstallSamplerCall(msgspec.Struct, frozen=True, tag="install_sampler"):
    """Make a checkpoint sampleable as `weights_id`: every rank reads the blob `key`
    (its tenant's) and holds the whole weights (sampling is data-parallel)."""

    weights_id: str
    key: str
    tenant: str


class TouchSamplerCall(msgspec.Struct, frozen=True, tag="touch_sampler"):
    """Whether a sampler set is installed; if so it becomes the most recently used."""

    weights_id: str


class DropSamplerCall(msgspec.Struct, frozen=True, tag="drop_sampler"):
    weights_id: str


class BeginSampleCall(msgspec.Struct, frozen=True, tag="begin_sample"):
    """Put a call in the running batch: rank r decodes samples [lo, hi) of
    `slices[r]` (none when lo == hi). `inp.params.seed` is set: sample i draws from
    `row_seed(seed, i)` on whichever rank it runs."""

    call_id: int
    weights_id: str
    inp: SampleInput
    slices: list[tuple[int, int]]


class SampleStepCall(msgspec.Struct, frozen=True, tag="sample_step"):
    """One decode step of every rank's running batch."""


class PingCall(msgspec.Struct, frozen=True, tag="ping"):
    """Nothing: proves every rank is there (and keeps an idle group's waits short)."""


class ShutdownCall(msgspec.Struct, frozen=True, tag="shutdown"):
    """Every follower leaves its loop and its process group."""


Call = (
    CreateCall
    | ForwardBackwardCall
    | BeginTrainingCall
    | TrainingSliceCall
    | FinishTrainingCall
    | OptimStepCall
    | ImportCall
    | GatherCall
    | DropCall
    | OffloadCall
    | OnloadCall
    | SpillCall
    | FetchCall
    | SnapshotCall
    | WriteSnapshotCall
    | SaveCall
    | RestoreCall
    | InstallSamplerCall
    | TouchSamplerCall
    | DropSamplerCall
    | BeginSampleCall
    | SampleStepCall
    | PingCall
    | ShutdownCall
)


class CreateReply(msgspec.Struct, frozen=True, tag="create"):
    trainable_params: int
    """Trainable parameters of the whole job (the same on every rank)."""
    shard_bytes: int
    """This rank's peak state bytes: its shard of weights, gradients and both moments."""
    state_bytes: int = 0
    """The whole job's peak state bytes (as one device's engine counts them)."""


class ForwardBackwardReply(msgspec.Struct, frozen=True, tag="forward_backward"):
    first: int
    """Index in the call's data of this rank's first datum."""
    outputs: list[dict[str, TensorArray]]
    loss: float
    tokens: int


class SlicesReply(msgspec.Struct, frozen=True, tag="slices"):
    count: int
    """Micro-batches every rank runs for the call (`TrainingSliceCall`s to send)."""


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
    seconds: float = 0.0
    """The write's time on this rank."""


class StateReply(msgspec.Struct, frozen=True, tag="state"):
    data: bytes
    """The rank's shard as safetensors bytes (`plexrl_worker.engine.state`)."""


class DoneReply(msgspec.Struct, frozen=True, tag="done"):
    pass


class FlagReply(msgspec.Struct, frozen=True, tag="flag"):
    value: bool


class RestoredReply(msgspec.Struct, frozen=True, tag="restored"):
    shard_bytes: int
    """This rank's peak state bytes of the restored job."""
    state_bytes: int = 0
    """The whole job's peak state bytes."""


class SamplePart(msgspec.Struct, frozen=True):
    """One rank's slice of a sample call after a step."""

    call_id: int
    remaining: int
    """Its sequences not finished yet."""
    output: SampleOutput | None = None
    """Its sequences, once all are finished (sent once)."""
    abandoned: str | None = None
    """Why it left the batch unfinished (its weights went away), if it did."""


class SampleStepReply(msgspec.Struct, frozen=True, tag="sample_step"):
    parts: list[SamplePart]


class ErrorReply(msgspec.Struct, frozen=True, tag="error"):
    code: ErrorCode
    message: str
    transient: bool = False
    """A service the rank needed was away: a later attempt may pass."""


Reply = (
    CreateReply
    | ForwardBackwardReply
    | SlicesReply
    | OptimStepReply
    | SwapReply
    | SavedReply
    | StateReply
    | DoneReply
    | FlagReply
    | RestoredReply
    | SampleStepReply
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
