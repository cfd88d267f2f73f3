"""What one call may ask for: admission caps and input rules, checked before anything is allocated.

The gateway checks every request against these rules before it publishes it, and the
worker's engine checks the call again before it runs it (a call can reach a worker
from a replayed topic, or from a client older than a rule). Both call the functions
here, so the rules cannot drift apart; each raises `InputError` whose message names
the field and says what to change, and each side wraps it in its own error type
(a 4xx at the gateway, an `EngineInputError` in the engine).

The caps also bound the engine time of one call: one engine thread serves every
tenant of a worker, so a call of at most `max_call_tokens` tokens is the longest any
other tenant's call waits behind it (see docs/security.md, "Fairness").
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields

import numpy as np

from plexrl.losses import LossInputs

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
SEED_MIN = -(2**63)
"""Seeds go to `torch.Generator.manual_seed`, which takes [-2^63, 2^64)."""
SEED_MAX = 2**64 - 1
LATEST_TIMESTAMP = 4_102_444_800.0
"""2100-01-01 in Unix seconds: no call ran later; a larger `since` is a typo."""


class InputError(ValueError):
    """A call's input breaks a rule here; the message says which field and what to change."""


@dataclass(frozen=True)
class ModelLimits:
    """What a base model accepts."""

    vocab_size: int
    """Token ids must lie in [0, vocab_size)."""
    max_positions: int
    """Longest sequence, prompt plus completion."""


@dataclass(frozen=True)
class CallLimits:
    """Per-call and per-tenant admission caps (defaults fit a 7B model on one device)."""

    max_body_bytes: int = 32 * 1024 * 1024
    """Largest HTTP request body; a forward_backward call at `max_call_tokens` with
    every per-token loss input is about 4 MiB, so 32 MiB is room and not a memory risk."""
    max_datums: int = 4096
    """Datums in one forward / forward_backward call."""
    max_call_tokens: int = 131_072
    """Tokens one call may make the engine process: the sum of the datums' lengths of a
    forward_backward, or num_samples x (prompt + max_tokens) of a sample. It bounds the
    engine time of one call, hence how long another tenant's call can wait behind it."""
    max_samples: int = 1024
    """num_samples of one sample call."""
    max_stop: int = 16
    """Stop strings (or stop token ids) of one sample call."""
    max_stop_chars: int = 256
    """Characters of one stop string."""
    max_topk_logprobs: int = 64
    """topk_prompt_logprobs of one sample call."""
    max_lora_rank: int = 1024
    """LoRA rank of a new training model."""
    max_pending_calls: int = 1024
    """Calls of one tenant published and not yet answered, per gateway; beyond it a new
    call is refused with 429 and Retry-After until some complete."""
    max_pending_bytes: int = 1024**3
    """Bytes of payloads (token batches, loss inputs) of one tenant's pending calls, per
    gateway: what Redis holds for them until they run."""
    retry_after_s: int = 2
    """The Retry-After a 429 (or a parse-busy 503) carries, seconds."""
    max_json_items: int = 1 << 20
    """Array elements plus object members of one JSON body, bounded from its bytes (each
    ',' and ':') before it is decoded, so the objects decoding makes are bounded by this
    and not by the body's size; a forward_backward at `max_call_tokens` with five
    per-token inputs has about 800k."""
    max_json_containers: int = 1 << 17
    """Arrays and objects of one JSON body (each '[' and '{'), bounded the same way."""
    max_parsing_bodies: int = 2
    """Request bodies decoded at once per gateway (what decoding holds in memory is at
    most this many bodies' worth); one more waits up to `parse_wait_s`, then gets a 503
    with Retry-After."""
    parse_wait_s: int = 2
    """Seconds a body waits for a decoding slot, or for room in `max_held_body_bytes`."""
    max_held_body_bytes: int = 256 * 1024 * 1024
    """Bytes of request bodies one gateway holds at once, all requests together, counted
    as they arrive; a body that would go over waits up to `parse_wait_s` for room, then
    gets a 503 with Retry-After. At least `max_body_bytes`."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"CallLimits.{f.name} is {value!r}; set it to an integer >= 1")


DEFAULT_LIMITS = CallLimits()


# Integers ------------------------------------------------------------------------------


def check_int64(where: str, value: int, low: int = 0) -> int:
    """`value` in [low, 2^63): what Redis, msgpack and torch all hold as a signed 64-bit int."""
    if not low <= value <= INT64_MAX:
        raise InputError(f"{where} is {value}; it must be between {low} and {INT64_MAX}")
    return value


def check_seed(where: str, value: int | None) -> int | None:
    if value is not None and not SEED_MIN <= value <= SEED_MAX:
        raise InputError(
            f"{where} is {value}, which does not fit in 64 bits; use a seed in "
            f"[{SEED_MIN}, {SEED_MAX}]"
        )
    return value


def check_lora_rank(rank: int, limits: CallLimits = DEFAULT_LIMITS) -> int:
    if not 1 <= rank <= limits.max_lora_rank:
        raise InputError(
            f"lora_config.rank is {rank}; use a rank between 1 and {limits.max_lora_rank}"
        )
    return rank


# Tokens ----------------------------------------------------------------------------------


def check_token_ids(where: str, ids: Sequence[int] | np.ndarray, vocab_size: int) -> None:
    """Every id in [0, vocab_size); the error names the first bad position."""
    try:
        array = np.asarray(ids, dtype=np.int64)
    except OverflowError:  # an id beyond 64 bits: find it the slow way
        array = None
    if array is not None:
        bad = np.flatnonzero((array < 0) | (array >= vocab_size))
        if not bad.size:
            return
        pos, value = int(bad[0]), int(array[int(bad[0])])
    else:
        pos, value = next((p, int(t)) for p, t in enumerate(ids) if not 0 <= t < vocab_size)
    raise InputError(
        f"{where}[{pos}] is {value}, outside the vocabulary [0, {vocab_size}); "
        "tokenize with the base model's tokenizer"
    )


def check_datum_length(i: int, n: int, model: ModelLimits) -> None:
    if n == 0:
        raise InputError(f"data[{i}] has no tokens; every datum needs at least one")
    if n > model.max_positions:
        raise InputError(
            f"data[{i}] has {n} tokens, more than the model's {model.max_positions} "
            "positions; shorten or split it"
        )


def check_call_size(lengths: Iterable[int], limits: CallLimits = DEFAULT_LIMITS) -> int:
    """A forward / forward_backward call's datum count and total tokens; returns the total."""
    lengths = list(lengths)
    if not lengths:
        raise InputError("data is empty; send at least one datum")
    if len(lengths) > limits.max_datums:
        raise InputError(
            f"data has {len(lengths)} datums, more than the {limits.max_datums} one call may "
            "carry; split it into several calls (forward_backward accumulates gradients)"
        )
    total = sum(lengths)
    if total > limits.max_call_tokens:
        raise InputError(
            f"data has {total} tokens in all, more than the {limits.max_call_tokens} one call "
            "may carry; split it into several forward_backward calls (gradients accumulate "
            "until optim_step)"
        )
    return total


