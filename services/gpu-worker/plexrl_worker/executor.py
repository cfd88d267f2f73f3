"""The rank side of a worker, as its leader sees it: the engine and each job's state in
its tiers, one shard per rank.

The leader's components (the runner, residency, recovery) speak only to an `Executor`;
what runs behind it is one rank in this process (`LocalExecutor`: a `TorchEngine` on
the engine thread) or a group of N ranks in step (`plexrl_worker.group.GroupExecutor`:
FSDP2 over the ranks, each rank moving its own shard). Every method runs to completion
before the next starts (the engine thread serialises them), so the ranks never see two
calls at once.

A job's state lives in one tier of its ranks: `device` (in the engine), `host` (each
rank's own CPU copy, kept here, out of the engine) or `disk` (blobs in the state-store:
one safetensors blob for one rank, a blob set with a manifest for a group, see
`plexrl_worker.stored`). Snapshots for recovery and states moved to disk can be read by
an executor of any group size.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from plexrl.messages import (
    CreateOutput,
    ForwardBackwardInput,
    ForwardBackwardOutput,
    JobSpec,
    OptimStepInput,
    OptimStepOutput,
    SampleInput,
    SampleOutput,
)
from plexrl.models import BaseModelInfo
from plexrl.state_store_client import StateStoreClient
from plexrl_worker import stored
from plexrl_worker.engine import TorchEngine
from plexrl_worker.engine.state import JobTensors, state_from_bytes, state_stream
from plexrl_worker.engine_thread import EngineThread


class SampleHandle(Protocol):
    """A sample call in the running batch (`cobatch.SampleCall` on one rank)."""

    @property
    def done(self) -> bool: ...
    @property
    def remaining(self) -> int:
        """Sequences not finished yet."""
        ...

    @property
    def abandoned(self) -> str | None:
        """Why the call left the batch unfinished (its weights went away), if it did."""
        ...

    @property
    def inp(self) -> SampleInput:
        """The call's input (`num_samples`: its sequences in all)."""
        ...

    def output(self) -> SampleOutput: ...


@dataclass(frozen=True)
class StateSource:
    """Where a checkpoint's state comes from: its blob (its tenant's), and, when the
    caller holds it already, the state itself (no second read)."""

    blob_key: str
    tenant: str
    state: JobTensors | None = None


class HeldSnapshot(Protocol):
    """A copy of a job's whole state taken at one moment, not yet written."""

    async def write(self, key: str) -> int:
        """Write it to the disk tier under `key` (from `Executor.stored_key`); bytes."""
        ...


Between = Callable[[], Awaitable[None]]
"""Awaited between two slices of a sliced `forward_backward` (where it may pause)."""


