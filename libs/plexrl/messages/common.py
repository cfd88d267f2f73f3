"""Types shared by several topics: enums, tensors, references, timings, errors.

Everything here is a `msgspec.Struct` encoded as a map (field names on the wire),
because Kafka messages outlive a deploy: a reader ignores fields it does not know
and fills defaults for fields an older writer did not send.
"""

from __future__ import annotations

import enum
import sys
from typing import Literal

import msgspec

SCHEMA_VERSION = 1
"""Bumped when a change is not backward compatible; readers reject newer majors."""

# Dtypes a TensorArray may carry. Little-endian raw bytes, C order.
TensorDtype = Literal["int64", "float32"]


class Function(enum.StrEnum):
    """A model function a job calls; one PhaseRequest runs one of these."""

    CREATE = "create"
    """Create the job's state on its home worker (weights, optimizer)."""
    FORWARD = "forward"
    """Loss and per-token outputs without gradients."""
    FORWARD_BACKWARD = "forward_backward"
    """Loss, outputs, and gradients accumulated into the job's state."""
    OPTIM_STEP = "optim_step"
    """One AdamW step over the accumulated gradients, which it then clears."""
    SAMPLE = "sample"
    """Generate completions (and optionally prompt logprobs) from some weights."""
    SAVE = "save"
    """Write weights (with or without optimizer) or sampler weights to the disk tier."""
    LOAD = "load"
    """Replace the job's weights (and optionally optimizer) from a checkpoint."""
    UNLOAD = "unload"
    """Drop every state of the job; the job is finished."""
    NOOP = "noop"
    """Do nothing on the worker; measures the control plane alone."""


class Tier(enum.StrEnum):
    """Where a state component lives."""

    DEVICE = "device"
    """Accelerator memory (on a CPU worker, the active working set)."""
    HOST = "host"
    """Host memory, outside the active working set."""
    DISK = "disk"
    """Safetensors files in the state-store."""


class StateComponent(enum.StrEnum):
    """One part of a job's state; each lives in one tier."""

    WEIGHTS = "weights"
    """Trainable weights: LoRA adapters, or the full model."""
    OPTIMIZER = "optimizer"
    """Adam moments and step counts."""
    GRADIENTS = "gradients"
    """Accumulated gradients, live between forward_backward and optim_step."""
    SAMPLER = "sampler"
    """The weights version a sampling client reads."""
    KV_CACHE = "kv_cache"
    """The inference engine's cache; discardable."""


class ErrorCode(enum.StrEnum):
    """Why a call failed; `user_error` codes map to HTTP 4xx at the gateway."""

    BAD_REQUEST = "bad_request"
    """The input was malformed (lengths, dtypes, unknown loss...)."""
    NOT_FOUND = "not_found"
    """A model, checkpoint or future the caller cannot see."""
    REJECTED = "rejected"
    """Admission refused: no worker group can ever hold the job's state."""
    INTERNAL = "internal"
    """A bug or an infrastructure failure; retrying may help."""
    CANCELLED = "cancelled"
    """The call was cancelled before it ran, or its effect refused (its lease was gone)."""
    UNAVAILABLE = "unavailable"
    """A service the call needs has no room for it (the state-store's disk is full); the
    call had no effect, and may succeed once an operator frees space."""


class TensorArray(msgspec.Struct, frozen=True):
    """A dense array as raw little-endian bytes in C order."""

    dtype: TensorDtype
    shape: list[int]
    data: bytes

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @classmethod
    def from_list(cls, values: list[float] | list[int], dtype: TensorDtype) -> TensorArray:
        import array

        code = "q" if dtype == "int64" else "f"
        buf = array.array(code, values)
        if sys.byteorder != "little":
            buf.byteswap()
        return cls(dtype=dtype, shape=[len(values)], data=buf.tobytes())

    def to_list(self) -> list[float] | list[int]:
        import array

        code = "q" if self.dtype == "int64" else "f"
        buf = array.array(code)
        buf.frombytes(self.data)
        if sys.byteorder != "little":
            buf.byteswap()
        return buf.tolist()


class PayloadRef(msgspec.Struct, frozen=True, tag="ref"):
    """A payload stored out of band (Redis with a TTL); the message carries the key."""

    key: str
    size: int


class Timings(msgspec.Struct, frozen=True):
    """Where a call's time went, in seconds."""

    queue_s: float = 0.0
    """From arrival at the gateway to the start of the worker's swap or compute."""
    swap_s: float = 0.0
    """Moving this job's state (and evicting others) before compute."""
    compute_s: float = 0.0
    """Running the function itself."""
    slices: int = 0
    """Micro-batches a `forward_backward` ran in, where the worker could pause it between
    two (it slices training); 0: run whole, or not training."""


class ErrorInfo(msgspec.Struct, frozen=True):
    """A failure, said so a caller can act on it."""

    code: ErrorCode
    message: str

    @property
    def user_error(self) -> bool:
        return self.code in (ErrorCode.BAD_REQUEST, ErrorCode.NOT_FOUND, ErrorCode.REJECTED)
