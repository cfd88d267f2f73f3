"""Runs one PhaseRequest against the engine and the state tiers; returns its output.

Every failure becomes an ErrorInfo classified by its cause: engine errors carry their
own code (bad input, not found); a request the state-store refuses is the call's bad
input, a full disk leaves the call UNAVAILABLE, a write whose lease is gone CANCELLED;
anything else is INTERNAL, marked `transient` when a later attempt may not meet it
(a service away). Nothing a call does can stop the worker, nor hold it for long:
waiting on a service that is away is bounded by `retry_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from plexrl import age_encryption, hf_export
from plexrl.messages import (
    CreateInput,
    ErrorCode,
    ErrorInfo,
    ExportOptions,
    ForwardBackwardInput,
    Function,
    JobSpec,
    LoadInput,
    LoadOutput,
    NoopOutput,
    OptimStepInput,
    PhaseInput,
    PhaseOutput,
    PhaseRequest,
    SampleInput,
    SampleOutput,
    SaveInput,
    SaveKind,
    SaveOutput,
    UnloadInput,
    UnloadOutput,
)
from plexrl.models import BaseModelInfo
from plexrl.payloads import resolve
from plexrl.retry import is_transient, retrying
from plexrl.state_store_client import (
    Fence,
    StateStoreClient,
    StateStoreFenced,
    StateStoreFull,
    StateStoreRefused,
)
from plexrl.stores import (
    CheckpointFile,
    CheckpointRecord,
    CheckpointStore,
    JobStore,
    PayloadStore,
    is_ephemeral,
)
from plexrl_worker.engine import BASE_PREFIX, EngineError, EngineInputError
from plexrl_worker.engine.state import WEIGHTS, JobTensors, state_stream
from plexrl_worker.executor import Between, Executor, SampleHandle, StateSource
from plexrl_worker.residency import StateManager
from plexrl_worker.samplers import SGLangSampling
from plexrl_worker.sharing import COMPUTE, SharingMeter, work_of
from plexrl_worker.tail import TailHook, TailWatch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ran:
    """What running a call produced, and where its time went."""

    output: PhaseOutput | None
    error: ErrorInfo | None
    swap_s: float
    compute_s: float
    started_at: float
    tail_released_at: float | None = None
    """When the worker let its next dispatch in beside this call's straggling tail (or,
    with `preempted`, beside this call preempted)."""
    preempted: bool = False
    """The release was the scheduler's preemption, not the tail threshold."""
    transient: bool = False
    """The error was an infrastructure fault a later attempt may not meet (a service
    away): the only kind worth running the call again for."""
    fenced: bool = False
    """The state-store refused a write of the call: by its reading of the ledger, the
    call's lease no longer stands."""
    slices: int = 0
    """Micro-batches a sliced `forward_backward` ran in (0: whole, or not training)."""


Finished = Callable[[list[tuple[int, Ran]]], Awaitable[None]]
"""Told the sample calls of a batch that finished (their indices and Ran), those that
ended in one decode step together."""


class Slicing(Protocol):
    """How a sliced `forward_backward` may pause (`DispatchPipeline`'s, per call)."""

    released_at: float | None
    """When the worker let its next dispatch in beside the call (preempted), if it did."""

    async def between(self) -> None:
        """Awaited between two slices: returns when the call may go on."""
        ...

    def paused_s(self) -> float:
        """Seconds the worker's training calls were held paused so far (growing)."""
        ...


