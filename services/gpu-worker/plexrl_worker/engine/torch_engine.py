"""TorchEngine: one device's model functions over Hugging Face models, on CPU or one GPU.

It composes four parts, each with one job: `BaseModels` (base loading, shared by every
LoRA job and by base sampling), `TrainingJobs` (each job's trainable weights, AdamW
state and gradients, and their moves out of the engine and back), `SamplerSet` (read-only
sampler weight sets, bounded) and `Sampler` (the co-batched decode loop over any of
them). What the engine itself owns is the lock: the shared base has one active adapter
at a time, so two calls must never interleave. Introspection takes no lock, so an event
loop can read it while a long call runs.

A job's state can leave the engine (`offload`) and come back (`onload`) without
changing a single bit of what it computes next.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Concatenate, ParamSpec, TypeVar

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
from plexrl.models import BaseModelInfo, ModelRegistry
from plexrl_worker.engine import cobatch
from plexrl_worker.engine.bases import BaseModels
from plexrl_worker.engine.cobatch import SampleCall
from plexrl_worker.engine.config import EngineConfig
from plexrl_worker.engine.errors import EngineInputError, UnknownJobError
from plexrl_worker.engine.jobs import TrainingJobs, TrainingRun
from plexrl_worker.engine.sampler import BASE_PREFIX, Sampler
from plexrl_worker.engine.sampler_set import SamplerSet
from plexrl_worker.engine.state import JobTensors
from plexrl_worker.engine.weight_set import check_adam

__all__ = ["BASE_PREFIX", "TorchEngine", "check_adam"]

P = ParamSpec("P")
R = TypeVar("R")

Method = Callable[Concatenate["TorchEngine", P], R]


def _locked(method: Method[P, R]) -> Method[P, R]:
    @functools.wraps(method)
    def wrapper(self: TorchEngine, *args: P.args, **kwargs: P.kwargs) -> R:
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper


def _training(method: Method[P, R]) -> Method[P, R]:
    """Locked, and a training call on a sampler set's id is told what that id is."""

    @functools.wraps(method)
    def wrapper(self: TorchEngine, *args: P.args, **kwargs: P.kwargs) -> R:
        with self._lock:
            try:
                return method(self, *args, **kwargs)
            except UnknownJobError as exc:
                if exc.job_id in self.samplers:
                    raise EngineInputError(
                        f"{exc.job_id!r} is a sampler weight set; only sample from it"
                    ) from None
                raise

    return wrapper


class TorchEngine:
    def __init__(self, registry: ModelRegistry, config: EngineConfig) -> None:
        self._config = config
        self._lock = threading.RLock()
        batcher = cobatch.Batcher(
            device=config.torch_device, max_batch_tokens=config.max_batch_tokens
        )
        self.bases = BaseModels(registry, config)
        self.jobs = TrainingJobs(self.bases, config, batcher)
        self.samplers = SamplerSet(self.bases, config, batcher)
        self.sampler = Sampler(
            self.bases,
            self.samplers,
            batcher,
            jobs=self.jobs.get,
            known=lambda: sorted([*self.jobs.ids(), *self.samplers.ids()]),
        )
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)

    # ---- training ----------------------------------------------------------------------

    @_locked
    def create(self, job_id: str, spec: JobSpec) -> CreateOutput:
        return self.jobs.create(job_id, spec)

    @_training
    def forward_backward(self, job_id: str, inp: ForwardBackwardInput) -> ForwardBackwardOutput:
        return self.jobs.forward_backward(job_id, inp)

    @_training
    def begin_forward_backward(self, job_id: str, inp: ForwardBackwardInput) -> TrainingRun:
        """A `forward_backward` to run a slice (micro-batch) at a time, other calls
        between (`forward_backward_slice`; the result is the whole call's)."""
        return self.jobs.begin_forward_backward(job_id, inp)

    @_training
    def forward_backward_slice(self, run: TrainingRun) -> bool:
        """The next slice of `run`; whether any is left."""
        return self.jobs.forward_backward_slice(run)

    @_training
    def optim_step(self, job_id: str, inp: OptimStepInput) -> OptimStepOutput:
        return self.jobs.optim_step(job_id, inp)

    @_training
    def import_weights(self, job_id: str, job_state: JobTensors, *, optimizer: bool) -> None:
        self.jobs.import_weights(job_id, job_state, optimizer=optimizer)

    # ---- a job's state out of the engine and back --------------------------------------

    @_training
    def export_state(self, job_id: str, *, optimizer: bool, gradients: bool) -> JobTensors:
        return self.jobs.export_state(job_id, optimizer=optimizer, gradients=gradients)

    @_training
    def offload(self, job_id: str) -> JobTensors:
        return self.jobs.offload(job_id)

    @_locked
    def onload(self, job_id: str, job_state: JobTensors) -> None:
        self.jobs.onload(job_id, job_state)

    @_locked
    def drop(self, job_id: str) -> bool:
        """Forget a job or sampler weight set and free its memory; False if there was none."""
        return self.jobs.drop(job_id) or self.samplers.drop(job_id, unless_read=False)

    @_training
    def state_bytes(self, job_id: str) -> int:
        return self.jobs.state_bytes(job_id)

    # ---- sampling ----------------------------------------------------------------------

    @_locked
    def sample(self, weights_id: str, inp: SampleInput) -> SampleOutput:
        """Generate from a job's current weights, an installed sampler weight set, or
        `base:<model name>` (see `sampling` for the exact semantics). Calls already in
        the running batch (`begin_sample`) advance with it."""
        return self.sampler.run([self.sampler.join(weights_id, inp)])[0]

    @_locked
    def sample_together(self, calls: Sequence[tuple[str, SampleInput]]) -> list[SampleOutput]:
        """Several `sample` calls in one running batch; each output is bit-identical to
        the same call's through `sample` alone."""
        return self.sampler.run([self.sampler.join(w, inp) for w, inp in calls])

    @_locked
    def begin_sample(self, weights_id: str, inp: SampleInput, first_index: int = 0) -> SampleCall:
        """Put a call in the running batch; `sample_step` advances it (and the others)."""
        return self.sampler.join(weights_id, inp, first_index)

    @_locked
    def sample_step(self) -> list[SampleCall]:
        """One decode step of the running batch; the calls it finished."""
        return self.sampler.step()

    def sampling_rows(self) -> tuple[int, int]:
        return self.sampler.rows()

    # ---- sampler weight sets -----------------------------------------------------------

    @_locked
    def install_sampler(self, weights_id: str, tensors: JobTensors) -> None:
        self.samplers.install(weights_id, tensors)

    @_locked
    def touch_sampler(self, weights_id: str) -> bool:
        """Whether the set is installed; if so it becomes the most recently used, so a
        call about to read it finds it."""
        return self.samplers.recent(weights_id) is not None

    @_locked
    def drop_sampler(self, weights_id: str) -> bool:
        return self.samplers.drop(weights_id, unless_read=True)

    @_locked
    def sampler_weights(self, weights_id: str) -> tuple[JobSpec, Path, dict[str, torch.Tensor]]:
        return self.samplers.weights(weights_id)

    # ---- introspection: lock-free snapshots, safe from any thread ----------------------

    def resident_jobs(self) -> list[str]:
        return self.jobs.ids()

    def installed_samplers(self) -> list[str]:
        return self.samplers.ids()

    def model_info(self, name: str) -> BaseModelInfo:
        """What the registry says of a base model (NotFoundError for one it lacks)."""
        return self.bases.info(name)

    def loaded_bases(self) -> list[str]:
        """Base models in memory (shared by the LoRA jobs on them)."""
        return self.bases.loaded()
