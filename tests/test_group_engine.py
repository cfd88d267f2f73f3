"""The worker group's rank side: FSDP2 training over 2 CPU ranks (gloo), per-shard swaps
(device, host, disk), sharded snapshots restored onto another group size, data-parallel
sampling through the worker's own sample loop (co-batching, the tail release, a
preempted batch), and a lost rank.

Each group session below runs one fixed script (two LoRA and full-parameter training
steps with swap round trips between them, a snapshot, then the sampling calls); the
tests assert on what the sessions recorded, so the whole module brings a group up four
times.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from plexrl.messages import (
    AdamParams,
    Datum,
    ForwardBackwardInput,
    Function,
    JobSpec,
    LoraSpec,
    LossFn,
    OptimStepInput,
    PhaseOutput,
    PhaseRequest,
    SampleInput,
    SamplingParams,
)
from plexrl.models import ModelRegistry
from plexrl_tools.cluster import free_port
from plexrl_worker import stored
from plexrl_worker.engine import EngineConfig, TorchEngine
from plexrl_worker.engine.arrays import to_array, to_tensor
from plexrl_worker.engine.state import JobTensors, state_from_bytes, state_to_bytes
from plexrl_worker.engine_thread import EngineThread
from plexrl_worker.executor import StateSource
from plexrl_worker.group import (
    GroupCallError,
    GroupConfig,
    Leader,
    RankLostError,
    calls,
    start_group,
)
from plexrl_worker.group.blobs import BlobPlace
from plexrl_worker.group.executor import GroupExecutor
from plexrl_worker.runner import CallRunner, Ran

MODEL = "plexrl/tiny-qwen3"
SPECS = {
    "lora": JobSpec(base_model=MODEL, lora=LoraSpec(rank=4), seed=3),
    "full": JobSpec(base_model=MODEL, seed=3),
}
ADAM = AdamParams(learning_rate=1e-2, grad_clip_norm=1.0)
# Small micro-batches: rank 0 runs two, rank 1 one and an idle one (in step with rank 0).
ENGINE = EngineConfig(max_batch_tokens=24)
TOLERANCE = 5e-5
"""Largest relative difference (max |a - b| / max |b| per tensor) allowed between group
sizes, and between a group and the one-device engine, after two AdamW steps (lr 1e-2)
and a third forward_backward. Measured (fp32 CPU): LoRA 2 ranks vs 1 rank 0 (the same
micro-batches, and a sum of two is commutative); full 2 vs 1 5.5e-6 (FSDP2's
reduce-scatter sums in another order; the logprobs differ by 1.7e-7); 1 rank vs the
engine 8.1e-6 (LoRA) and 9.4e-6 (full): FSDP2 runs the matmuls over its own copies of
the weights. Adam's normalisation lifts gradient differences of ~5e-7 to these."""


def _data() -> list[Datum]:
    gen = torch.Generator().manual_seed(7)
    data = []
    for n in (9, 12, 7):
        tokens = torch.randint(0, 700, (n + 1,), generator=gen)
        weights = torch.rand(n, generator=gen)
        data.append(
            Datum(
                tokens=tokens[:-1].tolist(),
                loss_fn_inputs={
                    "target_tokens": to_array(tokens[1:]),
                    "weights": to_array(weights),
                },
            )
        )
    return data


FB = ForwardBackwardInput(data=_data(), loss_fn=LossFn.CROSS_ENTROPY)

SAMPLER_KEY = "ckpt/t/sampler.safetensors"
"""A LoRA checkpoint (the LoRA spec's fresh adapter) every session installs as sampler
weights `sampler`."""


def _sample_call(rid: str, samples: int, max_tokens: int, seed: int, lora: bool) -> PhaseRequest:
    params = SamplingParams(max_tokens=max_tokens, seed=seed, stop_at_eos=False)
    inp = SampleInput(
        prompt=[21, 22, 15],
        num_samples=samples,
        params=params,
        weights_path="sampler" if lora else None,
    )
    return PhaseRequest(
        request_id=rid,
        job_id=f"job-{rid}",
        tenant="t",
        function=Function.SAMPLE,
        payload=inp,
        arrival_time=0.0,
        spec=SPECS["lora"],
    )


# Three short calls (3 samples x 2 tokens, one of them of the LoRA sampler set) and one
# long (1 x 12): after two steps 1 of 10 sequences decodes, under a 0.25 threshold.
SAMPLE_CALLS = [
    _sample_call("s1", 3, 2, 1, lora=False),
    _sample_call("s2", 3, 2, 2, lora=True),
    _sample_call("s3", 3, 2, 3, lora=False),
    _sample_call("long", 1, 12, 4, lora=True),
]


