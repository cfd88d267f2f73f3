"""The interference model at full scale: what the own policy predicted of each job's
slowdown while it shared, beside what the job measured, on a whole trace.

`bench/sim_interference.py` checks the prediction on forced groups; this runs the
headline's own deployment (the own policy on the engine with the tail release, the
trace's jobs at the given staleness and slicing, groups sized by the packing) and, every
`--sample-s` of simulated time, predicts the slowdown of every homed job beside its
group's other homed jobs (`plexrl.policy.plexrl_policy.predicted_slowdown`, on the
figures the policy last read of each, with the deployment's costs of sharing: what
admission and the review weigh). A job's predicted slowdown is the mean of those
samples over the time it was homed (0 while alone); its measured slowdown is its steps
against the same steps alone (Isolated), as the report has it.

It also shows what a scheduler could measure of the slowdown without that reference:
the job's step time over its alone step as the policy estimates it from what it learned
(`Figures.period`: its sample, stragglers and stalls, or its busy seconds) less one,
and that estimate's error against the true alone step.

    .venv/bin/python bench/sim_prediction.py
    .venv/bin/python bench/sim_prediction.py -w workloads/trace-unfitted.yaml --seed 1
    .venv/bin/python bench/sim_prediction.py --gpus 512 --jobs 225

Runs over the compiled build (`plexrl sim-build`) when one exists for the sources.
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# After PYTHONPATH: run again over the compiled build, the build's copies come first.
sys.path.append(str(ROOT / "libs"))

from plexrl_sim import native  # noqa: E402


def _over_build() -> None:
    """Run this script again over the compiled build, as `plexrl sim` does."""
    if native.active() or os.environ.get(native.ENV) == "0":
        return
    target = native.current_build(native.default_root(), native.libs_dir())
    if target is not None:
        print(f"sim_prediction: compiled build {target}", file=sys.stderr)
        argv = [sys.executable, *sys.argv]
        os.execve(sys.executable, argv, native.rerun_env(target, dict(os.environ)))


class Samples:
    """Each homed job's predicted slowdown, sampled at fixed steps of simulated time."""

    def __init__(self, sim: Any, every_s: float) -> None:
        self.sim = sim
        self.every_s = every_s
        self.next_s = 0.0
        self.sums: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self.shared: dict[str, int] = defaultdict(int)
        self.paired_alone: dict[str, int] = defaultdict(int)
        """Samples at which the job was alone on its group and another job of its
        profile alone on another: a pair the review could have formed, and did not."""

    def __call__(self, now: float) -> None:
        if now < self.next_s:
            return
        self.next_s = (math.floor(now / self.every_s) + 1) * self.every_s
        from plexrl.policy.plexrl_policy import predicted_slowdown

        groups: dict[str, list[Any]] = defaultdict(list)
        for job in self.sim.jobs.values():
            if job.home is not None and job.view is not None and not job.result.done:
                groups[job.home].append(job)
        alone: dict[str, int] = defaultdict(int)
        for members in groups.values():
            if len(members) == 1:
                alone[members[0].result.profile] += 1
        costs = self.sim.config.sharing
        for members in groups.values():
            views = [j.view for j in members]
            for job in members:
                others = [v for v in views if v.job_id != job.job_id]
                slow = min(1.0, predicted_slowdown(job.view, others, costs)) if others else 0.0
                self.sums[job.job_id] += slow
                self.counts[job.job_id] += 1
                self.shared[job.job_id] += bool(others)
                self.paired_alone[job.job_id] += not others and alone[job.result.profile] > 1


