"""The simulator interpreted against its mypyc build, or one build against another's:
CPU and sameness.

Builds the compiled simulator if there is no current build (`plexrl sim-build`, its CPU
reported), then runs one `plexrl sim` both ways, one after the other, each in its own
process, and measures each run's CPU (user + system, of the process and its children).
Every output file must be byte for byte the same, and the JSON line the same but for
its timings (wall_s, sim_wall_s, policy_s). Ends with one JSON line.

With `--previous REV` it compares builds instead: this checkout's and that of git
revision REV (a `git worktree`, built by its own `plexrl_sim.native` into the same
build directory), the two runs side by side, one per core, so both have the same hour
of the shared machine. Arguments after `--` go to `plexrl sim` as they are.

    .venv/bin/python bench/sim_native.py                     # a quarter of the trace
    .venv/bin/python bench/sim_native.py --gpus 2048 --jobs 0  # the whole trace
    .venv/bin/python bench/sim_native.py --gpus 2048 --jobs 0 --previous REV \\
        --policy plexrl+tail,split-async,isolated -- --staleness 1 --partition packed --fb-slices 8
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from control_plane import worktree

from plexrl_sim import native

TIMINGS = frozenset({"wall_s", "sim_wall_s", "policy_s", "out"})


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def sim_command(args: list[str], out: Path) -> list[str]:
    """`plexrl sim args`, its outputs to `out`, without charts."""
    return [
        sys.executable,
        "-m",
        "plexrl_tools.cli",
        "sim",
        *args,
        "--out",
        str(out),
        "--no-charts",
    ]


def run(args: list[str], out: Path, compiled: bool) -> tuple[float, dict[str, Any]]:
    env = {**os.environ, native.ENV: "1" if compiled else "0"}
    before = children_cpu()
    done = subprocess.run(
        sim_command(args, out),
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    cpu = children_cpu() - before
    if done.returncode != 0:
        sys.exit(f"plexrl sim failed ({'compiled' if compiled else 'interpreted'}):\n{done.stderr}")
    if compiled != ("compiled build" in done.stderr):
        sys.exit(f"expected the {'compiled' if compiled else 'interpreted'} run:\n{done.stderr}")
    return cpu, json.loads(done.stdout.strip().splitlines()[-1])


def build_of(libs: Path, root: Path) -> Path:
    """The compiled build of the sources in `libs`, made by their own `native` module
    if there is none yet under `root`."""
    made = subprocess.run(
        [sys.executable, "-c", BUILD, str(root), str(libs)],
        env={**os.environ, "PYTHONPATH": str(libs)},
        capture_output=True,
        text=True,
        check=False,
    )
    if made.returncode != 0:
        sys.exit(f"building the simulator of {libs} failed:\n{made.stderr}")
    return Path(made.stdout.strip().splitlines()[-1])


BUILD = (
    "import sys; from pathlib import Path; from plexrl_sim import native;"
    "print(native.build(Path(sys.argv[1]), Path(sys.argv[2])))"
)


def side_by_side(args: list[str], builds: dict[str, Path], outs: dict[str, Path]) -> dict[str, Any]:
    """Each build's run of `plexrl sim args` at the same time; per build its CPU (its
    process and the deployments' processes it waited for) and its JSON line."""
    running: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}
    for name, build in builds.items():
        env = {**os.environ, native.ENV: "active", "PYTHONPATH": str(build)}
        logs = outs[name].with_suffix(".log")
        with open(logs, "wb") as log, open(logs.with_suffix(".json"), "wb") as line:
            command = sim_command(args, outs[name])
            running[name] = (subprocess.Popen(command, env=env, stdout=line, stderr=log), logs)
    done: dict[str, Any] = {}
    for name, (process, logs) in running.items():
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
        if process.returncode != 0:
            sys.exit(f"plexrl sim over {builds[name]} failed:\n{logs.read_text()[-4000:]}")
        if "compiled build" not in logs.read_text():
            sys.exit(f"plexrl sim did not run over {builds[name]}:\n{logs.read_text()[-4000:]}")
        figures = json.loads(logs.with_suffix(".json").read_text().strip().splitlines()[-1])
        done[name] = (usage.ru_utime + usage.ru_stime, figures)
    return done


