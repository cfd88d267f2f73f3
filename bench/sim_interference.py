"""The interference model against the simulator: jobs forced onto one group, measured
slowdown beside the slowdown the plexrl policy predicts for them.

For each profile of the calibrated H200 profiles, each number of jobs on one group and
each stall scale: `n` jobs of the profile on one group of its size, their arrivals
spread over one step, every one admitted (the budget set out of reach) and run by the
own policy on the engine with the tail release, with the workload's costs of sharing.
Measured: the jobs' mean slowdown against each alone (Isolated, the same steps).
Predicted: the mean of `plexrl.policy.plexrl_policy.predicted_slowdown` for each job
beside the others, on the figures the policy had learned of them by the end of the run
(what admission reads). Several seeds per cell; each seed draws other steps.

    .venv/bin/python bench/sim_interference.py
    .venv/bin/python bench/sim_interference.py --profiles 7B --jobs 2 --seeds 1 --steps 40

Ends with one JSON line holding every cell.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "libs"))

from plexrl.policy.plexrl_policy import predicted_slowdown  # noqa: E402
from plexrl_sim.multiplexed import MultiplexedSim  # noqa: E402
from plexrl_sim.run import TAIL_SUFFIX, policy_config, prepare  # noqa: E402
from plexrl_sim.workload import TAIL_RELEASE, parse_colocation  # noqa: E402

PROFILES = ROOT / "workloads" / "profiles" / "h200.yaml"


def forced_group(
    profile: str,
    jobs: int,
    steps: int,
    stall_scale: float,
    staleness: int,
    colocation: dict[str, Any] | None = None,
    fb_slices: int = 1,
) -> dict:
    """One group of the profile's size and `jobs` jobs of it, arriving a step apart / n
    (their forward_backward calls in `fb_slices` slices each)."""
    profiles = yaml.safe_load(PROFILES.read_text())["profiles"]
    p = profiles[profile]
    devices = int(p["devices"])
    step_s = _step_estimate(p, stall_scale)
    doc: dict[str, Any] = {
        "name": f"forced-{profile}-{jobs}",
        "profiles": {profile: p},
        "cluster": {"colocation": colocation or {}},
        "workers": [
            {
                "id": "g0",
                "devices": devices,
                "device_bytes": f"{80 * devices} GB",
                "host_bytes": f"{200 * devices} GB",
                "device_host_bytes_per_s": f"{50 * devices} GB/s",
                "host_disk_bytes_per_s": f"{3 * devices} GB/s",
                "fixed_s": 0.5,
            }
        ],
        "jobs": [
            {
                "id": f"j{i}",
                "profile": profile,
                "steps": steps,
                "arrival_s": round(i * step_s / jobs, 1),
                "stall_scale": stall_scale,
            }
            for i in range(jobs)
        ],
        # Every job admitted at once (placement by memory alone, whatever the predicted
        # slowdown): the group is the experiment, not the admission.
        "policy": {"slowdown_budget": 100.0, "pack": False},
    }
    if staleness:
        doc["profiles"][profile] = {**doc["profiles"][profile], "staleness": staleness}
    if fb_slices > 1:
        doc["profiles"][profile] = {**doc["profiles"][profile], "fb_slices": fb_slices}
    return doc


def _step_estimate(p: dict, stall_scale: float) -> float:
    reward = p.get("reward_s", 0.0)
    median = reward["median"] if isinstance(reward, dict) else float(reward)
    return median * stall_scale + 600.0


def measure(
    profile: str,
    jobs: int,
    steps: int,
    stall_scale: float,
    seed: int,
    staleness: int,
    colocation: dict[str, Any] | None = None,
    fb_slices: int = 1,
) -> dict[str, float]:
    doc = forced_group(profile, jobs, steps, stall_scale, staleness, colocation, fb_slices)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "w.yaml"
        path.write_text(yaml.safe_dump(doc))
        setup = prepare(path, seed=seed)
    name = f"plexrl{TAIL_SUFFIX}"
    factory = setup.factory.with_tail_release(TAIL_RELEASE)
    config = policy_config(setup, "plexrl", {})
    sim = MultiplexedSim(factory, setup.jobs, setup.groups, config, setup.gpus, name=name)
    result = sim.run()
    if len(result.finished) != jobs or max(j.start_s for j in result.jobs) >= min(
        j.finish_s for j in result.jobs
    ):
        raise RuntimeError(f"{profile} x{jobs}: the jobs did not all share the group")
    measured = [j.slowdown for j in result.jobs]
    views = []
    for job in sim.jobs.values():
        job.touch()
        views.append(job.as_view(sim.now, {}, sim.min_history_s))
    predicted = [
        predicted_slowdown(v, [o for o in views if o.job_id != v.job_id], sim.config.sharing)
        for v in views
    ]
    return {
        "measured": sum(measured) / len(measured),
        "predicted": sum(predicted) / len(predicted),
        "measured_max": max(measured),
        "predicted_max": max(predicted),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profiles", default="7B,30B,235B")
    ap.add_argument("--jobs", default="2,3", help="jobs per group, a comma list")
    ap.add_argument("--stall-scales", default="1,2.5", help="per-job stall multipliers")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--staleness", type=int, default=0, help="the jobs' declared staleness")
    ap.add_argument(
        "--fb-slices",
        type=int,
        default=1,
        help="slices of each forward_backward call (an asynchronous job's yield to samples)",
    )
    ap.add_argument(
        "--colocation",
        default="",
        help="costs of sharing instead of the defaults, e.g. switch_s=0,tail_contention=1",
    )
    args = ap.parse_args()
    try:
        colocation: dict[str, Any] = dict(parse_colocation(args.colocation))
    except ValueError as err:
        ap.error(str(err))
    t0 = time.process_time()
    cells = []
    print("| profile | jobs | stall scale | measured (max) | predicted (max) |")
    print("|---|---:|---:|---:|---:|")
    for profile in args.profiles.split(","):
        for n in (int(x) for x in args.jobs.split(",")):
            for scale in (float(x) for x in args.stall_scales.split(",")):
                runs = [
                    measure(
                        profile,
                        n,
                        args.steps,
                        scale,
                        seed,
                        args.staleness,
                        colocation,
                        args.fb_slices,
                    )
                    for seed in range(args.seeds)
                ]
                cell = {
                    k: sum(r[k] for r in runs) / len(runs)
                    for k in ("measured", "predicted", "measured_max", "predicted_max")
                }
                cell.update(profile=profile, jobs=n, stall_scale=scale)
                cells.append(cell)
                print(
                    f"| {profile} | {n} | {scale:g} | {cell['measured']:.1%} "
                    f"({cell['measured_max']:.1%}) | {cell['predicted']:.1%} "
                    f"({cell['predicted_max']:.1%}) |",
                    flush=True,
                )
    errors = [c["predicted"] - c["measured"] for c in cells]
    print(
        json.dumps(
            {
                "bench": "sim_interference",
                "steps": args.steps,
                "seeds": args.seeds,
                "staleness": args.staleness,
                "fb_slices": args.fb_slices,
                "colocation": colocation,
                "cells": cells,
                "mean_error": sum(errors) / len(errors) if errors else math.nan,
                "cpu_s": time.process_time() - t0,
            }
        )
    )


if __name__ == "__main__":
    main()
