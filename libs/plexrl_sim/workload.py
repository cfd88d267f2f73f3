"""The workload a simulation runs: cluster, job profiles, and either a generated trace or
named jobs on named workers (the small setting). Read from YAML by `load_workload`.

A job is a sequence of training steps. Each step is

    sample (dense part, whole group) -> straggler tail -> reward / tool stall
      -> forward_backward x fb_calls -> optim_step -> save (weights for the sampler)
      -> host-side gap (data, logging)

with every duration drawn per step from the job's profile, once per seed, so every
deployment of one seed sees exactly the same steps (common random numbers).
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import yaml

from plexrl.policy import SwapCosts
from plexrl.policy.costs import SharingCosts

PARTITIONS = ("auto", "dedicated", "shared", "packed")
"""How the GPUs may be split into groups per model size (`ClusterSpec.partition`)."""

# Sizes ------------------------------------------------------------------------------------

_UNITS = {
    "": 1.0,
    "B": 1.0,
    "KB": 1e3,
    "MB": 1e6,
    "GB": 1e9,
    "TB": 1e12,
    "KIB": 2.0**10,
    "MIB": 2.0**20,
    "GIB": 2.0**30,
    "TIB": 2.0**40,
}
_SIZE = re.compile(r"^\s*([0-9.eE+-]+)\s*([A-Za-z]*)\s*(/\s*s)?\s*$")


def nbytes(value: float | int | str) -> float:
    """A byte count (or bytes/s) from a number or a string like '40 GB', '1.5TiB', '50 GB/s'."""
    if isinstance(value, int | float):
        return float(value)
    match = _SIZE.match(value)
    if match is None or match.group(2).upper() not in _UNITS:
        raise ValueError(
            f"cannot read {value!r} as a size; write a number of bytes or e.g. '40 GB', "
            f"'1.5 TiB', '50 GB/s'"
        )
    return float(match.group(1)) * _UNITS[match.group(2).upper()]


Size = float | int | str


# Schema (what the YAML may say) -----------------------------------------------------------


class Dist(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A lognormal duration: `median * exp(sigma * N(0, 1))`, clipped to [min, max]."""

    median: float
    sigma: float = 0.0
    min: float = 0.0
    max: float = math.inf

    def mean(self) -> float:
        return self.median * math.exp(self.sigma**2 / 2)

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.sigma == 0:
            values = np.full(n, self.median, dtype=float)
        else:
            values = self.median * np.exp(self.sigma * rng.standard_normal(n))
        return np.clip(values, self.min, self.max)


DistLike = float | Dist


def as_dist(value: DistLike) -> Dist:
    return value if isinstance(value, Dist) else Dist(median=float(value))