class Executor(Protocol):
    ranks: int
    """Ranks in the group (1: this process alone)."""
    slices_training: bool
    """Whether `forward_backward` pauses between its micro-batches when given `between`
    (otherwise it runs whole, and `between` is never awaited)."""

    async def watch(self, stop: asyncio.Event) -> None:
        """Until `stop`; raises `group.RankLostError` when a rank is lost."""
        ...

    async def close(self) -> None: ...

    # ---- training ----------------------------------------------------------------------
    async def create(self, job_id: str, spec: JobSpec) -> CreateOutput: ...
    async def forward_backward(
        self, job_id: str, inp: ForwardBackwardInput, between: Between | None = None
    ) -> ForwardBackwardOutput: ...
    async def optim_step(self, job_id: str, inp: OptimStepInput) -> OptimStepOutput: ...
    async def export_state(self, job_id: str, *, optimizer: bool) -> JobTensors:
        """The job's whole weights (and AdamW state), as one device's engine names them."""
        ...

    async def import_weights(self, job_id: str, source: StateSource, *, optimizer: bool) -> None:
        """Replace the job's weights (and AdamW state with `optimizer`) by a checkpoint's."""
        ...

    async def drop(self, job_id: str) -> None:
        """Forget the job on every rank, in every tier held here."""
        ...

    def rank_bytes(self, job_id: str, whole: int) -> list[int]:
        """Each rank's bytes of a job whose whole state is `whole` bytes."""
        ...

    # ---- tiers -------------------------------------------------------------------------
    def stored_key(self, prefix: str) -> str:
        """The key a state written under `prefix` gets (a blob, or a blob set's manifest)."""
        ...

    async def offload(self, job_id: str) -> None:
        """Device → host: every rank copies its shard out and frees it on the device."""
        ...

    async def spill(self, job_id: str, key: str) -> None:
        """Host → disk under `key`; the host copies go."""
        ...

    async def fetch(self, job_id: str, key: str) -> None:
        """Disk → host: every rank reads its shard of the state stored under `key`."""
        ...

    async def onload(self, job_id: str) -> None:
        """Host → device: rebuild the job from its host copies, exactly as it left."""
        ...

    async def snapshot(self, job_id: str) -> HeldSnapshot:
        """A copy of the whole state (weights, moments, gradients) now, written later."""
        ...

    async def restore(self, job_id: str, key: str) -> int:
        """Make the job on the device from a state stored under `key` by an executor of
        any group size; the whole state's bytes."""
        ...

    # ---- sampling ----------------------------------------------------------------------
    async def begin_sample(self, weights_id: str, inp: SampleInput) -> SampleHandle: ...
    async def sample_step(self) -> None: ...
    async def sample(self, weights_id: str, inp: SampleInput) -> SampleOutput: ...
    async def has_sampler(self, weights_id: str) -> bool:
        """Whether the set is installed (then the most recently used)."""
        ...

    async def install_sampler(self, weights_id: str, source: StateSource) -> None: ...
    async def drop_sampler(self, weights_id: str) -> None: ...
    def sampler_weights(self, weights_id: str) -> tuple[JobSpec, Path, dict[str, torch.Tensor]]:
        """An installed set's spec, base directory and weights (for SGLang to load)."""
        ...

    # ---- introspection (no lock) --------------------------------------------------------
    def pids(self) -> list[int]:
        """The process id of each rank started on this host, rank 0 (this one) first."""
        ...

    def model_info(self, name: str) -> BaseModelInfo: ...
    def installed_samplers(self) -> list[str]: ...
    def loaded_bases(self) -> list[str]: ...


class _LocalSnapshot:
    def __init__(self, store: StateStoreClient, state: JobTensors) -> None:
        self._store = store
        self._state = state

    async def write(self, key: str) -> int:
        # Sent piece by piece from the tensors' own memory: building one buffer of a large
        # state would stall the event loop (heartbeats, health) while it copies.
        stream = state_stream(self._state)
        return await self._store.put_stream(key, stream.chunks(), stream.size)


