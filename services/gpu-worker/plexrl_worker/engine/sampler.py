"""The sampling side of one engine: `sample` calls join the running co-batched batch
(`cobatch.Batcher`) over the weights they read — a base model as it is, an installed
sampler weight set, or (on one device) a training job's current weights.

`first_index` lets a call's samples be split over several engines (a worker group's
ranks each decode a slice of them): sample i of the call draws from the generator
seeded by `row_seed(seed, i)` wherever it runs, so the slices together are the call's
samples, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from plexrl.messages import SampleInput, SampleOutput
from plexrl_worker.engine import cobatch, sampling
from plexrl_worker.engine.bases import BaseModels
from plexrl_worker.engine.batch import ModelLimits
from plexrl_worker.engine.cobatch import Batcher, SampleCall
from plexrl_worker.engine.errors import NotFoundError, UnknownJobError
from plexrl_worker.engine.sampler_set import SamplerSet
from plexrl_worker.engine.sampling import StopRule
from plexrl_worker.engine.weight_set import WeightSet
from plexrl_worker.engine.weights import LoraWeights

BASE_PREFIX = "base:"
"""`sample("base:<model name>", ...)` samples a base model as it is."""

JobLookup = Callable[[str], WeightSet | None]
"""A training job's weights by id (None: no such job here)."""


class Sampler:
    """Not thread-safe: the engine calls it under its lock."""

    def __init__(
        self,
        bases: BaseModels,
        samplers: SamplerSet,
        batcher: Batcher,
        jobs: JobLookup | None = None,
        known: Callable[[], list[str]] | None = None,
    ) -> None:
        self._bases = bases
        self._samplers = samplers
        self._batcher = batcher
        self._jobs = jobs
        self._known = known or samplers.ids
        """Every weights id a call may read, for the error naming what there is."""

    def join(self, weights_id: str, inp: SampleInput, first_index: int = 0) -> SampleCall:
        """Validate the call and put it in the running batch (its prompt runs now)."""
        model, adapter, stop = self._prepare(weights_id, inp)
        return self._batcher.join(weights_id, model, adapter, inp, stop, first_index)

    def check(self, weights_id: str, inp: SampleInput) -> None:
        """Raise what `join` would raise for this call, and join nothing."""
        self._prepare(weights_id, inp)

    def _prepare(self, weights_id: str, inp: SampleInput) -> tuple[nn.Module, str, StopRule]:
        if weights_id.startswith(BASE_PREFIX):
            info = self._bases.info(weights_id.removeprefix(BASE_PREFIX))
            model, adapter = self._bases.shared(info).model, cobatch.BASE_ADAPTER
        else:
            found = (self._jobs(weights_id) if self._jobs else None) or self._samplers.recent(
                weights_id
            )
            if found is None:
                raise UnknownJobError(weights_id, self._known())
            info, weights = found.info, found.weights
            if isinstance(weights, LoraWeights):
                model, adapter = weights.base.model, weights.slot
            else:
                model, adapter = weights.module(), cobatch.BASE_ADAPTER
        sampling.validate(inp, ModelLimits(info.vocab_size, info.max_positions))
        stop = sampling.StopRule(
            token_ids=frozenset(inp.params.stop_tokens)
            | (_eos_ids(model) if inp.params.stop_at_eos else frozenset()),
            strings=tuple(inp.params.stop_strings),
            decode=self._bases.decoder(info.path) if inp.params.stop_strings else None,
        )
        return model, adapter, stop

    def run(self, calls: list[SampleCall]) -> list[SampleOutput]:
        """Step the batch until `calls` are done (the others in it advance too)."""
        self._batcher.run(calls)
        self._samplers.trim()
        return [answer(c) for c in calls]

    def step(self) -> list[SampleCall]:
        """One decode step of the running batch; the calls it finished."""
        finished = self._batcher.step()
        if finished:
            self._samplers.trim()
        return finished

    def rows(self) -> tuple[int, int]:
        """(calls, unfinished sequences) in the running batch; no lock (introspection)."""
        calls = self._batcher.calls
        return len(calls), sum(c.remaining for c in calls)


def answer(call: SampleCall) -> SampleOutput:
    if call.abandoned is not None:
        raise NotFoundError(call.abandoned)
    return call.output()


def _eos_ids(model: nn.Module) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model, "config", None), getattr(model, "generation_config", None)):
        eos: Any = getattr(source, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list | tuple):
            ids.update(int(e) for e in eos)
    return frozenset(ids)