class CallRunner:
    """Runs each kind of call on the executor (the ranks), with its state brought onto
    the device first and what it reads or writes outside the engine (payloads,
    checkpoints) through Redis and the state-store."""

    def __init__(
        self,
        *,
        executor: Executor,
        states: StateManager,
        payloads: PayloadStore,
        checkpoints: CheckpointStore,
        jobs: JobStore,
        store: StateStoreClient,
        sglang: SGLangSampling | None = None,
        ephemeral_keep: int = 8,
        retry_s: float = 60.0,
        meter: SharingMeter | None = None,
    ) -> None:
        self._executor = executor
        self.meter = meter or SharingMeter()
        """What sharing the engine costs, measured from the calls run here."""
        # How long a call waits in place for Redis or the state-store to come back
        # before it fails (transient): the worker is held meanwhile.
        self._retry_s = retry_s
        self._ephemeral_keep = ephemeral_keep
        self._sglang = sglang
        self._states = states
        self._payloads = payloads
        self._checkpoints = checkpoints
        self._jobs = jobs
        self._store = store
        self._specs: dict[str, JobSpec] = {}

    async def resolved(self, request: PhaseRequest) -> PhaseRequest:
        """The request with its payload inline (a ref expires; a ledger log entry must not)."""
        payload = await resolve(self._payloads, request.payload, PhaseInput)
        return msgspec.structs.replace(request, payload=payload)

    async def replay(self, request: PhaseRequest) -> None:
        """Apply a logged call again while restoring its job (on the device tier already).

        Raises on failure: a call that applied once must apply again, or the restore is off.
        """
        payload = await resolve(self._payloads, request.payload, PhaseInput)
        await self._dispatch(request, payload)

    async def run(
        self, request: PhaseRequest, fence: Fence | None = None, slicing: Slicing | None = None
    ) -> Ran:
        """Run the call; with `fence` (a numbered call's lease), what it writes in the
        state-store counts only while that lease stands. With `slicing`, a
        `forward_backward` runs a slice at a time (on an executor that slices training),
        awaiting `slicing.between` between slices; the seconds it was held there are
        not the call's compute seconds."""
        started_at = time.time()
        paused0 = slicing.paused_s() if slicing is not None else 0.0
        swap_s = 0.0
        t0 = time.perf_counter()
        wait = _Deadline(self._retry_s)
        try:
            # Before the call touches the engine, Redis or the state-store being away only
            # delays it: retried in place rather than answered with an error, all of it
            # within one `retry_s`.
            payload = await retrying(
                lambda: resolve(self._payloads, request.payload, PhaseInput),
                what=f"reading the payload of {request.request_id}",
                within_s=wait.left(),
            )
            if request.function not in (Function.CREATE, Function.NOOP, Function.UNLOAD):
                swap_s = await retrying(
                    lambda: self._states.onload(request.job_id),
                    what=f"bringing {request.job_id} onto the device",
                    within_s=wait.left(),
                )
            t0 = time.perf_counter()
            if slicing is None:
                with self._metered(request, payload, lambda: 0.0):
                    output = await self._dispatch(request, payload, fence)
                return Ran(output, None, swap_s, time.perf_counter() - t0, started_at)
            boundaries = 0

            async def between() -> None:
                nonlocal boundaries
                boundaries += 1
                # Held here (preempted), it computes nothing beside a tail.
                self.meter.running -= 1
                try:
                    await slicing.between()
                finally:
                    self.meter.running += 1

            with self._metered(request, payload, lambda: slicing.paused_s() - paused0):
                output = await self._dispatch(request, payload, fence, between)
            sliced = request.function == Function.FORWARD_BACKWARD
            return Ran(
                output,
                None,
                swap_s,
                time.perf_counter() - t0 - (slicing.paused_s() - paused0),
                started_at,
                tail_released_at=slicing.released_at,
                preempted=slicing.released_at is not None,
                slices=boundaries + 1 if sliced and self._executor.slices_training else 0,
            )
        except Exception as exc:
            error, transient = _error(request, exc), is_transient(exc)
            fenced = isinstance(exc, StateStoreFenced)
        return Ran(
            None,
            error,
            swap_s,
            time.perf_counter() - t0,
            started_at,
            transient=transient,
            fenced=fenced,
        )

    @contextlib.contextmanager
    def _metered(
        self,
        request: PhaseRequest,
        payload: PhaseInput,
        paused_s: Callable[[], float],
    ) -> Iterator[None]:
        """A compute call's seconds (less `paused_s`, held between slices), told to the
        meter once it ran; other calls are not metered."""
        if request.function not in COMPUTE:
            yield
            return
        mark = self.meter.call_began(request.job_id)
        t0, compute_s = time.perf_counter(), 0.0
        try:
            yield
            compute_s = time.perf_counter() - t0 - paused_s()
        finally:  # a call that failed counts as no sample (0 s)
            work = work_of(payload)
            self.meter.call_ended(mark, request.job_id, request.function, work, compute_s)

    async def _dispatch(
        self,
        request: PhaseRequest,
        payload: PhaseInput,
        fence: Fence | None = None,
        between: Between | None = None,
    ) -> PhaseOutput:
        job_id = request.job_id
        match payload:
            case CreateInput(spec=spec):
                self._specs[job_id] = spec
                created = await self._executor.create(job_id, spec)
                await self._states.created(job_id, created.state_bytes)
                return created
            case ForwardBackwardInput():
                await self._train_on_device()
                return await self._executor.forward_backward(job_id, payload, between)
            case OptimStepInput():
                await self._train_on_device()
                return await self._executor.optim_step(job_id, payload)
            case SampleInput():
                return await self._sample(request, payload)
            case SaveInput():
                return await self._save(request, payload, fence)
            case LoadInput():
                return await self._load(request, payload)
            case UnloadInput():
                await self._retire_ephemeral(job_id, request.tenant, 0, fence)
                await self._executor.drop(job_id)
                await self._states.dropped(job_id)
                self._specs.pop(job_id, None)
                return UnloadOutput()
            case _:
                return NoopOutput()

    async def _train_on_device(self) -> None:
        """A training call is next: SGLang hands over the device if it is set to."""
        if self._sglang is not None and self._sglang.yield_device:
            await asyncio.to_thread(self._sglang.release_for_training)

    async def run_samples(
        self,
        requests: Sequence[PhaseRequest],
        *,
        tail_threshold: float = 0.0,
        on_tail: TailHook | None = None,
        on_done: Finished | None = None,
        release: asyncio.Event | None = None,
        gate: Callable[[], Awaitable[None]] | None = None,
        paused_s: Callable[[], float] | None = None,
    ) -> list[Ran]:
        """Run sample calls in one running batch (co-batched: each call's output is the
        same as run alone); each Ran's compute_s is the call's share of the batch's
        seconds (see below). With `on_tail`, once fewer than `tail_threshold` of the
        batch's sequences still decode, or as soon as `release` is set (a preemption),
        it is awaited (once) and the calls finishing after carry the time in
        `tail_released_at`. `on_done` is awaited with the calls (index and Ran) as they
        finish, before the batch does: those that ended in one decode step together.
        `gate` is awaited before each decode step (a preempted batch's pause; SGLang
        pauses in the server instead, and `paused_s`, seconds paused so far, keeps the
        pause out of its calls' compute_s)."""
        if self._sglang is not None:
            return await self._run_sglang(
                self._sglang, requests, tail_threshold, on_tail, on_done, release, paused_s
            )
        started_at = time.time()
        done: dict[int, Ran] = {}
        joined: list[tuple[int, SampleHandle, float]] = []
        for i, request in enumerate(requests):
            t0 = time.perf_counter()
            try:
                payload, weights_id, swap_s = await self._prepare_sample(request)
                call = await self._executor.begin_sample(weights_id, payload)
                joined.append((i, call, swap_s))
            except Exception as exc:
                done[i] = Ran(None, _error(request, exc), 0.0, time.perf_counter() - t0, started_at)
        # Each step's seconds are split among the calls it ran, by their unfinished
        # sequences: a call's compute_s is its share of the device, and the shares of a
        # group add up to the group's seconds.
        share = {i: 0.0 for i, _, _ in joined}
        total_rows = sum(call.inp.num_samples for _, call, _ in joined)
        with self._tail_metered(requests, on_tail) as (on_tail, step_ran):
            tail = TailWatch(tail_threshold, total_rows, on_tail, release)
            waiting = list(joined)
            while waiting:
                if gate is not None:
                    await gate()
                rows = {i: call.remaining for i, call, _ in waiting}
                beside = self.meter.running > 0
                t0 = time.perf_counter()
                try:
                    await self._executor.sample_step()
                except Exception as exc:  # every call in the batch fails with it
                    for i, _call, swap_s in waiting:
                        done[i] = Ran(None, _error(requests[i], exc), swap_s, share[i], started_at)
                    break
                step_s = time.perf_counter() - t0
                step_ran(step_s, beside)
                total = sum(rows.values()) or 1
                still = []
                for i, call, swap_s in waiting:
                    share[i] += step_s * rows[i] / total
                    released_at = tail.released_at
                    if not call.done:
                        still.append((i, call, swap_s))
                    elif call.abandoned is not None:
                        error = ErrorInfo(ErrorCode.NOT_FOUND, call.abandoned)
                        done[i] = Ran(None, error, swap_s, share[i], started_at, released_at)
                    else:
                        out = call.output()
                        done[i] = Ran(out, None, swap_s, share[i], started_at, released_at)
                if on_done is not None:
                    ended = [(i, done[i]) for i, _call, _swap in waiting if i in done]
                    if ended:
                        await on_done(ended)
                waiting = still
                remaining = sum(call.remaining for _, call, _ in waiting)
                await tail.check([i for i, _, _ in waiting], remaining)
        return [done[i] for i in range(len(requests))]

    @contextlib.contextmanager
    def _tail_metered(
        self, requests: Sequence[PhaseRequest], on_tail: TailHook | None
    ) -> Iterator[tuple[TailHook | None, Callable[[float, bool], None]]]:
        """A sample batch on the meter: its jobs become the engine's last; once released
        (`on_tail`, wrapped) it counts as a tail, and each of its decode steps after (its
        seconds, whether a compute call was in flight when it began) as a tail step where
        a call was in flight throughout or none was."""
        meter = self.meter
        meter.batch_ran(frozenset(r.job_id for r in requests))
        released = False

        def step_ran(seconds: float, beside: bool) -> None:
            if released and beside == (meter.running > 0):
                meter.tail_step(seconds, beside)

        if on_tail is None:  # never released
            yield None, step_ran
            return
        told = on_tail

        async def counted(running: list[int], remaining: int, total: int) -> None:
            nonlocal released
            released = True  # `TailWatch` calls it once
            meter.tails += 1
            await told(running, remaining, total)

        try:
            yield counted, step_ran
        finally:
            if released:
                meter.tails -= 1

    async def _run_sglang(
        self,
        sglang: SGLangSampling,
        requests: Sequence[PhaseRequest],
        tail_threshold: float,
        on_tail: TailHook | None,
        on_done: Finished | None,
        release: asyncio.Event | None,
        paused_s: Callable[[], float] | None = None,
    ) -> list[Ran]:
        """`run_samples` through SGLang: every call is sent at once and SGLang batches
        them. Its steps are not visible here, so a call's compute_s is its wall time
        scaled by its share of the group's sequences, and the tail is judged as calls
        finish (or `release` is set)."""
        started_at = time.time()
        done: dict[int, Ran] = {}
        paused = paused_s or (lambda: 0.0)
        running: dict[asyncio.Task[SampleOutput], tuple[int, int, float, float]] = {}
        for i, request in enumerate(requests):
            try:
                payload, weights_id, swap_s = await self._prepare_sample(request)
            except Exception as exc:  # answered as the call's error
                done[i] = Ran(None, _error(request, exc), 0.0, 0.0, started_at)
                continue
            task = asyncio.create_task(asyncio.to_thread(sglang.sample, weights_id, payload))
            running[task] = (i, payload.num_samples, swap_s, time.perf_counter() - paused())
        total_rows = sum(rows for _, rows, _, _ in running.values())
        # Its steps are not seen here: it is a tail to the calls beside it (their share).
        with self._tail_metered(requests, on_tail) as (on_tail, _):
            tail = TailWatch(tail_threshold, total_rows, on_tail, release)
            asked = asyncio.ensure_future(release.wait()) if release is not None else None
            while running:
                watch: set[asyncio.Future[Any]] = set(running)
                if asked is not None and tail.released_at is None:
                    watch.add(asked)
                finished, _ = await asyncio.wait(watch, return_when=asyncio.FIRST_COMPLETED)
                ended: list[tuple[int, Ran]] = []
                for task in [t for t in running if t in finished]:
                    i, rows, swap_s, t0 = running.pop(task)
                    wall = time.perf_counter() - paused() - t0  # not the pause's seconds
                    compute_s = wall * rows / max(1, total_rows)
                    failure = task.exception()
                    released_at = tail.released_at
                    done[i] = (
                        Ran(
                            None,
                            _error(requests[i], failure),
                            swap_s,
                            compute_s,
                            started_at,
                            released_at,
                            transient=is_transient(failure),
                        )
                        if isinstance(failure, Exception)
                        else Ran(task.result(), None, swap_s, compute_s, started_at, released_at)
                    )
                    ended.append((i, done[i]))
                if on_done is not None and ended:
                    await on_done(ended)
                remaining = sum(rows for _, rows, _, _ in running.values())
                await tail.check([i for i, _, _, _ in running.values()], remaining)
        if asked is not None:
            asked.cancel()
        return [done[i] for i in range(len(requests))]

    async def _prepare_sample(self, request: PhaseRequest) -> tuple[SampleInput, str, float]:
        """A co-batched sample call's input, its job brought onto the device, and the
        engine's id of the weights it reads; returns (input, weights id, swap seconds).
        Redis or the state-store being away only delays it (retried in place)."""
        wait = _Deadline(self._retry_s)
        payload = await retrying(
            functools.partial(resolve, self._payloads, request.payload, PhaseInput),
            what=f"reading the payload of {request.request_id}",
            within_s=wait.left(),
        )
        if not isinstance(payload, SampleInput):
            raise TypeError(f"{request.request_id} carries no SampleInput")
        swap_s = await retrying(
            functools.partial(self._states.onload, request.job_id),
            what=f"bringing {request.job_id} onto the device",
            within_s=wait.left(),
        )
        return payload, await self._sample_weights(request, payload), swap_s

    async def _sample(self, request: PhaseRequest, inp: SampleInput) -> PhaseOutput:
        weights_id = await self._sample_weights(request, inp)
        if self._sglang is not None:
            return await asyncio.to_thread(self._sglang.sample, weights_id, inp)
        return await self._executor.sample(weights_id, inp)

    async def _sample_weights(self, request: PhaseRequest, inp: SampleInput) -> str:
        """The engine's id of the weights a sample call reads (installed if need be)."""
        if inp.weights_path is None:
            return BASE_PREFIX + (await self._spec(request)).base_model
        weights_id = inp.weights_path
        if not await self._executor.has_sampler(weights_id):
            record = await self._checkpoint(inp.weights_path, request.tenant)
            source = StateSource(record.blob_key, record.tenant)
            await self._executor.install_sampler(weights_id, source)
        return weights_id

    async def _save(
        self, request: PhaseRequest, inp: SaveInput, fence: Fence | None
    ) -> PhaseOutput:
        if inp.kind == SaveKind.EXTERNAL:
            return await self._export(request, inp, fence)
        full = inp.kind == SaveKind.STATE
        state = await self._executor.export_state(request.job_id, optimizer=full)
        # Sent piece by piece from the tensors' own memory: building one buffer of a
        # large state would stall the event loop (heartbeats, health) while it copies.
        stream = state_stream(state)
        kind = "weights" if full else "sampler_weights"
        blob_key = checkpoint_blob_key(request.tenant, request.job_id, kind, inp.path, fence)
        await self._store.put_stream(blob_key, stream.chunks(), stream.size, request.tenant, fence)
        spec = state.spec
        record = CheckpointRecord(
            path=inp.path,
            tenant=request.tenant,
            job_id=request.job_id,
            kind=kind,
            blob_key=blob_key,
            size_bytes=stream.size,
            created_at=time.time(),
            base_model=spec.base_model,
            lora_rank=spec.lora.rank if spec.lora else None,
        )
        await self._store.put_checkpoint(record, fence)
        if inp.ephemeral and not full:
            await self._checkpoints.add_ephemeral(record, inp.sampling_session)
            await self._retire_ephemeral(
                request.job_id, request.tenant, self._ephemeral_keep, fence
            )
        if not full:
            # Sampling clients of this path will most likely run here next: keep it warm.
            source = StateSource(blob_key, request.tenant, state)
            await self._executor.install_sampler(inp.path, source)
        return SaveOutput(path=inp.path, size_bytes=stream.size)

    async def _export(
        self, request: PhaseRequest, inp: SaveInput, fence: Fence | None
    ) -> PhaseOutput:
        """The job's weights as Hugging Face files (plexrl.hf_export), encrypted to the
        call's age recipients if it names any, stored as one blob: the files one after
        another, each a byte range the record lists."""
        state = await self._executor.export_state(request.job_id, optimizer=False)
        spec = state.spec
        info = self._executor.model_info(spec.base_model)
        options = inp.export or ExportOptions()
        # Building the files copies the weights and may encrypt them: off the event loop.
        files = await asyncio.to_thread(_export_files, state, info, options.age_recipients)
        entries, at = [], 0
        for name, data in files.items():
            digest = hashlib.sha256(data).hexdigest()
            entries.append(CheckpointFile(name, at, len(data), digest))
            at += len(data)
        kind = "external_weights"
        blob_key = checkpoint_blob_key(request.tenant, request.job_id, kind, inp.path, fence)
        await self._store.put_stream(blob_key, _pieces(files), at, request.tenant, fence)
        record = CheckpointRecord(
            path=inp.path,
            tenant=request.tenant,
            job_id=request.job_id,
            kind=kind,
            blob_key=blob_key,
            size_bytes=at,
            created_at=time.time(),
            base_model=spec.base_model,
            lora_rank=spec.lora.rank if spec.lora else None,
            files=tuple(entries),
        )
        await self._store.put_checkpoint(record, fence)
        return SaveOutput(path=inp.path, size_bytes=at)

    async def _load(self, request: PhaseRequest, inp: LoadInput) -> PhaseOutput:
        record = await self._checkpoint(inp.path, request.tenant)
        source = StateSource(record.blob_key, record.tenant)
        await self._executor.import_weights(request.job_id, source, optimizer=inp.with_optimizer)
        return LoadOutput(path=inp.path)

    async def _retire_ephemeral(
        self, job_id: str, tenant: str, keep: int, fence: Fence | None
    ) -> None:
        """Delete all but the job's newest `keep` ephemeral sampler snapshots: record and
        blob through the state-store, the sampling sessions opened over them, then the
        ranking (a crash in between leaves them ranked, and the next retirement deletes
        them again: a 404 there is fine)."""
        paths = await self._checkpoints.ephemeral_beyond(job_id, keep)
        for path in paths:
            await self._store.delete_checkpoint(path, tenant, fence)
            await self._executor.drop_sampler(path)
        for session in await self._checkpoints.ephemeral_sessions(job_id, paths):
            await self._jobs.delete_job(session)
        await self._checkpoints.unrank_ephemeral(job_id, paths)

    async def _checkpoint(self, path: str, tenant: str) -> CheckpointRecord:
        # Its owner's, or published; none once past its TTL (plexrl.stores.checkpoints).
        record = await self._checkpoints.readable(path, tenant)
        if record is None:
            if is_ephemeral(path):
                raise _NotFound(
                    f"no checkpoint at {path!r}: ephemeral sampler weights are kept for a "
                    f"job's latest {self._ephemeral_keep} saves and while the job lives "
                    "(PLEXRL_EPHEMERAL_KEEP); sample from a newer sampling client, or "
                    "save_weights_for_sampler with a name to keep them"
                )
            raise _NotFound(f"no checkpoint at {path!r}")
        return record

    async def _spec(self, request: PhaseRequest) -> JobSpec:
        spec = request.spec or self._specs.get(request.job_id)
        if spec is None:
            record = await self._jobs.get_job(request.job_id)
            if record is None:
                raise _NotFound(f"unknown job {request.job_id!r}")
            spec = record.spec
        self._specs[request.job_id] = spec
        return spec


