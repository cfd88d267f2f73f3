"""Restore = snapshot + replay of the calls since, on another engine: bit for bit the same.

This is what a worker's `JobRecovery` does after another worker died: the snapshot's
bytes come from the disk tier, the calls from the job's ledger. The engine must stay
deterministic under it, gradients accumulated mid-step included.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from pathlib import Path

import pytest

from plexrl.messages import AdamParams, ForwardBackwardInput, LossFn, OptimStepInput
from plexrl.models import ModelRegistry
from plexrl_worker.engine import EngineConfig, TorchEngine, state_from_bytes, state_to_bytes
from tests.test_engine import FULL, LORA, random_batch

Call = Callable[[TorchEngine], object]


def calls(steps: int) -> list[Call]:
    """A job's training calls after CREATE: forward_backward twice, then a step, per step."""
    out: list[Call] = []
    for step in range(steps):
        for half in (0, 1):
            inp = ForwardBackwardInput(
                random_batch(10 * step + half, rows=2, length=12), LossFn.CROSS_ENTROPY
            )
            out.append(functools.partial(TorchEngine.forward_backward, job_id="job", inp=inp))
        adam = OptimStepInput(AdamParams(learning_rate=1e-2, grad_clip_norm=1.0))
        out.append(functools.partial(TorchEngine.optim_step, job_id="job", inp=adam))
    return out


def digest(engine: TorchEngine) -> str:
    state = engine.export_state("job", optimizer=True, gradients=True)
    return hashlib.sha256(state_to_bytes(state)).hexdigest()


@pytest.mark.parametrize("spec", [LORA, FULL], ids=["lora", "full"])
@pytest.mark.parametrize("snapshot_after", [0, 4, 5])  # 4: gradients pending in the snapshot
def test_snapshot_plus_replay_is_the_undisturbed_state(
    tiny_registry: Path, spec: object, snapshot_after: int
) -> None:
    registry = ModelRegistry(tiny_registry)
    todo = calls(3)
    alone = TorchEngine(registry, EngineConfig())
    alone.create("job", spec)  # type: ignore[arg-type]
    snapshot = b""
    for i, call in enumerate(todo):
        if i == snapshot_after:
            snapshot = state_to_bytes(alone.export_state("job", optimizer=True, gradients=True))
        call(alone)

    restored = TorchEngine(registry, EngineConfig())  # another worker
    restored.onload("job", state_from_bytes(snapshot))
    for call in todo[snapshot_after:]:
        call(restored)

    assert digest(restored) == digest(alone)
    probe = ForwardBackwardInput(random_batch(99, rows=2, length=12), LossFn.CROSS_ENTROPY)
    assert restored.forward_backward("job", probe) == alone.forward_backward("job", probe)
