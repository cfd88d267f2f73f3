"""Tinker requests to phase inputs, checked against the base model before anything is published.

Pure functions: each takes a decoded request and what the gateway knows about the model
and returns a contract input, or raises a 400 that says what to change.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import numpy as np

from plexrl.losses import LOSS_INPUTS, LossInputs, loss_config
from plexrl.messages import (
    AdamParams,
    Datum,
    ForwardBackwardInput,
    JobSpec,
    LoraSpec,
    LossFn,
    SampleInput,
    SamplingParams,
    WorkHint,
)
from plexrl_gateway.codec import CodecError, chunk_tokens, tensor_array, to_tensor_array
from plexrl_gateway.errors import bad_request
from plexrl_gateway.proto import tinker_public_pb2 as pb
from plexrl_gateway.schemas import (
    AdamParamsBody,
    CreateModelBody,
    OptimStepBody,
    SampleBody,
)

TINKER_SCHEME = "tinker://"


@dataclass(frozen=True)
class ModelLimits:
    """What a base model accepts."""

    vocab_size: int
    """Token ids must lie in [0, vocab_size)."""
    max_positions: int
    """Longest sequence, prompt plus completion."""


# Ids ---------------------------------------------------------------------------------------


def training_model_id(session_id: str, model_seq_id: int) -> str:
    """The SDK computes this itself for create-via-load, so it must be exactly this."""
    return f"{session_id}:train:{model_seq_id}"


def sampling_session_id(session_id: str, sampling_session_seq_id: int) -> str:
    return f"{session_id}:sample:{sampling_session_seq_id}"


def session_of(model_id: str) -> str:
    """The session a training model or sampling session id belongs to."""
    return model_id.split(":", 1)[0]


def check_seq(name: str, value: int | None) -> int:
    if value is None:
        raise bad_request(f"{name} is missing; the SDK numbers every call of a model")
    if value < 0:
        raise bad_request(f"{name} is {value}; it must be 0 or more")
    return value


# Tinker paths ------------------------------------------------------------------------------


class CheckpointKind(enum.StrEnum):
    """The type segment of a tinker path."""

    WEIGHTS = "weights"
    """Weights with optimizer state, from save_state; loadable by training clients."""
    SAMPLER_WEIGHTS = "sampler_weights"
    """Weights only, from save_weights_for_sampler; read by sampling clients."""


@dataclass(frozen=True)
class TinkerPath:
    model_id: str
    kind: CheckpointKind
    name: str

    def __str__(self) -> str:
        return f"{TINKER_SCHEME}{self.model_id}/{self.kind}/{self.name}"

    @property
    def checkpoint_id(self) -> str:
        return f"{self.kind}/{self.name}"


def parse_tinker_path(path: str) -> TinkerPath:
    example = "tinker://<model_id>/weights/<name> or tinker://<model_id>/sampler_weights/<name>"
    if not path.startswith(TINKER_SCHEME):
        raise bad_request(f"bad tinker path {path!r}: it must start with tinker://, like {example}")
    parts = path[len(TINKER_SCHEME) :].split("/")
    if len(parts) != 3 or not all(parts):
        raise bad_request(f"bad tinker path {path!r}: expected three parts, like {example}")
    model_id, kind, name = parts
    if kind == "external_weights":
        raise bad_request(f"tinker path {path!r}: external weights are not supported by PlexRL")
    try:
        return TinkerPath(model_id, CheckpointKind(kind), name)
    except ValueError:
        raise bad_request(
            f"bad tinker path {path!r}: unknown type {kind!r}; expected {example}"
        ) from None


def checkpoint_name(name: str | None, fallback: str) -> str:
    """A checkpoint name as the last segment of its tinker path."""
    if name is None or name == "":
        return fallback
    if "/" in name or ":" in name or len(name) > 200:
        raise bad_request(
            f"checkpoint name {name!r} is not allowed: no '/' or ':', at most 200 characters"
        )
    return name


# Create --------------------------------------------------------------------------------


def job_spec(body: CreateModelBody, state_bytes: int) -> JobSpec:
    """The spec of a new training model; `state_bytes` is the registry's estimate."""
    if body.optimizer_config.type != "adamw":
        raise bad_request(
            f"optimizer_config type {body.optimizer_config.type!r} is not supported; "
            "PlexRL trains with adamw"
        )
    lora = None
    seed = 0
    if body.lora_config is not None:
        cfg = body.lora_config
        if cfg.rank < 1:
            raise bad_request(f"lora_config.rank is {cfg.rank}; it must be 1 or more")
        lora = LoraSpec(
            rank=cfg.rank,
            train_attn=cfg.train_attn,
            train_mlp=cfg.train_mlp,
            train_unembed=cfg.train_unembed,
        )
        seed = cfg.seed if cfg.seed is not None else 0
        if not (cfg.train_attn or cfg.train_mlp or cfg.train_unembed):
            raise bad_request(
                "lora_config trains nothing: set one of train_attn, train_mlp, train_unembed"
            )
    return JobSpec(base_model=body.base_model, lora=lora, seed=seed, state_bytes=state_bytes)


