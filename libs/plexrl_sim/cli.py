"""`plexrl sim`: simulate a workload under one deployment or all of them side by side,
write the report, and end with one JSON line of the figures."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

DEFAULT_OUT = Path("sim-out")


def _parse_sets(values: list[str]) -> dict[str, float | int | bool]:
    out: dict[str, float | int | bool] = {}
    for item in values:
        key, sep, raw = item.partition("=")
        if not sep:
            raise typer.BadParameter(f"--set {item!r}: write it as key=value, e.g. max_load=0.9")
        if raw.lower() in ("true", "false"):
            out[key] = raw.lower() == "true"
        else:
            try:
                out[key] = int(raw)
            except ValueError:
                try:
                    out[key] = float(raw)
                except ValueError:
                    raise typer.BadParameter(f"--set {item!r}: {raw!r} is not a number") from None
    return out


def _clean(value: Any) -> Any:
    """JSON has no NaN: write null instead."""
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def _use_native_build() -> None:
    """Run again over the compiled build if there is one for these sources."""
    from plexrl_sim import native

    if native.active():
        typer.echo("plexrl sim: compiled build (mypyc)", err=True)
        return
    if not native.wanted(dict(os.environ), sys.argv):
        return
    target = native.current_build(native.default_root(), native.libs_dir())
    if target is None:
        typer.echo(
            "plexrl sim: interpreted; `plexrl sim-build` compiles it once (about 45 s of "
            "CPU) and makes long runs about half as dear",
            err=True,
        )
        return
    native.rerun_over(target)


def sim_build() -> None:
    """Compile the simulator's hot modules with mypyc, once per change of its sources;
    `plexrl sim` then runs the build (PLEXRL_SIM_NATIVE=0 keeps it interpreted)."""
    from plexrl_sim import native

    root, libs = native.default_root(), native.libs_dir()
    found = native.current_build(root, libs)
    if found is not None:
        typer.echo(f"plexrl sim-build: {found} is current")
        return
    typer.echo(
        f"plexrl sim-build: compiling {len(native.COMPILED)} modules with mypyc into "
        f"{native.build_dir(root, libs)} (about 45 s of CPU)...",
        err=True,
    )
    started = time.perf_counter()
    try:
        target = native.build(root, libs)
    except (RuntimeError, OSError) as err:
        typer.echo(f"plexrl sim-build: {err}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"plexrl sim-build: {target} in {time.perf_counter() - started:.0f} s")


def sim(
    workload: Annotated[
        Path,
        typer.Option("--workload", "-w", help="Workload YAML (see workloads/)."),
    ],
    policy: Annotated[
        str,
        typer.Option(
            "--policy",
            "-p",
            help="Deployment(s), comma-separated: isolated, colocated, split-async, a policy "
            "(pack, spread, spread-backfill, plexrl, fifo) optionally suffixed +tail, or all.",
        ),
    ] = "all",
    gpus: Annotated[
        int | None, typer.Option(help="Cluster size (default: the workload's).")
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed for every random draw.")] = 0,
    out: Annotated[Path, typer.Option(help="Directory for the report.")] = DEFAULT_OUT,
    days: Annotated[
        float | None,
        typer.Option(help="Arrival window in days (default: the workload's; same rate)."),
    ] = None,
    jobs: Annotated[
        int | None, typer.Option(help="Jobs in the trace (default: the workload's).")
    ] = None,
    parallel: Annotated[int, typer.Option(help="Run deployments in this many processes.")] = 1,
    set_: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            help="PolicyConfig override for the shared deployments, e.g. --set max_load=0.9.",
        ),
    ] = None,
    partition: Annotated[
        str | None,
        typer.Option(
            help="Split of the GPUs into groups per model size: dedicated (default; the "
            "same layout for every deployment), shared, auto, or packed (the policies' "
            "groups sized by each job's run over the jobs a group is predicted to hold).",
        ),
    ] = None,
    staleness: Annotated[
        int | None,
        typer.Option(
            help="Every job's loop: 0 synchronous, k asynchronous with sampler weights at "
            "most k steps old (and Split-Async at the same staleness); default: the "
            "workload's.",
        ),
    ] = None,
    fb_slices: Annotated[
        int | None,
        typer.Option(
            help="Slices of each forward_backward call an asynchronous job's training may "
            "be paused between for another job's sample (1: whole calls, the live "
            "worker's); default: the workload's.",
        ),
    ] = None,
    declared_error: Annotated[
        float | None,
        typer.Option(
            help="How far the trace's jobs' declared steps (what admission orders by) are "
            "off their real steps: the sigma of a lognormal factor (0: exact); default: "
            "the workload's.",
        ),
    ] = None,
    known_duty: Annotated[
        bool,
        typer.Option(
            help="A control: each shared deployment runs twice, the second time with "
            "every job's duty cycle as the first run learned it by the job's last step "
            "given to the policy from the job's arrival, instead of its kind's figures "
            "until the job has a history of its own (what the live scheduler knows).",
        ),
    ] = False,
    colocation: Annotated[
        str,
        typer.Option(
            help="Costs of sharing a group instead of the workload's (`cluster.colocation`), "
            "e.g. switch_s=0,tail_min_share=0,tail_contention=1: a control, what the shared "
            "deployments measure were sharing that cheap; charged and predicted alike.",
        ),
    ] = "",
    charge: Annotated[
        str,
        typer.Option(
            help="Costs of sharing the executor charges on top of those (same keys as "
            "--colocation), which the shared deployments' policy does not know: it starts "
            "from the others and learns these as the live scheduler learns its workers' "
            "measurements (--learn-costs). What if a real group costs other than assumed.",
        ),
    ] = "",
    learn_costs: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="With --charge: how often a cost must have been paid before the policy "
            "predicts with it; default: the live scheduler's (PLEXRL_SHARING_LEARN_SAMPLES); "
            "0: never (the policy keeps the costs it assumed).",
        ),
    ] = None,
    charts: Annotated[bool, typer.Option(help="Write the PNG charts.")] = True,
) -> None:
    """Simulate RLVR jobs on a cluster under the scheduler's own policy code."""
    from tqdm import tqdm

    _use_native_build()

    from plexrl_sim.report import write_report
    from plexrl_sim.run import DEPLOYMENTS, label, prepare, run_many
    from plexrl_sim.workload import parse_colocation

    started = time.perf_counter()
    try:
        setup = prepare(
            workload,
            seed=seed,
            gpus=gpus,
            days=days,
            jobs=jobs,
            partition=partition,
            staleness=staleness,
            fb_slices=fb_slices,
            declared_error=declared_error,
            known_duty=known_duty,
            colocation=parse_colocation(colocation),
            charge=parse_colocation(charge),
            **({"learn_costs": learn_costs} if learn_costs is not None else {}),
        )
    except (OSError, ValueError) as err:
        typer.echo(f"plexrl sim: {err}", err=True)
        raise typer.Exit(2) from None
    names = list(DEPLOYMENTS) if policy == "all" else [p.strip() for p in policy.split(",")]
    overrides = _parse_sets(set_ or [])
    # The report compares against the dedicated baselines, which cost next to nothing.
    names = [b for b in ("isolated", "colocated", "split-async") if b not in names] + names
    typer.echo(
        f"plexrl sim: {setup.workload.name}, {len(setup.jobs)} jobs on {setup.gpus} GPUs "
        f"({len(setup.groups)} groups), seed {seed}: {', '.join(label(n) for n in names)}",
        err=True,
    )
    if parallel > 1:
        bar = tqdm(total=len(names), unit="deployment", file=sys.stderr)

        def done(result: Any) -> None:
            bar.set_postfix_str(label(result.name))
            bar.update(1)

        try:
            results = run_many(setup, names, parallel, overrides, on_done=done)
        except ValueError as err:
            typer.echo(f"plexrl sim: {err}", err=True)
            raise typer.Exit(2) from None
        bar.close()
    else:
        results = {}
        bars: dict[str, Any] = {}
        horizon_s = [86400.0]

        def tick(name: str, x: float) -> None:
            # Shared deployments report simulated seconds, dedicated ones a fraction.
            in_time = name not in ("isolated", "colocated", "split-async")
            scale = 86400.0 if horizon_s[0] >= 2 * 86400 else 1.0
            if name not in bars:
                bars[name] = tqdm(
                    total=round(horizon_s[0] / scale, 1) if in_time else 1.0,
                    desc=label(name),
                    unit=("day" if scale > 1 else "s") if in_time else "",
                    file=sys.stderr,
                    bar_format="{l_bar}{bar}| {n:.1f}/{total_fmt} {unit}",
                )
            b = bars[name]
            value = x / scale if in_time else x
            b.update(max(0.0, min(value, b.total) - b.n))

        for name in names:
            try:
                part = run_many(setup, [name], 1, overrides, progress=tick)
            except ValueError as err:
                typer.echo(f"plexrl sim: {err}", err=True)
                raise typer.Exit(2) from None
            results.update(part)
            if name in bars:
                # The horizon was Isolated's makespan; a shared cluster ends sooner.
                bars[name].total = bars[name].n
                bars[name].refresh()
                bars[name].close()
            if name == "isolated":
                horizon_s[0] = max(part[name].makespan_s, 1.0)
    figs = write_report(out, setup, results, charts=charts)
    figs["out"] = str(out)
    figs["wall_s"] = time.perf_counter() - started
    typer.echo(f"plexrl sim: report in {out}/report.md", err=True)
    typer.echo(json.dumps(_clean(figs), separators=(",", ":")))
