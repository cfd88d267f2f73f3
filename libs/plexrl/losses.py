"""The built-in losses' contract: which per-token inputs each reads, its config and defaults.

The gateway validates requests against it and the worker's engine computes with it, so
the rules live here once. The arithmetic itself is in the engine
(`plexrl_worker.engine.losses`); docs/losses.md has every formula.
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
    """float32 inputs that default to all ones when absent (`weights`: every token counts;
    `sequence_ratio_mask`: every token of the datum enters GSPO's sequence ratio)."""

    @property
    def accepted(self) -> tuple[str, ...]:
        return ("target_tokens", *self.required, *self.optional)


# The policy-gradient losses all read the sampler's per-token logprobs and advantages.
_RL = ("logprobs", "advantages")

# `weights` scales each token's term in every loss (absent: ones). Tinker documents it
# for cross_entropy only; clients that also send it with the RL losses mean a token mask.
LOSS_INPUTS: dict[LossFn, LossInputs] = {
    LossFn.CROSS_ENTROPY: LossInputs(required=(), optional=("weights",)),
    LossFn.IMPORTANCE_SAMPLING: LossInputs(required=_RL, optional=("weights",)),
    LossFn.PPO: LossInputs(required=_RL, optional=("weights",)),
    LossFn.CISPO: LossInputs(required=_RL, optional=("weights",)),
    LossFn.DRO: LossInputs(required=_RL, optional=("weights",)),
    LossFn.GSPO: LossInputs(required=_RL, optional=("weights", "sequence_ratio_mask")),
    LossFn.STABLE_REINFORCE: LossInputs(required=_RL, optional=("weights",)),
}

# The one place the losses' knobs are named (Tinker's `loss_fn_config` keys) and defaulted.
CLIP_LOW = "clip_low_threshold"
"""Lower bound of the clipped importance ratio (ppo, cispo, gspo)."""
CLIP_HIGH = "clip_high_threshold"
"""Upper bound of the clipped importance ratio (ppo, cispo, gspo, stable_reinforce)."""
BETA = "beta"
"""Weight of DRO's quadratic penalty on the log-ratio."""
KL_COEFF = "kl_coeff"
"""Weight of stable_reinforce's KL(sampler || policy) penalty (k3 estimator)."""

LOSS_CONFIG_DEFAULTS: dict[LossFn, dict[str, float]] = {
    LossFn.CROSS_ENTROPY: {},
    LossFn.IMPORTANCE_SAMPLING: {},
    LossFn.PPO: {CLIP_LOW: 0.8, CLIP_HIGH: 1.2},
    # Tinker's documented one-sided default: no lower bound, the coefficient capped at 4.
    LossFn.CISPO: {CLIP_LOW: 0.0, CLIP_HIGH: 4.0},
    # Tinker's page shows beta=0.05 and states no default; PlexRL takes that value.
    LossFn.DRO: {BETA: 0.05},
    # GSPO's paper clips the sequence ratio at 1 - 3e-4 and 1 + 4e-4: a geometric mean of
    # token ratios moves far less than any one token's ratio.
    LossFn.GSPO: {CLIP_LOW: 1.0 - 3e-4, CLIP_HIGH: 1.0 + 4e-4},
    # Truncated importance sampling caps the weight at 2 (Yao et al., 2025); no KL penalty.
    LossFn.STABLE_REINFORCE: {CLIP_HIGH: 2.0, KL_COEFF: 0.0},
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
    problem = _config_problem(config)
    if problem:
        raise ValueError(f"{loss_fn} loss_fn_config: {problem}")
    return config


def _config_problem(config: dict[str, float]) -> str | None:
    low, high = config.get(CLIP_LOW), config.get(CLIP_HIGH)
    if low is not None and high is not None and not 0.0 <= low <= high:
        return f"needs 0 <= {CLIP_LOW} <= {CLIP_HIGH}; got {low} and {high}"
    if low is None and high is not None and not high > 0.0:
        return f"{CLIP_HIGH} is {high}; the importance weight's cap must be > 0"
    for key in (BETA, KL_COEFF):
        if key in config and not config[key] >= 0.0:
            return f"{key} is {config[key]}; it must be >= 0 (0 turns the penalty off)"
    return None
