"""One rank's executor: its shard of every resident job, trained with FSDP2.

Every rank of a group holds one of these and runs each call the leader broadcasts, in
the same order, with the same arguments. Two rules keep the ranks in step:

- an input error (`EngineError`) is raised before the call's first collective, and
  identically on every rank (each sees the whole input and the same job state), so a
  refused call leaves no rank waiting in a collective;
- every rank makes the same collectives in the same order: a rank with less data runs
  masked idle micro-batches so that FSDP2's all-gathers and reduce-scatters pair up.

A full job is its own copy of the model, `fully_shard`-ed per decoder layer and at the
root; its parameters, gradients and Adam moments are DTensors sharded by rows. A LoRA
job's adapter sits in a base model loaded and sharded once per base (frozen, so FSDP2
only all-gathers it); the adapters are small and replicated, their gradients summed
over ranks after each `forward_backward`, and each rank exports only its rows of them,
so swaps and snapshots have one layout for both kinds (`shards`).

Gradients are sums over every datum of the call (Tinker semantics), never averages:
FSDP2's divide factor is 1 and its reductions pure sums (gloo has no PREMUL_SUM).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Shard

from plexrl.messages import (
    ErrorCode,
    ForwardBackwardInput,
    JobSpec,
    LossFn,
    OptimStepInput,
)
from plexrl.models import BaseModelInfo, ModelRegistry, UnknownModelError
from plexrl.retry import is_transient
from plexrl.state_store_client import StateStoreError
from plexrl_worker import shards, stored
from plexrl_worker.engine import state
from plexrl_worker.engine.batch import MicroBatch, ModelLimits, batch_loss, checked_loss, prepare
from plexrl_worker.engine.config import EngineConfig
from plexrl_worker.engine.errors import (
    EngineError,
    EngineInputError,
    JobExistsError,
    NotFoundError,
    UnknownJobError,
)
from plexrl_worker.engine.state import JobTensors, NamedParams, host_copy
from plexrl_worker.engine.weight_set import (
    adamw,
    adamw_step,
    check_adam,
    clip_grads,
    describe,
    step_metrics,
)
from plexrl_worker.engine.weights import (
    FullWeights,
    LoraWeights,
    SharedBase,
    Weights,
    empty_model,
    load_model,
)
from plexrl_worker.group import calls
from plexrl_worker.group.blobs import Blobs
from plexrl_worker.group.calls import Call, Reply
from plexrl_worker.group.sampling import RankSampling

_ModelBuilder = Callable[[Path, EngineConfig], nn.Module]
"""`load_model` (pretrained weights) or `empty_model` (a state is about to be copied in)."""


@dataclass
class _Job:
    spec: JobSpec
    info: BaseModelInfo
    weights: Weights
    optimizer: torch.optim.AdamW
    steps: int = 0


class RankEngine:
    """This rank's share of the group's jobs (see the module docstring)."""

    def __init__(
        self,
        registry: ModelRegistry,
        config: EngineConfig,
        mesh: DeviceMesh,
        blobs: Blobs,
    ) -> None:
        self._registry = registry
        self.blobs = blobs
        self._config = config
        self._mesh = mesh
        self.rank = mesh.get_local_rank()
        self.world_size = mesh.size()
        self._bases: dict[Path, SharedBase] = {}
        self._jobs: dict[str, _Job] = {}
        self._host: dict[str, JobTensors] = {}
        """Offloaded shards (this rank's host tier)."""
        self._held: dict[str, JobTensors] = {}
        """Snapshot copies taken and not yet written, by token."""
        self._training: dict[str, _TrainingRun] = {}
        """Sliced `forward_backward` calls begun and not finished, by job."""
        self.sampling = RankSampling(registry, config, self.rank, blobs)

    def execute(self, call: Call) -> Reply:
        """Run one call on this rank. An `EngineError` comes back as an ErrorReply, as
        does a failed read or write of the disk tier (transient when the state-store was
        away): the group goes on."""
        try:
            return self._dispatch(call)
        except EngineError as exc:
            return calls.ErrorReply(code=exc.code, message=str(exc))
        except (StateStoreError, httpx.HTTPError, OSError) as exc:
            return calls.ErrorReply(
                code=ErrorCode.INTERNAL,
                message=f"rank {self.rank}: {type(exc).__name__}: {exc}",
                transient=is_transient(exc),
            )

    def _dispatch(self, call: Call) -> Reply:
        match call:
            case calls.CreateCall(job_id, spec):
                return self.create(job_id, spec)
            case calls.ForwardBackwardCall(job_id, inp):
                return self.forward_backward(job_id, inp)
            case calls.BeginTrainingCall(job_id, inp):
                return self.begin_training(job_id, inp)
            case calls.TrainingSliceCall(job_id):
                return self.training_slice(job_id)
            case calls.FinishTrainingCall(job_id):
                return self.finish_training(job_id)
            case calls.OptimStepCall(job_id, inp):
                return self.optim_step(job_id, inp)
            case calls.ImportCall(job_id, key, tenant, optimizer):
                return self.import_weights(job_id, key, tenant, optimizer)
            case calls.GatherCall(job_id, optimizer, gradients):
                shard = self.export_shard(job_id, optimizer=optimizer, gradients=gradients)
                return calls.StateReply(state.state_to_bytes(shard))
            case calls.DropCall(job_id):
                self.drop(job_id)
                return calls.DoneReply()
            case calls.OffloadCall(job_id):
                return self.offload(job_id)
            case calls.OnloadCall(job_id):
                return self.onload(job_id)
            case calls.SpillCall(job_id, key):
                return self.spill(job_id, key)
            case calls.FetchCall(job_id, key):
                return self.fetch(job_id, key)
            case calls.SnapshotCall(job_id, token):
                self._held[token] = self.export_shard(job_id)
                return calls.DoneReply()
            case calls.WriteSnapshotCall(token, key):
                held = self._held.pop(token)
                return self.write_shard(held, key)
            case calls.SaveCall(job_id, key):
                return self.save(job_id, key)
            case calls.RestoreCall(job_id, key):
                return self.restore(job_id, key)
            case calls.InstallSamplerCall(weights_id, key, tenant):
                return self.sampling.install(weights_id, key, tenant)
            case calls.TouchSamplerCall(weights_id):
                return self.sampling.touch(weights_id)
            case calls.DropSamplerCall(weights_id):
                return self.sampling.drop(weights_id)
            case calls.BeginSampleCall():
                return self.sampling.begin(call)
            case calls.SampleStepCall():
                return self.sampling.step()
            case calls.PingCall() | calls.ShutdownCall():
                return calls.DoneReply()
        raise EngineInputError(f"no call named {type(call).__name__}")

    # ---- model functions -------------------------------------------------------------

    def create(self, job_id: str, spec: JobSpec) -> calls.CreateReply:
        """Fresh adapters seeded by `spec.seed` (bit-identical to the one-device engine's),
        or a sharded full copy of the base weights; a fresh AdamW either way."""
        if job_id in self._jobs or job_id in self._host:
            raise JobExistsError(job_id)
        info = self._info(spec.base_model)
        weights = self._weights(spec, info, load_model)
        job = self._jobs[job_id] = _Job(spec, info, weights, adamw(weights))
        return calls.CreateReply(
            trainable_params=sum(p.numel() for _, p in weights.params()),
            shard_bytes=self._shard_bytes(job),
            state_bytes=_whole_bytes(weights.params()),
        )

    def forward_backward(
        self, job_id: str, inp: ForwardBackwardInput
    ) -> calls.ForwardBackwardReply:
        """This rank's contiguous slice of the data; gradients summed over every rank."""
        count = self.begin_training(job_id, inp).count
        for _ in range(count):
            self.training_slice(job_id)
        return self.finish_training(job_id)

    def begin_training(self, job_id: str, inp: ForwardBackwardInput) -> calls.SlicesReply:
        """A `forward_backward` cut into this rank's micro-batches, none run yet."""
        job = self._job(job_id)
        loss_fn, config = checked_loss(inp.loss_fn, inp.loss_fn_config)
        limits = ModelLimits(job.info.vocab_size, job.info.max_positions)
        batch_tokens = self._config.max_batch_tokens
        # The whole input is checked on every rank, so all refuse it alike.
        whole = prepare(inp.data, loss_fn, limits, batch_tokens)
        lo, hi = shards.row_range(len(inp.data), self.rank, self.world_size)
        mine = prepare(inp.data[lo:hi], loss_fn, limits, batch_tokens) if hi > lo else []
        count = torch.tensor([len(mine)], dtype=torch.int64)
        if self.world_size > 1:
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
        trained = isinstance(job.weights, LoraWeights) and inp.backward
        self._training[job_id] = _TrainingRun(
            inp=inp,
            loss_fn=loss_fn,
            config=config,
            first=lo,
            mine=mine,
            idle=_idle(mine[0] if mine else whole[0]),
            count=int(count),
            trained=trained,
            carried=_take_grads(job.weights.params()) if trained else {},
            outputs=[{} for _ in range(hi - lo)],
        )
        return calls.SlicesReply(int(count))

    def training_slice(self, job_id: str) -> calls.DoneReply:
        """The next micro-batch of the job's run (an empty one past this rank's data).
        The job's model is looked up again: other calls may have run since the last."""
        run = self._training.get(job_id)
        if run is None or run.ran >= run.count:
            raise EngineInputError(f"{job_id!r} has no forward_backward slice left to run")
        i = run.ran
        mb = run.mine[i] if i < len(run.mine) else run.idle
        model = self._job(job_id).weights.module()
        device = self._config.torch_device
        out = batch_loss(model, mb, run.loss_fn, run.config, device, run.inp.backward)
        run.ran += 1
        if i < len(run.mine):
            run.total += float(out.loss.detach())
            run.tokens += int(out.mask.sum())
            run.outputs[mb.first : mb.first + len(mb.lengths)] = out.outputs(mb)
        return calls.DoneReply()

    def finish_training(self, job_id: str) -> calls.ForwardBackwardReply:
        run = self._training.pop(job_id, None)
        if run is None or run.ran < run.count:
            raise EngineInputError(f"{job_id!r} has no finished forward_backward to answer")
        if run.trained:
            self._sum_replicated_grads(self._job(job_id).weights.params(), run.carried)
        return calls.ForwardBackwardReply(
            first=run.first, outputs=run.outputs, loss=run.total, tokens=run.tokens
        )

    def optim_step(self, job_id: str, inp: OptimStepInput) -> calls.OptimStepReply:
        """One AdamW step, each rank on its shard (full) or on the replicated adapter."""
        job = self._job(job_id)
        adam = inp.adam
        check_adam(adam)
        norm = clip_grads([p for _, p in job.weights.params()], adam)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        adamw_step(job.optimizer, adam)
        job.steps += 1
        return calls.OptimStepReply(metrics=step_metrics(norm, job.steps, adam))

    # ---- state movement --------------------------------------------------------------

    def export_shard(
        self, job_id: str, *, optimizer: bool = True, gradients: bool = True
    ) -> JobTensors:
        """A host copy of this rank's rows of the job's weights, and gradients and
        moments unless told not to."""
        job = self._job(job_id)
        params = job.weights.params()
        tensors: dict[str, torch.Tensor] = {}
        shapes: dict[str, list[int]] = {}

        def put(key: str, t: torch.Tensor) -> None:
            shapes[key] = list(t.shape)
            tensors[key] = host_copy(self._local(t))

        for name, p in params:
            put(state.WEIGHTS + name, p.detach())
            if gradients and p.grad is not None:
                put(state.GRADS + name, p.grad)
            for key, value in job.optimizer.state.get(p, {}).items() if optimizer else ():
                if key in state.ADAM_KEYS:
                    put(f"{state.OPTIM}{name}.{key}", value)
        state.wait_for_copies(self._config.torch_device)
        meta = shards.shard_metadata(
            state.make_metadata(job.spec, job.steps), self.rank, self.world_size, shapes
        )
        return JobTensors(tensors, meta)

    def import_shard(self, job_id: str, shard: JobTensors) -> None:
        """Put this rank's shard back into a resident job (weights, gradients, moments),
        in place; a collective for LoRA jobs, whose replicated adapters are rebuilt
        from every rank's rows."""
        job = self._job(job_id)
        params = job.weights.params()
        expected = {state.WEIGHTS + name for name, _ in params}
        given = {k for k in shard.tensors if k.startswith(state.WEIGHTS)}
        if expected != given:
            raise EngineInputError(
                f"the shard does not fit this job: missing {sorted(expected - given)[:3]}, "
                f"unexpected {sorted(given - expected)[:3]}"
            )
        full = self._whole if isinstance(job.weights, LoraWeights) else self._sharded
        job.optimizer.state.clear()
        with torch.no_grad():
            for name, p in params:
                local = shard.tensors[state.WEIGHTS + name]
                if list(local.shape) != list(self._local(p).shape):
                    raise EngineInputError(
                        f"weight {name} has {list(local.shape)} rows on rank {self.rank}, the "
                        f"job's shard has {list(self._local(p).shape)}; restore it with "
                        "RestoreCall, which reshards a snapshot of any group size"
                    )
                if isinstance(p, DTensor):
                    p.to_local().copy_(local)
                else:
                    p.copy_(self._whole(local, p))
                grad = shard.tensors.get(state.GRADS + name)
                p.grad = None if grad is None else full(grad, p)
                keys = [f"{state.OPTIM}{name}.{k}" for k in state.ADAM_KEYS]
                if all(k in shard.tensors for k in keys):
                    exp_avg, exp_avg_sq, step = (shard.tensors[k] for k in keys)
                    job.optimizer.state[p] = {
                        "step": step.clone(),
                        "exp_avg": full(exp_avg, p),
                        "exp_avg_sq": full(exp_avg_sq, p),
                    }
        job.steps = shard.steps

    def offload(self, job_id: str) -> calls.SwapReply:
        """This rank's shard to host memory; the job then leaves the device."""
        if job_id in self._training:
            # Its earlier calls' adapter gradients are set aside until the call ends.
            raise EngineInputError(
                f"{job_id!r} is between two slices of a forward_backward; it can leave "
                "the device once that call ends"
            )
        start = time.perf_counter()
        shard = self.export_shard(job_id)
        seconds = time.perf_counter() - start
        self.drop(job_id)
        self._host[job_id] = shard
        return _swap_reply(shard, seconds)

    def onload(self, job_id: str) -> calls.SwapReply:
        """Rebuild the job from its offloaded shard, exactly as it left."""
        shard = self._host.get(job_id)
        if shard is None:
            raise UnknownJobError(job_id, sorted(self._host))
        seconds = self._rebuild(job_id, shard)
        del self._host[job_id]
        return _swap_reply(shard, seconds)

    def save(self, job_id: str, key: str) -> calls.SavedReply:
        """This rank's blob of a sharded snapshot (the leader writes the manifest)."""
        return self.write_shard(self.export_shard(job_id), key)

    def write_shard(self, shard: JobTensors, key: str) -> calls.SavedReply:
        """Write this rank's shard as its member of the blob set `key` names."""
        name = stored.member_key(key, self.rank)
        stream = state.state_stream(shard)
        digest = hashlib.sha256()
        pieces = []
        for piece in stream.chunks():
            digest.update(piece)
            pieces.append(piece)
        self.blobs.put(name, pieces, stream.size)
        return calls.SavedReply(
            file=name.rpartition("/")[2],
            nbytes=stream.size,
            digest=digest.hexdigest(),
            metadata=json.dumps(shard.metadata),
        )

    def read_shard(self, key: str, tenant: str | None = None) -> JobTensors:
        """This rank's rows of a state stored under `key` by a group of any size."""
        try:
            return stored.rows_of(
                key, lambda k: self.blobs.get(k, tenant), self.rank, self.world_size
            )
        except (ValueError, KeyError) as exc:
            raise NotFoundError(f"no complete stored state at {key!r} ({exc})") from exc

    def _read_agreed(self, key: str, tenant: str | None = None) -> JobTensors:
        """`read_shard`, when collectives follow: every rank learns whether all read
        theirs, and all refuse together if one could not (none is left waiting)."""
        failure: BaseException | None = None
        shard: JobTensors | None = None
        try:
            shard = self.read_shard(key, tenant)
        except (EngineError, StateStoreError, httpx.HTTPError, OSError) as exc:
            failure = exc
        ok = torch.tensor([0 if failure is not None else 1], dtype=torch.int64)
        if self.world_size > 1:
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if failure is not None:
            raise failure
        if not int(ok):
            raise EngineInputError(f"another rank could not read {key!r}; see its answer")
        assert shard is not None
        return shard

    def restore(self, job_id: str, key: str) -> calls.RestoredReply:
        """Make the job from a state stored by a group of any size."""
        if job_id in self._jobs or job_id in self._host:
            raise JobExistsError(job_id)
        shard = self._read_agreed(key)
        self._rebuild(job_id, shard)
        job = self._job(job_id)
        return calls.RestoredReply(
            shard_bytes=self._shard_bytes(job), state_bytes=_whole_bytes(job.weights.params())
        )

    def spill(self, job_id: str, key: str) -> calls.SavedReply:
        """Host → disk: this rank's host copy as its blob of the set `key` names."""
        shard = self._host.get(job_id)
        if shard is None:
            raise UnknownJobError(job_id, sorted(self._host))
        reply = self.write_shard(shard, key)
        del self._host[job_id]
        return reply

    def fetch(self, job_id: str, key: str) -> calls.SwapReply:
        """Disk → host: this rank's rows of a state stored by a group of any size."""
        start = time.perf_counter()
        shard = self.read_shard(key)
        self._host[job_id] = shard
        return _swap_reply(shard, time.perf_counter() - start)

    def import_weights(
        self, job_id: str, key: str, tenant: str, optimizer: bool
    ) -> calls.DoneReply:
        """Replace the job's weights (and moments with `optimizer`; fresh ones otherwise)
        by this rank's rows of a checkpoint; pending gradients are dropped. A checkpoint
        that does not fit leaves the job as it was."""
        job = self._job(job_id)
        rows = self._read_agreed(key, tenant)
        saved = rows.spec
        if self._info(saved.base_model).path != job.info.path or saved.lora != job.spec.lora:
            raise EngineInputError(
                f"the checkpoint was saved for {describe(saved)}, but this job is "
                f"{describe(job.spec)}; load it into a job made like the one that saved it"
            )
        if optimizer and not rows.has(state.OPTIM):
            raise EngineInputError(
                "the checkpoint holds no optimizer state; load it without the optimizer"
            )
        wanted = (state.WEIGHTS, state.OPTIM) if optimizer else (state.WEIGHTS,)
        replacement = JobTensors(
            {k: v for k, v in rows.tensors.items() if k.startswith(wanted)},
            state.make_metadata(job.spec, rows.steps if optimizer else 0),
        )
        old = self._jobs.pop(job_id)
        try:
            self._rebuild(job_id, replacement)
        except EngineError:
            self._jobs[job_id] = old
            raise
        old.weights.release()
        return calls.DoneReply()

    def loaded_bases(self) -> list[str]:
        """Base models in memory: the sharded ones training uses, the plain ones sampling
        uses."""
        return sorted(
            {base.info.name for base in list(self._bases.values())} | set(self.sampling.loaded())
        )

    def drop(self, job_id: str) -> bool:
        self._training.pop(job_id, None)
        job = self._jobs.pop(job_id, None)
        host = self._host.pop(job_id, None)
        if job is not None:
            job.weights.release()
        return job is not None or host is not None

    def resident_jobs(self) -> list[str]:
        return sorted(self._jobs)

    # ---- internals -------------------------------------------------------------------

    def _rebuild(self, job_id: str, shard: JobTensors) -> float:
        """A new job from a shard; the seconds its tensor copies took."""
        try:
            spec = shard.spec
        except (KeyError, ValueError) as exc:
            raise EngineInputError(f"the shard carries no valid JobSpec: {exc}") from exc
        info = self._info(spec.base_model)
        weights = self._weights(spec, info, empty_model)
        self._jobs[job_id] = _Job(spec, info, weights, adamw(weights))
        start = time.perf_counter()
        try:
            self.import_shard(job_id, shard)
        except EngineError:
            self.drop(job_id)
            raise
        return time.perf_counter() - start

    def _weights(self, spec: JobSpec, info: BaseModelInfo, build: _ModelBuilder) -> Weights:
        if spec.lora is None:
            return FullWeights(self._shard(build(info.path, self._config)))
        base = self._bases.get(info.path)
        if base is None:
            model = self._shard(load_model(info.path, self._config))
            base = self._bases[info.path] = SharedBase(info, model)
        return LoraWeights(base, base.add_adapter(spec.lora, spec.seed))

    def _shard(self, model: nn.Module) -> nn.Module:
        """FSDP2 over every decoder layer, then the root (embeddings, norm, head)."""
        layers = getattr(getattr(model, "model", None), "layers", None)
        if not isinstance(layers, nn.ModuleList):
            raise EngineInputError(
                f"{type(model).__name__} has no `model.layers`; the group shards decoder "
                "models laid out as Hugging Face's Llama and Qwen families are"
            )
        for layer in layers:
            fully_shard(layer, mesh=self._mesh)
        fully_shard(model, mesh=self._mesh)
        # Each FSDP module keeps its own reduction settings: set them on every one.
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
        return model

    def _local(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a sharded (DTensor) or replicated tensor."""
        if isinstance(t, DTensor):
            return t.to_local()
        return shards.shard_of(t, self.rank, self.world_size)

    def _sharded(self, local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """A DTensor laid out as `like` over this rank's rows (a copy on the device)."""
        if local.dim() == 0 or not isinstance(like, DTensor):
            return local.to(self._config.torch_device, copy=True)
        return DTensor.from_local(
            local.to(self._config.torch_device, copy=True),
            self._mesh,
            [Shard(0)],
            run_check=False,
            shape=like.shape,
            stride=like.stride(),
        )

    def _whole(self, local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """The whole replicated tensor from every rank's rows (a collective)."""
        device = self._config.torch_device
        if local.dim() == 0 or self.world_size == 1:
            return local.to(device, copy=True)
        rows = like.shape[0]
        chunk = shards.row_range(rows, 0, self.world_size)[1]
        padded = torch.zeros((chunk, *local.shape[1:]), dtype=local.dtype, device=device)
        padded[: local.shape[0]] = local
        out = torch.empty(
            (chunk * self.world_size, *local.shape[1:]), dtype=local.dtype, device=device
        )
        dist.all_gather_into_tensor(out, padded)
        return out[:rows].clone()

    def _sum_replicated_grads(
        self, params: NamedParams, carried: dict[int, torch.Tensor | None]
    ) -> None:
        """Sum this call's adapter gradients over ranks, then add the earlier calls'
        (already summed) ones: each rank ends with the same, whole gradient."""
        live = [p for _, p in params if p.grad is not None]
        if self.world_size > 1 and live:
            flat = torch.cat([p.grad.reshape(-1) for p in live if p.grad is not None])
            dist.all_reduce(flat)
            offset = 0
            for p in live:
                assert p.grad is not None
                n = p.grad.numel()
                p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
                offset += n
        for _, p in params:
            before = carried.get(id(p))
            if before is not None:
                p.grad = before if p.grad is None else before + p.grad

    def _shard_bytes(self, job: _Job) -> int:
        # Weights, gradients and AdamW's two moments, each the size of this rank's rows.
        return 4 * _local_bytes(job.weights.params())

    def _job(self, job_id: str) -> _Job:
        job = self._jobs.get(job_id)
        if job is None:
            raise UnknownJobError(job_id, sorted(self._jobs))
        return job

    def _info(self, name: str) -> BaseModelInfo:
        try:
            return self._registry.info(name)
        except UnknownModelError as exc:
            raise NotFoundError(str(exc)) from exc


@dataclass
class _TrainingRun:
    """One rank's side of a sliced `forward_backward` (`RankEngine.begin_training`)."""

    inp: ForwardBackwardInput
    loss_fn: LossFn
    config: dict[str, float]
    first: int
    """Index in the call's data of this rank's first datum."""
    mine: list[MicroBatch]
    idle: MicroBatch
    count: int
    """Micro-batches every rank runs (the most any rank has)."""
    trained: bool
    """Adapter gradients to sum over the ranks at the end (a LoRA job's backward)."""
    carried: dict[int, torch.Tensor | None]
    """The gradients of earlier calls, set aside meanwhile."""
    outputs: list[dict[str, calls.TensorArray]]
    ran: int = 0
    total: float = 0.0
    tokens: int = 0


def _idle(batch: MicroBatch) -> MicroBatch:
    """A one-token micro-batch that counts for nothing (its only token masked out): a
    rank with no more data runs it so its collectives pair up with the others'."""
    return MicroBatch(
        first=0,
        lengths=[],
        tokens=batch.tokens[:1, :1].clone(),
        mask=torch.zeros((1, 1), dtype=torch.bool),
        inputs={k: v[:1, :1].clone() for k, v in batch.inputs.items()},
    )


def _take_grads(params: NamedParams) -> dict[int, torch.Tensor | None]:
    """Set the gradients aside (they are already summed over ranks) and clear them."""
    out: dict[int, torch.Tensor | None] = {}
    for _, p in params:
        out[id(p)] = p.grad
        p.grad = None
    return out


def _local_bytes(params: NamedParams) -> int:
    """Bytes this rank holds of the parameters: its rows of a sharded (DTensor) one, the
    whole of a replicated one (a LoRA adapter)."""
    total = 0
    for _, p in params:
        local = p.to_local() if isinstance(p, DTensor) else p
        total += local.numel() * local.element_size()
    return total


def _whole_bytes(params: NamedParams) -> int:
    """The whole job's peak state bytes (weights, gradients, both moments), as one
    device's engine counts them (a DTensor's numel is its whole tensor's)."""
    return 4 * sum(p.numel() * p.element_size() for _, p in params)


def _swap_reply(shard: JobTensors, seconds: float) -> calls.SwapReply:
    digest = hashlib.sha256(state.state_to_bytes(shard)).hexdigest()
    return calls.SwapReply(nbytes=shard.nbytes(), seconds=seconds, digest=digest)
