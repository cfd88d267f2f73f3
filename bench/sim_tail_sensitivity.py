"""How much the own policy's figures rest on the rollout-tail release and its costs.

Runs `plexrl+tail` on the three-month trace (at `--scale` of its GPUs and jobs, over the
same 90 days) for every release threshold and tail contention asked for, beside
Isolated and Split-Async, and prints one row per pair: the worst occupied GPU-hours per
step against Split-Async, the mean slowdown against Isolated and against Split-Async,
and the makespan against Isolated. The threshold is the fraction of a rollout's
sequences done when the engine hands the group on (75%: the default `TAIL_RELEASE`);
the contention stretches a straggler tail that decodes beside another job's Run
(`CoLocation.tail_contention`).

    nice -n 10 .venv/bin/python bench/sim_tail_sensitivity.py [--scale 0.25] [--seed 0]
        [--thresholds 0.75,0.85,0.95] [--contention 1.0,1.25,1.5]

Ends with one JSON line holding every row.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import msgspec

from plexrl_sim.report import figures
from plexrl_sim.run import prepare, run_deployment

ROOT = Path(__file__).resolve().parent.parent


def no_nan(value: object) -> object:
    """JSON has no NaN: null instead."""
    return None if isinstance(value, float) and math.isnan(value) else value


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default=str(ROOT / "workloads" / "trace-3mo.yaml"))
    parser.add_argument("--scale", type=float, default=0.25, help="share of GPUs and jobs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--thresholds", type=floats, default=[0.75, 0.85, 0.95])
    parser.add_argument("--contention", type=floats, default=[1.0, 1.25, 1.5])
    args = parser.parse_args()

    probe = prepare(args.workload, seed=args.seed)
    gpus = round(probe.workload.cluster.gpus * args.scale)
    jobs = round(len(probe.jobs) * args.scale)
    setup = prepare(args.workload, seed=args.seed, gpus=gpus, jobs=jobs)
    base = {name: run_deployment(setup, name) for name in ("isolated", "split-async")}
    costs = setup.workload.cluster.colocation
    rows = []
    started = time.process_time()
    for threshold in args.thresholds:
        for contention in args.contention:
            result = run_deployment(
                setup,
                "plexrl+tail",
                tail_release=round(1.0 - threshold, 6),
                colocation=msgspec.structs.replace(costs, tail_contention=contention),
            )
            e = figures(setup, {**base, "plexrl+tail": result})["deployments"]["plexrl+tail"]
            occupied = e["occupied_savings_vs_split_async"]
            row = {
                "threshold": threshold,
                "contention": contention,
                "worst_occupied_vs_split_async": max(occupied.values()),
                "occupied_vs_split_async": occupied,
                "mean_slowdown": e["mean_slowdown"],
                "mean_slowdown_vs_split_async": e["mean_slowdown_vs_split_async"],
                "makespan_vs_isolated": e["makespan_vs_isolated"],
            }
            rows.append(row)
            print(
                f"threshold {threshold:.0%} contention {contention:.2f}x: worst occupied "
                f"{row['worst_occupied_vs_split_async']:+.1%}, slowdown "
                f"{row['mean_slowdown']:.1%} (vs Split-Async "
                f"{row['mean_slowdown_vs_split_async']:+.1%}), makespan "
                f"{row['makespan_vs_isolated']:.1%} of Isolated",
                flush=True,
            )
    print(
        json.dumps(
            {
                "bench": "sim_tail_sensitivity",
                "workload": setup.workload.name,
                "seed": args.seed,
                "gpus": gpus,
                "jobs": jobs,
                "colocation": msgspec.to_builtins(costs),
                "cpu_s": round(time.process_time() - started, 1),
                "rows": [{k: no_nan(v) for k, v in r.items()} for r in rows],
            },
            separators=(",", ":"),
        )
    )


if __name__ == "__main__":
    main()