class Lengths(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Response lengths of one rollout batch and the decode speed that turns them into time."""

    batch_size: int
    """Sequences per rollout batch."""
    median_tokens: float
    """Median response length."""
    sigma: float
    """Lognormal shape of response lengths; 0.8-1.2 gives RLVR's long tail."""
    max_tokens: int
    """The job's response-length cap (responses are truncated there)."""
    decode_s_per_token: float
    """Seconds per decode step of the whole batch on the job's devices."""
    prefill_s: float = 0.0
    """Prompt processing before decoding, seconds."""


class Rollout(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How long a step's `sample` takes: from response lengths, or given directly."""

    lengths: Lengths | None = None
    sample_s: DistLike | None = None
    """Seconds of the dense part when not derived from `lengths` (the small setting)."""
    tail_s: DistLike = 0.0
    """Seconds of the straggler tail when not derived from `lengths`."""
    dense_util: float = 1.0
    """Fraction of the group's devices doing useful work in the dense part (given form)."""
    tail_util: float = 0.0
    """Fraction of the group the stragglers use in the tail (given form)."""
    tail_threshold: float = 0.0
    """When fewer than this fraction of the batch's sequences are still decoding, the
    group is released to other jobs and the stragglers finish in the background (0: the
    sample call holds the group until its last sequence, as the reference system does).
    Deployments named `<policy>+tail` override it with `TAIL_RELEASE`."""


class SplitAsync(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The disaggregated asynchronous layout of the job (the Split-Async deployment)."""

    rollout_fraction: float | None = None
    """Share of the job's devices in the rollout pool; the rest train. None (the
    default): for each job the split that minimises its run time, found by search over
    every whole number of rollout devices (the baseline is tuned, not strawmanned)."""
    sync_s: float = 10.0
    """Seconds to broadcast new weights from the trainer pool to the rollout pool."""
    staleness: int = 1
    """Rollouts may use weights this many steps old (0: synchronous; 1-2 is what
    asynchronous RLVR systems run)."""
    scoring: str = "rollout"
    """Where reward scoring and tool stalls sit: `rollout` (the documented model: the
    rollout pool waits for its batch's scores and tool results before it generates
    again) or `scorer` (a reward service off the accelerators scores batch k while the
    rollout pool generates batch k+1, as disaggregated deployments can place it)."""
    partial_rollouts: bool = False
    """Partial rollouts: the engine keeps its batch full, carrying unfinished sequences
    into the next iteration (at most `staleness` iterations later), so a rollout
    iteration is throughput-bound: its tokens at full-batch speed, but never shorter
    than the longest response's decode time over `staleness + 1` iterations."""


class Colocated(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The colocated layout: rollout and training on the same devices, one after the other."""

    rollout_slowdown: float = 1.0
    """Dense rollout time multiplier from running rollout at training's data-parallel width."""
    switch_s: float = 0.0
    """Seconds per step to switch the devices between the trainer and the rollout engine
    (offload/onload, resharding), both ways together."""


class Profile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One kind of job (usually one model size)."""

    devices: int
    """Accelerators the job needs (its dedicated pool; the size of its group)."""
    state_bytes: Size
    """Movable training state on the group: weights, optimizer, gradients."""
    rollout: Rollout
    train_s: DistLike
    """forward_backward seconds of one step (all micro-batches) at the profile's mean
    response length; scaled per step by that step's mean length."""
    reward_s: DistLike = 0.0
    """Reward computation and tool / sandbox stalls after the rollout (off the devices)."""
    fb_calls: int = 1
    """forward_backward calls per step (micro-batches the client sends)."""
    fb_slices: int = 1
    """Slices of one forward_backward call the worker can pause between (its micro-
    batches, run one by one): an asynchronous job's training then yields to another
    job's waiting sample at the next slice (`plexrl.policy.preempt`). 1: a call runs
    whole (the live worker's behaviour)."""
    train_util: float = 1.0
    """Fraction of the devices busy during forward_backward / optim_step (pipeline bubbles
    and communication are idle time)."""
    optim_s: float = 0.0
    save_s: float = 0.0
    """save_weights_for_sampler: the new weights become the sampler's."""
    save_util: float = 1.0
    misc_s: DistLike = 0.0
    """Host-side gap per step: data loading, logging, evaluation."""
    create_s: float = 0.0
    """Creating the job's state on its group (loading the base checkpoint)."""
    staleness: int = 0
    """The job's own loop (its client), on a shared group and on its own (Isolated): 0,
    synchronous (each step samples with the weights the previous step saved); k >= 1,
    asynchronous: the next rollout is sampled as soon as the last one is scored, with
    sampler weights at most k steps older than the newest, while the job trains on the
    rollout before it (the rollout waits for its scores, as Split-Async's pool does)."""
    sampler_bytes: Size | None = None
    """Bytes a sampling engine loads to sample the job's saved weights on another group
    (`plexrl.policy.roam`); default: an eighth of `state_bytes` (bf16 weights of a
    16-byte-per-parameter training state)."""
    split: SplitAsync = SplitAsync()
    colocated: Colocated = Colocated()


class SwapSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Per-device tier bandwidths (a group moves its shards in parallel, so a group's
    bandwidth is this times its devices)."""

    device_host_bytes_per_s: Size = "50 GB/s"
    """PCIe Gen5 x16, effective, per accelerator."""
    host_disk_bytes_per_s: Size = "3 GB/s"
    """The node's NVMe share per accelerator (about 25 GB/s per 8-GPU node)."""
    fixed_s: float = 0.5
    """Per move: allocator, engine memory release / resume, communicator re-init."""


class CoLocation(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What sharing a group costs beyond the swaps (`SwapCosts`), as the workload sets it:
    the figures of `plexrl.policy.costs.SharingCosts` (see there what each means), which
    the executor charges and the policy predicts with. `bench/sim_tail_sensitivity.py`
    sweeps the two that the tail release rests on."""

    switch_s: float = 1.0
    """Seconds a group spends when a Run's job is not the job of its previous Run, with
    both states already on the device (engine sleep / wake, KV cache handed over)."""
    tail_min_share: float = 0.25
    """The least share of the group a rollout's stragglers hold beside a Run."""
    tail_contention: float = 1.25
    """How many times slower a straggler tail decodes beside a Run; 1.0: none."""
    contention_while: str = "run"
    """`run`: the tail costs apply while a Run is in flight on the group; `shared`: for
    the whole tail whenever another job is homed there (a pessimistic bound)."""

    def costs(self) -> SharingCosts:
        return SharingCosts(
            self.switch_s, self.tail_min_share, self.tail_contention, self.contention_while
        )

    def validate(self) -> None:
        try:
            self.costs()
        except ValueError as err:
            raise ValueError(f"cluster.colocation: {err}") from None


class ClusterSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    gpus: int = 2048
    device_bytes_per_gpu: Size = "80 GB"
    """HBM per GPU for job states (of an H200's 141 GB; the rest is KV cache,
    activations and the runtime)."""
    host_bytes_per_gpu: Size = "200 GB"
    """Pinned host memory per GPU for parked states."""
    swap: SwapSpec = SwapSpec()
    groups: dict[str, int] | None = None
    """Groups per profile; by default the GPUs are split by each profile's expected demand."""
    partition: str = "dedicated"
    """How the default split weighs demand: `dedicated` (device-seconds of whole runs;
    every deployment on the same layout), `shared` (device-seconds the jobs' calls hold
    a group: a layout for a cluster that multiplexes), `auto` (dedicated for Isolated,
    Colocated and Split-Async, shared for the policies), or `packed` (dedicated for
    those, and for the policies each job's whole run over the jobs a group is predicted
    to hold within the slowdown budget: `plexrl_sim.packing`)."""
    colocation: CoLocation = CoLocation()
    """Costs of sharing a group (engine switches, the stragglers' memory and contention)."""


class WorkerSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A named worker group of the small setting, with its measured bandwidths."""

    id: str
    device_bytes: Size
    host_bytes: Size
    device_host_bytes_per_s: Size
    host_disk_bytes_per_s: Size
    devices: int = 1
    fixed_s: float = 0.0


class TraceSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A generated arrival trace."""

    days: float
    """Arrival window."""
    jobs: int
    """Jobs arriving in the window."""
    mix: dict[str, float]
    """Profile name -> share of jobs."""
    steps: DistLike = 100.0
    """Training steps per job."""
    steps_by_profile: dict[str, DistLike] = {}
    """Training steps per job for the profiles named here (instead of `steps`)."""
    stall_scale: DistLike = 1.0
    """Per-job multiplier of the profile's reward / tool stall (math verifiers are quick,
    agentic sandboxes slow)."""
    diurnal: float = 0.0
    """Amplitude (0-1) of the daily cycle in the arrival rate."""
    weekend: float = 1.0
    """Weekend arrival rate relative to weekdays."""
    front_load: float = 1.0
    """Arrival rate at the start of the window relative to its end (a research push)."""
    declared_error: float = 0.0
    """How far the steps each job declares (`JobView.declared_steps`, what admission
    orders by) are off its real steps: the sigma of a lognormal factor, drawn per job
    (0: every job declares its steps exactly)."""


PHYSICAL_TAIL = 0.25
"""Where a rollout stops being throughput-bound: after 75% of the sequences finish,
decoding is latency-bound, so more devices no longer shorten it. Used to rescale
rollouts to another pool width (Split-Async's rollout pool, Colocated's training width)."""

TAIL_RELEASE = PHYSICAL_TAIL
"""The early tail release of `<policy>+tail` deployments: the group is handed to other
jobs once 75% of a rollout's sequences have finished, where decoding turns
latency-bound (`PHYSICAL_TAIL`): the stragglers then use a small share of the group
(their fraction of the batch), and keeping the whole group for them idles the rest."""


class JobDecl(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A named job of the small setting."""

    id: str
    profile: str
    steps: int
    arrival_s: float = 0.0
    stall_scale: float = 1.0


class Reference(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The paper's figures this workload is compared against in the report."""

    bubble: dict[str, float] = {}
    savings_vs_split_async: dict[str, float] = {}
    makespan_vs_isolated: dict[str, float] = {}


class Estimates(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How the simulated scheduler learns a job from its calls (`plexrl.policy.history`,
    the live scheduler's rules)."""

    min_history_s: float = 1800.0
    """Seconds a job must have been homed before its measured duty cycle is used; until
    then it borrows its kind's figures. The live scheduler's 5 s span two steps of the
    demo's jobs; 30 min spans two to four steps of the H200 profiles' jobs."""


class Workload(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    profiles: dict[str, Profile]
    description: str = ""
    cluster: ClusterSpec = ClusterSpec()
    workers: list[WorkerSpec] = []
    """Named workers (small setting); when given, `cluster` only supplies defaults."""
    trace: TraceSpec | None = None
    jobs: list[JobDecl] = []
    """Named jobs (small setting); used instead of, or besides, the trace."""
    policy: dict[str, float | int | bool] = {}
    """PolicyConfig overrides for every PlexRL deployment (e.g. max_load)."""
    estimates: Estimates = Estimates()
    reference: Reference = Reference()

    def validate(self) -> None:
        if self.cluster.partition not in PARTITIONS:
            raise ValueError(
                f"cluster.partition is {self.cluster.partition!r}; use one of "
                f"{', '.join(PARTITIONS)}"
            )
        self.cluster.colocation.validate()
        if self.trace is None and not self.jobs:
            raise ValueError(f"workload {self.name!r} has neither a trace nor jobs; add one")
        names = set(self.profiles)
        for decl in self.jobs:
            if decl.profile not in names:
                raise ValueError(
                    f"job {decl.id!r} uses profile {decl.profile!r}; known: {sorted(names)}"
                )
        if self.trace is not None:
            unknown = set(self.trace.mix) - names
            if unknown:
                raise ValueError(f"trace mix names unknown profiles {sorted(unknown)}")
            stray = set(self.trace.steps_by_profile) - names
            if stray:
                raise ValueError(f"trace steps_by_profile names unknown profiles {sorted(stray)}")
            if abs(sum(self.trace.mix.values()) - 1.0) > 1e-6:
                raise ValueError(
                    f"trace mix shares sum to {sum(self.trace.mix.values())}; make them sum to 1"
                )
        for name, p in self.profiles.items():
            r = p.rollout
            if (r.lengths is None) == (r.sample_s is None):
                raise ValueError(
                    f"profile {name!r}: give the rollout either `lengths` or `sample_s`"
                )
            frac = p.split.rollout_fraction
            if frac is not None and not 0 < frac < 1:
                raise ValueError(
                    f"profile {name!r}: split.rollout_fraction is {frac}; it must be between "
                    f"0 and 1, or left out to search the best split per job"
                )
            if p.split.scoring not in ("scorer", "rollout"):
                raise ValueError(
                    f"profile {name!r}: split.scoring is {p.split.scoring!r}; use `scorer` "
                    f"(a reward service beside the pools) or `rollout` (the rollout pool waits)"
                )
            if not 0 <= p.split.staleness <= 8:
                raise ValueError(
                    f"profile {name!r}: split.staleness is {p.split.staleness}; use 0 to 8 steps"
                )
            if not 0 <= p.staleness <= 8:
                raise ValueError(
                    f"profile {name!r}: staleness is {p.staleness}; use 0 (synchronous) to 8 steps"
                )
            if p.devices < 1 or p.fb_calls < 1 or p.fb_slices < 1:
                raise ValueError(
                    f"profile {name!r}: devices, fb_calls and fb_slices must be at least 1"
                )


def with_fb_slices(workload: Workload, slices: int) -> Workload:
    """The workload with every job's forward_backward run in `slices` slices."""
    if slices < 1:
        raise ValueError(f"fb slices is {slices}; use 1 (whole calls) or more")
    profiles = {
        name: msgspec.structs.replace(p, fb_slices=slices) for name, p in workload.profiles.items()
    }
    return msgspec.structs.replace(workload, profiles=profiles)


def at_staleness(workload: Workload, staleness: int) -> Workload:
    """The workload with every job running its loop at `staleness` (0: synchronous) and,
    from 1 on, Split-Async at the same staleness: the comparison like for like."""
    if not 0 <= staleness <= 8:
        raise ValueError(f"staleness is {staleness}; use 0 (synchronous) to 8 steps")
    profiles = {}
    for name, p in workload.profiles.items():
        split = msgspec.structs.replace(p.split, staleness=staleness) if staleness else p.split
        profiles[name] = msgspec.structs.replace(p, staleness=staleness, split=split)
    return msgspec.structs.replace(workload, profiles=profiles)


def parse_colocation(text: str) -> dict[str, float | str]:
    """`CoLocation` fields from `key=value,key=value` (`switch_s=0,tail_contention=1`):
    numbers but for `contention_while`. Raises ValueError naming what is wrong."""
    fields = set(CoLocation.__struct_fields__)
    out: dict[str, float | str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in fields:
            raise ValueError(
                f"colocation {item!r}: use key=value with a key of {', '.join(sorted(fields))}"
            )
        try:
            out[key] = value.strip() if key == "contention_while" else float(value)
        except ValueError:
            raise ValueError(f"colocation {item!r}: {key} takes a number") from None
    return out


def with_colocation(workload: Workload, overrides: dict[str, float | str]) -> Workload:
    """The workload with the costs of sharing in `overrides` instead of its own (a
    control: what the shared deployments measure were sharing that cheap)."""
    colocation = msgspec.convert(
        {**msgspec.to_builtins(workload.cluster.colocation), **overrides}, CoLocation
    )
    colocation.validate()
    cluster = msgspec.structs.replace(workload.cluster, colocation=colocation)
    return msgspec.structs.replace(workload, cluster=cluster)


def with_declared_error(workload: Workload, sigma: float) -> Workload:
    """The workload with its trace's jobs declaring their steps off by a lognormal
    factor of `sigma` (`TraceSpec.declared_error`)."""
    if sigma < 0:
        raise ValueError(f"declared error is {sigma}; use 0 (exact) or more (0.5: a factor e^0.5)")
    if workload.trace is None:
        return workload
    return msgspec.structs.replace(
        workload, trace=msgspec.structs.replace(workload.trace, declared_error=sigma)
    )


def load_workload(path: str | Path) -> Workload:
    """Read and check a workload YAML; errors name the field and what to change.

    `profiles_from: other.yaml` (relative to this file) takes that file's profiles;
    profiles named here replace those of the same name.
    """
    path = Path(path)
    raw: Any = yaml.safe_load(path.read_text())
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    base = raw.pop("profiles_from", None)
    if base is not None:
        other: Any = yaml.safe_load((path.parent / str(base)).read_text())
        raw["profiles"] = {**(other or {}).get("profiles", {}), **(raw.get("profiles") or {})}
    try:
        workload = msgspec.convert(raw, Workload)
    except msgspec.ValidationError as err:
        raise ValueError(f"{path}: {err}") from None
    workload.validate()
    return workload


# Jobs and their steps ---------------------------------------------------------------------


@dataclass(frozen=True)
class JobSpec:
    job_id: str
    profile: str
    arrival_s: float
    steps: int
    stall_scale: float
    index: int
    """Position in the workload; with the seed it fixes the job's random draws."""
    declared_steps: int = 0
    """The steps it declares (`JobView.declared_steps`): its steps, off by the trace's
    `declared_error`; 0: none declared."""


@dataclass(frozen=True)
class Steps:
    """One job's per-step durations (seconds) and device work (group-seconds: seconds
    times the fraction of the group's devices doing useful work)."""

    dense_s: np.ndarray
    """The part of `sample` that holds the whole group."""
    dense_work: np.ndarray
    tail_s: np.ndarray
    """The straggler part of `sample`, decoded in the background once the group is released."""
    tail_work: np.ndarray
    scalable_s: np.ndarray
    """The throughput-bound part of the rollout (whatever the release point): it shrinks
    or grows with the rollout's device count; the rest is latency-bound."""
    reward_s: np.ndarray
    fb_s: np.ndarray
    """All forward_backward calls of the step together."""
    optim_s: float
    save_s: float
    misc_s: np.ndarray
    create_s: float
    train_util: float
    save_util: float
    fb_calls: int
    staleness: int = 0
    fb_slices: int = 1
    """The job's loop (`Profile.staleness`): 0 synchronous, k asynchronous."""

    @property
    def n(self) -> int:
        return len(self.dense_s)

    @cached_property
    def train_work(self) -> np.ndarray:
        return (self.fb_s + self.optim_s) * self.train_util + self.save_s * self.save_util

    @cached_property
    def useful_work(self) -> np.ndarray:
        """Group-seconds of useful device work per step (same in every deployment)."""
        return self.dense_work + self.tail_work + self.train_work

    @cached_property
    def isolated_step_s(self) -> np.ndarray:
        """Step time on a dedicated group, nothing else on it."""
        return (
            self.dense_s
            + self.tail_s
            + self.reward_s
            + self.fb_s
            + self.optim_s
            + self.save_s
            + self.misc_s
        )

    @cached_property
    def exclusive_s(self) -> np.ndarray:
        """Seconds per step the job holds its group exclusively (its calls)."""
        return self.dense_s + self.fb_s + self.optim_s + self.save_s


def _stable_seed(*parts: int | str) -> list[int]:
    return [p if isinstance(p, int) else zlib.crc32(p.encode()) for p in parts]


@dataclass(frozen=True)
class _RolloutTable:
    dense_s: np.ndarray
    dense_work: np.ndarray
    tail_s: np.ndarray
    tail_work: np.ndarray
    scalable_s: np.ndarray
    mean_len: np.ndarray


_TABLE_SIZE = 512


def _split(
    lens: np.ndarray, threshold: float, t: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Seconds and group-seconds of work before and after the point where fewer than
    `threshold` of each (sorted) batch's sequences are still decoding."""
    n, b = lens.shape
    keep = b - math.ceil(threshold * b)
    cut = lens[:, keep - 1] if keep >= 1 else np.zeros(n)
    dense_tokens = np.minimum(lens, cut[:, None]).sum(axis=1) / b
    tail_tokens = np.maximum(lens - cut[:, None], 0).sum(axis=1) / b
    return t * cut, t * dense_tokens, t * (lens[:, -1] - cut), t * tail_tokens


def _rollout_table(profile: Profile, name: str, seed: int, release: float) -> _RolloutTable:
    """Stats of `_TABLE_SIZE` sampled rollout batches; steps draw batches from it. Every
    decode step of the batch takes the same time; the fraction of sequences still
    decoding is the fraction of the group doing useful work."""
    lengths = profile.rollout.lengths
    assert lengths is not None
    rng = np.random.default_rng(_stable_seed(seed, "rollout", name))
    n, b = _TABLE_SIZE, lengths.batch_size
    raw = lengths.median_tokens * np.exp(lengths.sigma * rng.standard_normal((n, b)))
    lens = np.clip(np.ceil(raw), 1, lengths.max_tokens)
    lens.sort(axis=1)
    t, prefill = lengths.decode_s_per_token, lengths.prefill_s
    dense_s, dense_work, tail_s, tail_work = _split(lens, release, t)
    scalable_s = _split(lens, PHYSICAL_TAIL, t)[0]
    return _RolloutTable(
        dense_s=prefill + dense_s,
        dense_work=prefill + dense_work,
        tail_s=tail_s,
        tail_work=tail_work,
        scalable_s=prefill + scalable_s,
        mean_len=lens.mean(axis=1),
    )


class JobFactory:
    """Draws every job's steps for one workload and seed; the same answer every time.

    `tail_release` overrides every profile's `rollout.tail_threshold` (the `+tail`
    deployments); it changes only where a rollout releases its group, never a duration.
    """

    def __init__(
        self,
        workload: Workload,
        seed: int,
        tail_release: float | None = None,
        family: dict[float | None, JobFactory] | None = None,
    ) -> None:
        self.workload = workload
        self.seed = seed
        self.tail_release = tail_release
        self._tables: dict[str, _RolloutTable] = {}
        self._family = family if family is not None else {}
        """The factories of this workload and seed, by release: each draws its rollout
        tables once (512 batches per profile), however often a variant is asked for."""
        self._family.setdefault(tail_release, self)
        self.memo: dict[tuple[object, ...], float] = {}
        """A figure per job computed once per factory (`dedicated.alone_reference_s`)."""

    def with_tail_release(self, release: float | None) -> JobFactory:
        found = self._family.get(release)
        if found is None:
            found = JobFactory(self.workload, self.seed, release, self._family)
        return found

    def _table(self, name: str) -> _RolloutTable:
        if name not in self._tables:
            profile = self.workload.profiles[name]
            release = (
                self.tail_release
                if self.tail_release is not None
                else profile.rollout.tail_threshold
            )
            self._tables[name] = _rollout_table(profile, name, self.seed, release)
        return self._tables[name]

    def steps(self, job: JobSpec) -> Steps:
        p = self.workload.profiles[job.profile]
        rng = np.random.default_rng(_stable_seed(self.seed, "steps", job.index))
        n = job.steps
        r = p.rollout
        if r.lengths is not None:
            table = self._table(job.profile)
            pick = rng.integers(0, _TABLE_SIZE, n)
            dense_s, dense_work = table.dense_s[pick], table.dense_work[pick]
            tail_s, tail_work = table.tail_s[pick], table.tail_work[pick]
            scalable_s = table.scalable_s[pick]
            token_scale = table.mean_len[pick] / table.mean_len.mean()
        else:
            assert r.sample_s is not None
            dense_s = as_dist(r.sample_s).draw(rng, n)
            dense_work = dense_s * r.dense_util
            tail_s = as_dist(r.tail_s).draw(rng, n)
            tail_work = tail_s * r.tail_util
            scalable_s = dense_s
            token_scale = np.ones(n)
            release = self.tail_release if self.tail_release is not None else r.tail_threshold
            if release <= 0:
                # The engine holds the group to the last sequence: the tail is exclusive.
                dense_s, dense_work = dense_s + tail_s, dense_work + tail_work
                tail_s, tail_work = np.zeros(n), np.zeros(n)
        reward = as_dist(p.reward_s).draw(rng, n) * job.stall_scale
        fb = as_dist(p.train_s).draw(rng, n) * token_scale
        misc = as_dist(p.misc_s).draw(rng, n)
        return Steps(
            dense_s=dense_s,
            dense_work=dense_work,
            tail_s=tail_s,
            tail_work=tail_work,
            scalable_s=scalable_s,
            reward_s=reward,
            fb_s=fb,
            optim_s=p.optim_s,
            save_s=p.save_s,
            misc_s=misc,
            create_s=p.create_s,
            train_util=p.train_util,
            save_util=p.save_util,
            fb_calls=p.fb_calls,
            staleness=p.staleness,
            fb_slices=p.fb_slices,
        )

    def expected_isolated_step_s(self, name: str) -> float:
        """Mean dedicated step time of a profile (for sizing groups and arrivals)."""
        p = self.workload.profiles[name]
        if p.rollout.lengths is not None:
            table = self._table(name)
            rollout = float((table.dense_s + table.tail_s).mean())
        else:
            assert p.rollout.sample_s is not None
            rollout = as_dist(p.rollout.sample_s).mean() + as_dist(p.rollout.tail_s).mean()
        return (
            rollout
            + as_dist(p.reward_s).mean()
            + as_dist(p.train_s).mean()
            + p.optim_s
            + p.save_s
            + as_dist(p.misc_s).mean()
        )

    def jobs(self, days: float | None = None, jobs: int | None = None) -> list[JobSpec]:
        """The named jobs, then the trace's (window and count optionally overridden; a new
        window keeps the arrival rate unless `jobs` is given too)."""
        out = [
            JobSpec(d.id, d.profile, d.arrival_s, d.steps, d.stall_scale, i, d.steps)
            for i, d in enumerate(self.workload.jobs)
        ]
        trace = self.workload.trace
        if trace is None:
            return out
        window = days if days is not None else trace.days
        count = jobs if jobs is not None else round(trace.jobs * window / trace.days)
        rng = np.random.default_rng(_stable_seed(self.seed, "trace"))
        arrivals = _arrivals(rng, count, window, trace)
        names = sorted(trace.mix)
        shares = np.array([trace.mix[k] for k in names])
        kinds = rng.choice(len(names), size=count, p=shares / shares.sum())
        steps = np.ones(count, dtype=int)
        for k, name in enumerate(names):
            dist = trace.steps_by_profile.get(name, trace.steps)
            draws = np.maximum(np.round(as_dist(dist).draw(rng, count)), 1).astype(int)
            steps = np.where(kinds == k, draws, steps)
        stall = as_dist(trace.stall_scale).draw(rng, count)
        # Its own stream: the error leaves every other draw of the trace as it was.
        errors = np.random.default_rng(_stable_seed(self.seed, "declared")).normal(size=count)
        declared = np.maximum(np.round(steps * np.exp(trace.declared_error * errors)), 1)
        base = len(out)
        for i in range(count):
            out.append(
                JobSpec(
                    job_id=f"j{i:04d}-{names[kinds[i]]}",
                    profile=names[kinds[i]],
                    arrival_s=float(arrivals[i]),
                    steps=int(steps[i]),
                    stall_scale=float(stall[i]),
                    index=base + i,
                    declared_steps=int(declared[i]),
                )
            )
        return out


def _arrivals(rng: np.random.Generator, n: int, days: float, trace: TraceSpec) -> np.ndarray:
    """n arrival times in [0, days) from a rate with a front-loaded trend, a daily cycle
    and weekends (sorted; drawn by rejection from the rate's shape)."""
    if n == 0:
        return np.zeros(0)
    horizon = days * 86400.0
    out: list[float] = []
    peak = max(trace.front_load, 1.0) * (1 + trace.diurnal) * max(trace.weekend, 1.0)
    while len(out) < n:
        t = rng.uniform(0, horizon, 4 * n)
        frac = t / horizon
        trend = trace.front_load + (1.0 - trace.front_load) * frac
        day = t / 86400.0
        diurnal = 1 + trace.diurnal * np.sin(2 * np.pi * (day - 0.375))
        weekend = np.where((np.floor(day) % 7) >= 5, trace.weekend, 1.0)
        accept = rng.uniform(0, peak, t.size) < trend * diurnal * weekend
        out.extend(t[accept].tolist())
    return np.sort(np.array(out[:n]))


# The cluster ------------------------------------------------------------------------------


@dataclass(frozen=True)
class GroupSpec:
    group_id: str
    devices: int
    device_bytes: int
    host_bytes: int
    swap: SwapCosts
    """The group's aggregate bandwidths (every device moves its own shard)."""
    profile: str | None
    """The profile it was sized for (None: named worker)."""


def build_groups(
    workload: Workload,
    factory: JobFactory,
    jobs: list[JobSpec],
    gpus: int | None = None,
    shared: bool = False,
    per_group: Callable[[JobSpec], float] | None = None,
    at_least: dict[str, int] | None = None,
) -> list[GroupSpec]:
    """Named workers as given; otherwise the GPUs split into groups per profile, in
    proportion to each profile's device-seconds of demand in `jobs`: of whole runs on
    dedicated pools, or (`shared`) of the group time their calls hold, which is what a
    shared cluster must provide; with `per_group`, each job's whole run over the jobs a
    group is expected to hold beside it (`plexrl_sim.packing`). `at_least`: groups a
    profile gets whatever its demand (`apportion`)."""
    if workload.workers:
        return [
            GroupSpec(
                group_id=w.id,
                devices=w.devices,
                device_bytes=int(nbytes(w.device_bytes)),
                host_bytes=int(nbytes(w.host_bytes)),
                swap=SwapCosts(
                    nbytes(w.device_host_bytes_per_s), nbytes(w.host_disk_bytes_per_s), w.fixed_s
                ),
                profile=None,
            )
            for w in workload.workers
        ]
    cluster = workload.cluster
    total = gpus if gpus is not None else cluster.gpus
    counts = (
        dict(cluster.groups)
        if cluster.groups
        else _groups_by_demand(workload, factory, jobs, total, shared, per_group, at_least)
    )
    used = sum(workload.profiles[k].devices * c for k, c in counts.items())
    if used > total:
        raise ValueError(
            f"the groups need {used} GPUs but the cluster has {total}; "
            f"lower cluster.groups or raise --gpus"
        )
    per_gpu = cluster.swap
    groups: list[GroupSpec] = []
    for name in sorted(counts, key=lambda k: workload.profiles[k].devices):
        d = workload.profiles[name].devices
        swap = SwapCosts(
            nbytes(per_gpu.device_host_bytes_per_s) * d,
            nbytes(per_gpu.host_disk_bytes_per_s) * d,
            per_gpu.fixed_s,
        )
        for i in range(counts[name]):
            groups.append(
                GroupSpec(
                    group_id=f"g{name}-{i:03d}",
                    devices=d,
                    device_bytes=int(nbytes(cluster.device_bytes_per_gpu) * d),
                    host_bytes=int(nbytes(cluster.host_bytes_per_gpu) * d),
                    swap=swap,
                    profile=name,
                )
            )
    return groups


def _groups_by_demand(
    workload: Workload,
    factory: JobFactory,
    jobs: list[JobSpec],
    gpus: int,
    shared: bool,
    per_group: Callable[[JobSpec], float] | None = None,
    at_least: dict[str, int] | None = None,
) -> dict[str, int]:
    demand: dict[str, float] = {}
    for job in jobs:
        p = workload.profiles[job.profile]
        if shared:
            steps = factory.steps(job)
            need = float(steps.exclusive_s.sum() + steps.tail_work.sum())
        else:
            need = factory.expected_isolated_step_s(job.profile) * job.steps
            if per_group is not None:
                need /= per_group(job)
        demand[job.profile] = demand.get(job.profile, 0.0) + p.devices * need
    total = sum(demand.values())
    sizes = {name: workload.profiles[name].devices for name in demand}
    share = {name: gpus * need / total for name, need in demand.items()}
    return apportion(share, sizes, gpus, at_least)


def apportion(
    share: dict[str, float],
    size: dict[str, int],
    gpus: int,
    at_least: dict[str, int] | None = None,
) -> dict[str, int]:
    """Whole groups per profile for `gpus` GPUs, `share[name]` GPUs wanted in groups of
    `size[name]`: the counts that give the least-covered profile the most of its share
    (each at least one group, or `at_least[name]`), then what is left to the
    least-covered profiles whose group still fits. Rounding each share down on its own
    can leave a profile with large groups far below its share and GPUs no group of it
    fits idle. Counts that cannot fit `gpus` at all (one group each, or `at_least`) are
    returned as they are: `build_groups` says what to change."""
    least = at_least or {}

    def needed(cover: float) -> dict[str, int]:
        # The float guard keeps `cover = n / wanted` from rounding up to n + 1 groups.
        return {
            k: max(1, least.get(k, 1), math.ceil(cover * share[k] / size[k] - 1e-9)) for k in share
        }

    def gpus_of(counts: dict[str, int]) -> int:
        return sum(size[k] * c for k, c in counts.items())

    # The best coverage is one where some profile gets exactly n groups: n / its groups wanted.
    covers = sorted(
        {
            n * size[k] / share[k]
            for k in share
            if share[k] > 0
            for n in range(1, gpus // size[k] + 1)
        }
    )
    counts = needed(0.0)
    lo, hi = 0, len(covers) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        trial = needed(covers[mid])
        if gpus_of(trial) <= gpus:
            counts, lo = trial, mid + 1
        else:
            hi = mid - 1
    spare = gpus - gpus_of(counts)
    while True:
        fits = [k for k in counts if size[k] <= spare]
        if not fits:
            return counts
        k = min(
            fits, key=lambda k: (size[k] * counts[k] / share[k] if share[k] > 0 else math.inf, k)
        )
        counts[k] += 1
        spare -= size[k]
