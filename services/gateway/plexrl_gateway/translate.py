"""Tinker requests to phase inputs, checked against the base model before anything is published.

Pure functions: each takes a decoded request and what the gateway knows about the model
and returns a contract input, or raises a 400 that says what to change.
"""

from __future__ import annotations

import contextlib
import enum
import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from plexrl import limits as rules
from plexrl.limits import DEFAULT_LIMITS, CallLimits, InputError, ModelLimits
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
from plexrl.names import BadNameError, check_name
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


@contextlib.contextmanager
def _as_400() -> Iterator[None]:
    """The shared input rules (plexrl.limits) raise InputError; the caller gets a 400."""
    try:
        yield
    except InputError as exc:
        raise bad_request(str(exc)) from None


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
    with _as_400():
        return rules.check_int64(name, value)


# Tinker paths ------------------------------------------------------------------------------


class CheckpointKind(enum.StrEnum):
    """The type segment of a tinker path."""

    WEIGHTS = "weights"
    """Weights with optimizer state, from save_state; loadable by training clients."""
    SAMPLER_WEIGHTS = "sampler_weights"
    """Weights only, from save_weights_for_sampler; read by sampling clients."""
    EXTERNAL_WEIGHTS = "external_weights"
    """Hugging Face files from save_weights_external (a PEFT adapter or a model
    directory): downloaded through get_external_weights_urls, never loaded or sampled."""


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
    example = (
        "tinker://<model_id>/weights/<name>, tinker://<model_id>/sampler_weights/<name> "
        "or tinker://<model_id>/external_weights/<name>"
    )
    if not path.startswith(TINKER_SCHEME):
        raise bad_request(f"bad tinker path {path!r}: it must start with tinker://, like {example}")
    parts = path[len(TINKER_SCHEME) :].split("/")
    if len(parts) != 3 or not all(parts):
        raise bad_request(f"bad tinker path {path!r}: expected three parts, like {example}")
    model_id, kind, name = parts
    try:
        return TinkerPath(model_id, CheckpointKind(kind), name)
    except ValueError:
        raise bad_request(
            f"bad tinker path {path!r}: unknown type {kind!r}; expected {example}"
        ) from None


def parse_runnable_path(path: str) -> TinkerPath:
    """A tinker path a model can load or sample from: not one of exported files."""
    parsed = parse_tinker_path(path)
    if parsed.kind == CheckpointKind.EXTERNAL_WEIGHTS:
        raise bad_request(
            f"{path} names exported Hugging Face files, which are downloaded "
            "(get_external_weights_urls), not loaded or sampled; use the weights/ or "
            "sampler_weights/ checkpoint of the same run"
        )
    return parsed


def checkpoint_name(name: str | None, fallback: str) -> str:
    """A checkpoint name as the last segment of its tinker path."""
    if name is None or name == "":
        return fallback
    try:
        return check_name(name)
    except BadNameError as exc:
        raise bad_request(str(exc)) from None


# Create --------------------------------------------------------------------------------


def job_spec(
    body: CreateModelBody, state_bytes: int, limits: CallLimits = DEFAULT_LIMITS
) -> JobSpec:
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
        with _as_400():
            rules.check_lora_rank(cfg.rank, limits)
            rules.check_seed("lora_config.seed", cfg.seed)
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
    request: pb.ForwardBackwardRequest,
    limits: ModelLimits,
    caps: CallLimits = DEFAULT_LIMITS,
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
    with _as_400():
        # Datum count and total tokens first, from the encoded sizes: nothing is decoded
        # (or made dense) for a call that is too big anyway.
        rules.check_call_size((_encoded_tokens(d) for d in request.data), caps)
        data = [_datum(i, d, loss_fn, shape, limits, caps) for i, d in enumerate(request.data)]
    config = _loss_config(request, loss_fn, shape)
    inp = ForwardBackwardInput(
        data=data,
        loss_fn=loss_fn,
        loss_fn_config=config or None,
        backward=not request.forward_only,
    )
    return inp, WorkHint(tokens=sum(len(d.tokens) for d in data), sequences=len(data))