# Per-token loss inputs -------------------------------------------------------------------


def check_tensor_shape(
    where: str, shape: Sequence[int], limits: CallLimits = DEFAULT_LIMITS
) -> None:
    """A tensor's declared shape, before it is made dense: no negative dimension, and no
    more elements than one call may carry tokens (each per-token input has one per token)."""
    dims = [int(d) for d in shape]
    if any(d < 0 for d in dims):
        raise InputError(f"{where} has a negative dimension in shape {dims}")
    if math.prod(dims) > limits.max_call_tokens:
        raise InputError(
            f"{where} has shape {dims}, {math.prod(dims)} elements, more than the "
            f"{limits.max_call_tokens} a call may carry; send one value per token"
        )


def check_loss_input_keys(i: int, given: Iterable[str], loss_fn: str, shape: LossInputs) -> None:
    given = set(given)
    needed = ["target_tokens", *shape.required]
    missing = [k for k in needed if k not in given]
    if missing:
        raise InputError(f"data[{i}].loss_fn_inputs lacks {missing}; {loss_fn} needs {needed}")
    unknown = sorted(given - set(shape.accepted))
    if unknown:
        raise InputError(
            f"data[{i}].loss_fn_inputs has {unknown}, which this loss does not read; "
            f"{loss_fn} accepts {list(shape.accepted)}"
        )


