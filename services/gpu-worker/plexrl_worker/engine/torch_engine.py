"""TorchEngine: a worker's model functions over Hugging Face models, on CPU or one GPU.

Jobs on the same base model share its weights (loaded once); each job owns only its
trainable weights (LoRA adapters or a full copy), its AdamW state and its accumulated
gradients. A job's state can leave the engine (`offload`) and come back (`onload`)
without changing a single bit of what it computes next.

Calls are synchronous and serialised by a lock: the shared base has one active
adapter at a time, so two calls must never interleave. The introspection methods
take no lock, so an event loop can call them while a long call runs.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

import torch
from torch import nn
from transformers import AutoTokenizer

from plexrl.messages import (
    AdamParams,
    CreateOutput,
    ForwardBackwardInput,
    ForwardBackwardOutput,
    JobSpec,
    OptimStepInput,
    OptimStepOutput,
    SampleInput,
    SampleOutput,
    TensorArray,
)
from plexrl.models import BaseModelInfo, ModelRegistry, UnknownModelError
from plexrl_worker.engine import cobatch, sampling, state
from plexrl_worker.engine.batch import ModelLimits, batch_loss, checked_loss, prepare
from plexrl_worker.engine.cobatch import SampleCall
from plexrl_worker.engine.config import EngineConfig
from plexrl_worker.engine.errors import (
    EngineInputError,
    JobExistsError,
    NotFoundError,
    UnknownJobError,
)
from plexrl_worker.engine.state import JobTensors
from plexrl_worker.engine.weights import (
    FullWeights,
    LoraWeights,
    SharedBase,
    Weights,
    empty_model,
    load_model,
)

BASE_PREFIX = "base:"
"""`sample("base:<model name>", ...)` samples a base model as it is."""

P = ParamSpec("P")
R = TypeVar("R")


Method = Callable[Concatenate["TorchEngine", P], R]


def _locked(method: Method[P, R]) -> Method[P, R]:
    @functools.wraps(method)
    def wrapper(self: TorchEngine, *args: P.args, **kwargs: P.kwargs) -> R:
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper


@dataclass
class _WeightSet:
    """A training job's state, or (optimizer None) a read-only sampler weight set."""

    spec: JobSpec
    info: BaseModelInfo
    weights: Weights
    optimizer: torch.optim.AdamW | None
    steps: int = 0
    """Optimizer steps taken."""


