"""The built-in losses' contract: which per-token inputs each reads, its config and defaults.

The gateway validates requests against it and the worker's engine computes with it, so
the rules live here once. The arithmetic itself is in the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from plexrl.messages import LossFn


@dataclass(frozen=True)
class LossInputs:
    """Which per-token inputs a loss reads; `target_tokens` (int64) is always required."""

    required: tuple[str, ...]
    """float32 inputs the caller must send."""
    optional: tuple[str, ...] = ()
    """float32 inputs with a default when absent (`weights` defaults to all ones)."""

    @property
    def accepted(self) -> tuple[str, ...]:
        return ("target_tokens", *self.required, *self.optional)


# `weights` scales each token's term in every loss (absent: ones). Tinker documents it
# for cross_entropy only; clients that also send it with the RL losses mean a token mask.
LOSS_INPUTS: dict[LossFn, LossInputs] = {
    LossFn.CROSS_ENTROPY: LossInputs(required=(), optional=("weights",)),
    LossFn.IMPORTANCE_SAMPLING: LossInputs(
        required=("logprobs", "advantages"), optional=("weights",)
    ),
    LossFn.PPO: LossInputs(required=("logprobs", "advantages"), optional=("weights",)),
}

# The one place PPO's knobs are named (Tinker's `loss_fn_config` keys) and defaulted.
PPO_CLIP_LOW = "clip_low_threshold"
PPO_CLIP_HIGH = "clip_high_threshold"
LOSS_CONFIG_DEFAULTS: dict[LossFn, dict[str, float]] = {
    LossFn.CROSS_ENTROPY: {},
    LossFn.IMPORTANCE_SAMPLING: {},
    LossFn.PPO: {PPO_CLIP_LOW: 0.8, PPO_CLIP_HIGH: 1.2},
}


def loss_config(loss_fn: LossFn, given: dict[str, float] | None) -> dict[str, float]:
    """The loss's config with defaults filled in; ValueError on unknown keys or bad values."""
    defaults = LOSS_CONFIG_DEFAULTS[loss_fn]
    given = given or {}
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        accepted = ", ".join(defaults) or "no keys"
        raise ValueError(
            f"loss_fn_config keys {unknown} mean nothing to {loss_fn}; it takes {accepted}"
        )
    config = {**defaults, **{k: float(v) for k, v in given.items()}}
    if loss_fn == LossFn.PPO and not 0.0 <= config[PPO_CLIP_LOW] <= config[PPO_CLIP_HIGH]:
        raise ValueError(
            f"PPO needs 0 <= {PPO_CLIP_LOW} <= {PPO_CLIP_HIGH}; got "
            f"{config[PPO_CLIP_LOW]} and {config[PPO_CLIP_HIGH]}"
        )
    return config
