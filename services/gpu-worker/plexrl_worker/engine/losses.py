"""The built-in losses, with Tinker semantics: per-token terms, SUMMED (never averaged).

Every loss is a function of the target tokens' log-probabilities under the current
weights (`logprobs`, shape [B, T]) and the datum's per-token inputs (same shape).
"""

from __future__ import annotations

import torch

from plexrl.losses import (
    LOSS_CONFIG_DEFAULTS,
    LOSS_INPUTS,
    PPO_CLIP_HIGH,
    PPO_CLIP_LOW,
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
    ratio = torch.exp(logprobs - inputs["logprobs"])
    advantages = inputs["advantages"]
    if loss_fn == LossFn.IMPORTANCE_SAMPLING:
        return -weights * ratio * advantages
    if loss_fn == LossFn.PPO:
        clipped = torch.clamp(ratio, config[PPO_CLIP_LOW], config[PPO_CLIP_HIGH])
        return -weights * torch.minimum(ratio * advantages, clipped * advantages)
    raise ValueError(f"no loss named {loss_fn!r}")
