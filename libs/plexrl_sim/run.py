"""Setting up a simulation and running deployments of it, one or all side by side."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from plexrl.policy import POLICIES, PolicyConfig
from plexrl.policy.costs import LEARN_SAMPLES
from plexrl_sim.dedicated import DEDICATED, simulate_dedicated
from plexrl_sim.multiplexed import MultiplexedSim
from plexrl_sim.packing import drain_minimum, packing_by_profile
from plexrl_sim.results import DeploymentResult
from plexrl_sim.workload import (
    PARTITIONS,
    TAIL_RELEASE,
    CoLocation,
    GroupSpec,
    JobFactory,
    JobSpec,
    Workload,
    at_staleness,
    build_groups,
    load_workload,
    with_colocation,
    with_declared_error,
    with_fb_slices,
)

MULTIPLEXED = (
    "pack",
    "spread",
    "spread-backfill",
    "plexrl",
    "spread-backfill+tail",
    "plexrl+tail",
)
"""Deployments decided by `plexrl.policy.decide`, in report order. `<policy>+tail` runs
the policy on an engine that releases the group early in a rollout's straggler tail
(`workload.TAIL_RELEASE`); every registered policy can be named, with or without it."""
DEPLOYMENTS = (*DEDICATED, *MULTIPLEXED)
"""What `plexrl sim --policy all` runs (any registered policy may also be named)."""
TAIL_SUFFIX = "+tail"
LABELS = {
    "isolated": "Isolated",
    "colocated": "Colocated",
    "split-async": "Split-Async",
    "pack": "Pack",
    "spread": "Spread",
    "spread-backfill": "Spread+Backfill",
    "plexrl": "PlexRL (own)",
    "fifo": "FIFO",
}


def label(name: str) -> str:
    if name.endswith(TAIL_SUFFIX):
        return f"{label(name[: -len(TAIL_SUFFIX)])} + tail release"
    return LABELS.get(name, name)


@dataclass(frozen=True)
class Setup:
    """Everything one seed of one workload fixes: the jobs, their steps, the groups."""

    workload_path: str
    workload: Workload
    seed: int
    gpus: int
    days: float | None
    job_count: int | None
    factory: JobFactory
    jobs: list[JobSpec]
    groups: list[GroupSpec]
    """The dedicated split (or the named workers): what the dedicated deployments use."""
    partition: str = "dedicated"
    staleness: int | None = None
    """The jobs' loop, when the command line set it (`prepare`)."""
    fb_slices: int | None = None
    """The jobs' forward_backward slicing, when the command line set it."""
    known_duty: bool = False
    """A control: each shared deployment runs twice, the second time with every job's
    duty cycle as the first run had learned it by the job's last step given to the
    policy from the job's arrival (`MultiplexedSim`), instead of its kind's figures
    until it has a history of its own."""
    declared_error: float | None = None
    """How far the jobs' declared steps are off, when the command line set it."""
    colocation: dict[str, float | str] | None = None
    """The costs of sharing set for the run (`prepare`), charged and predicted alike."""
    charge: dict[str, float | str] | None = None
    """The costs of sharing charged instead (`prepare`): the workload then holds those,
    and `assumed` the ones the shared deployments' policy starts from."""
    assumed: CoLocation | None = None
    learn_costs: int = LEARN_SAMPLES
    """How often a cost must have been paid before the policy predicts with it instead
    of `assumed` (`MultiplexedSim`); 0: never."""

    def recipe(self) -> dict[str, Any]:
        """`prepare`'s arguments that make this setup again (in another process)."""
        return {
            "workload_path": self.workload_path,
            "seed": self.seed,
            "gpus": self.gpus if self.gpus != self.workload.cluster.gpus else None,
            "days": self.days,
            "jobs": self.job_count,
            "partition": self.partition,
            "staleness": self.staleness,
            "fb_slices": self.fb_slices,
            "declared_error": self.declared_error,
            "known_duty": self.known_duty,
            "colocation": self.colocation,
            "charge": self.charge,
            "learn_costs": self.learn_costs,
        }

    def groups_for(
        self,
        name: str,
        factory: JobFactory,
        config: PolicyConfig | None = None,
        colocation: CoLocation | None = None,
    ) -> list[GroupSpec]:
        """The groups a deployment runs on (see `ClusterSpec.partition`); `config`: the
        policy's, whose slowdown budget a `packed` layout is sized for, with the costs of
        sharing the policy predicts with from the start (`colocation`, else those it is
        assumed to start from, else the workload's): the layout is planned before any is
        measured."""
        own = (
            name not in DEDICATED and not self.workload.workers and not self.workload.cluster.groups
        )
        if own and self.partition == "packed":
            policy = config or PolicyConfig()
            chosen = colocation if colocation is not None else self.assumed
            if chosen is None:
                chosen = self.workload.cluster.colocation
            costs = chosen.costs()
            packing = packing_by_profile(
                factory, self.jobs, costs, policy.slowdown_budget, policy.budget_over_cluster
            )
            least = drain_minimum(factory, self.jobs, packing, costs, self.gpus)
            return build_groups(
                self.workload,
                factory,
                self.jobs,
                self.gpus,
                per_group=lambda job: packing[job.profile],
                at_least=least,
            )
        if own and self.partition in ("shared", "auto"):
            return build_groups(self.workload, factory, self.jobs, self.gpus, shared=True)
        return self.groups

    @property
    def device_gpus(self) -> int:
        return sum(g.devices for g in self.groups)