class LocalExecutor:
    """One rank in this process: the `TorchEngine` on the engine thread; host copies in
    this process's memory; disk as one safetensors blob per state."""

    ranks = 1
    slices_training = True

    def __init__(self, engine: TorchEngine, thread: EngineThread, store: StateStoreClient) -> None:
        self.engine = engine
        self._thread = thread
        self._store = store
        self._host: dict[str, JobTensors] = {}

    async def watch(self, stop: asyncio.Event) -> None:
        await stop.wait()  # one rank, this process: nothing else to lose

    async def close(self) -> None:
        self._thread.shutdown()

    # ---- training ----------------------------------------------------------------------

    async def create(self, job_id: str, spec: JobSpec) -> CreateOutput:
        return await self._thread.call(self.engine.create, job_id, spec)

    async def forward_backward(
        self, job_id: str, inp: ForwardBackwardInput, between: Between | None = None
    ) -> ForwardBackwardOutput:
        if between is None:
            return await self._thread.call(self.engine.forward_backward, job_id, inp)
        # A slice at a time, the event loop free between them: `between` may hold the
        # call there while other calls use the engine.
        run = await self._thread.call(self.engine.begin_forward_backward, job_id, inp)
        while await self._thread.call(self.engine.forward_backward_slice, run):
            await between()
        return run.output()

    async def optim_step(self, job_id: str, inp: OptimStepInput) -> OptimStepOutput:
        return await self._thread.call(self.engine.optim_step, job_id, inp)

    async def export_state(self, job_id: str, *, optimizer: bool) -> JobTensors:
        return await self._thread.call(
            self.engine.export_state, job_id, optimizer=optimizer, gradients=False
        )

    async def import_weights(self, job_id: str, source: StateSource, *, optimizer: bool) -> None:
        state = await self._read(source)
        await self._thread.call(self.engine.import_weights, job_id, state, optimizer=optimizer)

    async def drop(self, job_id: str) -> None:
        self._host.pop(job_id, None)
        await self._thread.call(self.engine.drop, job_id)

    def rank_bytes(self, job_id: str, whole: int) -> list[int]:
        return [whole]

    # ---- tiers -------------------------------------------------------------------------

    def stored_key(self, prefix: str) -> str:
        return f"{prefix}.safetensors"

    async def offload(self, job_id: str) -> None:
        self._host[job_id] = await self._thread.call(self.engine.offload, job_id)

    async def spill(self, job_id: str, key: str) -> None:
        state = self._host[job_id]
        stream = state_stream(state)  # sent piece by piece: the loop runs between them
        await self._store.put_stream(key, stream.chunks(), stream.size)
        del self._host[job_id]

    async def fetch(self, job_id: str, key: str) -> None:
        self._host[job_id] = await stored.read_whole(self._store, key)

    async def onload(self, job_id: str) -> None:
        await self._thread.call(self.engine.onload, job_id, self._host[job_id])
        del self._host[job_id]

    async def snapshot(self, job_id: str) -> HeldSnapshot:
        # The copy is taken now, before the next call can change the job.
        state = await self._thread.call(
            self.engine.export_state, job_id, optimizer=True, gradients=True
        )
        return _LocalSnapshot(self._store, state)

    async def restore(self, job_id: str, key: str) -> int:
        state = await stored.read_whole(self._store, key)
        await self._thread.call(self.engine.onload, job_id, state)
        return self.engine.state_bytes(job_id)

    # ---- sampling ----------------------------------------------------------------------

    async def begin_sample(self, weights_id: str, inp: SampleInput) -> SampleHandle:
        return await self._thread.call(self.engine.begin_sample, weights_id, inp)

    async def sample_step(self) -> None:
        await self._thread.call(self.engine.sample_step)

    async def sample(self, weights_id: str, inp: SampleInput) -> SampleOutput:
        return await self._thread.call(self.engine.sample, weights_id, inp)

    async def has_sampler(self, weights_id: str) -> bool:
        return await self._thread.call(self.engine.touch_sampler, weights_id)

    async def install_sampler(self, weights_id: str, source: StateSource) -> None:
        state = await self._read(source)
        await self._thread.call(self.engine.install_sampler, weights_id, state)

    async def _read(self, source: StateSource) -> JobTensors:
        if source.state is not None:
            return source.state
        data = await self._store.get_blob(source.blob_key, source.tenant)
        return await asyncio.to_thread(state_from_bytes, data)

    async def drop_sampler(self, weights_id: str) -> None:
        await self._thread.call(self.engine.drop_sampler, weights_id)

    def sampler_weights(self, weights_id: str) -> tuple[JobSpec, Path, dict[str, torch.Tensor]]:
        return self.engine.sampler_weights(weights_id)

    # ---- introspection -----------------------------------------------------------------

    def pids(self) -> list[int]:
        return [os.getpid()]

    def model_info(self, name: str) -> BaseModelInfo:
        return self.engine.model_info(name)

    def installed_samplers(self) -> list[str]:
        return self.engine.installed_samplers()

    def loaded_bases(self) -> list[str]:
        return self.engine.loaded_bases()
