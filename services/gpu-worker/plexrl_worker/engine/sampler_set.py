"""The sampler weight sets one engine holds: read-only weights a sampling client reads
(what `save_weights_for_sampler` made), installed from exported tensors, bounded.

An RL loop saves new sampler weights every step, so the sets would pile up for the
worker's lifetime: beyond `EngineConfig.max_samplers` the least recently sampled sets
no running call reads are dropped (a later call installs one again from the
state-store). Sets are kept in use order, least recent first.
"""

from __future__ import annotations

from pathlib import Path

import torch

from plexrl.messages import JobSpec
from plexrl_worker.engine import state, weight_set
from plexrl_worker.engine.bases import BaseModels
from plexrl_worker.engine.cobatch import Batcher
from plexrl_worker.engine.config import EngineConfig
from plexrl_worker.engine.errors import UnknownJobError
from plexrl_worker.engine.state import JobTensors
from plexrl_worker.engine.weight_set import WeightSet


class SamplerSet:
    """Not thread-safe: the engine calls it under its lock (`ids` excepted)."""

    def __init__(self, bases: BaseModels, config: EngineConfig, batcher: Batcher) -> None:
        self._bases = bases
        self._config = config
        # A set in use by the running batch is never freed under it.
        self._batcher = batcher
        self._sets: dict[str, WeightSet] = {}

    def __contains__(self, weights_id: str) -> bool:
        return weights_id in self._sets

    def ids(self) -> list[str]:
        """Installed sets; no lock (introspection)."""
        return sorted(list(self._sets))

    def install(self, weights_id: str, tensors: JobTensors) -> None:
        """Make exported weights sampleable as `weights_id` (replacing any set of that id)."""
        weights_only = JobTensors(
            {k: v for k, v in tensors.tensors.items() if k.startswith(state.WEIGHTS)},
            tensors.metadata,
        )
        new = weight_set.build(self._bases, self._config, weights_only, trainable=False)
        old = self._sets.pop(weights_id, None)
        if old is not None:
            self._batcher.abandon(weights_id, f"{weights_id!r} was replaced while sampling")
            old.weights.release()
        self._sets[weights_id] = new
        self.trim()

    def recent(self, weights_id: str) -> WeightSet | None:
        """The installed set, made the most recently used (the last `trim` drops); None
        if not installed."""
        found = self._sets.pop(weights_id, None)
        if found is not None:
            self._sets[weights_id] = found
        return found

    def trim(self) -> None:
        """Drop the least recently sampled sets beyond `max_samplers` that no call in the
        running batch reads."""
        excess = len(self._sets) - self._config.max_samplers
        if excess <= 0:
            return
        reading = self._read_by_batch()
        for weights_id in [w for w in self._sets if w not in reading][:excess]:
            self._sets.pop(weights_id).weights.release()

    def drop(self, weights_id: str, *, unless_read: bool) -> bool:
        """Free a set; with `unless_read`, not one a running call reads (it goes when
        `trim` finds it idle). False if none was dropped."""
        if unless_read and weights_id in self._read_by_batch():
            return False
        found = self._sets.pop(weights_id, None)
        if found is None:
            return False
        if not unless_read:
            self._batcher.abandon(weights_id, f"{weights_id!r} was dropped while sampling")
        found.weights.release()
        return True

    def weights(self, weights_id: str) -> tuple[JobSpec, Path, dict[str, torch.Tensor]]:
        """A set's spec, base model directory and weights (CPU copies, named as the job's
        parameters), for another sampler to load."""
        found = self._sets.get(weights_id)
        if found is None:
            raise UnknownJobError(weights_id, self.ids())
        tensors = {n: p.detach().to("cpu").clone() for n, p in found.weights.params()}
        return found.spec, found.info.path, tensors

    def _read_by_batch(self) -> set[str]:
        return {call.weights_id for call in self._batcher.calls}