def prepare(
    workload_path: str | Path,
    seed: int = 0,
    gpus: int | None = None,
    days: float | None = None,
    jobs: int | None = None,
    partition: str | None = None,
    staleness: int | None = None,
    fb_slices: int | None = None,
    declared_error: float | None = None,
    known_duty: bool = False,
    colocation: dict[str, float | str] | None = None,
    charge: dict[str, float | str] | None = None,
    learn_costs: int = LEARN_SAMPLES,
) -> Setup:
    """One seed of a workload; `staleness` replaces every job's declared loop (and
    Split-Async's staleness from 1 on: `workload.at_staleness`), `fb_slices` every job's
    forward_backward slicing (`workload.with_fb_slices`), `declared_error` how far the
    trace's jobs' declared steps are off (`workload.with_declared_error`), `colocation`
    the costs of sharing (`workload.with_colocation`); `charge` the costs of sharing
    charged on top of those, which the shared deployments' policy does not know until
    it learns them (`learn_costs`); `known_duty`, `Setup.known_duty`."""
    workload = load_workload(workload_path)
    if colocation:
        workload = with_colocation(workload, colocation)
    assumed = None
    if charge:
        assumed = workload.cluster.colocation
        workload = with_colocation(workload, charge)
    if declared_error is not None:
        workload = with_declared_error(workload, declared_error)
    if staleness is not None:
        workload = at_staleness(workload, staleness)
    if fb_slices is not None:
        workload = with_fb_slices(workload, fb_slices)
    split = partition or workload.cluster.partition
    if split not in PARTITIONS:
        raise ValueError(f"partition {split!r}: use one of {', '.join(PARTITIONS)}")
    factory = JobFactory(workload, seed)
    specs = factory.jobs(days=days, jobs=jobs)
    groups = build_groups(workload, factory, specs, gpus, shared=split == "shared")
    total = (
        gpus
        if gpus is not None
        else (sum(g.devices for g in groups) if workload.workers else workload.cluster.gpus)
    )
    return Setup(
        str(workload_path),
        workload,
        seed,
        total,
        days,
        jobs,
        factory,
        specs,
        groups,
        split,
        staleness,
        fb_slices,
        known_duty,
        declared_error,
        colocation or None,
        charge or None,
        assumed,
        learn_costs,
    )