# Forward / backward --------------------------------------------------------------------


def forward_backward_input(
    request: pb.ForwardBackwardRequest, limits: ModelLimits
) -> tuple[ForwardBackwardInput, WorkHint]:
    try:
        loss_fn = LossFn(request.loss_fn)
    except ValueError:
        valid = ", ".join(LOSS_INPUTS)
        # "custom" names a loss uploaded with create_custom_loss, which PlexRL does not
        # host; forward_backward_custom with a Python callable runs on forward and
        # cross_entropy and needs nothing more.
        hint = "; for a custom loss pass a Python callable to forward_backward_custom"
        raise bad_request(
            f"loss_fn {request.loss_fn!r} is not supported; use one of: {valid}"
            + (hint if request.loss_fn == "custom" else "")
        ) from None
    shape = LOSS_INPUTS[loss_fn]
    if not request.data:
        raise bad_request("data is empty; send at least one datum")
    data = [_datum(i, d, shape, limits) for i, d in enumerate(request.data)]
    config = _loss_config(request, loss_fn, shape)
    inp = ForwardBackwardInput(
        data=data,
        loss_fn=loss_fn,
        loss_fn_config=config or None,
        backward=not request.forward_only,
    )
    return inp, WorkHint(tokens=sum(len(d.tokens) for d in data), sequences=len(data))


def _datum(i: int, datum: pb.Datum, shape: LossInputs, limits: ModelLimits) -> Datum:
    try:
        tokens: list[int] = []
        for j, chunk in enumerate(datum.model_input):
            tokens += chunk_tokens(f"data[{i}].model_input[{j}]", chunk)
        given = {
            key: tensor_array(f"data[{i}].loss_fn_inputs[{key!r}]", tensor)
            for key, tensor in datum.loss_fn_inputs.items()
        }
    except CodecError as exc:
        raise bad_request(str(exc)) from None
    n = len(tokens)
    if n == 0:
        raise bad_request(f"data[{i}] has no tokens; every datum needs at least one")
    if n > limits.max_positions:
        raise bad_request(
            f"data[{i}] has {n} tokens, more than the model's {limits.max_positions} "
            "positions; shorten or split it"
        )
    check_token_ids(f"data[{i}].model_input", tokens, limits)
    needed = ["target_tokens", *shape.required]
    missing = [k for k in needed if k not in given]
    if missing:
        raise bad_request(f"data[{i}].loss_fn_inputs lacks {missing}; this loss needs {needed}")
    accepted = shape.accepted
    unknown = sorted(set(given) - set(accepted))
    if unknown:
        raise bad_request(
            f"data[{i}].loss_fn_inputs has {unknown}, which this loss does not read; "
            f"it accepts {list(accepted)}"
        )
    inputs = {}
    for key, values in given.items():
        where = f"data[{i}].loss_fn_inputs[{key!r}]"
        if list(values.shape) != [n]:
            raise bad_request(
                f"{where} has shape {list(values.shape)}, but the datum has {n} tokens; send one "
                f"value per token (shape [{n}]); top-k (N, K) targets are not supported"
            )
        if key == "target_tokens":
            if values.dtype.kind == "f":
                raise bad_request(f"{where} holds floats; send integer token ids (int64)")
            check_token_ids(where, values, limits)
            inputs[key] = to_tensor_array(values, "int64")
        else:
            floats = values.astype("<f4")
            if not np.isfinite(floats).all():
                raise bad_request(f"{where} holds NaN or infinity; send finite numbers")
            inputs[key] = to_tensor_array(floats, "float32")
    return Datum(tokens=tokens, loss_fn_inputs=inputs)


