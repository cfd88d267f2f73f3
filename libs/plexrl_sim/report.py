"""Turning deployment results into figures, a Markdown report, CSV files and PNG charts."""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from plexrl_sim.dedicated import bubble_ratio
from plexrl_sim.results import HOUR, DeploymentResult
from plexrl_sim.run import TAIL_SUFFIX, Setup, label
from plexrl_sim.workload import TAIL_RELEASE

DAY = 86400.0
BEAT = {"savings_vs_split_async": -0.45, "mean_slowdown": 0.05, "makespan_vs_isolated": 0.50}
"""The issue's "beat it" targets for the project's own policy."""


def _f(x: float, digits: int = 2, pct: bool = False, sign: bool = False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if pct:
        return f"{x * 100:+.{digits}f}%" if sign else f"{x * 100:.{digits}f}%"
    return f"{x:+.{digits}f}" if sign else f"{x:.{digits}f}"


def profiles_of(setup: Setup) -> list[str]:
    """The profiles with jobs, smallest first; profiles of one size in the workload's
    order (a set's order would change with the process's hash seed)."""
    present = {j.profile for j in setup.jobs}
    declared = list(setup.workload.profiles)
    return sorted(present, key=lambda p: (setup.workload.profiles[p].devices, declared.index(p)))


def dedicated_bubbles(
    setup: Setup, results: dict[str, DeploymentResult] | None = None
) -> dict[str, dict[str, float]]:
    """Per profile and dedicated layout: the idle fraction of the job's pool, over the
    workload's jobs of that profile (from the layout's result when it was run)."""
    out: dict[str, dict[str, float]] = {}
    for name in profiles_of(setup):
        profile = setup.workload.profiles[name]
        jobs = [j for j in setup.jobs if j.profile == name]
        out[name] = {}
        for layout in ("isolated", "colocated", "split-async"):
            ran = (results or {}).get(layout)
            if ran is not None:
                sel = [j for j in ran.finished if j.profile == name]
                useful = sum(j.useful_device_s / j.devices for j in sel)
                wall = sum(j.finish_s - j.start_s for j in sel)
                out[name][layout] = 1 - useful / wall if wall else math.nan
                continue
            useful = wall = 0.0
            for job in jobs:
                steps = setup.factory.steps(job)
                b = bubble_ratio(steps, profile, layout)
                u = float(steps.useful_work.sum())
                useful += u
                wall += u / (1 - b) if b < 1 else 0.0
            out[name][layout] = 1 - useful / wall if wall else math.nan
    return out


def alone_billed_gpu_h_per_step(setup: Setup, name: str) -> dict[str, float]:
    """The control of the billed cost: each job alone on its own group, unshared, billed
    (as the shared deployments bill) for its calls and its stragglers' work only, on the
    deployment's engine. Billed minus this is what the scheduler did; the rest is the
    bubble that billing busy time alone leaves out."""
    factory = setup.factory
    if name.endswith(TAIL_SUFFIX):
        factory = factory.with_tail_release(TAIL_RELEASE)
    device_s: dict[str, float] = {}
    steps: dict[str, int] = {}
    for job in setup.jobs:
        s = factory.steps(job)
        busy = s.create_s + float(s.exclusive_s.sum() + s.tail_work.sum())
        devices = setup.workload.profiles[job.profile].devices
        device_s[job.profile] = device_s.get(job.profile, 0.0) + devices * busy
        steps[job.profile] = steps.get(job.profile, 0) + job.steps
    return {p: device_s[p] / HOUR / steps[p] for p in device_s}


def _vs_split_async(
    results: dict[str, DeploymentResult], r: DeploymentResult
) -> tuple[float, float]:
    """Mean and p95 over jobs of the step-time slowdown against the same job's
    Split-Async run (its steps pipelined on its own pool)."""
    base = results.get("split-async")
    if base is None:
        return math.nan, math.nan
    sa = {j.job_id: j.step_time_s for j in base.finished}
    slow = [
        j.step_time_s / sa[j.job_id] - 1 for j in r.finished if sa.get(j.job_id, 0) > 0 and j.steps
    ]
    return _mean_p95(slow)


def _mean_p95(slow: Sequence[float] | np.ndarray) -> tuple[float, float]:
    """The mean and p95 of some jobs' slowdowns (NaN for none)."""
    if len(slow) == 0:
        return math.nan, math.nan
    return float(np.mean(slow)), float(np.percentile(slow, 95))


def figures(setup: Setup, results: dict[str, DeploymentResult]) -> dict[str, Any]:
    """Every number the report prints, as one JSON-able dict."""
    profiles = profiles_of(setup)
    base_sa = results.get("split-async")
    base_col = results.get("colocated")
    base_iso = results.get("isolated")
    deployments: dict[str, Any] = {}
    floor = makespan_floor_s(base_iso) if base_iso is not None else math.nan
    for name, r in results.items():
        mean, p95 = _mean_p95(r.slowdowns())
        by_size = {p: _mean_p95(r.slowdowns(p)) for p in profiles}
        vs_sa, vs_sa_p95 = _vs_split_async(results, r)
        entry: dict[str, Any] = {
            "label": label(name),
            "makespan_days": r.makespan_s / DAY,
            "finished": len(r.finished),
            "rejected": sum(1 for j in r.jobs if j.rejected),
            "mean_slowdown": mean,
            "p95_slowdown": p95,
            "slowdown_by_size": {p: {"mean": m, "p95": q} for p, (m, q) in by_size.items()},
            "mean_slowdown_vs_split_async": vs_sa,
            "p95_slowdown_vs_split_async": vs_sa_p95,
            "mean_admission_wait_h": _mean([j.admission_wait_s / HOUR for j in r.finished]),
            "mean_call_wait_per_step_s": _mean(
                [j.call_queue_s / j.steps for j in r.finished if j.steps]
            ),
            "busy_fraction": r.busy_fraction(),
            "swapped_tb": sum(j.swapped_bytes for j in r.jobs) / 1e12,
            "gpu_h_per_step": {p: r.gpu_hours_per_step(p) for p in profiles},
            "occupied_gpu_h_per_step": {p: r.gpu_hours_per_step(p, "occupied") for p in profiles},
            "sim_wall_s": r.wall_s,
            "events": r.events,
            "policy_calls": r.plans,
            "policy_s": r.plan_s,
            **({"counts": r.counts} if r.counts else {}),
        }
        if base_iso is not None and base_iso.makespan_s > 0:
            entry["makespan_vs_isolated"] = r.makespan_s / base_iso.makespan_s
        for key, base in (("split_async", base_sa), ("colocated", base_col)):
            if base is None:
                continue
            entry[f"savings_vs_{key}"] = {
                p: r.gpu_hours_per_step(p) / base.gpu_hours_per_step(p) - 1 for p in profiles
            }
            entry[f"occupied_savings_vs_{key}"] = {
                p: r.gpu_hours_per_step(p, "occupied") / base.gpu_hours_per_step(p, "occupied") - 1
                for p in profiles
            }
        if r.kind == "multiplexed" and base_sa is not None:
            alone = alone_billed_gpu_h_per_step(setup, name)
            entry["alone_billed_gpu_h_per_step"] = alone
            entry["alone_billed_savings_vs_split_async"] = {
                p: alone[p] / base_sa.gpu_hours_per_step(p) - 1 for p in profiles if p in alone
            }
        deployments[name] = entry
    return {
        "workload": setup.workload.name,
        "seed": setup.seed,
        "gpus": setup.gpus,
        "jobs": len(setup.jobs),
        "steps": sum(j.steps for j in setup.jobs),
        "groups": len(setup.groups),
        "bubble": {p: b["isolated"] for p, b in dedicated_bubbles(setup, results).items()},
        "makespan_floor_days": floor / DAY,
        "makespan_floor_vs_isolated": (
            floor / base_iso.makespan_s
            if base_iso is not None and base_iso.makespan_s
            else math.nan
        ),
        "deployments": deployments,
    }


def makespan_floor_s(isolated: DeploymentResult) -> float:
    """The shortest makespan any deployment could reach without making a job faster
    than on its own pool: first arrival to the latest (arrival + dedicated run)."""
    if not isolated.finished:
        return math.nan
    first = min(j.arrival_s for j in isolated.jobs)
    return max(j.arrival_s + (j.finish_s - j.start_s) for j in isolated.finished) - first


def _bytes(n: float) -> str:
    for unit, size in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def _span(seconds: float) -> str:
    if seconds >= 2 * DAY:
        return f"{seconds / DAY:.1f} d"
    if seconds >= 2 * HOUR:
        return f"{seconds / HOUR:.1f} h"
    return f"{seconds:.1f} s"


def _mean(values: list[float]) -> float:
    return float(np.mean(values)) if values else math.nan


def markdown(setup: Setup, results: dict[str, DeploymentResult], figs: dict[str, Any]) -> str:
    profiles = profiles_of(setup)
    ref = setup.workload.reference
    dep = figs["deployments"]
    lines: list[str] = []
    add = lines.append
    add(f"# PlexRL simulation: {setup.workload.name}")
    add("")
    if setup.workload.description:
        add(setup.workload.description.strip())
        add("")
    add(
        f"Seed {setup.seed}; {setup.gpus} GPUs in {len(setup.groups)} groups; "
        f"{len(setup.jobs)} jobs, {figs['steps']} training steps."
    )
    add("")
    add("## Deployments")
    add("")
    add(
        "| deployment | makespan | vs Isolated | mean slowdown | p95 slowdown | "
        "mean slowdown vs Split-Async | admission wait (h) | call wait per step (s) | "
        "busy fraction | swapped |"
    )
    add("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for e in dep.values():
        add(
            f"| {e['label']} | {_span(e['makespan_days'] * DAY)} | "
            f"{_f(e.get('makespan_vs_isolated', math.nan), 1, pct=True)} | "
            f"{_f(e['mean_slowdown'], 1, pct=True)} | {_f(e['p95_slowdown'], 1, pct=True)} | "
            f"{_f(e['mean_slowdown_vs_split_async'], 1, pct=True, sign=True)} | "
            f"{_f(e['mean_admission_wait_h'], 1)} | {_f(e['mean_call_wait_per_step_s'], 1)} | "
            f"{_f(e['busy_fraction'], 1, pct=True)} | {_bytes(e['swapped_tb'] * 1e12)} |"
        )
    add("")
    add(
        "Slowdown: a job's summed step time against the same steps on a dedicated group "
        "(Isolated); against Split-Async: against the same job's steps pipelined on its own "
        "pool (negative: faster). Busy fraction: useful device-seconds over the cluster's "
        "device-seconds until the makespan."
    )
    add("")
    add(
        "Slowdown by model size, mean (p95): where a budget held as a mean over every job is spent."
    )
    add("")
    add("| deployment | " + " | ".join(profiles) + " |")
    add("|---|" + "---:|" * len(profiles))
    for e in dep.values():
        by_size = e["slowdown_by_size"]
        cells = [
            f"{_f(by_size[p]['mean'], 1, pct=True)} ({_f(by_size[p]['p95'], 1, pct=True)})"
            for p in profiles
        ]
        add(f"| {e['label']} | " + " | ".join(cells) + " |")
    if not math.isnan(figs["makespan_floor_vs_isolated"]):
        add("")
        add(
            f"Makespan floor: {_span(figs['makespan_floor_days'] * DAY)} "
            f"({_f(figs['makespan_floor_vs_isolated'], 1, pct=True)} of Isolated's) — the "
            "latest arrival plus dedicated run; no deployment that keeps every job at least "
            "as slow as on its own pool can finish sooner."
        )
    add("")
    add("## GPU-hours per training step, by model size: occupied")
    add("")
    add(
        "*Occupied*: what the cluster pays for the groups it holds — a dedicated job's pool "
        "for its whole run; on a shared group each job's share (by use) of every second the "
        "group was held, idle time included. This is the cost to compare."
    )
    add("")
    add(
        "| deployment | "
        + " | ".join(f"{p} occupied | {p} vs Split-Async | {p} vs Colocated" for p in profiles)
        + " |"
    )
    add("|---|" + "---:|" * (3 * len(profiles)))
    for e in dep.values():
        cells = []
        for p in profiles:
            cells.append(_f(e["occupied_gpu_h_per_step"][p], 2))
            cells.append(
                _f(e.get("occupied_savings_vs_split_async", {}).get(p, math.nan), 1, True, True)
            )
            cells.append(
                _f(e.get("occupied_savings_vs_colocated", {}).get(p, math.nan), 1, True, True)
            )
        add(f"| {e['label']} | " + " | ".join(cells) + " |")
    add("")
    billed = [e for e in dep.values() if "alone_billed_gpu_h_per_step" in e]
    if billed:
        add("## As billed, beside its control")
        add("")
        add(
            "*Billed*: each job charged only for its calls, its stragglers' share and its "
            "swaps (the DESIGN's accounting, the paper's user GPU-hour cost). *Alone*: the "
            "same billing for each job alone on its own group, unshared — most of the billed "
            "saving is the bubble this billing leaves out, whoever schedules. *Scheduler*: "
            "billed minus alone, in points: what sharing the groups changed."
        )
        add("")
        add(
            "| deployment | "
            + " | ".join(
                f"{p} billed vs Split-Async | {p} alone vs Split-Async | {p} scheduler"
                for p in profiles
            )
            + " |"
        )
        add("|---|" + "---:|" * (3 * len(profiles)))
        for e in billed:
            cells = []
            for p in profiles:
                got = e.get("savings_vs_split_async", {}).get(p, math.nan)
                alone = e["alone_billed_savings_vs_split_async"].get(p, math.nan)
                cells += [_f(got, 1, True, True), _f(alone, 1, True, True)]
                cells.append(_f(got - alone, 1, True, True).replace("%", " pt"))
            add(f"| {e['label']} | " + " | ".join(cells) + " |")
        add("")
    add("## Dedicated bubble ratios")
    add("")
    add("| size | Isolated (sim) | reference | Split-Async | Colocated |")
    add("|---|---:|---:|---:|---:|")
    for p, b in dedicated_bubbles(setup, results).items():
        add(
            f"| {p} | {_f(b['isolated'], 2, True)} | {_f(ref.bubble.get(p, math.nan), 2, True)} | "
            f"{_f(b['split-async'], 2, True)} | {_f(b['colocated'], 2, True)} |"
        )
    add("")
    rows = _reference_rows(setup, figs)
    if rows:
        add("## Against the reference")
        add("")
        add("| figure | reference | simulated | gap |")
        add("|---|---:|---:|---:|")
        for what, want, got in rows:
            add(
                f"| {what} | {_f(want, 2, True)} | {_f(got, 2, True)} | "
                f"{_f(got - want, 2, True, True)} |"
            )
        add("")
    beat = _beat_rows(figs)
    if beat:
        add("## The own policy against the targets")
        add("")
        add("| deployment | target | required | simulated | met |")
        add("|---|---|---:|---:|:-:|")
        for who, target, need, value, ok in beat:
            add(f"| {who} | {target} | {need} | {value} | {'yes' if ok else 'no'} |")
        add("")
    if len(setup.jobs) <= 30:
        lines.extend(_per_job(results))
    add("## Files")
    add("")
    add(
        "`summary.csv` (one row per deployment), `cost.csv` (deployment x size), `jobs.csv` "
        "(one row per job and deployment), `timeline.csv` (hourly allocated and busy GPUs), "
        "and the charts `gpu_hours_per_step.png`, `makespan.png`, `slowdown_cdf.png`, "
        "`queueing_delay.png`, `busy_fraction.png`."
    )
    add("")
    return "\n".join(lines)


def _per_job(results: dict[str, DeploymentResult]) -> list[str]:
    """The small setting's prediction, job by job, to set beside a measured live run."""
    iso = results.get("isolated")
    dedicated = {j.job_id: j.used_device_s for j in iso.jobs} if iso else {}
    out = [
        "## Per-job prediction",
        "",
        "Charged device-seconds against the same job on its own pool for its whole run "
        "(the live system's `/plexrl/v1` accounting reports the same two numbers).",
        "",
        "| deployment | job | group | finish (s) | mean step (s) | slowdown "
        "| call wait per step (s) | swaps | swap (s) | charged device-s | vs own pool |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        if r.kind != "multiplexed" and name != "isolated":
            continue
        for j in r.jobs:
            own = dedicated.get(j.job_id, math.nan)
            saving = j.used_device_s / own - 1 if own else math.nan
            out.append(
                f"| {label(name)} | {j.job_id} | {j.group or '–'} | {_f(j.finish_s, 1)} | "
                f"{_f(j.step_time_s / j.steps if j.steps else math.nan, 2)} | "
                f"{_f(j.slowdown, 1, True)} | {_f(j.call_queue_s / j.steps, 2)} | {j.swaps} | "
                f"{_f(j.swap_s, 2)} | {_f(j.used_device_s, 1)} | {_f(saving, 1, True, True)} |"
            )
    out.append("")
    return out


def _reference_rows(setup: Setup, figs: dict[str, Any]) -> list[tuple[str, float, float]]:
    ref = setup.workload.reference
    dep = figs["deployments"]
    rows: list[tuple[str, float, float]] = []
    for p, want in ref.bubble.items():
        if p in figs["bubble"]:
            rows.append((f"bubble ratio {p} (dedicated)", want, figs["bubble"][p]))
    sb = dep.get("spread-backfill", {}).get("savings_vs_split_async", {})
    for p, want in ref.savings_vs_split_async.items():
        if p in sb:
            rows.append((f"Split-Async -> Spread+Backfill, {p} (charged)", want, sb[p]))
    for name, want in ref.makespan_vs_isolated.items():
        got = dep.get(name, {}).get("makespan_vs_isolated")
        if got is not None:
            rows.append((f"makespan {label(name)} / Isolated", want, got))
    return rows


def _beat_rows(figs: dict[str, Any]) -> list[tuple[str, str, str, str, bool]]:
    rows: list[tuple[str, str, str, str, bool]] = []
    for name in ("plexrl", "plexrl+tail"):
        e = figs["deployments"].get(name)
        if e is None:
            continue
        lab = e["label"]
        by_size = e.get("occupied_savings_vs_split_async", {})
        if by_size:
            worst = max(by_size.values())
            rows.append(
                (
                    lab,
                    "occupied GPU-hours/step vs Split-Async (worst size)",
                    "≤ -45%",
                    _f(worst, 1, True, True),
                    worst <= BEAT["savings_vs_split_async"],
                )
            )
        rows.append(
            (
                lab,
                "mean per-job slowdown",
                "≤ 5%",
                _f(e["mean_slowdown"], 1, True),
                e["mean_slowdown"] <= BEAT["mean_slowdown"],
            )
        )
        vs_sa = e.get("mean_slowdown_vs_split_async", math.nan)
        if not math.isnan(vs_sa):
            rows.append(
                (
                    lab,
                    "mean per-job slowdown vs Split-Async's step time",
                    "≤ 5%",
                    _f(vs_sa, 1, True, True),
                    vs_sa <= BEAT["mean_slowdown"],
                )
            )
        if "makespan_vs_isolated" in e:
            floor = figs.get("makespan_floor_vs_isolated", math.nan)
            rows.append(
                (
                    lab,
                    "makespan / Isolated"
                    + ("" if math.isnan(floor) else f" (floor {_f(floor, 1, True)})"),
                    "≤ 50%",
                    _f(e["makespan_vs_isolated"], 1, True),
                    e["makespan_vs_isolated"] <= BEAT["makespan_vs_isolated"],
                )
            )
    return rows


# Files ------------------------------------------------------------------------------------


def write_csvs(
    out: Path, setup: Setup, results: dict[str, DeploymentResult], figs: dict[str, Any]
) -> None:
    profiles = profiles_of(setup)
    with (out / "summary.csv").open("w", newline="") as fh:
        w = csv.writer(fh)
        keys = [
            "makespan_days",
            "makespan_vs_isolated",
            "mean_slowdown",
            "p95_slowdown",
            "mean_slowdown_vs_split_async",
            "mean_admission_wait_h",
            "mean_call_wait_per_step_s",
            "busy_fraction",
            "swapped_tb",
            "finished",
            "rejected",
            "sim_wall_s",
            "events",
            "policy_calls",
            "policy_s",
        ]
        w.writerow(["deployment", *keys])
        for name, e in figs["deployments"].items():
            w.writerow([name, *[e.get(k, "") for k in keys]])
    with (out / "cost.csv").open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(
            [
                "deployment",
                "size",
                "gpu_h_per_step_charged",
                "gpu_h_per_step_occupied",
                "savings_vs_split_async",
                "savings_vs_colocated",
                "occupied_savings_vs_split_async",
                "occupied_savings_vs_colocated",
                "alone_billed_savings_vs_split_async",
            ]
        )
        for name, e in figs["deployments"].items():
            for p in profiles:
                w.writerow(
                    [
                        name,
                        p,
                        e["gpu_h_per_step"][p],
                        e["occupied_gpu_h_per_step"][p],
                        e.get("savings_vs_split_async", {}).get(p, ""),
                        e.get("savings_vs_colocated", {}).get(p, ""),
                        e.get("occupied_savings_vs_split_async", {}).get(p, ""),
                        e.get("occupied_savings_vs_colocated", {}).get(p, ""),
                        e.get("alone_billed_savings_vs_split_async", {}).get(p, ""),
                    ]
                )
    with (out / "jobs.csv").open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(
            [
                "deployment",
                "job",
                "size",
                "devices",
                "steps",
                "group",
                "arrival_s",
                "start_s",
                "finish_s",
                "step_time_s",
                "isolated_step_time_s",
                "slowdown",
                "call_wait_s",
                "swap_s",
                "swaps",
                "useful_device_s",
                "charged_gpu_s",
                "occupied_gpu_s",
                "learned_duty",
                "rehomed_from",
                "rejected",
            ]
        )
        for name, r in results.items():
            for j in r.jobs:
                w.writerow(
                    [
                        name,
                        j.job_id,
                        j.profile,
                        j.devices,
                        j.steps,
                        j.group,
                        f"{j.arrival_s:.1f}",
                        f"{j.start_s:.1f}",
                        f"{j.finish_s:.1f}",
                        f"{j.step_time_s:.1f}",
                        f"{j.isolated_step_time_s:.1f}",
                        f"{j.slowdown:.5f}",
                        f"{j.call_queue_s:.1f}",
                        f"{j.swap_s:.1f}",
                        j.swaps,
                        f"{j.useful_device_s:.0f}",
                        f"{j.used_device_s:.0f}",
                        f"{j.occupied_gpu_s:.0f}",
                        "" if math.isnan(j.learned_duty) else f"{j.learned_duty:.4f}",
                        j.rehomed_from,
                        j.rejected,
                    ]
                )
    with (out / "timeline.csv").open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["deployment", "hour", "allocated_gpus", "busy_gpus"])
        for name, r in results.items():
            alloc, busy = r.timeline.trimmed(max(r.makespan_s, 1.0))
            for h, (a, b) in enumerate(zip(alloc, busy, strict=True)):
                w.writerow([name, h, f"{a / HOUR:.1f}", f"{b / HOUR:.1f}"])


def write_charts(
    out: Path, setup: Setup, results: dict[str, DeploymentResult], figs: dict[str, Any]
) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[str] = []
    profiles = profiles_of(setup)
    names = list(results)
    dep = figs["deployments"]

    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / max(len(names), 1)
    x = np.arange(len(profiles))
    for i, name in enumerate(names):
        values = [dep[name]["occupied_gpu_h_per_step"][p] for p in profiles]
        ax.bar(x + i * width, values, width, label=label(name))
    ax.set_xticks(x + width * (len(names) - 1) / 2, profiles)
    ax.set_yscale("log")
    ax.set_ylabel("GPU-hours per training step (occupied)")
    ax.set_title("GPU-hours per training step by model size")
    ax.legend(fontsize=7, ncol=2)
    written.append(_save(fig, out / "gpu_hours_per_step.png"))

    fig, ax = plt.subplots(figsize=(9, 4))
    spans = [dep[n]["makespan_days"] for n in names]
    ax.barh([label(n) for n in names], spans, color="tab:blue")
    iso = dep.get("isolated", {}).get("makespan_days")
    if iso:
        ax.axvline(iso, color="k", ls="--", lw=1, label="Isolated")
        ax.axvline(0.5 * iso, color="tab:red", ls=":", lw=1, label="50% of Isolated")
        ax.legend(fontsize=8)
    ax.set_xlabel("makespan (days)")
    ax.set_title("Makespan by deployment")
    written.append(_save(fig, out / "makespan.png"))

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, r in results.items():
        s = np.sort(r.slowdowns())
        if s.size:
            ax.plot(s * 100, np.arange(1, s.size + 1) / s.size, label=label(name))
    ax.axvline(5, color="tab:red", ls=":", lw=1)
    ax.set_xlabel("per-job step-time slowdown vs Isolated (%)")
    ax.set_ylabel("fraction of jobs")
    ax.set_title("Per-job slowdown distribution")
    ax.legend(fontsize=7)
    written.append(_save(fig, out / "slowdown_cdf.png"))

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in results.items():
        waits = np.sort([j.admission_wait_s / HOUR for j in r.finished])
        if waits.size:
            a1.plot(waits, np.arange(1, waits.size + 1) / waits.size, label=label(name))
    a1.set_xlabel("admission wait (hours)")
    a1.set_ylabel("fraction of jobs")
    a1.set_title("Waiting for a pool / home group")
    a1.legend(fontsize=7)
    multiplexed = [n for n, r in results.items() if r.kind == "multiplexed"]
    a2.bar(
        [label(n) for n in multiplexed],
        [dep[n]["mean_call_wait_per_step_s"] for n in multiplexed],
        color="tab:orange",
    )
    a2.set_ylabel("call wait per training step (s)")
    a2.set_title("Waiting for the group (shared deployments)")
    a2.tick_params(axis="x", labelrotation=30, labelsize=7)
    written.append(_save(fig, out / "queueing_delay.png"))

    fig, ax = plt.subplots(figsize=(10, 4.5))
    for name, r in results.items():
        _, busy = r.timeline.trimmed(max(r.makespan_s, 1.0))
        days = np.arange(busy.size) / 24
        smooth = _daily(busy) / (setup.gpus * HOUR)
        ax.plot(days[: smooth.size * 24 : 24] if smooth.size else days, smooth, label=label(name))
    ax.set_xlabel("day")
    ax.set_ylabel("busy fraction of the cluster (daily mean)")
    ax.set_title("Cluster busy fraction over time (useful device-seconds)")
    ax.legend(fontsize=7)
    written.append(_save(fig, out / "busy_fraction.png"))
    return written


def _daily(hourly: np.ndarray) -> np.ndarray:
    n = hourly.size // 24
    if n == 0:
        return hourly
    return hourly[: n * 24].reshape(n, 24).mean(axis=1)


def _save(fig: Any, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return str(path)


def write_report(
    out: Path, setup: Setup, results: dict[str, DeploymentResult], charts: bool = True
) -> dict[str, Any]:
    """Write report.md, the CSVs and the charts into `out`; returns the figures."""
    out.mkdir(parents=True, exist_ok=True)
    figs = figures(setup, results)
    (out / "report.md").write_text(markdown(setup, results, figs))
    write_csvs(out, setup, results, figs)
    if charts:
        write_charts(out, setup, results, figs)
    return figs
