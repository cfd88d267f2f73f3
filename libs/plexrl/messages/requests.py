"""Topic `plexrl.requests` (key: job id): gateway → scheduler.

A PhaseRequest is one call of a model function by one job. Its `request_id` is the
idempotency key: a replayed request returns the recorded result instead of running
twice. Inputs are a tagged union (one struct per function), so no request collects
optional fields for every concern.
"""

from __future__ import annotations

import enum

import msgspec

from plexrl.messages.common import SCHEMA_VERSION, Function, PayloadRef, TensorArray


class LossFn(enum.StrEnum):
    """Built-in losses; each sums over tokens (Tinker semantics)."""

    CROSS_ENTROPY = "cross_entropy"
    """-sum(weights * logp(target)); inputs: target_tokens, weights."""
    IMPORTANCE_SAMPLING = "importance_sampling"
    """-sum(exp(logp - sampling_logp) * advantages); inputs: target_tokens, logprobs, advantages."""
    PPO = "ppo"
    """Clipped importance sampling; inputs as importance_sampling, config clip thresholds."""
    CISPO = "cispo"
    """-sum(sg(clip(ratio)) * logp * advantages); inputs as importance_sampling."""
    DRO = "dro"
    """-sum(logp * advantages - beta/2 * (logp - sampling_logp)^2); inputs as IS."""
    GSPO = "gspo"
    """PPO on the sequence's geometric-mean ratio (GSPO-token); optional sequence_ratio_mask."""
    STABLE_REINFORCE = "stable_reinforce"
    """REINFORCE with a truncated, detached importance weight; inputs as importance_sampling."""


class LoraSpec(msgspec.Struct, frozen=True):
    """LoRA adapters over a shared base model."""

    rank: int = 32
    alpha: float | None = None
    """Scaling numerator; None means alpha = rank."""
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = False


class JobSpec(msgspec.Struct, frozen=True):
    """What a job is: its base model and how it trains; fixed at creation."""

    base_model: str
    lora: LoraSpec | None = None
    """None means full fine-tuning: the job owns a full copy of the weights."""
    seed: int = 0
    """Seeds adapter initialisation, so a job's results do not depend on placement."""
    state_bytes: int = 0
    """The gateway's estimate of the job's trainable state (weights + optimizer + grads)."""


class Datum(msgspec.Struct, frozen=True):
    """One training example: input tokens and per-token loss inputs."""

    tokens: list[int]
    loss_fn_inputs: dict[str, TensorArray]


class CreateInput(msgspec.Struct, frozen=True, tag="create"):
    spec: JobSpec


class ForwardBackwardInput(msgspec.Struct, frozen=True, tag="forward_backward"):
    data: list[Datum]
    loss_fn: LossFn
    loss_fn_config: dict[str, float] | None = None
    backward: bool = True
    """False for `forward`: outputs and loss only, no gradients."""


class AdamParams(msgspec.Struct, frozen=True):
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0
    """0 disables clipping."""


class OptimStepInput(msgspec.Struct, frozen=True, tag="optim_step"):
    adam: AdamParams


class SamplingParams(msgspec.Struct, frozen=True):
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    """-1 disables top-k."""
    seed: int | None = None
    stop_strings: list[str] = []
    stop_tokens: list[int] = []
    stop_at_eos: bool = True
    """False: not even the end-of-sequence token stops a sequence (Tinker's `stop: []`).
    Stop strings and stop tokens add to it; they never switch it off."""


class SampleInput(msgspec.Struct, frozen=True, tag="sample"):
    prompt: list[int]
    num_samples: int
    params: SamplingParams
    weights_path: str | None = None
    """A sampler checkpoint (`tinker://...`); None samples the job's base model."""
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0


class SaveKind(enum.StrEnum):
    """What a SAVE writes."""

    STATE = "state"
    """Weights and optimizer state, for `load_state` later."""
    SAMPLER = "sampler"
    """Weights only, readable by sampling clients."""
    EXTERNAL = "external"
    """The weights as Hugging Face files (a PEFT adapter, or a model directory for full
    fine-tuning), downloaded through signed URLs; never loaded or sampled."""


class ExportOptions(msgspec.Struct, frozen=True):
    """How an EXTERNAL save writes its files."""

    age_recipients: list[str] = []
    """age recipients (`age1...` keys, SSH public keys) every file is encrypted to, and
    then named with a `.age` suffix; empty: plain files."""


class SaveInput(msgspec.Struct, frozen=True, tag="save"):
    kind: SaveKind
    path: str
    """The `tinker://` path the checkpoint will answer to."""
    ephemeral: bool = False
    """A sampler snapshot the server named (`save_weights_and_get_sampling_client`): the
    worker keeps the job's newest few (`PLEXRL_EPHEMERAL_KEEP`) and retires the rest."""
    sampling_session: str = ""
    """For an ephemeral snapshot: the sampling session the gateway opened over it (a job
    record), retired with the snapshot."""
    export: ExportOptions | None = None
    """For an EXTERNAL save: how its files are written (None: plain files). Its TTL
    travels as every save's does (`CheckpointStore.expire_on_save`)."""


class LoadInput(msgspec.Struct, frozen=True, tag="load"):
    path: str
    with_optimizer: bool


class UnloadInput(msgspec.Struct, frozen=True, tag="unload"):
    pass


class NoopInput(msgspec.Struct, frozen=True, tag="noop"):
    pass


PhaseInput = (
    CreateInput
    | ForwardBackwardInput
    | OptimStepInput
    | SampleInput
    | SaveInput
    | LoadInput
    | UnloadInput
    | NoopInput
)


class WorkHint(msgspec.Struct, frozen=True):
    """What the scheduler may know of the call without reading its payload (a ref)."""

    tokens: int = 0
    sequences: int = 0
    portable: bool = False
    """It reads saved sampler weights (a checkpoint), nothing of the job's training
    state: it may run before the job's earlier calls, on any worker serving the job's
    base model (`plexrl.policy.roam`)."""


class PhaseRequest(msgspec.Struct, frozen=True):
    request_id: str
    """Idempotency key; also the future id the client polls."""
    job_id: str
    tenant: str
    function: Function
    payload: PhaseInput | PayloadRef
    arrival_time: float
    """Wall-clock seconds when the gateway accepted the call."""
    work: WorkHint = WorkHint()
    spec: JobSpec | None = None
    """Set on CREATE (and on a sampling job's first call) so the scheduler can admit it."""
    schema_version: int = SCHEMA_VERSION