def check_token_ids(where: str, ids: list[int] | np.ndarray, limits: ModelLimits) -> None:
    array = np.asarray(ids, dtype=np.int64)
    bad = np.flatnonzero((array < 0) | (array >= limits.vocab_size))
    if bad.size:
        pos = int(bad[0])
        raise bad_request(
            f"{where}[{pos}] is {int(array[pos])}, outside the vocabulary [0, "
            f"{limits.vocab_size}); tokenize with the base model's tokenizer"
        )


def _loss_config(
    request: pb.ForwardBackwardRequest, loss_fn: LossFn, shape: LossInputs
) -> dict[str, float]:
    config = {k: float(v) for k, v in request.loss_fn_config.items()}
    for key, value in request.loss_fn_config_v2.items():
        if value.WhichOneof("value") == "text":
            raise bad_request(f"loss_fn_config[{key!r}] is text; {loss_fn} takes numbers only")
        config[key] = value.number
    if not all(math.isfinite(v) for v in config.values()):
        raise bad_request("loss_fn_config holds NaN or infinity; send finite numbers")
    try:
        loss_config(loss_fn, config)  # the engine's rules: keys, ranges
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    return config


# Optimizer -----------------------------------------------------------------------------


def adam_params(body: OptimStepBody) -> AdamParams:
    if body.adam_params is None:
        kind = (body.optimizer_params or {}).get("type", "unknown")
        raise bad_request(
            f"optimizer {kind!r} is not supported; PlexRL trains with adamw (send adam_params)"
        )
    p: AdamParamsBody = body.adam_params
    problems = [
        f"{name} is {value}; {rule}"
        for name, value, ok, rule in (
            ("learning_rate", p.learning_rate, p.learning_rate >= 0, "it must be >= 0"),
            ("beta1", p.beta1, 0 <= p.beta1 < 1, "it must be in [0, 1)"),
            ("beta2", p.beta2, 0 <= p.beta2 < 1, "it must be in [0, 1)"),
            ("eps", p.eps, p.eps > 0, "it must be > 0"),
            ("weight_decay", p.weight_decay, p.weight_decay >= 0, "it must be >= 0"),
            ("grad_clip_norm", p.grad_clip_norm, p.grad_clip_norm >= 0, "0 disables clipping"),
        )
        if not ok or not math.isfinite(value)
    ]
    if problems:
        raise bad_request("adam_params: " + "; ".join(problems))
    return AdamParams(
        learning_rate=p.learning_rate,
        beta1=p.beta1,
        beta2=p.beta2,
        eps=p.eps,
        weight_decay=p.weight_decay,
        grad_clip_norm=p.grad_clip_norm,
    )


# Sample --------------------------------------------------------------------------------