def compare_builds(previous: str, sim_args: list[str]) -> None:
    root, libs = native.default_root(), native.libs_dir()
    with (
        worktree(previous) as (commit, path),
        tempfile.TemporaryDirectory(prefix="plexrl-sim-builds-") as tmp,
    ):
        print(f"building this checkout's simulator and {commit[:10]}'s...", file=sys.stderr)
        builds = {"this": build_of(libs, root), "previous": build_of(path / "libs", root)}
        outs = {name: Path(tmp) / name for name in builds}
        print(f"plexrl sim {' '.join(sim_args)}: both builds at once...", file=sys.stderr)
        runs = side_by_side(sim_args, builds, outs)
        (cpu, figures), (cpu_prev, figures_prev) = runs["this"], runs["previous"]
        same = sameness((outs["this"], outs["previous"]), (figures, figures_prev))
    finish(
        {
            "benchmark": "sim_native",
            "sim_args": sim_args,
            "previous": commit,
            "this_cpu_s": round(cpu, 1),
            "previous_cpu_s": round(cpu_prev, 1),
            "this_over_previous": round(cpu / cpu_prev, 3) if cpu_prev else None,
            **same,
        }
    )


def sameness(outs: tuple[Path, Path], figures: tuple[Any, Any]) -> dict[str, Any]:
    """Two runs' output files compared byte for byte (`summary.csv` holds timings) and
    their JSON lines but for their timings."""
    files = sorted(p.name for p in outs[0].iterdir() if p.name != "summary.csv")
    _, mismatch, errors = filecmp.cmpfiles(outs[0], outs[1], files, shallow=False)
    same_json = without_timings(figures[0]) == without_timings(figures[1])
    return {
        "files_compared": len(files),
        "files_differing": mismatch + errors,
        "figures_identical": same_json and not (mismatch or errors),
    }


def finish(line: dict[str, Any]) -> None:
    """Print the JSON line; exit 1 unless the two runs' figures were the same."""
    print(json.dumps(line))
    if not line["figures_identical"]:
        sys.exit(1)


def without_timings(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: without_timings(v) for k, v in value.items() if k not in TIMINGS}
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="workloads/trace-3mo.yaml")
    parser.add_argument("--policy", default="plexrl+tail")
    parser.add_argument("--gpus", type=int, default=512)
    parser.add_argument("--jobs", type=int, default=225, help="0: the workload's")
    parser.add_argument(
        "--previous", metavar="REV", help="compare this checkout's build with REV's, side by side"
    )
    parser.add_argument("sim_args", nargs=argparse.REMAINDER, help="after --: to plexrl sim")
    args = parser.parse_args()
    extra = args.sim_args[1:] if args.sim_args[:1] == ["--"] else args.sim_args
    sim_args = ["--workload", args.workload, "--policy", args.policy, "--gpus", str(args.gpus)]
    if args.jobs:
        sim_args += ["--jobs", str(args.jobs)]
    sim_args += extra
    if args.previous:
        compare_builds(args.previous, sim_args)
        return

    root, libs = native.default_root(), native.libs_dir()
    build_cpu = None
    if native.current_build(root, libs) is None:
        print("compiling the simulator (plexrl sim-build)...", file=sys.stderr, flush=True)
        before = time.process_time(), children_cpu()
        native.build(root, libs)
        build_cpu = round(time.process_time() - before[0] + children_cpu() - before[1], 1)

    with tempfile.TemporaryDirectory(prefix="plexrl-sim-native-") as tmp:
        outs = {name: Path(tmp) / name for name in ("interpreted", "compiled")}
        print(f"plexrl sim {' '.join(sim_args)}: interpreted...", file=sys.stderr, flush=True)
        cpu_py, figs_py = run(sim_args, outs["interpreted"], compiled=False)
        print(f"  {cpu_py:.1f} s CPU; compiled...", file=sys.stderr, flush=True)
        cpu_c, figs_c = run(sim_args, outs["compiled"], compiled=True)
        print(f"  {cpu_c:.1f} s CPU", file=sys.stderr, flush=True)
        same = sameness((outs["interpreted"], outs["compiled"]), (figs_py, figs_c))
    finish(
        {
            "benchmark": "sim_native",
            "workload": args.workload,
            "policy": args.policy,
            "gpus": args.gpus,
            "jobs": args.jobs or None,
            "build_cpu_s": build_cpu,
            "interpreted_cpu_s": round(cpu_py, 1),
            "compiled_cpu_s": round(cpu_c, 1),
            "compiled_over_interpreted": round(cpu_c / cpu_py, 3) if cpu_py else None,
            **same,
        }
    )


if __name__ == "__main__":
    main()
