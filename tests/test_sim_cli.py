"""`plexrl sim` end to end on the shipped small setting: report files and the JSON line."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner, Result

from plexrl_sim.cli import sim
from plexrl_sim.workload import load_workload

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = sorted((ROOT / "workloads").glob("*.yaml"))


def app() -> typer.Typer:
    a = typer.Typer()
    a.command()(sim)
    return a


def run_small(*args: str) -> Result:
    """`plexrl sim` on the shipped small setting with these further arguments."""
    return CliRunner().invoke(
        app(), ["--workload", str(ROOT / "workloads" / "small-cpu.yaml"), *args]
    )


def test_small_setting_report_and_json_line(tmp_path):
    out = tmp_path / "out"
    result = run_small("--policy", "all", "--out", str(out))
    assert result.exit_code == 0, result.output
    last = result.stdout.strip().splitlines()[-1]
    figures = json.loads(last)
    assert figures["workload"] == "small-cpu" and figures["jobs"] == 3
    assert set(figures["deployments"]) >= {"isolated", "split-async", "colocated", "plexrl"}
    for name in (
        "report.md",
        "summary.csv",
        "cost.csv",
        "jobs.csv",
        "timeline.csv",
        "gpu_hours_per_step.png",
        "makespan.png",
        "slowdown_cdf.png",
        "queueing_delay.png",
        "busy_fraction.png",
    ):
        assert (out / name).stat().st_size > 0, name
    report = (out / "report.md").read_text()
    assert "GPU-hours per training step" in report and "Per-job prediction" in report
    with (out / "jobs.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    # The duty cycle a shared deployment learned for each job; none where nothing learns.
    assert all(0 < float(r["learned_duty"]) <= 1 for r in rows if r["deployment"] == "plexrl")
    assert all(r["learned_duty"] == "" for r in rows if r["deployment"] == "isolated")
    # Each size's slowdowns are its jobs' in jobs.csv; together they make the whole mean.
    assert "Slowdown by model size" in report
    for name, entry in figures["deployments"].items():
        mine = [r for r in rows if r["deployment"] == name and not r["rejected"]]
        summed = 0.0
        for size, spread in entry["slowdown_by_size"].items():
            slow = [float(r["slowdown"]) for r in mine if r["size"] == size]
            assert spread["mean"] == pytest.approx(sum(slow) / len(slow), abs=1e-4)
            assert spread["p95"] <= max(slow) + 1e-4
            summed += spread["mean"] * len(slow)
        assert summed / len(mine) == pytest.approx(entry["mean_slowdown"], abs=1e-4)


def test_unknown_policy_says_what_to_choose(tmp_path):
    result = run_small("--policy", "nope", "--out", str(tmp_path), "--no-charts")
    assert result.exit_code == 2
    assert "unknown deployment 'nope'" in result.output


def test_the_known_duty_control_from_the_command_line_in_parallel_or_not(tmp_path):
    def run(*extra: str) -> dict:
        out = str(tmp_path / "-".join(extra))
        result = run_small("--policy", "plexrl", "--out", out, "--no-charts", *extra)
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout.strip().splitlines()[-1])["deployments"]["plexrl"]

    # The same control in one process and in several: the same figures.
    one, many = run("--known-duty"), run("--known-duty", "--parallel", "2")
    for key in ("mean_slowdown", "makespan_days", "occupied_gpu_h_per_step"):
        assert one[key] == many[key], key


def test_the_costs_of_sharing_from_the_command_line(tmp_path):
    def mean_slowdown(*extra: str) -> float:
        out = str(tmp_path / ("-".join(extra) or "default"))
        result = run_small("--policy", "fifo", "--out", out, "--no-charts", *extra)
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout.strip().splitlines()[-1])["deployments"]["fifo"][
            "mean_slowdown"
        ]

    dear = mean_slowdown("--colocation", "switch_s=30")
    assert dear > mean_slowdown()
    # Charged apart from what the policy assumes, every deployment pays it; in several
    # processes each is set up again with the same costs.
    assert mean_slowdown("--charge", "switch_s=30") == dear
    assert mean_slowdown("--charge", "switch_s=30", "--parallel", "2") == dear
    assert mean_slowdown("--colocation", "switch_s=30", "--parallel", "2") == dear
    bad = run_small("--policy", "fifo", "--out", str(tmp_path), "--colocation", "switch=1")
    assert bad.exit_code == 2
    assert "use key=value with a key of" in bad.output


@pytest.mark.parametrize("path", WORKLOADS, ids=lambda p: p.name)
def test_shipped_workloads_load(path):
    workload = load_workload(path)
    assert workload.profiles


def test_a_bad_workload_names_the_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nprofiles: {p: {devices: two}}\njobs: []\n")
    with pytest.raises(ValueError, match="devices"):
        load_workload(bad)
