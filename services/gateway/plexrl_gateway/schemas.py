"""The Tinker REST API's JSON request bodies, as the SDK 0.38 sends them.

Unknown fields are ignored (a newer SDK may add some); missing required ones are a 422
that names the field. `type` discriminators are accepted and not checked.

The forward / forward_backward bodies are msgspec Structs, decoded straight from the
bytes (codec_json.py) with every value's type and range checked as it is read: they
carry the big token and loss-input arrays, which would cost several times their size
as a generic object graph first. The rest are pydantic models FastAPI validates.
Both kinds are in the OpenAPI document (`JSON_BODY_COMPONENTS` holds the Structs').
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field

from plexrl.limits import INT64_MAX, INT64_MIN
from plexrl.messages import AdamParams


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class SdkVersionBody(Body):
    sdk_version: str | None = None


class CreateSessionBody(Body):
    tags: list[str] = []
    user_metadata: dict[str, Any] | None = None
    sdk_version: str | None = None
    project_id: str | None = None
    display_name: str | None = None


class SessionIdBody(Body):
    session_id: str


class LoraConfigBody(Body):
    rank: int
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class OptimizerConfigBody(Body):
    model_config = ConfigDict(extra="allow")
    type: str = "adamw"


class CreateModelBody(Body):
    session_id: str
    model_seq_id: int
    base_model: str
    user_metadata: dict[str, Any] | None = None
    lora_config: LoraConfigBody | None = None
    optimizer_config: OptimizerConfigBody = OptimizerConfigBody()


class ModelIdBody(Body):
    model_id: str


_ADAM = AdamParams()  # Tinker's defaults are the contract's: one place for them


class AdamParamsBody(Body):
    learning_rate: float = _ADAM.learning_rate
    beta1: float = _ADAM.beta1
    beta2: float = _ADAM.beta2
    eps: float = _ADAM.eps
    weight_decay: float = _ADAM.weight_decay
    grad_clip_norm: float = _ADAM.grad_clip_norm


class OptimStepBody(Body):
    model_id: str
    seq_id: int | None = None
    adam_params: AdamParamsBody | None = None
    optimizer_params: dict[str, Any] | None = None


class SaveWeightsBody(Body):
    model_id: str
    path: str | None = None
    seq_id: int | None = None
    ttl_seconds: int | None = None
    overwrite: bool = False
    user_metadata: dict[str, str] | None = None


class SaveWeightsExternalBody(Body):
    model_id: str
    path: str
    seq_id: int | None = None
    ttl_seconds: int | None = None
    age_encryption_recipients: list[str] | None = None


class SaveWeightsForSamplerBody(Body):
    model_id: str
    path: str | None = None
    sampling_session_seq_id: int | None = None
    kind: str = "snapshot"
    seq_id: int | None = None
    ttl_seconds: int | None = None
    user_metadata: dict[str, str] | None = None


class LoadWeightsBody(Body):
    model_id: str | None = None
    seq_id: int | None = None
    session_id: str | None = None
    model_seq_id: int | None = None
    base_model: str | None = None
    user_metadata: dict[str, Any] | None = None
    path: str
    optimizer: bool = False
    optimizer_config: OptimizerConfigBody | None = None


class CreateSamplingSessionBody(Body):
    session_id: str
    sampling_session_seq_id: int
    base_model: str | None = None
    model_path: str | None = None


class ChunkBody(Body):
    model_config = ConfigDict(extra="allow")
    type: str = "encoded_text"
    tokens: list[int] | None = None


class ModelInputBody(Body):
    chunks: list[ChunkBody]


class SamplingParamsBody(Body):
    max_tokens: int | None = None
    seed: int | None = None
    stop: str | list[int | str] | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0


class SampleBody(Body):
    num_samples: int = 1
    prompt: ModelInputBody
    sampling_params: SamplingParamsBody
    base_model: str | None = None
    model_path: str | None = None
    sampling_session_id: str | None = None
    seq_id: int | None = None
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: dict[str, Any] | None = None
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: int | None = None
    record_stability_info: bool | None = None


class FutureBody(Body):
    request_id: str
    allow_metadata_only: bool = False


class TinkerPathBody(Body):
    tinker_path: str


class IdleBody(Body):
    seconds: float = Field(gt=0, le=24 * 3600, description="expected stall, seconds")


class JobOptionsBody(Body):
    staleness: int | None = Field(
        default=None,
        ge=0,
        le=8,
        description="0: a synchronous loop; k: the job samples its next rollouts with "
        "sampler weights up to k steps older than its newest, while it trains; "
        "unset: as declared before (0 at first)",
    )
    steps: int | None = Field(
        default=None,
        ge=0,
        le=10_000_000,
        description="the training steps the job expects to run in all (0: not declared); "
        "while jobs wait for a group, the plexrl policy admits the most declared work "
        "first; unset: as declared before",
    )


# forward / forward_backward ------------------------------------------------------------

TokenId = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
"""A token id as the protobuf wire holds it (int32); the vocabulary check comes later."""
SeqId = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
"""A call's seq_id as the protobuf request holds it (int32)."""
Int64 = Annotated[int, msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)]
Dimension = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]


class TensorDataBody(msgspec.Struct):
    """Tinker's TensorData: a flat list of values with its dtype and (optional) shape."""

    data: list[Int64 | float]
    dtype: Literal["int64", "float32"]
    shape: list[Dimension] | None = None


class TextChunkBody(msgspec.Struct):
    """One model-input chunk; only `encoded_text` ones carry tokens PlexRL can serve."""

    type: str = "encoded_text"
    tokens: list[TokenId] = []


class DatumInputBody(msgspec.Struct):
    chunks: list[TextChunkBody]


class DatumBody(msgspec.Struct):
    model_input: DatumInputBody
    loss_fn_inputs: dict[str, TensorDataBody] | None = None


class ForwardBackwardInputBody(msgspec.Struct):
    data: list[DatumBody]
    loss_fn: str
    loss_fn_config: dict[str, float | str] | None = None


class ForwardBackwardBody(msgspec.Struct):
    """POST /forward_backward as JSON (SDKs before protobuf, and newer ones without it)."""

    model_id: str
    forward_backward_input: ForwardBackwardInputBody
    seq_id: SeqId | None = None


class ForwardBody(msgspec.Struct):
    """POST /forward as JSON: the same input under `forward_input`."""

    model_id: str
    forward_input: ForwardBackwardInputBody
    seq_id: SeqId | None = None


JSON_BODY_REF = "#/components/schemas/{name}"
_, JSON_BODY_COMPONENTS = msgspec.json.schema_components(
    (ForwardBackwardBody, ForwardBody), ref_template=JSON_BODY_REF
)
"""The Structs' JSON Schemas, for the OpenAPI document's components."""


def struct_request_body(
    struct: type[msgspec.Struct], protobuf: str | None = None
) -> dict[str, Any]:
    """A route's `openapi_extra` for a body decoded into `struct` (and, given its media
    type, sent as protobuf too)."""
    content: dict[str, Any] = {
        "application/json": {"schema": {"$ref": JSON_BODY_REF.format(name=struct.__name__)}}
    }
    if protobuf is not None:
        content[protobuf] = {"schema": {"type": "string", "format": "binary"}}
    return {"requestBody": {"required": True, "content": content}}