def check_loss_input_shape(where: str, shape: Sequence[int], n: int) -> None:
    if list(shape) != [n]:
        raise InputError(
            f"{where} has shape {list(shape)}, but the datum has {n} tokens; send one value "
            f"per token (shape [{n}]); top-k (N, K) targets are not supported"
        )


# Sampling ------------------------------------------------------------------------------


def default_max_tokens(
    prompt_len: int, num_samples: int, model: ModelLimits, limits: CallLimits = DEFAULT_LIMITS
) -> int:
    """max_tokens when the caller sent none: what fits the model and the call's token cap."""
    per_sample = limits.max_call_tokens // max(num_samples, 1)
    # At least 1: when even that does not fit, check_sample_size says how many samples do.
    return max(1, min(model.max_positions, per_sample) - prompt_len)


def check_num_samples(num_samples: int, limits: CallLimits = DEFAULT_LIMITS) -> None:
    if not 1 <= num_samples <= limits.max_samples:
        raise InputError(f"num_samples is {num_samples}; it must be in [1, {limits.max_samples}]")


def check_sample_size(
    prompt_len: int,
    num_samples: int,
    max_tokens: int,
    model: ModelLimits,
    limits: CallLimits = DEFAULT_LIMITS,
) -> None:
    """Prompt, num_samples and max_tokens: what the model holds and one call may cost."""
    if prompt_len == 0:
        raise InputError("prompt is empty; send at least one token")
    check_num_samples(num_samples, limits)
    room = model.max_positions - prompt_len
    if room < 1:
        raise InputError(
            f"prompt has {prompt_len} tokens, which leaves no room in the model's "
            f"{model.max_positions} positions; shorten it"
        )
    if max_tokens < 1:
        raise InputError(f"sampling_params.max_tokens is {max_tokens}; it must be 1 or more")
    if max_tokens > room:
        raise InputError(
            f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the model's "
            f"{model.max_positions} positions; lower max_tokens to at most {room}"
        )
    cost = num_samples * (prompt_len + max_tokens)
    if cost > limits.max_call_tokens:
        fit = limits.max_call_tokens // (prompt_len + max_tokens)
        raise InputError(
            f"num_samples ({num_samples}) x (prompt {prompt_len} + max_tokens {max_tokens}) is "
            f"{cost} tokens, more than the {limits.max_call_tokens} one call may cost; ask for "
            f"at most {fit} samples per call, or lower max_tokens"
        )


def check_sampling_params(temperature: float, top_p: float, top_k: int, seed: int | None) -> None:
    if not (math.isfinite(temperature) and temperature >= 0):
        raise InputError(f"sampling_params.temperature is {temperature}; use a finite value >= 0")
    if not 0 < top_p <= 1:
        raise InputError(f"sampling_params.top_p is {top_p}; it must be in (0, 1]")
    if top_k != -1 and not 1 <= top_k <= INT64_MAX:
        raise InputError(f"sampling_params.top_k is {top_k}; use -1 (no limit) or 1 or more")
    check_seed("sampling_params.seed", seed)


def check_stop(
    strings: Sequence[str],
    tokens: Sequence[int],
    model: ModelLimits,
    limits: CallLimits = DEFAULT_LIMITS,
) -> None:
    count = len(strings) + len(tokens)
    if count > limits.max_stop:
        raise InputError(
            f"sampling_params.stop has {count} entries; send at most {limits.max_stop}"
        )
    for j, s in enumerate(strings):
        if not s:
            raise InputError("sampling_params.stop holds an empty string; remove it")
        if len(s) > limits.max_stop_chars:
            raise InputError(
                f"sampling_params.stop[{j}] has {len(s)} characters; use at most "
                f"{limits.max_stop_chars}"
            )
    check_token_ids("sampling_params.stop", tokens, model.vocab_size)


def check_topk_logprobs(k: int, limits: CallLimits = DEFAULT_LIMITS) -> None:
    if not 0 <= k <= limits.max_topk_logprobs:
        raise InputError(
            f"topk_prompt_logprobs is {k}; use 0 (off) up to {limits.max_topk_logprobs}"
        )


def check_since(since: float) -> float:
    """A `since` timestamp (Unix seconds) that names a time calls can have run at."""
    if not (math.isfinite(since) and 0 <= since <= LATEST_TIMESTAMP):
        raise InputError(
            f"since is {since}; send Unix seconds between 0 and {LATEST_TIMESTAMP:.0f}"
        )
    return since