@dataclass
class Sampled:
    """What a session's sampling calls answered."""

    outputs: list[PhaseOutput | None] = field(default_factory=list)
    tails: list[tuple[list[int], int, int]] = field(default_factory=list)
    released: list[bool] = field(default_factory=list)
    """Per call, whether it finished after the tail release."""
    preempted: PhaseOutput | None = None
    """The long call again, asked to yield at once (a preemption) and run to its end."""
    preempt_told: list[tuple[list[int], int, int]] = field(default_factory=list)


class _Resident:
    """The edge of the sample loop here: every state is on the device already."""

    async def onload(self, job_id: str) -> float:
        return 0.0


async def _sample_on(leader: Leader) -> Sampled:
    """The worker's own CallRunner over the group: the co-batched sample loop with the
    tail release, then a preempted batch."""
    thread = EngineThread()
    executor = GroupExecutor(leader, thread)
    none: Any = None
    runner = CallRunner(
        executor=executor,
        states=_Resident(),  # type: ignore[arg-type]
        payloads=none,
        checkpoints=none,
        jobs=none,
        store=none,
    )
    record = Sampled()

    async def on_tail(running: list[int], remaining: int, total: int) -> None:
        record.tails.append((running, remaining, total))

    try:
        await executor.install_sampler("sampler", StateSource(SAMPLER_KEY, "t"))
        rans: list[Ran] = await runner.run_samples(
            SAMPLE_CALLS, tail_threshold=0.25, on_tail=on_tail
        )
        record.outputs = [r.output for r in rans]
        record.released = [r.tail_released_at is not None for r in rans]
        asked = asyncio.Event()
        asked.set()

        async def told(running: list[int], remaining: int, total: int) -> None:
            record.preempt_told.append((running, remaining, total))

        (ran,) = await runner.run_samples(
            [SAMPLE_CALLS[3]], tail_threshold=0.0, on_tail=told, release=asked
        )
        record.preempted = ran.output
    finally:
        thread.shutdown()
    return record


@dataclass
class Session:
    """What one group session recorded, per job."""

    outputs: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    losses: dict[str, list[float]] = field(default_factory=dict)
    digests: dict[str, tuple[list[str], list[str]]] = field(default_factory=dict)
    swap_kept_state: dict[str, bool] = field(default_factory=dict)
    disk_kept_state: dict[str, bool] = field(default_factory=dict)
    disk_digests: dict[str, tuple[list[str], list[str]]] = field(default_factory=dict)
    final: dict[str, JobTensors] = field(default_factory=dict)
    restored: dict[str, JobTensors] = field(default_factory=dict)
    sampled: Sampled = field(default_factory=Sampled)
    seconds: float = 0.0


def _config(world_size: int, collective_timeout_s: float = 20.0) -> GroupConfig:
    return GroupConfig(
        world_size=world_size,
        start_method="forkserver",
        num_threads=1,
        collective_timeout_s=collective_timeout_s,
    )


def _step(leader: Leader, job: str, outputs: list[torch.Tensor], losses: list[float]) -> None:
    out = leader.forward_backward(job, FB)
    losses.append(out.metrics["loss:sum"])
    outputs.extend(to_tensor(o["logprobs"]) for o in out.loss_fn_outputs)


def _session(
    config: GroupConfig, registry: Path, blobs: Path, name: str, restore_from: str | None
) -> Session:
    """Create, train two steps (swapping out and back in between), snapshot as
    `<name>/<job>`; then restore the snapshots of session `restore_from`, if given (a
    key names its group size), and gather them."""
    record = Session()
    start = time.perf_counter()
    with start_group(config, registry, ENGINE, BlobPlace(directory=blobs)) as leader:
        for job, spec in SPECS.items():
            leader.create(job, spec)
            outputs: list[torch.Tensor] = []
            losses: list[float] = []
            _step(leader, job, outputs, losses)
            leader.optim_step(job, OptimStepInput(adam=ADAM))
            _step(leader, job, outputs, losses)
            # Gradients and moments are both live here: the round trip must keep both.
            before = leader.gather(job)
            first = [r.digest for r in leader.offload(job)]
            leader.onload(job)
            again = [r.digest for r in leader.offload(job)]
            leader.onload(job)
            record.digests[job] = (first, again)
            record.swap_kept_state[job] = _same(before, leader.gather(job))
            # Device -> host -> disk -> device: every rank moves its own shard.
            key = stored.set_key(f"{name}/offload-{job}", config.world_size)
            out = leader.offload(job)
            leader.write_manifest(key, leader.call(calls.SpillCall(job, key)))
            leader.call(calls.FetchCall(job, key))
            back = leader.onload(job)
            record.disk_digests[job] = ([r.digest for r in out], [r.digest for r in back])
            record.disk_kept_state[job] = _same(before, leader.gather(job))
            leader.optim_step(job, OptimStepInput(adam=ADAM))
            _step(leader, job, outputs, losses)
            record.outputs[job], record.losses[job] = outputs, losses
            record.final[job] = leader.gather(job)
            leader.save(job, stored.set_key(f"{name}/{job}", config.world_size))
        if restore_from is not None:
            for job in SPECS:
                (found,) = (blobs / restore_from).glob(f"{job}.ranks*/manifest.json")
                leader.restore(f"{job}-restored", str(found.relative_to(blobs)))
                record.restored[job] = leader.gather(f"{job}-restored")
        record.sampled = asyncio.run(_sample_on(leader))
    record.seconds = time.perf_counter() - start
    return record


