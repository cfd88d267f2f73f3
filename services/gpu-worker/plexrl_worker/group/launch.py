"""Bring a group up: the calling process becomes rank 0 (the leader) and starts ranks
1..N-1 as processes of their own; each joins the TCP-store rendezvous, the process
group (gloo on CPU, NCCL on CUDA, device r for rank r) and the command channel, then
runs every call the leader broadcasts, in step with the others.

The leader is the group's voice: `Leader.call` broadcasts a call, runs it on rank 0,
gathers every rank's reply and combines them. Losing a rank never hangs the leader:
the collective it is in raises (at once when the peer's sockets close, else after
`collective_timeout_s`), and the call raises `RankLostError`, naming the rank and how
it ended. The group is then unusable; close it, start another and restore its jobs.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import multiprocessing as mp
import multiprocessing.process
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from plexrl.messages import ErrorCode, ForwardBackwardOutput
from plexrl.models import ModelRegistry
from plexrl_worker import shards
from plexrl_worker.engine.config import EngineConfig
from plexrl_worker.engine.errors import EngineError
from plexrl_worker.engine.state import JobTensors, state_from_bytes
from plexrl_worker.group import calls
from plexrl_worker.group.blobs import BlobPlace
from plexrl_worker.group.calls import Call, Reply
from plexrl_worker.group.channel import Channel
from plexrl_worker.group.config import GroupConfig
from plexrl_worker.group.rank import RankEngine

log = logging.getLogger(__name__)


class GroupCallError(EngineError):
    """A call a rank refused (bad input, unknown job, the state-store away); the group is
    fine. `status_code` 503 marks one a later attempt may pass (`plexrl.retry`)."""

    def __init__(self, code: ErrorCode, message: str, transient: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.status_code = 503 if transient else 0


class RankLostError(BaseException):
    """A rank died or stopped answering; the group can run nothing more.

    Not an `Exception`, like `asyncio.CancelledError`: the worker's handlers answer a
    failed call with its error, but a call the group could not run must not be answered
    at all. It goes up to the service, which stops; the scheduler re-homes its jobs, and
    their calls run again from their snapshots on a whole group."""


def start_group(
    config: GroupConfig,
    registry_root: Path,
    engine: EngineConfig | None = None,
    blobs: BlobPlace | None = None,
) -> Leader:
    """Start ranks 1..N-1, join them as rank 0, and return the leader. `engine` is each
    rank's engine configuration (its device is replaced by the rank's own); `blobs`
    where the ranks read and write the disk tier (default: a fresh temporary
    directory)."""
    engine = engine or EngineConfig()
    blobs = blobs or BlobPlace(directory=Path(tempfile.mkdtemp(prefix="plexrl-group-")))
    timeout = datetime.timedelta(seconds=config.rendezvous_timeout_s)
    store = dist.TCPStore(
        config.master_addr,
        config.master_port,
        config.world_size,
        is_master=True,
        timeout=timeout,
        wait_for_workers=False,
    )
    context = (
        mp.get_context("forkserver")
        if config.start_method == "forkserver"
        else mp.get_context("spawn")
    )
    if config.start_method == "forkserver":
        # The server imports torch, transformers and peft once; each rank is then a
        # cheap fork of that clean process (never of this one, which may have run
        # autograd: a forked child cannot).
        context.set_forkserver_preload([__name__])
    # Ranks from `local_ranks` on run on other hosts, started there (`follow`).
    followers = [
        context.Process(
            target=_follower_main,
            args=(rank, config, store.port, registry_root, engine, blobs),
            name=f"plexrl-rank-{rank}",
            daemon=True,
        )
        for rank in range(1, config.started_here)
    ]
    for process in followers:
        process.start()
    previous_threads = torch.get_num_threads()
    try:
        rank_engine, channel = _join(0, config, store, registry_root, engine, blobs)
    except Exception as exc:
        described = _describe_ranks(followers)
        for process in followers:
            process.kill()
            process.join()
        raise RankLostError(f"the group did not come up ({exc}); {described}") from exc
    return Leader(rank_engine, channel, followers, store, previous_threads)


class Leader:
    """Rank 0: runs each call on every rank in step and speaks for the group."""

    def __init__(
        self,
        engine: RankEngine,
        channel: Channel,
        followers: Sequence[multiprocessing.process.BaseProcess],
        store: dist.TCPStore,
        previous_threads: int,
    ) -> None:
        self.engine = engine
        self._channel = channel
        self._followers = list(followers)
        self._store = store  # the rendezvous store lives as long as the group
        self._previous_threads = previous_threads
        self._broken: str | None = None
        self.world_size = channel.world_size

    @property
    def follower_pids(self) -> list[int]:
        return [p.pid for p in self._followers if p.pid is not None]

    def call(self, call: Call) -> list[Reply]:
        """Every rank's reply, in rank order; GroupCallError if the ranks refused it,
        RankLostError if a rank was lost."""
        if self._broken is not None:
            raise RankLostError(self._broken)
        try:
            self._channel.broadcast(calls.encode(call))
            mine = self.engine.execute(call)
            gathered = self._channel.gather(calls.encode(mine))
        except Exception as exc:
            self._broken = (
                f"the group lost a rank while running {type(call).__name__} ({exc}); "
                f"{_describe_ranks(self._followers)}; the group can run nothing more: "
                "close it, start a new one and restore its jobs from their snapshots"
            )
            raise RankLostError(self._broken) from exc
        assert gathered is not None
        replies = [calls.decode_reply(r) for r in gathered]
        for reply in replies:
            if isinstance(reply, calls.ErrorReply):
                raise GroupCallError(reply.code, reply.message, reply.transient)
        return replies

    def ping(self) -> None:
        """Every rank answers, or RankLostError."""
        self.call(calls.PingCall())

    # ---- the group's model functions, combined ----------------------------------------

    def create(self, job_id: str, spec: calls.JobSpec) -> calls.CreateReply:
        replies = self.call(calls.CreateCall(job_id, spec))
        first = replies[0]
        assert isinstance(first, calls.CreateReply)
        return first

    def forward_backward(
        self, job_id: str, inp: calls.ForwardBackwardInput
    ) -> ForwardBackwardOutput:
        return _joined(self.call(calls.ForwardBackwardCall(job_id, inp)))

    def begin_training(self, job_id: str, inp: calls.ForwardBackwardInput) -> int:
        """A `forward_backward` to run a micro-batch at a time: how many to run
        (`training_slice` each), then `finish_training`."""
        first = self.call(calls.BeginTrainingCall(job_id, inp))[0]
        assert isinstance(first, calls.SlicesReply)
        return first.count

    def training_slice(self, job_id: str) -> None:
        self.call(calls.TrainingSliceCall(job_id))

    def finish_training(self, job_id: str) -> ForwardBackwardOutput:
        return _joined(self.call(calls.FinishTrainingCall(job_id)))

    def optim_step(self, job_id: str, inp: calls.OptimStepInput) -> dict[str, float]:
        first = self.call(calls.OptimStepCall(job_id, inp))[0]
        assert isinstance(first, calls.OptimStepReply)
        return first.metrics

    def offload(self, job_id: str) -> list[calls.SwapReply]:
        return _swaps(self.call(calls.OffloadCall(job_id)))

    def onload(self, job_id: str) -> list[calls.SwapReply]:
        return _swaps(self.call(calls.OnloadCall(job_id)))

    def save(self, job_id: str, key: str) -> None:
        """A sharded snapshot, the blob set `key` names (`stored.set_key`); complete
        (its manifest written) only once every rank's blob is stored."""
        self.write_manifest(key, self.call(calls.SaveCall(job_id, key)))

    def write_manifest(self, key: str, replies: list[Reply]) -> int:
        """The set's manifest, from every rank's SavedReply; the set's bytes in all."""
        files = []
        for r in replies:
            assert isinstance(r, calls.SavedReply)
            files.append((r.file, r.nbytes, r.digest))
        first = replies[0]
        assert isinstance(first, calls.SavedReply)
        data = shards.manifest_bytes(files, json.loads(first.metadata))
        self.engine.blobs.put(key, [data], len(data))
        return sum(n for _, n, _ in files) + len(data)

    def restore(self, job_id: str, key: str) -> int:
        """Make the job from a state stored under `key` (any group size); its bytes."""
        replies = self.call(calls.RestoreCall(job_id, key))
        return sum(r.shard_bytes for r in replies if isinstance(r, calls.RestoredReply))

    def gather(self, job_id: str) -> JobTensors:
        """The job's whole state on the leader, as the one-device engine names it."""
        parts = self.call(calls.GatherCall(job_id))
        states = []
        for part in parts:
            assert isinstance(part, calls.StateReply)
            states.append(state_from_bytes(part.data))
        return shards.merge(states)

    def drop(self, job_id: str) -> None:
        self.call(calls.DropCall(job_id))

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop every follower and leave the process group (also after a lost rank)."""
        if self._broken is None:
            with contextlib.suppress(RankLostError):
                self.call(calls.ShutdownCall())
        deadline = time.monotonic() + timeout_s
        for process in self._followers:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
        if dist.is_initialized():
            dist.destroy_process_group()
        torch.set_num_threads(self._previous_threads)

    def __enter__(self) -> Leader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _swaps(replies: list[Reply]) -> list[calls.SwapReply]:
    out = []
    for r in replies:
        assert isinstance(r, calls.SwapReply)
        out.append(r)
    return out


def _join(
    rank: int,
    config: GroupConfig,
    store: dist.Store,
    registry_root: Path,
    engine: EngineConfig,
    blobs: BlobPlace,
    device: str | None = None,
) -> tuple[RankEngine, Channel]:
    """This process as `rank` (on `device`, by default the config's for the rank): its
    threads, device, process group, mesh and channel."""
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    device = device or config.device(rank)
    # Every rank at the door first, within the rendezvous timeout: a rank still importing
    # torch on a busy host is waited for here, not by the process group's first barrier,
    # which only waits the (shorter) collective timeout.
    store.set(f"plexrl/arrived/{rank}", "1")
    store.wait(
        [f"plexrl/arrived/{r}" for r in range(config.world_size)],
        datetime.timedelta(seconds=config.rendezvous_timeout_s),
    )
    kwargs: dict[str, object] = {}
    if config.device_type == "cuda":
        torch.cuda.set_device(torch.device(device))
        kwargs["device_id"] = torch.device(device)
    dist.init_process_group(
        config.backend,
        store=store,
        rank=rank,
        world_size=config.world_size,
        timeout=datetime.timedelta(seconds=config.collective_timeout_s),
        **kwargs,  # type: ignore[arg-type]
    )
    # The command channel stays on the host under NCCL; on the CPU it is the group itself.
    channel_group: dist.ProcessGroup | None = None
    if config.device_type == "cuda":
        made = dist.new_group(backend="gloo")
        assert isinstance(made, dist.ProcessGroup)  # every rank is a member
        channel_group = made
    mesh = init_device_mesh(config.device_type, (config.world_size,))
    rank_config = EngineConfig(
        device=device,
        dtype=engine.dtype,
        max_batch_tokens=engine.max_batch_tokens,
        attn_implementation=engine.attn_implementation,
    )
    rank_engine = RankEngine(ModelRegistry(registry_root), rank_config, mesh, blobs.open())
    return rank_engine, Channel(channel_group)


def follow(
    rank: int,
    config: GroupConfig,
    registry_root: Path,
    engine: EngineConfig,
    blobs: BlobPlace,
    device: str | None = None,
) -> None:
    """Run rank `rank` of a group whose leader serves its rendezvous at
    `config.master_addr:master_port` (a rank on another host than the leader's), on
    `device` (`cuda:k` of this host; None: the config's guess)."""
    if not config.master_port:
        raise ValueError(
            "a rank started on its own needs the leader's rendezvous port; set "
            "PLEXRL_WORKER_RENDEZVOUS_PORT to the same fixed port on every rank"
        )
    _follower_main(rank, config, config.master_port, registry_root, engine, blobs, device)


def _follower_main(
    rank: int,
    config: GroupConfig,
    port: int,
    registry_root: Path,
    engine: EngineConfig,
    blobs: BlobPlace,
    device: str | None = None,
) -> None:
    """A follower's life: join, then run each broadcast call until told to stop."""
    os.environ.update(
        MASTER_ADDR=config.master_addr,
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(config.world_size),
    )
    store = dist.TCPStore(
        config.master_addr,
        port,
        config.world_size,
        is_master=False,
        timeout=datetime.timedelta(seconds=config.rendezvous_timeout_s),
    )
    rank_engine, channel = _join(rank, config, store, registry_root, engine, blobs, device)
    while True:
        call = calls.decode_call(channel.broadcast(None))
        reply = rank_engine.execute(call)
        channel.gather(calls.encode(reply))
        if isinstance(call, calls.ShutdownCall):
            break
    dist.destroy_process_group()


def _describe_ranks(followers: Sequence[multiprocessing.process.BaseProcess]) -> str:
    """Which followers have ended, and how (waiting a moment: the death that broke a
    collective may not have been reaped yet)."""
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline and all(p.exitcode is None for p in followers):
        time.sleep(0.05)
    ended = []
    for rank, p in enumerate(followers, start=1):
        if p.exitcode is None:
            continue
        how = f"killed by signal {-p.exitcode}" if p.exitcode < 0 else f"exit code {p.exitcode}"
        ended.append(f"rank {rank} (pid {p.pid}) ended, {how}")
    if not ended:
        return "every follower is still running (one stopped answering)"
    return "; ".join(ended)


def _joined(parts: list[Reply]) -> ForwardBackwardOutput:
    """One `forward_backward`'s output from every rank's part, in rank order."""
    outputs: list[dict[str, calls.TensorArray]] = []
    total, tokens = 0.0, 0
    for part in parts:
        assert isinstance(part, calls.ForwardBackwardReply)
        outputs.extend(part.outputs)
        total += part.loss
        tokens += part.tokens
    return ForwardBackwardOutput(
        loss_fn_outputs=outputs, metrics={"loss:sum": total, "tokens:sum": float(tokens)}
    )
