"""A set of weights the engine holds: a training job's state, or a read-only sampler
weight set; built from exported tensors exactly as they were exported."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from plexrl.messages import AdamParams, JobSpec
from plexrl.models import BaseModelInfo
from plexrl_worker.engine import state
from plexrl_worker.engine.bases import BaseModels
from plexrl_worker.engine.config import EngineConfig
from plexrl_worker.engine.errors import EngineInputError
from plexrl_worker.engine.state import JobTensors
from plexrl_worker.engine.weights import FullWeights, LoraWeights, Weights, empty_model


@dataclass
class WeightSet:
    """A training job's state, or (optimizer None) a read-only sampler weight set."""

    spec: JobSpec
    info: BaseModelInfo
    weights: Weights
    optimizer: torch.optim.AdamW | None
    steps: int = 0
    """Optimizer steps taken."""


def build(
    bases: BaseModels, config: EngineConfig, job_state: JobTensors, *, trainable: bool
) -> WeightSet:
    """A weight set holding `job_state` (its AdamW state too when `trainable`)."""
    try:
        spec = job_state.spec
    except (KeyError, ValueError) as exc:
        raise EngineInputError(f"the state carries no valid JobSpec: {exc}") from exc
    info = bases.info(spec.base_model)
    if spec.lora is None:
        weights: Weights = FullWeights(empty_model(info.path, config))
    else:
        base = bases.shared(info)
        weights = LoraWeights(base, base.add_adapter(spec.lora, spec.seed))
    try:
        params = weights.params()
        state.import_params(params, job_state.tensors, gradients=trainable)
        optimizer = adamw(weights) if trainable else None
        if optimizer is not None:
            state.import_adam(params, optimizer, job_state.tensors)
    except ValueError as exc:
        weights.release()
        raise EngineInputError(str(exc)) from exc
    return WeightSet(spec, info, weights, optimizer, steps=job_state.steps)


def adamw(weights: Weights) -> torch.optim.AdamW:
    # lr and the rest are set on every optim_step; these are placeholders.
    return torch.optim.AdamW([p for _, p in weights.params()], lr=0.0)


def state_bytes(weight_set: WeightSet) -> int:
    # Weights, gradients and AdamW's two moments, each the size of the trainable weights.
    return 4 * sum(p.numel() * p.element_size() for _, p in weight_set.weights.params())


def check_adam(adam: AdamParams) -> None:
    """Refuse hyperparameters AdamW would misbehave with, naming each and its range."""
    problems = []
    if not adam.learning_rate >= 0:
        problems.append(f"learning_rate {adam.learning_rate} must be >= 0")
    for name, beta in (("beta1", adam.beta1), ("beta2", adam.beta2)):
        if not 0 <= beta < 1:
            problems.append(f"{name} {beta} must be in [0, 1)")
    if not adam.eps > 0:
        problems.append(f"eps {adam.eps} must be > 0")
    if not adam.weight_decay >= 0:
        problems.append(f"weight_decay {adam.weight_decay} must be >= 0")
    if not adam.grad_clip_norm >= 0:
        problems.append(f"grad_clip_norm {adam.grad_clip_norm} must be >= 0 (0 turns clipping off)")
    if problems:
        raise EngineInputError("bad AdamParams: " + "; ".join(problems))


def clip_grads(params: list[torch.nn.Parameter], adam: AdamParams) -> torch.Tensor:
    """The gradients' total norm (zero when none has one), after scaling them down to
    `adam.grad_clip_norm` where that is positive and the norm exceeds it."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
    if adam.grad_clip_norm > 0 and grads:
        torch.nn.utils.clip_grads_with_norm_(params, adam.grad_clip_norm, norm)
    return norm


def adamw_step(optimizer: torch.optim.AdamW, adam: AdamParams) -> None:
    """One AdamW step over the accumulated gradients, which it then clears."""
    # Hyperparameters arrive with every step (a schedule lives in the client).
    for group in optimizer.param_groups:
        group.update(
            lr=adam.learning_rate,
            betas=(adam.beta1, adam.beta2),
            eps=adam.eps,
            weight_decay=adam.weight_decay,
        )
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def step_metrics(norm: torch.Tensor, steps: int, adam: AdamParams) -> dict[str, float]:
    # "name:reduction": the Tinker SDK splits metric keys on the colon.
    return {
        "grad_norm:mean": float(norm),
        "step:max": float(steps),
        "learning_rate:mean": adam.learning_rate,
    }


def describe(spec: JobSpec) -> str:
    if spec.lora is None:
        return f"full fine-tuning of {spec.base_model!r}"
    return f"LoRA {spec.lora} over {spec.base_model!r}"