def _same(a: JobTensors, b: JobTensors) -> bool:
    return a.tensors.keys() == b.tensors.keys() and all(
        torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors
    )


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = float(b.abs().max()) if b.numel() else 0.0
    return float((a - b).abs().max()) / scale if scale else float((a - b).abs().max())


@pytest.fixture(scope="module")
def sessions(tiny_registry: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Session]:
    """Two 2-rank sessions and one 1-rank session: the 1-rank one restores the first
    pair's snapshots (2 -> 1), the second pair restores the 1-rank's (1 -> 2)."""
    root = tmp_path_factory.mktemp("group")
    engine = TorchEngine(ModelRegistry(tiny_registry), ENGINE)
    engine.create("src", SPECS["lora"])
    sampler = engine.export_state("src", optimizer=False, gradients=False)
    (root / SAMPLER_KEY).parent.mkdir(parents=True)
    (root / SAMPLER_KEY).write_bytes(state_to_bytes(sampler))
    pair = _session(_config(2), tiny_registry, root, "pair", None)
    solo = _session(_config(1), tiny_registry, root, "solo", "pair")
    # Rank 1 joins as a rank on another host would: started on its own, it finds the
    # leader's rendezvous at a fixed address and port (`launch.follow`).
    port = free_port()
    apart = dataclasses.replace(_config(2), local_ranks=1, master_port=port)
    with _rank_on_its_own(1, apart, tiny_registry, root) as remote:
        again = _session(apart, tiny_registry, root, "again", "solo")
    assert remote.wait(timeout=60) == 0  # it left when the leader closed the group
    return {"pair": pair, "solo": solo, "again": again}


@contextlib.contextmanager
def _rank_on_its_own(
    rank: int, config: GroupConfig, registry: Path, blobs: Path
) -> Iterator[subprocess.Popen[bytes]]:
    code = (
        "from pathlib import Path\n"
        "from plexrl_worker.engine import EngineConfig\n"
        "from plexrl_worker.group import GroupConfig\n"
        "from plexrl_worker.group.blobs import BlobPlace\n"
        "from plexrl_worker.group.launch import follow\n"
        f"follow({rank}, {config!r}, Path({str(registry)!r}), {ENGINE!r}, "
        f"BlobPlace(directory=Path({str(blobs)!r})))\n"
    )
    process = subprocess.Popen([sys.executable, "-c", code])
    try:
        yield process
    finally:
        if process.poll() is None:
            process.wait(timeout=60)


@pytest.mark.parametrize("job", list(SPECS))
def test_two_ranks_train_bit_identically_across_runs(
    sessions: dict[str, Session], job: str
) -> None:
    pair, again = sessions["pair"], sessions["again"]
    assert pair.losses[job] == again.losses[job]
    assert all(
        torch.equal(a, b) for a, b in zip(pair.outputs[job], again.outputs[job], strict=True)
    )
    assert _same(pair.final[job], again.final[job])
    assert pair.final[job].steps == 2
    # Training moved the weights (the comparison is not of two untouched states).
    assert pair.losses[job][2] < pair.losses[job][0]


@pytest.mark.parametrize("job", list(SPECS))
def test_two_ranks_agree_with_one_rank_within_tolerance(
    sessions: dict[str, Session], job: str
) -> None:
    pair, solo = sessions["pair"], sessions["solo"]
    assert pair.final[job].tensors.keys() == solo.final[job].tensors.keys()
    worst = max(
        _relative(pair.final[job].tensors[k], solo.final[job].tensors[k])
        for k in solo.final[job].tensors
    )
    assert worst <= TOLERANCE, f"2 ranks differ from 1 by {worst:.2e} (relative)"
    for a, b in zip(pair.outputs[job], solo.outputs[job], strict=True):
        assert _relative(a, b) <= TOLERANCE
    assert pair.losses[job] == pytest.approx(solo.losses[job], rel=TOLERANCE)