def _encoded_tokens(datum: pb.Datum) -> int:
    """A datum's token count as encoded (int32 ids), without decoding it."""
    return sum(len(c.encoded_text.tokens) // 4 for c in datum.model_input)


def _datum(
    i: int,
    datum: pb.Datum,
    loss_fn: LossFn,
    shape: LossInputs,
    limits: ModelLimits,
    caps: CallLimits,
) -> Datum:
    for key, tensor in datum.loss_fn_inputs.items():
        # Before tensor_array makes a sparse tensor dense: a shape of 2^20 x 2^20 is
        # refused here, not allocated.
        rules.check_tensor_shape(f"data[{i}].loss_fn_inputs[{key!r}]", tensor.shape, caps)
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
    rules.check_datum_length(i, n, limits)
    rules.check_token_ids(f"data[{i}].model_input", tokens, limits.vocab_size)
    rules.check_loss_input_keys(i, given, loss_fn, shape)
    inputs = {}
    for key, values in given.items():
        where = f"data[{i}].loss_fn_inputs[{key!r}]"
        rules.check_loss_input_shape(where, values.shape, n)
        if key == "target_tokens":
            if values.dtype.kind == "f":
                raise bad_request(f"{where} holds floats; send integer token ids (int64)")
            rules.check_token_ids(where, values, limits.vocab_size)
            inputs[key] = to_tensor_array(values, "int64")
        else:
            floats = values.astype("<f4")
            if not np.isfinite(floats).all():
                raise bad_request(f"{where} holds NaN or infinity; send finite numbers")
            inputs[key] = to_tensor_array(floats, "float32")
    return Datum(tokens=tokens, loss_fn_inputs=inputs)


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
    body: SampleBody,
    limits: ModelLimits,
    weights_path: str | None,
    caps: CallLimits = DEFAULT_LIMITS,
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
    with _as_400():
        rules.check_token_ids("prompt", prompt, limits.vocab_size)
        params = _sampling_params(body, len(prompt), limits, caps)
        rules.check_topk_logprobs(body.topk_prompt_logprobs, caps)
    prompt_logprobs = bool(body.prompt_logprobs)
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
        tokens=len(prompt) + body.num_samples * params.max_tokens,
        sequences=body.num_samples,
        # A checkpoint's weights never change: any worker serving the base reads them alike.
        portable=weights_path is not None,
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


def _sampling_params(
    body: SampleBody, prompt_len: int, limits: ModelLimits, caps: CallLimits
) -> SamplingParams:
    """Raises InputError (the shared rules) or a 400."""
    p = body.sampling_params
    rules.check_num_samples(body.num_samples, caps)  # before anything is sized by it
    max_tokens = p.max_tokens
    if max_tokens is None:
        max_tokens = rules.default_max_tokens(prompt_len, body.num_samples, limits, caps)
    rules.check_sample_size(prompt_len, body.num_samples, max_tokens, limits, caps)
    rules.check_sampling_params(p.temperature, p.top_p, p.top_k, p.seed)
    strings, tokens, at_eos = _stop(p.stop)
    rules.check_stop(strings, tokens, limits, caps)
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


def _stop(stop: str | list[int | str] | None) -> tuple[list[str], list[int], bool]:
    """Tinker's `stop`: absent stops at EOS; `[]` stops nowhere, not even at EOS."""
    if stop is None:
        return [], [], True
    if isinstance(stop, str):
        stop = [stop]
    if not stop:
        return [], [], False
    if all(isinstance(s, str) for s in stop):
        return [str(s) for s in stop], [], True
    if all(isinstance(s, int) for s in stop):
        return [], [int(s) for s in stop], True
    raise bad_request("sampling_params.stop mixes strings and token ids; send one kind")
