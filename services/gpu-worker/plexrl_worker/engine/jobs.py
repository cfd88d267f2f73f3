"""The training side of one engine: each resident job's trainable weights, AdamW state
and accumulated gradients; the model functions that change them; and their moves out
of the engine and back, which never change a bit of what the job computes next."""

from __future__ import annotations

from dataclasses import dataclass

from plexrl.messages import (
    CreateOutput,
    ForwardBackwardInput,
    ForwardBackwardOutput,
    JobSpec,
    LossFn,
    OptimStepInput,
    OptimStepOutput,
    TensorArray,
)
from plexrl_worker.engine import state, weight_set
from plexrl_worker.engine.bases import BaseModels
from plexrl_worker.engine.batch import (
    MicroBatch,
    ModelLimits,
    batch_loss,
    checked_loss,
    prepare,
)
from plexrl_worker.engine.cobatch import Batcher
from plexrl_worker.engine.config import EngineConfig
from plexrl_worker.engine.errors import EngineInputError, JobExistsError, UnknownJobError
from plexrl_worker.engine.state import JobTensors
from plexrl_worker.engine.weight_set import WeightSet, adamw
from plexrl_worker.engine.weights import FullWeights, LoraWeights, Weights, load_model


@dataclass
class TrainingRun:
    """A `forward_backward` call in progress, a micro-batch (a slice) at a time."""

    job_id: str
    inp: ForwardBackwardInput
    loss_fn: LossFn
    config: dict[str, float]
    batches: list[MicroBatch]
    outputs: list[dict[str, TensorArray]]
    ran: int = 0
    """Micro-batches run so far."""
    total: float = 0.0
    tokens: int = 0

    @property
    def slices(self) -> int:
        return len(self.batches)

    def output(self) -> ForwardBackwardOutput:
        if self.ran < len(self.batches):
            raise RuntimeError(f"{self.ran} of {len(self.batches)} slices of the call ran")
        return ForwardBackwardOutput(
            loss_fn_outputs=self.outputs,
            metrics={"loss:sum": self.total, "tokens:sum": float(self.tokens)},
        )