def _error(request: PhaseRequest, exc: Exception) -> ErrorInfo:
    """What a failed call answers: engine errors carry their own code, the state-store's
    refusals theirs; anything else is a bug or an infrastructure fault, logged and
    answered INTERNAL."""
    if isinstance(exc, EngineError):
        return ErrorInfo(exc.code, str(exc))
    if isinstance(exc, StateStoreRefused):
        return ErrorInfo(ErrorCode.BAD_REQUEST, str(exc))
    if isinstance(exc, StateStoreFull):
        log.error("call %s (%s): %s", request.request_id, request.function, exc)
        return ErrorInfo(ErrorCode.UNAVAILABLE, f"{exc}; the call had no effect, retry later")
    if isinstance(exc, StateStoreFenced):
        return ErrorInfo(ErrorCode.CANCELLED, str(exc))
    log.exception("call %s (%s) failed", request.request_id, request.function, exc_info=exc)
    return ErrorInfo(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")


class _Deadline:
    """Seconds left of one wait that several retried steps share."""

    def __init__(self, seconds: float) -> None:
        self._end = time.monotonic() + seconds

    def left(self) -> float:
        return max(0.0, self._end - time.monotonic())


class _NotFound(EngineError):
    code = ErrorCode.NOT_FOUND


def _export_files(
    state: JobTensors, info: BaseModelInfo, recipients: list[str]
) -> dict[str, bytes]:
    weights = {
        name.removeprefix(WEIGHTS): t
        for name, t in state.tensors.items()
        if name.startswith(WEIGHTS)
    }
    spec = state.spec
    base_files = hf_export.base_model_files(info.path) if spec.lora is None else None
    try:
        files = hf_export.export_files(weights, spec, info, base_files)
        if recipients:
            files = age_encryption.encrypt_files(files, age_encryption.parse_recipients(recipients))
    except (hf_export.ExportError, age_encryption.RecipientError) as exc:
        raise EngineInputError(str(exc)) from exc
    return files


def _pieces(files: dict[str, bytes], chunk_bytes: int = 1 << 20) -> Iterator[memoryview]:
    """The files' bytes one after another, in slices (no copy) the event loop can breathe
    between."""
    for data in files.values():
        view = memoryview(data)
        for start in range(0, len(view), chunk_bytes):
            yield view[start : start + chunk_bytes]


def checkpoint_blob_key(tenant: str, job_id: str, kind: str, path: str, fence: Fence | None) -> str:
    """Where a save's bytes go: `ckpt/<tenant>/<job>/<kind>/<name>@e<epoch>-<random>`.
    Unique per save, so a late or repeated save never overwrites a blob a record names
    (the record is switched to the new blob instead, and the old one deleted), and a
    deleted checkpoint's tombstone names only its own bytes. Job id and name are
    escaped into the key's alphabet, injectively (`=XX` per byte outside it)."""
    name = path.rpartition("/")[2]
    epoch = fence.epoch if fence is not None else 0
    return (
        f"ckpt/{tenant}/{key_part(job_id)}/{kind}/{key_part(name)}@e{epoch}-{uuid.uuid4().hex[:12]}"
    )


_KEY_SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-:")


def key_part(text: str) -> str:
    """`text` as one blob-key part: no '/', '@', '.' segment or character the key
    alphabet lacks can come through (each such byte becomes `=XX`; a job id's ':'
    stays)."""
    out: list[str] = []
    for ch in text:
        if ch in _KEY_SAFE or (ch == "." and out):
            out.append(ch)
        else:
            out.extend(f"={b:02X}" for b in ch.encode())
    return "".join(out) or "=00"