def policy_config(
    setup: Setup, name: str, overrides: dict[str, float | int | bool]
) -> PolicyConfig:
    """The workload's policy settings, then `overrides`, for policy `name`."""
    params: dict[str, Any] = {**setup.workload.policy, **overrides}
    known = {f.name for f in fields(PolicyConfig)} - {"name"}
    unknown = sorted(set(params) - known)
    if unknown:
        raise ValueError(f"unknown policy setting(s) {unknown}; known: {sorted(known)}")
    return replace(PolicyConfig(name=name), **params)


def run_deployment(
    setup: Setup,
    name: str,
    progress: Callable[[float], None] | None = None,
    overrides: dict[str, float | int | bool] | None = None,
    tail_release: float | None = None,
    colocation: CoLocation | None = None,
) -> DeploymentResult:
    """Simulate one deployment; `progress` gets simulated seconds (multiplexed) or the
    finished fraction of jobs (dedicated). `tail_release` replaces `TAIL_RELEASE` for a
    `+tail` deployment, `colocation` the workload's costs of sharing (sensitivity runs)."""
    if name in DEDICATED:
        groups = setup.groups_for(name, setup.factory)
        return simulate_dedicated(name, setup.factory, setup.jobs, groups, setup.gpus, progress)
    policy, factory = name, setup.factory
    if name.endswith(TAIL_SUFFIX):
        policy = name[: -len(TAIL_SUFFIX)]
        factory = factory.with_tail_release(
            tail_release if tail_release is not None else TAIL_RELEASE
        )
    if policy not in POLICIES:
        raise ValueError(
            f"unknown deployment {name!r}; choose from {', '.join(DEDICATED)}, a policy "
            f"({', '.join(sorted(POLICIES))}) optionally suffixed {TAIL_SUFFIX}, or all"
        )
    config = policy_config(setup, policy, overrides or {})
    groups = setup.groups_for(name, factory, config, colocation)

    def deployment(known_duty: dict[str, float] | None = None) -> MultiplexedSim:
        return MultiplexedSim(
            factory,
            setup.jobs,
            groups,
            config,
            setup.gpus,
            name=name,
            colocation=colocation,
            known_duty=known_duty,
            assumed=setup.assumed.costs() if setup.assumed is not None else None,
            learn_samples=setup.learn_costs,
        )

    if not setup.known_duty:
        return deployment().run(progress)
    first = deployment().run()
    sim = deployment({j.job_id: j.learned_duty for j in first.jobs if j.done})
    return sim.run(progress)


_ChildArgs = tuple[dict[str, Any], str, dict[str, float | int | bool]]
"""A deployment to run in another process: `Setup.recipe`, its name, its overrides."""


def _run_in_child(args: _ChildArgs) -> DeploymentResult:
    recipe, name, overrides = args
    return run_deployment(prepare(**recipe), name, None, overrides)


def run_many(
    setup: Setup,
    names: Sequence[str],
    parallel: int = 1,
    overrides: dict[str, float | int | bool] | None = None,
    on_done: Callable[[DeploymentResult], None] | None = None,
    progress: Callable[[str, float], None] | None = None,
) -> dict[str, DeploymentResult]:
    """Run several deployments of one setup; in `parallel` processes when above 1."""
    results: dict[str, DeploymentResult] = {}
    if parallel <= 1 or len(names) <= 1:
        for name in names:
            tick = _named(progress, name) if progress else None
            result = run_deployment(setup, name, tick, overrides)
            results[name] = result
            if on_done:
                on_done(result)
        return results
    recipe = setup.recipe()
    jobs_arg: list[_ChildArgs] = [(recipe, n, overrides or {}) for n in names]
    workers = min(parallel, len(names), os.cpu_count() or 1)
    with ProcessPoolExecutor(max_workers=workers) as pool:
        for name, result in zip(names, pool.map(_run_in_child, jobs_arg), strict=True):
            results[name] = result
            if on_done:
                on_done(result)
    return results


def _named(progress: Callable[[str, float], None], name: str) -> Callable[[float], None]:
    def tick(x: float) -> None:
        progress(name, x)

    return tick