def run(args: argparse.Namespace) -> dict[str, Any]:
    from plexrl.policy.plexrl_policy import figures_of
    from plexrl_sim.multiplexed import MultiplexedSim
    from plexrl_sim.run import TAIL_SUFFIX, policy_config, prepare
    from plexrl_sim.workload import TAIL_RELEASE

    setup = prepare(
        args.workload,
        seed=args.seed,
        gpus=args.gpus,
        jobs=args.jobs,
        partition="packed",
        staleness=args.staleness,
        fb_slices=args.fb_slices,
    )
    name = f"plexrl{TAIL_SUFFIX}"
    factory = setup.factory.with_tail_release(TAIL_RELEASE)
    config = policy_config(setup, "plexrl", {})
    groups = setup.groups_for(name, factory, config)
    sim = MultiplexedSim(factory, setup.jobs, groups, config, setup.gpus, name=name)
    samples = Samples(sim, args.sample_s)
    sim.run(samples)
    rows: dict[str, list[dict[str, float]]] = defaultdict(list)
    for job_id, job in sim.jobs.items():
        r = job.result
        if not r.done or r.isolated_step_time_s <= 0 or not samples.counts[job_id]:
            continue
        n = samples.counts[job_id]
        alone = figures_of(job.view).period * job.steps.n if job.view is not None else 0.0
        rows[r.profile].append(
            {
                "measured": r.slowdown,
                "predicted": samples.sums[job_id] / n,
                "shared": samples.shared[job_id] / n,
                "alone_beside_alone": samples.paired_alone[job_id] / n,
                "step_over_estimate": r.step_time_s / alone - 1 if alone > 0 else math.nan,
                "estimate_error": alone / r.isolated_step_time_s - 1 if alone > 0 else math.nan,
            }
        )
    classes = {p: _summary(v) for p, v in sorted(rows.items())}
    everyone = [row for v in rows.values() for row in v]
    return {"classes": classes, "all": _summary(everyone)}


def _summary(rows: list[dict[str, float]]) -> dict[str, float]:
    def mean(key: str) -> float:
        values = [r[key] for r in rows if not math.isnan(r[key])]
        return statistics.fmean(values) if values else math.nan

    measured = [r["measured"] for r in rows]
    predicted = [r["predicted"] for r in rows]
    errors = [p - m for p, m in zip(predicted, measured, strict=True)]
    spread = [r["estimate_error"] for r in rows if not math.isnan(r["estimate_error"])]
    return {
        "jobs": len(rows),
        "measured": mean("measured"),
        "predicted": mean("predicted"),
        "shared": mean("shared"),
        "alone_beside_alone": mean("alone_beside_alone"),
        "error_mean_abs": statistics.fmean(abs(e) for e in errors) if errors else math.nan,
        "correlation": _correlation(measured, predicted),
        "step_over_estimate": mean("step_over_estimate"),
        "estimate_error": mean("estimate_error"),
        "estimate_error_sd": statistics.pstdev(spread) if len(spread) > 1 else math.nan,
    }


def _correlation(xs: list[float], ys: list[float]) -> float:
    """Pearson's, NaN where it says nothing (fewer than three jobs, or one side flat)."""
    if len(xs) < 3:
        return math.nan
    try:
        return statistics.correlation(xs, ys)
    except statistics.StatisticsError:
        return math.nan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-w", "--workload", default=str(ROOT / "workloads" / "trace-3mo.yaml"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gpus", type=int, default=None, help="cluster size (default: the trace's)")
    ap.add_argument("--jobs", type=int, default=None, help="jobs (default: the trace's)")
    ap.add_argument("--staleness", type=int, default=1)
    ap.add_argument("--fb-slices", type=int, default=8)
    ap.add_argument("--sample-s", type=float, default=3600.0, help="simulated seconds apart")
    args = ap.parse_args()
    _over_build()
    t0 = time.process_time()
    out = run(args)
    print(
        "| class | jobs | measured | predicted | mean abs error | correlation | shared "
        "| alone, another alone | step over its estimate alone | that estimate's error (sd) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for label, s in [*out["classes"].items(), ("all", out["all"])]:
        print(
            f"| {label} | {s['jobs']} | {s['measured']:.2%} | {s['predicted']:.2%} | "
            f"{s['error_mean_abs']:.2%} | {s['correlation']:.2f} | {s['shared']:.0%} | "
            f"{s['alone_beside_alone']:.0%} | "
            f"{s['step_over_estimate']:.2%} | {s['estimate_error']:+.2%} "
            f"({s['estimate_error_sd']:.2%}) |"
        )
    print(
        json.dumps(
            {
                "bench": "sim_prediction",
                "workload": Path(args.workload).name,
                "seed": args.seed,
                "gpus": args.gpus,
                "jobs": args.jobs,
                "staleness": args.staleness,
                "fb_slices": args.fb_slices,
                **out,
                "cpu_s": time.process_time() - t0,
            }
        )
    )


if __name__ == "__main__":
    main()