@pytest.mark.parametrize("job", list(SPECS))
def test_one_rank_group_agrees_with_the_one_device_engine(
    sessions: dict[str, Session], tiny_registry: Path, job: str
) -> None:
    engine = TorchEngine(ModelRegistry(tiny_registry), ENGINE)
    engine.create(job, SPECS[job])
    losses = []
    for step in range(3):
        losses.append(engine.forward_backward(job, FB).metrics["loss:sum"])
        if step < 2:
            engine.optim_step(job, OptimStepInput(adam=ADAM))
    expected = engine.export_state(job, optimizer=True, gradients=True)
    solo = sessions["solo"].final[job]
    assert solo.tensors.keys() == expected.tensors.keys()
    worst = max(_relative(solo.tensors[k], expected.tensors[k]) for k in expected.tensors)
    assert worst <= TOLERANCE, f"1 rank differs from the engine by {worst:.2e} (relative)"
    assert sessions["solo"].losses[job] == pytest.approx(losses, rel=TOLERANCE)


@pytest.mark.parametrize("job", list(SPECS))
def test_per_shard_swap_round_trip_keeps_every_byte(sessions: dict[str, Session], job: str) -> None:
    for name in ("pair", "solo"):
        first, again = sessions[name].digests[job]
        assert first == again
        assert len(set(first)) == len(first)  # each rank moved its own shard
        assert sessions[name].swap_kept_state[job]


@pytest.mark.parametrize("job", list(SPECS))
def test_per_shard_round_trip_through_the_disk_tier_keeps_every_byte(
    sessions: dict[str, Session], job: str
) -> None:
    for name in ("pair", "solo"):
        out, back = sessions[name].disk_digests[job]
        assert out == back and len(set(out)) == len(out)
        assert sessions[name].disk_kept_state[job]


def test_sampling_on_a_group_is_the_one_device_engines_co_batched_and_released_at_its_tail(
    sessions: dict[str, Session], tiny_registry: Path
) -> None:
    # One thread, as each rank runs: attention's sums split over threads round otherwise.
    threads = torch.get_num_threads()
    engine = TorchEngine(ModelRegistry(tiny_registry), dataclasses.replace(ENGINE, num_threads=1))
    try:
        engine.create("src", SPECS["lora"])
        state = engine.export_state("src", optimizer=False, gradients=False)
        engine.install_sampler("sampler", state)
        engine.drop("src")
        alone = []
        for call in SAMPLE_CALLS:
            inp = call.payload
            assert isinstance(inp, SampleInput)
            alone.append(engine.sample(inp.weights_path or f"base:{MODEL}", inp))
    finally:
        torch.set_num_threads(threads)
    for name in ("pair", "solo", "again"):
        sampled = sessions[name].sampled
        # Each call's samples, split over the ranks and co-batched with the others, are
        # bit for bit what one device samples for it alone.
        assert sampled.outputs == alone, name
        # Released once, with the long call in its tail (each rank admits rows into its
        # own batch, so which short calls are still going then depends on the group).
        ((running, remaining, total),) = sampled.tails
        assert 3 in running and remaining < 0.25 * total and total == 10, name
        assert sampled.released[3] and not sampled.released[0], name
        # Preempted (asked to yield before its first step): told at once, same samples.
        assert sampled.preempt_told == [([0], 1, 1)] and sampled.preempted == alone[3], name


@pytest.mark.parametrize("job", list(SPECS))
def test_snapshots_restore_onto_another_group_size(sessions: dict[str, Session], job: str) -> None:
    # 2 ranks -> 1 rank, and 1 rank -> 2 ranks: the same whole state, bit for bit.
    assert _same(sessions["solo"].restored[job], sessions["pair"].final[job])
    assert _same(sessions["again"].restored[job], sessions["solo"].final[job])


def test_the_worker_settings_describe_a_group_across_hosts() -> None:
    from plexrl.settings import WorkerSettings
    from plexrl_worker.components import group_config, rank_devices

    settings = WorkerSettings(
        worker_ranks=4, worker_local_ranks=2, worker_rendezvous_port=29500, worker_threads=1
    )
    config = group_config(settings)
    assert (config.world_size, config.started_here, config.master_port) == (4, 2, 29500)
    assert config.backend == "gloo" and rank_devices(settings) == ["cpu"] * 4
    with pytest.raises(ValueError, match="PLEXRL_WORKER_RENDEZVOUS_PORT"):
        group_config(WorkerSettings(worker_ranks=4, worker_local_ranks=2))
    assert rank_devices(WorkerSettings()) == ["cpu"]