class TorchEngine:
    def __init__(self, registry: ModelRegistry, config: EngineConfig) -> None:
        self._registry = registry
        self._config = config
        self._bases: dict[Path, SharedBase] = {}
        self._jobs: dict[str, _WeightSet] = {}
        self._samplers: dict[str, _WeightSet] = {}
        # Offloaded jobs keep their (empty) modules and optimizer here, so that onload
        # only copies tensors back instead of rebuilding adapters (peft's injection
        # costs ~10 ms, the copy well under one for a LoRA state).
        self._parked: dict[str, _WeightSet] = {}
        self._decoders: dict[Path, Callable[[list[int]], str]] = {}
        self._lock = threading.RLock()
        self._batcher = cobatch.Batcher(
            device=config.torch_device, max_batch_tokens=config.max_batch_tokens
        )
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)

    # ---- model functions -------------------------------------------------------------

    @_locked
    def create(self, job_id: str, spec: JobSpec) -> CreateOutput:
        """New state for a job: fresh adapters seeded by `spec.seed`, or (`spec.lora is
        None`) a full copy of the base weights; a fresh AdamW either way."""
        if job_id in self._jobs:
            raise JobExistsError(job_id)
        info = self._info(spec.base_model)
        if spec.lora is None:
            weights: Weights = FullWeights(load_model(info.path, self._config))
        else:
            base = self._base(info)
            weights = LoraWeights(base, base.add_adapter(spec.lora, spec.seed))
        job = self._jobs[job_id] = _WeightSet(spec, info, weights, _adamw(weights))
        return CreateOutput(
            trainable_params=sum(p.numel() for _, p in weights.params()),
            state_bytes=_state_bytes(job),
        )

    @_locked
    def forward_backward(self, job_id: str, inp: ForwardBackwardInput) -> ForwardBackwardOutput:
        """Summed loss and per-token outputs; with `inp.backward`, gradients that add up
        across calls until `optim_step`."""
        job = self._trainable(job_id)
        loss_fn, config = checked_loss(inp.loss_fn, inp.loss_fn_config)
        limits = ModelLimits(job.info.vocab_size, job.info.max_positions)
        batches = prepare(inp.data, loss_fn, limits, self._config.max_batch_tokens)
        model = job.weights.module()
        outputs: list[dict[str, TensorArray]] = [{} for _ in inp.data]
        total = 0.0
        tokens = 0
        for mb in batches:
            run = batch_loss(model, mb, loss_fn, config, self._config.torch_device, inp.backward)
            total += float(run.loss.detach())
            tokens += int(run.mask.sum())
            outputs[mb.first : mb.first + len(mb.lengths)] = run.outputs(mb)
        return ForwardBackwardOutput(
            loss_fn_outputs=outputs, metrics={"loss:sum": total, "tokens:sum": float(tokens)}
        )

    @_locked
    def optim_step(self, job_id: str, inp: OptimStepInput) -> OptimStepOutput:
        """One AdamW step over the accumulated gradients, which it then clears."""
        job = self._trainable(job_id)
        adam = inp.adam
        check_adam(adam)
        assert job.optimizer is not None  # _trainable guarantees it
        params = [p for _, p in job.weights.params()]
        grads = [p.grad for p in params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        if adam.grad_clip_norm > 0 and grads:
            torch.nn.utils.clip_grads_with_norm_(params, adam.grad_clip_norm, norm)
        # Hyperparameters arrive with every step (a schedule lives in the client).
        for group in job.optimizer.param_groups:
            group.update(
                lr=adam.learning_rate,
                betas=(adam.beta1, adam.beta2),
                eps=adam.eps,
                weight_decay=adam.weight_decay,
            )
        job.optimizer.step()
        job.optimizer.zero_grad(set_to_none=True)
        job.steps += 1
        return OptimStepOutput(
            metrics={
                # "name:reduction": the Tinker SDK splits metric keys on the colon.
                "grad_norm:mean": float(norm),
                "step:max": float(job.steps),
                "learning_rate:mean": adam.learning_rate,
            }
        )

    @_locked
    def sample(self, weights_id: str, inp: SampleInput) -> SampleOutput:
        """Generate from a job's current weights, an installed sampler weight set, or
        `base:<model name>` (see `sampling` for the exact semantics). Calls already in
        the running batch (`begin_sample`) advance with it."""
        call = self._join(weights_id, inp)
        self._batcher.run([call])
        self._trim_samplers()
        return _answer(call)

    @_locked
    def sample_together(self, calls: Sequence[tuple[str, SampleInput]]) -> list[SampleOutput]:
        """Several `sample` calls in one running batch; each output is bit-identical to
        the same call's through `sample` alone."""
        joined = [self._join(weights_id, inp) for weights_id, inp in calls]
        self._batcher.run(joined)
        self._trim_samplers()
        return [_answer(c) for c in joined]

    @_locked
    def begin_sample(self, weights_id: str, inp: SampleInput) -> SampleCall:
        """Put a call in the running batch; `sample_step` advances it (and the others)."""
        return self._join(weights_id, inp)

    @_locked
    def sample_step(self) -> list[SampleCall]:
        """One decode step of the running batch; the calls it finished."""
        finished = self._batcher.step()
        if finished:
            self._trim_samplers()
        return finished

    def sampling_rows(self) -> tuple[int, int]:
        """(calls, unfinished sequences) in the running batch; no lock (introspection)."""
        calls = self._batcher.calls
        return len(calls), sum(c.remaining for c in calls)

    def _join(self, weights_id: str, inp: SampleInput) -> SampleCall:
        if weights_id.startswith(BASE_PREFIX):
            info = self._info(weights_id.removeprefix(BASE_PREFIX))
            model, adapter = self._base(info).model, cobatch.BASE_ADAPTER
        else:
            weight_set = self._jobs.get(weights_id) or self._recent_sampler(weights_id)
            if weight_set is None:
                raise UnknownJobError(weights_id, sorted([*self._jobs, *self._samplers]))
            info, weights = weight_set.info, weight_set.weights
            if isinstance(weights, LoraWeights):
                model, adapter = weights.base.model, weights.slot
            else:
                model, adapter = weights.module(), cobatch.BASE_ADAPTER
        sampling.validate(inp, ModelLimits(info.vocab_size, info.max_positions))
        stop = sampling.StopRule(
            token_ids=frozenset(inp.params.stop_tokens)
            | (_eos_ids(model) if inp.params.stop_at_eos else frozenset()),
            strings=tuple(inp.params.stop_strings),
            decode=self._decoder(info.path) if inp.params.stop_strings else None,
        )
        return self._batcher.join(weights_id, model, adapter, inp, stop)

    # ---- state movement --------------------------------------------------------------

    @_locked
    def export_state(self, job_id: str, *, optimizer: bool, gradients: bool) -> JobTensors:
        """A CPU copy of the job's weights, and optionally its AdamW state and gradients."""
        job = self._trainable(job_id)
        params = job.weights.params()
        tensors = state.export_params(params, gradients=gradients)
        if optimizer:
            assert job.optimizer is not None
            tensors |= state.export_adam(params, job.optimizer)
        state.wait_for_copies(self._config.torch_device)
        return JobTensors(tensors, state.make_metadata(job.spec, job.steps))

    @_locked
    def offload(self, job_id: str) -> JobTensors:
        """Everything the job holds, as a CPU copy; then free its memory here."""
        out = self.export_state(job_id, optimizer=True, gradients=True)
        self._batcher.abandon(job_id, f"{job_id!r} left the device while sampling")
        job = self._jobs.pop(job_id)
        state.empty_params(job.weights.params(), job.optimizer)
        self._parked[job_id] = job
        return out

    @_locked
    def onload(self, job_id: str, job_state: JobTensors) -> None:
        """Recreate a job exactly as `offload` (or `export_state`) left it."""
        if job_id in self._jobs:
            raise JobExistsError(job_id)
        parked = self._parked.pop(job_id, None)
        if parked is not None and parked.spec == job_state.spec:
            assert parked.optimizer is not None
            state.refill_params(
                parked.weights.params(),
                parked.optimizer,
                job_state.tensors,
                self._config.torch_device,
            )
            parked.steps = job_state.steps
            self._jobs[job_id] = parked
            return
        if parked is not None:
            parked.weights.release()
        self._jobs[job_id] = self._build(job_state, trainable=True)

    @_locked
    def import_weights(self, job_id: str, job_state: JobTensors, *, optimizer: bool) -> None:
        """Replace a job's weights (load_state); its AdamW moments too with `optimizer`,
        else fresh moments. Pending gradients are dropped either way."""
        job = self._trainable(job_id)
        saved = job_state.spec
        if self._info(saved.base_model).path != job.info.path or saved.lora != job.spec.lora:
            raise EngineInputError(
                f"the checkpoint was saved for {_describe(saved)}, but this job is "
                f"{_describe(job.spec)}; load it into a job made like the one that saved it"
            )
        if optimizer and not job_state.has(state.OPTIM):
            raise EngineInputError(
                "the checkpoint holds no optimizer state; load it without the optimizer"
            )
        wanted = (state.WEIGHTS, state.OPTIM) if optimizer else (state.WEIGHTS,)
        replacement = JobTensors(
            {k: v for k, v in job_state.tensors.items() if k.startswith(wanted)},
            state.make_metadata(job.spec, job_state.steps if optimizer else 0),
        )
        # Build first: a checkpoint that does not fit must leave the job as it was.
        new = self._build(replacement, trainable=True)
        job.weights.release()
        self._jobs[job_id] = new

    @_locked
    def install_sampler(self, weights_id: str, tensors: JobTensors) -> None:
        """Make exported weights sampleable as `weights_id` (replacing any set of that id)."""
        weights_only = JobTensors(
            {k: v for k, v in tensors.tensors.items() if k.startswith(state.WEIGHTS)},
            tensors.metadata,
        )
        new = self._build(weights_only, trainable=False)
        old = self._samplers.pop(weights_id, None)
        if old is not None:
            self._batcher.abandon(weights_id, f"{weights_id!r} was replaced while sampling")
            old.weights.release()
        self._samplers[weights_id] = new
        self._trim_samplers()

    def _trim_samplers(self) -> None:
        """Drop the least recently sampled sampler sets beyond `max_samplers` that no
        call in the running batch reads (called with the lock held, after a run)."""
        excess = len(self._samplers) - self._config.max_samplers
        if excess <= 0:
            return
        reading = self._read_by_batch()
        for weights_id in [w for w in self._samplers if w not in reading][:excess]:
            self._samplers.pop(weights_id).weights.release()

    def _read_by_batch(self) -> set[str]:
        """The weight sets calls in the running batch read (never freed under them)."""
        return {call.weights_id for call in self._batcher.calls}

    @_locked
    def drop(self, job_id: str) -> bool:
        """Forget a job or sampler weight set and free its memory; False if there was none."""
        weight_set = (
            self._jobs.pop(job_id, None)
            or self._samplers.pop(job_id, None)
            or self._parked.pop(job_id, None)
        )
        if weight_set is None:
            return False
        self._batcher.abandon(job_id, f"{job_id!r} was dropped while sampling")
        weight_set.weights.release()
        return True

    @_locked
    def drop_sampler(self, weights_id: str) -> bool:
        """Free a sampler set no call in the running batch reads (one being read goes
        when `_trim_samplers` finds it idle); False if none was dropped."""
        if weights_id in self._read_by_batch():
            return False
        weight_set = self._samplers.pop(weights_id, None)
        if weight_set is None:
            return False
        weight_set.weights.release()
        return True

    # ---- introspection: lock-free snapshots, safe from any thread ----------------------

    def resident_jobs(self) -> list[str]:
        return sorted(list(self._jobs))

    def installed_samplers(self) -> list[str]:
        return sorted(list(self._samplers))

    @_locked
    def touch_sampler(self, weights_id: str) -> bool:
        """Whether the sampler set is installed; if so it becomes the most recently used
        (the last `_trim_samplers` drops), so a call about to read it finds it."""
        return self._recent_sampler(weights_id) is not None

    def _recent_sampler(self, weights_id: str) -> _WeightSet | None:
        """The installed sampler set, made the most recently used (sets are kept in use
        order: `_trim_samplers` drops from the front); None if not installed."""
        weight_set = self._samplers.pop(weights_id, None)
        if weight_set is not None:
            self._samplers[weights_id] = weight_set
        return weight_set

    @_locked
    def sampler_weights(self, weights_id: str) -> tuple[JobSpec, Path, dict[str, torch.Tensor]]:
        """An installed sampler weight set's spec, base model directory and weights (CPU
        copies, named as the job's parameters), for another sampler to load."""
        weight_set = self._samplers.get(weights_id)
        if weight_set is None:
            raise UnknownJobError(weights_id, self.installed_samplers())
        tensors = {n: p.detach().to("cpu").clone() for n, p in weight_set.weights.params()}
        return weight_set.spec, weight_set.info.path, tensors

    def model_info(self, name: str) -> BaseModelInfo:
        """What the registry says of a base model (NotFoundError for one it lacks)."""
        return self._info(name)

    def loaded_bases(self) -> list[str]:
        """Base models in memory (shared by the LoRA jobs on them)."""
        return sorted(base.info.name for base in list(self._bases.values()))

    def state_bytes(self, job_id: str) -> int:
        """Peak bytes of the job's own state: weights, gradients and both Adam moments."""
        return _state_bytes(self._trainable(job_id))

    # ---- internals -------------------------------------------------------------------

    def _trainable(self, job_id: str) -> _WeightSet:
        job = self._jobs.get(job_id)
        if job is None:
            if job_id in self._samplers:
                raise EngineInputError(f"{job_id!r} is a sampler weight set; only sample from it")
            raise UnknownJobError(job_id, sorted(self._jobs))
        return job

    def _info(self, name: str) -> BaseModelInfo:
        try:
            return self._registry.info(name)
        except UnknownModelError as exc:
            raise NotFoundError(str(exc)) from exc

    def _base(self, info: BaseModelInfo) -> SharedBase:
        base = self._bases.get(info.path)
        if base is None:
            base = self._bases[info.path] = SharedBase(info, load_model(info.path, self._config))
        return base

    def _build(self, job_state: JobTensors, *, trainable: bool) -> _WeightSet:
        try:
            spec = job_state.spec
        except (KeyError, ValueError) as exc:
            raise EngineInputError(f"the state carries no valid JobSpec: {exc}") from exc
        info = self._info(spec.base_model)
        if spec.lora is None:
            weights: Weights = FullWeights(empty_model(info.path, self._config))
        else:
            base = self._base(info)
            weights = LoraWeights(base, base.add_adapter(spec.lora, spec.seed))
        try:
            params = weights.params()
            state.import_params(params, job_state.tensors, gradients=trainable)
            optimizer = _adamw(weights) if trainable else None
            if optimizer is not None:
                state.import_adam(params, optimizer, job_state.tensors)
        except ValueError as exc:
            weights.release()
            raise EngineInputError(str(exc)) from exc
        return _WeightSet(spec, info, weights, optimizer, steps=job_state.steps)

    def _decoder(self, path: Path) -> Callable[[list[int]], str]:
        decode = self._decoders.get(path)
        if decode is None:
            tokenizer = AutoTokenizer.from_pretrained(path)

            def decode(ids: list[int]) -> str:
                return str(tokenizer.decode(ids, skip_special_tokens=False))

            self._decoders[path] = decode
        return decode


def _answer(call: SampleCall) -> SampleOutput:
    if call.abandoned is not None:
        raise NotFoundError(call.abandoned)
    return call.output()


def _adamw(weights: Weights) -> torch.optim.AdamW:
    # lr and the rest are set on every optim_step; these are placeholders.
    return torch.optim.AdamW([p for _, p in weights.params()], lr=0.0)


def _state_bytes(job: _WeightSet) -> int:
    # Weights, gradients and AdamW's two moments, each the size of the trainable weights.
    return 4 * sum(p.numel() * p.element_size() for _, p in job.weights.params())


def check_adam(adam: AdamParams) -> None:
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


def _eos_ids(model: nn.Module) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model, "config", None), getattr(model, "generation_config", None)):
        eos: Any = getattr(source, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list | tuple):
            ids.update(int(e) for e in eos)
    return frozenset(ids)


def _describe(spec: JobSpec) -> str:
    if spec.lora is None:
        return f"full fine-tuning of {spec.base_model!r}"
    return f"LoRA {spec.lora} over {spec.base_model!r}"
