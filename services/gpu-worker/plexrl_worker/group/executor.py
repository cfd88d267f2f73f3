"""The worker's rank side on a group of N ranks: the `Executor` the leader's parts speak
to, over `Leader.call` (every rank runs each call, in step).

Every call goes through the engine thread, one at a time, so the ranks see them in one
order. Training is FSDP2 over the ranks (`group.rank`); a job's state moves shard by
shard, every rank moving its own at once (host copies in each rank's memory, disk as a
blob set each rank writes its member of, `plexrl_worker.stored`); snapshots are sharded
the same way, and a state stored by a group of any size restores here. Sampling is
data-parallel (`group.sampling`): each call's samples are split over the ranks.

When a rank is lost, every later call raises `RankLostError` (not an `Exception`: no
call is answered from a broken group), and `watch` raises it too, so the service stops
and the scheduler re-homes its jobs. An idle group is pinged every `ping_s`, which also
keeps the followers' waits for the next call shorter than their collective timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import secrets
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import ParamSpec, TypeVar

import msgspec
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
from plexrl_worker import shards, stored
from plexrl_worker.engine.errors import NotFoundError
from plexrl_worker.engine.state import JobTensors, state_from_bytes
from plexrl_worker.engine_thread import EngineThread
from plexrl_worker.executor import Between, HeldSnapshot, SampleHandle, StateSource
from plexrl_worker.group import calls
from plexrl_worker.group.launch import Leader, RankLostError
from plexrl_worker.group.rank import RankEngine

log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")


class GroupSample:
    """A sample call split over the ranks: done once every rank's slice is."""

    def __init__(self, call_id: int, inp: SampleInput, slices: list[tuple[int, int]]) -> None:
        self.call_id = call_id
        self._inp = inp
        self._first = {r: lo for r, (lo, _) in enumerate(slices)}
        self._remaining = {r: hi - lo for r, (lo, hi) in enumerate(slices) if hi > lo}
        self._outputs: dict[int, SampleOutput] = {}
        self._abandoned: str | None = None

    @property
    def inp(self) -> SampleInput:
        return self._inp

    @property
    def done(self) -> bool:
        return self._abandoned is not None or len(self._outputs) == len(self._remaining)

    @property
    def remaining(self) -> int:
        return 0 if self._abandoned is not None else sum(self._remaining.values())

    @property
    def abandoned(self) -> str | None:
        return self._abandoned

    def update(self, rank: int, part: calls.SamplePart) -> None:
        self._remaining[rank] = part.remaining
        if part.abandoned is not None:
            self._abandoned = part.abandoned
        if part.output is not None:
            self._outputs[rank] = part.output

    def output(self) -> SampleOutput:
        if self._abandoned is not None:
            raise NotFoundError(self._abandoned)
        ranks = sorted(self._outputs, key=self._first.__getitem__)  # in sample order
        first = self._outputs[ranks[0]]
        return SampleOutput(
            sequences=[s for r in ranks for s in self._outputs[r].sequences],
            prompt_logprobs=first.prompt_logprobs,
            topk_prompt_logprobs=first.topk_prompt_logprobs,
        )


class _GroupSnapshot:
    def __init__(self, executor: GroupExecutor, token: str) -> None:
        self._executor = executor
        self._token = token

    async def write(self, key: str) -> int:
        replies = await self._executor.call(calls.WriteSnapshotCall(self._token, key))
        return await self._executor.write_manifest(key, replies)


