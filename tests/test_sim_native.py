"""The simulator's mypyc build: found only for the sources it was made from, and a run
over it gives the interpreted run's figures (the whole build, side by side at scale, is
`bench/sim_native.py`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from plexrl_sim import native

REPO = Path(__file__).resolve().parent.parent
SMALL = ("plexrl_sim/events.py", "plexrl_sim/accounting.py", "plexrl/policy/snapshot.py")
"""Three of the compiled modules, the snapshot's thawed types among them: enough to
compile and run a build for real, cheaply."""


def fake_libs(root: Path) -> Path:
    for package, module in (("plexrl", "a.py"), ("plexrl_sim", "b.py")):
        (root / package).mkdir(parents=True)
        (root / package / module).write_text("X = 1\n")
    return root


def test_a_build_is_found_only_for_its_own_sources(tmp_path: Path) -> None:
    libs = fake_libs(tmp_path / "libs")
    builds = tmp_path / "builds"
    target = native.build_dir(builds, libs)
    assert native.current_build(builds, libs) is None
    target.mkdir(parents=True)
    assert native.current_build(builds, libs) is None  # not finished: no `ok`
    (target / "ok").write_text("done\n")
    assert native.current_build(builds, libs) == target
    (libs / "plexrl_sim" / "b.py").write_text("X = 2\n")  # an edited source
    assert native.current_build(builds, libs) is None
    assert native.digest(libs) != native.digest(libs, SMALL)  # the module list counts too


def test_only_plexrl_sim_itself_runs_again_over_a_build() -> None:
    argv = ["/venv/bin/plexrl", "sim", "--workload", "w.yaml"]
    assert native.wanted({}, argv)
    assert not native.wanted({native.ENV: "0"}, argv)  # turned off
    assert not native.wanted({native.ENV: "active"}, argv)  # already over one
    assert not native.wanted({}, ["/venv/bin/pytest", "tests/test_sim_cli.py"])
    env = native.rerun_env(Path("/b"), {"PYTHONPATH": "/x", "HOME": "/h"})
    assert env["PYTHONPATH"] == f"/b{os.pathsep}/x"
    assert env[native.ENV] == "active" and env["HOME"] == "/h"
    assert native.rerun_env(Path("/b"), {})["PYTHONPATH"] == "/b"


def sim(out: Path, env: dict[str, str]) -> tuple[dict[str, object], str]:
    command = [sys.executable, "-m", "plexrl_tools.cli", "sim", "--workload"]
    command += ["workloads/small-demo.yaml", "--policy", "fifo,plexrl", "--no-charts"]
    done = subprocess.run(
        [*command, "--out", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    for key in ("wall_s", "out"):
        figures.pop(key)
    for deployment in figures["deployments"].values():
        for key in ("sim_wall_s", "policy_s"):
            deployment.pop(key)
    return figures, done.stderr


@pytest.mark.timeout(600)
def test_a_compiled_build_gives_the_same_figures(tmp_path: Path) -> None:
    pytest.importorskip("mypyc")
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler: plexrl sim-build needs one (the sources run without)")
    target = native.build(tmp_path / "builds", native.libs_dir(), SMALL)
    assert (target / "ok").is_file()
    assert list((target / "plexrl_sim").glob("events.*.so"))
    assert not (target / "build").exists()  # mypyc's scratch is gone
    assert native.build(tmp_path / "builds", native.libs_dir(), SMALL) == target  # kept

    # The snapshot's types are native classes there, plain dataclasses hashed and
    # compared as the frozen ones are (`native.thaw`); the sources keep them frozen.
    probe = (
        "import dataclasses; from plexrl.policy.snapshot import *;"
        "j = JobView('a', 1, home='g'); w = WorkerView('g', 1, 1);"
        "s = ClusterSnapshot(0.0, {'g': w}, {'a': j}, ());"
        "t = dataclasses.replace(s, jobs={'a': dataclasses.replace(j, home='h')});"
        "print(hasattr(j, '__dict__'), JobView.__dataclass_params__.frozen,"
        " hash(w) == hash(WorkerView('g', 1, 1)), s.homed_view('g') == [j],"
        " t.homed_view('h')[0].home, t.homed_view('g'))"
    )
    env = native.rerun_env(target, dict(os.environ))
    shown = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
    )
    assert shown.stdout.split() == ["False", "False", "True", "True", "h", "()"]

    plain, _ = sim(tmp_path / "py", {**os.environ, native.ENV: "0"})
    over, stderr = sim(tmp_path / "c", native.rerun_env(target, dict(os.environ)))
    assert "compiled build" in stderr
    assert over == plain
    for name in ("cost.csv", "jobs.csv", "report.md", "timeline.csv"):
        assert (tmp_path / "c" / name).read_bytes() == (tmp_path / "py" / name).read_bytes()


def test_the_snapshots_types_are_thawed_for_a_build_and_only_there() -> None:
    source = (native.libs_dir() / "plexrl/policy/snapshot.py").read_text()
    assert "@quick_init\n@dataclass(frozen=True)\nclass JobView:" in source
    thawed = native.thaw(source)
    assert "frozen=True" not in thawed and "@quick_init\n" not in thawed
    assert "@dataclass(unsafe_hash=True)\nclass JobView:" in thawed
    assert native.thaw("@dataclass(frozen=True)\nclass A:\n    x: int\n") == (
        "@dataclass(unsafe_hash=True)\nclass A:\n    x: int\n"
    )
    with pytest.raises(ValueError, match="nothing to thaw"):
        native.thaw("@dataclass\nclass A:\n    x: int\n")
    assert set(native.THAWED) <= set(native.COMPILED)
