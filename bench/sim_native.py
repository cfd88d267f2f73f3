"""The simulator interpreted against its mypyc build, side by side: CPU and sameness.

Builds the compiled simulator if there is no current build (`plexrl sim-build`, its CPU
reported), then runs one `plexrl sim` both ways, one after the other, each in its own
process, and measures each run's CPU (user + system, of the process and its children).
Every output file must be byte for byte the same, and the JSON line the same but for
its timings (wall_s, sim_wall_s, policy_s). Ends with one JSON line.

    .venv/bin/python bench/sim_native.py                     # a quarter of the trace
    .venv/bin/python bench/sim_native.py --gpus 2048 --jobs 0  # the whole trace
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

from plexrl_sim import native

TIMINGS = frozenset({"wall_s", "sim_wall_s", "policy_s", "out"})


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(args: list[str], out: Path, compiled: bool) -> tuple[float, dict[str, Any]]:
    env = {**os.environ, native.ENV: "1" if compiled else "0"}
    before = children_cpu()
    done = subprocess.run(
        [sys.executable, "-m", "plexrl_tools.cli", "sim", *args, "--out", str(out), "--no-charts"],
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
    args = parser.parse_args()

    root, libs = native.default_root(), native.libs_dir()
    build_cpu = None
    if native.current_build(root, libs) is None:
        print("compiling the simulator (plexrl sim-build)...", file=sys.stderr, flush=True)
        before = time.process_time(), children_cpu()
        native.build(root, libs)
        build_cpu = round(time.process_time() - before[0] + children_cpu() - before[1], 1)

    sim_args = ["--workload", args.workload, "--policy", args.policy, "--gpus", str(args.gpus)]
    if args.jobs:
        sim_args += ["--jobs", str(args.jobs)]
    with tempfile.TemporaryDirectory(prefix="plexrl-sim-native-") as tmp:
        outs = {name: Path(tmp) / name for name in ("interpreted", "compiled")}
        print(f"plexrl sim {' '.join(sim_args)}: interpreted...", file=sys.stderr, flush=True)
        cpu_py, figs_py = run(sim_args, outs["interpreted"], compiled=False)
        print(f"  {cpu_py:.1f} s CPU; compiled...", file=sys.stderr, flush=True)
        cpu_c, figs_c = run(sim_args, outs["compiled"], compiled=True)
        print(f"  {cpu_c:.1f} s CPU", file=sys.stderr, flush=True)
        files = sorted(p.name for p in outs["interpreted"].iterdir() if p.name != "summary.csv")
        _, mismatch, errors = filecmp.cmpfiles(
            outs["interpreted"], outs["compiled"], files, shallow=False
        )
    same_json = without_timings(figs_py) == without_timings(figs_c)
    line = {
        "benchmark": "sim_native",
        "workload": args.workload,
        "policy": args.policy,
        "gpus": args.gpus,
        "jobs": args.jobs or None,
        "build_cpu_s": build_cpu,
        "interpreted_cpu_s": round(cpu_py, 1),
        "compiled_cpu_s": round(cpu_c, 1),
        "compiled_over_interpreted": round(cpu_c / cpu_py, 3) if cpu_py else None,
        "files_compared": len(files),
        "files_differing": mismatch + errors,
        "figures_identical": same_json and not (mismatch or errors),
    }
    print(json.dumps(line))
    if not line["figures_identical"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
