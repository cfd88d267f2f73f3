"""bench/sim_prediction.py: the prediction sampled through a small trace, and its
summary's arithmetic."""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from sim_prediction import _correlation, _summary, run  # noqa: E402


def test_the_summary_compares_each_job_with_itself() -> None:
    rows = [
        {
            "measured": 0.04,
            "predicted": 0.05,
            "shared": 1.0,
            "alone_beside_alone": 0.0,
            "step_over_estimate": 0.01,
            "estimate_error": 0.03,
        },
        {
            "measured": 0.0,
            "predicted": 0.0,
            "shared": 0.0,
            "alone_beside_alone": 0.5,
            "step_over_estimate": math.nan,
            "estimate_error": math.nan,
        },
    ]
    s = _summary(rows)
    assert s["jobs"] == 2
    assert s["measured"] == pytest.approx(0.02) and s["predicted"] == pytest.approx(0.025)
    assert s["error_mean_abs"] == pytest.approx(0.005)
    # A job with no estimate of its step alone is left out of those columns, not zero.
    assert s["estimate_error"] == pytest.approx(0.03)
    assert math.isnan(_correlation([0.1, 0.2, 0.3], [0.0, 0.0, 0.0]))
    assert _correlation([0.1, 0.2, 0.3], [0.2, 0.4, 0.6]) == pytest.approx(1.0)


def test_a_small_trace_is_sampled_while_its_jobs_share() -> None:
    args = argparse.Namespace(
        workload=str(ROOT / "workloads" / "trace-3mo.yaml"),
        seed=0,
        gpus=256,
        jobs=12,
        staleness=1,
        fb_slices=8,
        sample_s=7200.0,
    )
    out = run(args)
    summary = out["all"]
    assert 0 < summary["jobs"] <= 12
    assert sum(c["jobs"] for c in out["classes"].values()) == summary["jobs"]
    assert 0.0 <= summary["predicted"] <= 1.0 and math.isfinite(summary["measured"])
    # Some of the time they shared a group; alone beside another alone is time alone.
    assert 0.0 < summary["shared"] <= 1.0
    assert summary["alone_beside_alone"] <= 1.0 - summary["shared"] + 1e-9


def test_over_the_build_its_copies_are_imported_not_the_sources(tmp_path: Path) -> None:
    # Run again over a build (`native.rerun_env`), the script must not put the sources
    # ahead of the build's copies on the path, or it runs interpreted while it says
    # compiled. A stand-in build with a package of its own stands for the real one.
    build = tmp_path / "build"
    (build / "plexrl_sim").mkdir(parents=True)
    (build / "plexrl_sim" / "__init__.py").write_text("")
    (build / "plexrl_sim" / "native.py").write_text("ENV = 'PLEXRL_SIM_NATIVE'\n")
    probe = (
        "import sys; sys.path.insert(0, sys.argv[1]); import sim_prediction, plexrl_sim; "
        "print(plexrl_sim.__file__)"
    )
    env = {**os.environ, "PLEXRL_SIM_NATIVE": "active", "PYTHONPATH": str(build)}
    out = subprocess.run(
        [sys.executable, "-c", probe, str(ROOT / "bench")],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert Path(out.stdout.strip()).parent == build / "plexrl_sim"