class TrainingJobs:
    """Not thread-safe: the engine calls it under its lock."""

    def __init__(self, bases: BaseModels, config: EngineConfig, batcher: Batcher) -> None:
        self._bases = bases
        self._config = config
        # Calls sampling a job's own weights leave the batch when the job leaves.
        self._batcher = batcher
        self._jobs: dict[str, WeightSet] = {}
        # Offloaded jobs keep their (empty) modules and optimizer here, so that onload
        # only copies tensors back instead of rebuilding adapters (peft's injection
        # costs ~10 ms, the copy well under one for a LoRA state).
        self._parked: dict[str, WeightSet] = {}

    def get(self, job_id: str) -> WeightSet | None:
        return self._jobs.get(job_id)

    def ids(self) -> list[str]:
        return sorted(list(self._jobs))

    def create(self, job_id: str, spec: JobSpec) -> CreateOutput:
        """New state for a job: fresh adapters seeded by `spec.seed`, or (`spec.lora is
        None`) a full copy of the base weights; a fresh AdamW either way."""
        if job_id in self._jobs:
            raise JobExistsError(job_id)
        info = self._bases.info(spec.base_model)
        if spec.lora is None:
            weights: Weights = FullWeights(load_model(info.path, self._config))
        else:
            base = self._bases.shared(info)
            weights = LoraWeights(base, base.add_adapter(spec.lora, spec.seed))
        job = self._jobs[job_id] = WeightSet(spec, info, weights, adamw(weights))
        return CreateOutput(
            trainable_params=sum(p.numel() for _, p in weights.params()),
            state_bytes=weight_set.state_bytes(job),
        )

    def forward_backward(self, job_id: str, inp: ForwardBackwardInput) -> ForwardBackwardOutput:
        """Summed loss and per-token outputs; with `inp.backward`, gradients that add up
        across calls until `optim_step`."""
        run = self.begin_forward_backward(job_id, inp)
        while self.forward_backward_slice(run):
            pass
        return run.output()

    def begin_forward_backward(self, job_id: str, inp: ForwardBackwardInput) -> TrainingRun:
        """A `forward_backward` checked and cut into its micro-batches, none run yet:
        `forward_backward_slice` runs them one at a time (the whole call's result is the
        same however long it pauses between them)."""
        job = self.trainable(job_id)
        loss_fn, config = checked_loss(inp.loss_fn, inp.loss_fn_config)
        limits = ModelLimits(job.info.vocab_size, job.info.max_positions)
        batches = prepare(inp.data, loss_fn, limits, self._config.max_batch_tokens)
        return TrainingRun(job_id, inp, loss_fn, config, batches, [{} for _ in inp.data])

    def forward_backward_slice(self, run: TrainingRun) -> bool:
        """Run the next micro-batch of `run`; whether any is left. The job's model is
        looked up again each time: between two slices other jobs' calls may have run
        (a shared base's active adapter is this job's again)."""
        mb = run.batches[run.ran]
        model = self.trainable(run.job_id).weights.module()
        out = batch_loss(
            model, mb, run.loss_fn, run.config, self._config.torch_device, run.inp.backward
        )
        run.total += float(out.loss.detach())
        run.tokens += int(out.mask.sum())
        run.outputs[mb.first : mb.first + len(mb.lengths)] = out.outputs(mb)
        run.ran += 1
        return run.ran < len(run.batches)

    def optim_step(self, job_id: str, inp: OptimStepInput) -> OptimStepOutput:
        """One AdamW step over the accumulated gradients, which it then clears."""
        job = self.trainable(job_id)
        adam = inp.adam
        weight_set.check_adam(adam)
        assert job.optimizer is not None  # trainable guarantees it
        norm = weight_set.clip_grads([p for _, p in job.weights.params()], adam)
        weight_set.adamw_step(job.optimizer, adam)
        job.steps += 1
        return OptimStepOutput(metrics=weight_set.step_metrics(norm, job.steps, adam))

    # ---- moves -------------------------------------------------------------------------

    def export_state(self, job_id: str, *, optimizer: bool, gradients: bool) -> JobTensors:
        """A CPU copy of the job's weights, and optionally its AdamW state and gradients."""
        job = self.trainable(job_id)
        params = job.weights.params()
        tensors = state.export_params(params, gradients=gradients)
        if optimizer:
            assert job.optimizer is not None
            tensors |= state.export_adam(params, job.optimizer)
        state.wait_for_copies(self._config.torch_device)
        return JobTensors(tensors, state.make_metadata(job.spec, job.steps))

    def offload(self, job_id: str) -> JobTensors:
        """Everything the job holds, as a CPU copy; then free its memory here."""
        out = self.export_state(job_id, optimizer=True, gradients=True)
        self._batcher.abandon(job_id, f"{job_id!r} left the device while sampling")
        job = self._jobs.pop(job_id)
        state.empty_params(job.weights.params(), job.optimizer)
        self._parked[job_id] = job
        return out

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
        self._jobs[job_id] = weight_set.build(self._bases, self._config, job_state, trainable=True)

    def import_weights(self, job_id: str, job_state: JobTensors, *, optimizer: bool) -> None:
        """Replace a job's weights (load_state); its AdamW moments too with `optimizer`,
        else fresh moments. Pending gradients are dropped either way."""
        job = self.trainable(job_id)
        saved = job_state.spec
        if self._bases.info(saved.base_model).path != job.info.path or saved.lora != job.spec.lora:
            raise EngineInputError(
                f"the checkpoint was saved for {weight_set.describe(saved)}, but this job is "
                f"{weight_set.describe(job.spec)}; load it into a job made like the one that "
                "saved it"
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
        new = weight_set.build(self._bases, self._config, replacement, trainable=True)
        job.weights.release()
        self._jobs[job_id] = new

    def drop(self, job_id: str) -> bool:
        """Forget a job (resident or parked) and free its memory; False if there was none."""
        job = self._jobs.pop(job_id, None) or self._parked.pop(job_id, None)
        if job is None:
            return False
        self._batcher.abandon(job_id, f"{job_id!r} was dropped while sampling")
        job.weights.release()
        return True

    def state_bytes(self, job_id: str) -> int:
        """Peak bytes of the job's own state: weights, gradients and both Adam moments."""
        return weight_set.state_bytes(self.trainable(job_id))

    def trainable(self, job_id: str) -> WeightSet:
        job = self._jobs.get(job_id)
        if job is None:
            raise UnknownJobError(job_id, sorted(self._jobs))
        return job