class GroupExecutor:
    """The group's ranks behind the `Executor` interface (see the module docstring)."""

    slices_training = True

    def __init__(self, leader: Leader, thread: EngineThread, ping_s: float = 5.0) -> None:
        self._leader = leader
        self._thread = thread
        self._ping_s = ping_s
        self.ranks = leader.world_size
        self._rank_bytes: dict[str, list[int]] = {}
        self._samples: dict[int, GroupSample] = {}
        self._ids = itertools.count()
        self._turn = itertools.count()
        """Which rank takes the first slice of the next sample call (rotating, so
        one-sample calls spread over the ranks)."""
        self._last_call = time.monotonic()
        self._lost: RankLostError | None = None

    @property
    def rank0(self) -> RankEngine:
        """Rank 0, in this process (read its introspection only)."""
        return self._leader.engine

    async def call(self, call: calls.Call) -> list[calls.Reply]:
        """Run `call` on every rank; every rank's reply in rank order."""
        return await self._on_thread(self._leader.call, call)

    async def _on_thread(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """A Leader method on the engine thread; a lost rank marks the group lost."""
        if self._lost is not None:
            raise self._lost
        self._last_call = time.monotonic()
        try:
            return await self._thread.call(fn, *args, **kwargs)
        except RankLostError as exc:
            self._lost = exc
            raise

    async def watch(self, stop: asyncio.Event) -> None:
        """Ping the group while it is idle until `stop`; raises RankLostError when a
        rank is lost (then the service stops)."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self._ping_s / 2)
            if self._lost is not None:
                raise self._lost
            if not stop.is_set() and time.monotonic() - self._last_call >= self._ping_s:
                await self.call(calls.PingCall())

    async def close(self) -> None:
        await self._thread.call(self._leader.close)

    # ---- training ----------------------------------------------------------------------

    async def create(self, job_id: str, spec: JobSpec) -> CreateOutput:
        replies = await self.call(calls.CreateCall(job_id, spec))
        self._rank_bytes[job_id] = [_of(r, calls.CreateReply).shard_bytes for r in replies]
        first = _of(replies[0], calls.CreateReply)
        return CreateOutput(trainable_params=first.trainable_params, state_bytes=first.state_bytes)

    async def forward_backward(
        self, job_id: str, inp: ForwardBackwardInput, between: Between | None = None
    ) -> ForwardBackwardOutput:
        if between is None:
            return await self._on_thread(self._leader.forward_backward, job_id, inp)
        # A micro-batch at a time on every rank in step; other calls of the group may
        # run between two (each rank keeps the call's progress meanwhile).
        count = await self._on_thread(self._leader.begin_training, job_id, inp)
        for i in range(count):
            if i:
                await between()
            await self._on_thread(self._leader.training_slice, job_id)
        return await self._on_thread(self._leader.finish_training, job_id)

    async def optim_step(self, job_id: str, inp: OptimStepInput) -> OptimStepOutput:
        replies = await self.call(calls.OptimStepCall(job_id, inp))
        return OptimStepOutput(metrics=_of(replies[0], calls.OptimStepReply).metrics)

    async def export_state(self, job_id: str, *, optimizer: bool) -> JobTensors:
        replies = await self.call(calls.GatherCall(job_id, optimizer=optimizer, gradients=False))
        parts = [state_from_bytes(_of(r, calls.StateReply).data) for r in replies]
        return await asyncio.to_thread(shards.merge, parts)

    async def import_weights(self, job_id: str, source: StateSource, *, optimizer: bool) -> None:
        await self.call(calls.ImportCall(job_id, source.blob_key, source.tenant, optimizer))

    async def drop(self, job_id: str) -> None:
        self._rank_bytes.pop(job_id, None)
        await self.call(calls.DropCall(job_id))

    def rank_bytes(self, job_id: str, whole: int) -> list[int]:
        known = self._rank_bytes.get(job_id)
        if known is not None:
            return known
        return [len(chunk) for chunk in _even(whole, self.ranks)]

    # ---- tiers -------------------------------------------------------------------------

    def stored_key(self, prefix: str) -> str:
        return stored.set_key(prefix, self.ranks)

    async def offload(self, job_id: str) -> None:
        await self.call(calls.OffloadCall(job_id))

    async def spill(self, job_id: str, key: str) -> None:
        await self.write_manifest(key, await self.call(calls.SpillCall(job_id, key)))

    async def fetch(self, job_id: str, key: str) -> None:
        await self.call(calls.FetchCall(job_id, key))

    async def onload(self, job_id: str) -> None:
        await self.call(calls.OnloadCall(job_id))

    async def snapshot(self, job_id: str) -> HeldSnapshot:
        token = uuid.uuid4().hex
        await self.call(calls.SnapshotCall(job_id, token))
        return _GroupSnapshot(self, token)

    async def restore(self, job_id: str, key: str) -> int:
        replies = await self.call(calls.RestoreCall(job_id, key))
        restored = [_of(r, calls.RestoredReply) for r in replies]
        self._rank_bytes[job_id] = [r.shard_bytes for r in restored]
        return restored[0].state_bytes

    async def write_manifest(self, key: str, replies: list[calls.Reply]) -> int:
        """Complete a blob set every rank wrote its member of; the set's bytes."""
        return await self._on_thread(self._leader.write_manifest, key, replies)

    # ---- sampling ----------------------------------------------------------------------

    async def begin_sample(self, weights_id: str, inp: SampleInput) -> SampleHandle:
        if inp.params.seed is None:  # every rank's slice draws from the same seed
            params = msgspec.structs.replace(inp.params, seed=secrets.randbits(63))
            inp = msgspec.structs.replace(inp, params=params)
        first = next(self._turn) % self.ranks
        pieces = _even(range(inp.num_samples), self.ranks)
        slices = [(0, 0)] * self.ranks
        for k, piece in enumerate(pieces):
            slices[(first + k) % self.ranks] = (piece.start, piece.stop)
        call_id = next(self._ids)
        await self.call(calls.BeginSampleCall(call_id, weights_id, inp, slices))
        sample = self._samples[call_id] = GroupSample(call_id, inp, slices)
        return sample

    async def sample_step(self) -> None:
        replies = await self.call(calls.SampleStepCall())
        for rank, reply in enumerate(replies):
            for part in _of(reply, calls.SampleStepReply).parts:
                sample = self._samples.get(part.call_id)
                if sample is not None:
                    sample.update(rank, part)
        for call_id in [i for i, s in self._samples.items() if s.done]:
            del self._samples[call_id]

    async def sample(self, weights_id: str, inp: SampleInput) -> SampleOutput:
        handle = await self.begin_sample(weights_id, inp)
        while not handle.done:
            await self.sample_step()
        return handle.output()

    async def has_sampler(self, weights_id: str) -> bool:
        replies = await self.call(calls.TouchSamplerCall(weights_id))
        return _of(replies[0], calls.FlagReply).value

    async def install_sampler(self, weights_id: str, source: StateSource) -> None:
        await self.call(calls.InstallSamplerCall(weights_id, source.blob_key, source.tenant))

    async def drop_sampler(self, weights_id: str) -> None:
        await self.call(calls.DropSamplerCall(weights_id))

    def sampler_weights(self, weights_id: str) -> tuple[JobSpec, Path, dict[str, torch.Tensor]]:
        # Rank 0's replica, read on the engine thread (never beside a call changing it).
        return self._thread.submit(self.rank0.sampling.samplers.weights, weights_id).result()

    # ---- introspection -----------------------------------------------------------------

    def pids(self) -> list[int]:
        return [os.getpid(), *self._leader.follower_pids]

    def model_info(self, name: str) -> BaseModelInfo:
        return self.rank0.sampling.bases.info(name)

    def installed_samplers(self) -> list[str]:
        return self.rank0.sampling.samplers.ids()

    def loaded_bases(self) -> list[str]:
        return self.rank0.loaded_bases()


def _of(reply: calls.Reply, kind: type[R]) -> R:
    assert isinstance(reply, kind), f"expected {kind.__name__}, got {type(reply).__name__}"
    return reply


def _even(items: range | int, parts: int) -> list[range]:
    """`items` (or range(items)) cut into `parts` contiguous pieces, sizes differing by
    at most one."""
    whole = range(items) if isinstance(items, int) else items
    n = len(whole)
    cuts = [whole.start + (n * k) // parts for k in range(parts + 1)]
    return [range(cuts[k], cuts[k + 1]) for k in range(parts)]
