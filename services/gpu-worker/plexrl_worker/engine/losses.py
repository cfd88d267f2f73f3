"""The built-in losses, with Tinker semantics: per-token terms, SUMMED (never averaged).

Every loss is a function of the target tokens' log-probabilities under the current
weights (`logprobs`, shape [B, T]) and the datum's per-token inputs (same shape, zero on
padding). Which inputs and config keys each loss takes is `plexrl.losses`; the formulas
are tabled in docs/losses.md. `sg(x)` below is `x.detach()`: a value that carries no
gradient, which is how CISPO, GSPO and stable_reinforce shape their gradients.
"""

from __future__ import annotations

import torch

from plexrl.losses import (
    BETA,
    CLIP_HIGH,
    CLIP_LOW,
    KL_COEFF,
    LOSS_CONFIG_DEFAULTS,
    LOSS_INPUTS,
    LossInputs,
    loss_config,
)
from plexrl.messages import LossFn

__all__ = [
    "LOSS_CONFIG_DEFAULTS",
    "LOSS_INPUTS",
    "LossInputs",
    "elementwise_loss",
    "loss_config",
]


def elementwise_loss(
    loss_fn: LossFn,
    logprobs: torch.Tensor,
    inputs: dict[str, torch.Tensor],
    config: dict[str, float],
) -> torch.Tensor:
    """Per-token loss terms, [B, T]; the call's loss is their sum over real (unpadded) tokens."""
    weights = inputs["weights"]  # batch.prepare fills in the default ones
    if loss_fn == LossFn.CROSS_ENTROPY:
        return -weights * logprobs
    sampler = inputs["logprobs"]
    advantages = inputs["advantages"]
    if loss_fn == LossFn.GSPO:
        return -weights * _clipped_surrogate(_gspo_ratio(logprobs, inputs), advantages, config)
    log_ratio = logprobs - sampler
    ratio = torch.exp(log_ratio)
    if loss_fn == LossFn.IMPORTANCE_SAMPLING:
        return -weights * ratio * advantages
    if loss_fn == LossFn.PPO:
        return -weights * _clipped_surrogate(ratio, advantages, config)
    if loss_fn == LossFn.CISPO:
        coefficient = torch.clamp(ratio, config[CLIP_LOW], config[CLIP_HIGH]).detach()
        return -weights * coefficient * logprobs * advantages
    if loss_fn == LossFn.DRO:
        return -weights * (logprobs * advantages - 0.5 * config[BETA] * log_ratio**2)
    if loss_fn == LossFn.STABLE_REINFORCE:
        # Truncated importance sampling: every token keeps its policy gradient, with a
        # weight that can shrink toward 0 but never grow past the cap, so stale or
        # numerically mismatched samples cannot blow a step up. The k3 term
        # (ratio - 1 - log ratio >= 0, zero on-policy) pulls back toward the sampler.
        weight = torch.clamp(ratio, max=config[CLIP_HIGH]).detach()
        kl = ratio - 1.0 - log_ratio
        return weights * (config[KL_COEFF] * kl - weight * logprobs * advantages)
    raise ValueError(f"no loss named {loss_fn!r}")


def _clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, config: dict[str, float]
) -> torch.Tensor:
    """PPO's pessimistic objective per token: min(r * A, clip(r) * A)."""
    clipped = torch.clamp(ratio, config[CLIP_LOW], config[CLIP_HIGH])
    return torch.minimum(ratio * advantages, clipped * advantages)


def _gspo_ratio(logprobs: torch.Tensor, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """GSPO-token: each token carries its row's sequence ratio (the geometric mean of the
    token ratios over the tokens `sequence_ratio_mask` marks) as its value, and its own
    log-probability's gradient: sg(s) * p / sg(p)."""
    in_ratio = inputs["sequence_ratio_mask"] != 0
    # where(), not a product: logprobs on padding may be inf, and inf * 0 is nan.
    diffs = torch.where(in_ratio, logprobs.detach() - inputs["logprobs"], 0.0)
    # A row that marks no token has ratio 1 (log-ratio 0) rather than 0/0.
    counts = in_ratio.sum(dim=-1, keepdim=True).clamp(min=1)
    sequence_log_ratio = diffs.sum(dim=-1, keepdim=True) / counts
    return torch.exp(sequence_log_ratio + logprobs - logprobs.detach())