def sample_input(
    body: SampleBody, limits: ModelLimits, weights_path: str | None
) -> tuple[SampleInput, WorkHint]:
    unsupported = [
        name
        for name, used in (
            ("topk_sample_logprobs", body.topk_sample_logprobs > 0),
            ("target_prompt_logprobs", body.target_prompt_logprobs is not None),
            ("prompt_alt_tokens_k", body.prompt_alt_tokens_k > 0),
        )
        if used
    ]
    if unsupported:
        raise bad_request(f"{', '.join(unsupported)}: not supported by PlexRL; leave unset")
    prompt = _prompt_tokens(body)
    check_token_ids("prompt", prompt, limits)
    if not 1 <= body.num_samples <= 1024:
        raise bad_request(f"num_samples is {body.num_samples}; it must be in [1, 1024]")
    params = _sampling_params(body, len(prompt), limits)
    prompt_logprobs = bool(body.prompt_logprobs)
    if body.topk_prompt_logprobs < 0:
        raise bad_request("topk_prompt_logprobs must be 0 or more")
    if body.prompt_logprobs_last_n is not None:
        if not prompt_logprobs:
            raise bad_request("prompt_logprobs_last_n needs prompt_logprobs=true")
        if not 1 <= body.prompt_logprobs_last_n <= len(prompt) - 1:
            raise bad_request(
                f"prompt_logprobs_last_n is {body.prompt_logprobs_last_n}; it must be between 1 "
                f"and len(prompt) - 1 = {len(prompt) - 1}"
            )
    inp = SampleInput(
        prompt=prompt,
        num_samples=body.num_samples,
        params=params,
        weights_path=weights_path,
        prompt_logprobs=prompt_logprobs,
        topk_prompt_logprobs=body.topk_prompt_logprobs,
    )
    work = WorkHint(
        tokens=len(prompt) + body.num_samples * params.max_tokens, sequences=body.num_samples
    )
    return inp, work


def _prompt_tokens(body: SampleBody) -> list[int]:
    tokens: list[int] = []
    for j, chunk in enumerate(body.prompt.chunks):
        if chunk.type != "encoded_text" or chunk.tokens is None:
            raise bad_request(
                f"prompt.chunks[{j}] is a {chunk.type!r} chunk, which is not supported: PlexRL "
                "serves text models only; send encoded_text chunks"
            )
        tokens += chunk.tokens
    if not tokens:
        raise bad_request("prompt is empty; send at least one token")
    return tokens


def _sampling_params(body: SampleBody, prompt_len: int, limits: ModelLimits) -> SamplingParams:
    p = body.sampling_params
    room = limits.max_positions - prompt_len
    if room < 1:
        raise bad_request(
            f"prompt has {prompt_len} tokens, which leaves no room in the model's "
            f"{limits.max_positions} positions; shorten it"
        )
    max_tokens = room if p.max_tokens is None else p.max_tokens
    if max_tokens < 1:
        raise bad_request(f"sampling_params.max_tokens is {max_tokens}; it must be 1 or more")
    if max_tokens > room:
        raise bad_request(
            f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the model's "
            f"{limits.max_positions} positions; lower max_tokens to at most {room}"
        )
    if not (p.temperature >= 0 and math.isfinite(p.temperature)):
        raise bad_request(f"sampling_params.temperature is {p.temperature}; it must be >= 0")
    if not 0 < p.top_p <= 1:
        raise bad_request(f"sampling_params.top_p is {p.top_p}; it must be in (0, 1]")
    if p.top_k == 0 or p.top_k < -1:
        raise bad_request(f"sampling_params.top_k is {p.top_k}; use -1 (no limit) or 1 or more")
    strings, tokens, at_eos = _stop(p.stop, limits)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        seed=p.seed,
        stop_strings=strings,
        stop_tokens=tokens,
        stop_at_eos=at_eos,
    )


def _stop(
    stop: str | list[int | str] | None, limits: ModelLimits
) -> tuple[list[str], list[int], bool]:
    """Tinker's `stop`: absent stops at EOS; `[]` stops nowhere, not even at EOS."""
    if stop is None:
        return [], [], True
    if isinstance(stop, str):
        stop = [stop]
    if not stop:
        return [], [], False
    if all(isinstance(s, str) for s in stop):
        strings = [str(s) for s in stop]
        if any(not s for s in strings):
            raise bad_request("sampling_params.stop holds an empty string; remove it")
        return strings, [], True
    if all(isinstance(s, int) for s in stop):
        tokens = [int(s) for s in stop]
        check_token_ids("sampling_params.stop", tokens, limits)
        return [], tokens, True
    raise bad_request("sampling_params.stop mixes strings and token ids; send one kind")