def test_bad_input_is_refused_by_every_rank_and_the_group_goes_on(tiny_registry: Path) -> None:
    with start_group(_config(2), tiny_registry, ENGINE) as leader:
        with pytest.raises(GroupCallError, match="no state for 'nobody'"):
            leader.optim_step("nobody", OptimStepInput(adam=ADAM))
        leader.create("lora", SPECS["lora"])
        with pytest.raises(GroupCallError, match="learning_rate"):
            leader.optim_step("lora", OptimStepInput(adam=AdamParams(learning_rate=-1.0)))
        assert leader.forward_backward("lora", FB).metrics["tokens:sum"] == 28.0


def test_a_call_run_a_micro_batch_at_a_time_on_the_ranks_is_the_whole_call(
    tiny_registry: Path,
) -> None:
    # At 12 tokens a micro-batch rank 0 has two, rank 1 one and an idle one: every slice
    # is run by every rank in step. Between two, another job trains (its own
    # collectives) and the sliced job cannot leave the device. Two jobs alike: one runs
    # the call whole.
    engine = dataclasses.replace(ENGINE, max_batch_tokens=12)
    with start_group(_config(2), tiny_registry, engine) as leader:
        for job in ("whole", "sliced"):
            leader.create(job, SPECS["lora"])
        leader.create("full", SPECS["full"])
        whole = leader.forward_backward("whole", FB)
        assert leader.begin_training("sliced", FB) == 2
        leader.training_slice("sliced")
        leader.forward_backward("full", FB)
        with pytest.raises(GroupCallError, match="between two slices"):
            leader.offload("sliced")
        leader.training_slice("sliced")
        with pytest.raises(GroupCallError, match="no forward_backward slice left"):
            leader.training_slice("sliced")
        split = leader.finish_training("sliced")
        grads = {
            job: [
                state_from_bytes(r.data).tensors
                for r in leader.call(calls.GatherCall(job, optimizer=False, gradients=True))
                if isinstance(r, calls.StateReply)
            ]
            for job in ("whole", "sliced")
        }
    assert split.metrics == whole.metrics
    for a, b in zip(whole.loss_fn_outputs, split.loss_fn_outputs, strict=True):
        assert torch.equal(to_tensor(a["logprobs"]), to_tensor(b["logprobs"]))
    for mine, theirs in zip(grads["whole"], grads["sliced"], strict=True):
        assert sorted(mine) == sorted(theirs) and any("grad" in k for k in mine)
        assert all(torch.equal(mine[k], theirs[k]) for k in mine)


@pytest.fixture
def doomed_group(tiny_registry: Path) -> Iterator[Leader]:
    leader = start_group(_config(2, collective_timeout_s=10.0), tiny_registry, ENGINE)
    yield leader
    leader.close()


def test_killing_a_rank_mid_call_raises_on_the_leader_within_bounds(
    doomed_group: Leader,
) -> None:
    leader = doomed_group
    leader.create("full", SPECS["full"])
    leader.forward_backward("full", FB)
    (pid,) = leader.follower_pids
    killed_at: list[float] = []

    def kill() -> None:
        killed_at.append(time.monotonic())
        os.kill(pid, signal.SIGKILL)

    timer = threading.Timer(0.3, kill)
    timer.start()
    with pytest.raises(RankLostError) as caught:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            leader.forward_backward("full", FB)
    timer.join()
    waited = time.monotonic() - killed_at[0]
    assert waited < 10.0, f"the leader took {waited:.1f}s to notice"
    assert "rank 1" in str(caught.value) and "signal 9" in str(caught.value)
    with pytest.raises(RankLostError):  # broken for good, at once
        leader.forward_backward("full", FB)


@pytest.mark.gpu
@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL ranks on cuda:0, cuda:1)"
)
def test_two_cuda_ranks_train_and_reshard(
    tiny_registry: Path, tmp_path: Path, sessions: dict[str, Session]
) -> None:
    config = GroupConfig(world_size=2, device_type="cuda", start_method="spawn")
    cuda = _session(config, tiny_registry, tmp_path, "cuda", None)
    for job in SPECS:
        assert cuda.digests[job][0] == cuda.digests[job][1]
        worst = max(
            _relative(cuda.final[job].tensors[k], sessions["pair"].final[job].tensors[k])
            for k in cuda.final[job].tensors
        )
        assert worst < 1e-3  # other kernels than the CPU's
