"""One rank's sampler side: data-parallel sampling over the group.

Every rank holds the whole weights it samples — each base model loaded plain (beside
its FSDP2-sharded copy for training) and every sampler weight set — and decodes its
own slice of each call's samples with the one-device engine's co-batched loop
(`engine.sampler`), with no collective inside a step. Sample i of a call draws from
`row_seed(seed, i)` on whichever rank decodes it, so a call's samples are bit-identical
to one rank's, whatever the group size and whatever else shares the batch. Why data-
and not tensor-parallel: docs/worker_group.md, "Sampling".

Every rank runs the same install / touch / drop calls in the same order, so every
rank's sampler sets (and their least-recently-used order) are the same.
"""

from __future__ import annotations

import msgspec

from plexrl.models import ModelRegistry
from plexrl_worker.engine.bases import BaseModels
from plexrl_worker.engine.cobatch import Batcher, SampleCall
from plexrl_worker.engine.config import EngineConfig
from plexrl_worker.engine.sampler import Sampler
from plexrl_worker.engine.sampler_set import SamplerSet
from plexrl_worker.engine.state import state_from_bytes
from plexrl_worker.group import calls
from plexrl_worker.group.blobs import Blobs


class RankSampling:
    def __init__(
        self, registry: ModelRegistry, config: EngineConfig, rank: int, blobs: Blobs
    ) -> None:
        self._rank = rank
        self._blobs = blobs
        batcher = Batcher(device=config.torch_device, max_batch_tokens=config.max_batch_tokens)
        self.bases = BaseModels(registry, config)
        self.samplers = SamplerSet(self.bases, config, batcher)
        self._sampler = Sampler(self.bases, self.samplers, batcher)
        self._calls: dict[int, SampleCall] = {}
        """This rank's slice of each call in the batch, by the leader's call id."""

    def install(self, weights_id: str, key: str, tenant: str) -> calls.DoneReply:
        self.samplers.install(weights_id, state_from_bytes(self._blobs.get(key, tenant)))
        return calls.DoneReply()

    def touch(self, weights_id: str) -> calls.FlagReply:
        return calls.FlagReply(self.samplers.recent(weights_id) is not None)

    def drop(self, weights_id: str) -> calls.DoneReply:
        self.samplers.drop(weights_id, unless_read=True)
        return calls.DoneReply()

    def begin(self, call: calls.BeginSampleCall) -> calls.DoneReply:
        """Join this rank's slice (every rank checks the whole call: all refuse alike)."""
        lo, hi = call.slices[self._rank]
        if hi <= lo:
            self._sampler.check(call.weights_id, call.inp)
            return calls.DoneReply()
        mine = msgspec.structs.replace(call.inp, num_samples=hi - lo)
        # Prompt logprobs are the same on every rank: the leader takes the first slice's.
        self._calls[call.call_id] = self._sampler.join(call.weights_id, mine, first_index=lo)
        return calls.DoneReply()

    def step(self) -> calls.SampleStepReply:
        """One decode step (if this rank has rows); each slice's progress."""
        if self._calls:
            self._sampler.step()
        parts = []
        for call_id, call in list(self._calls.items()):
            if call.abandoned is not None:
                parts.append(calls.SamplePart(call_id, 0, abandoned=call.abandoned))
            elif call.done:
                parts.append(calls.SamplePart(call_id, 0, output=call.output()))
            else:
                parts.append(calls.SamplePart(call_id, call.remaining))
                continue
            del self._calls[call_id]
        return calls.SampleStepReply(parts)

    def loaded(self) -> list[str]:
        return self.bases.loaded()
