"""The simulator's mypyc build: found only for the sources it was made from, and a run
over it gives the interpreted run's figures (the whole build, side by side at scale, is
`bench/sim_native.py`)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

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
        " t.homed_view('h')[0].home, t.homed_view('g'),"
        " type(JobView.__init__).__name__, type(j.estimates).__name__, s.swap.fixed_s)"
    )
    env = native.rerun_env(target, dict(os.environ))
    shown = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
    )
    # ... with their own `__init__`s compiled (`native.with_inits`), not a Python function.
    assert shown.stdout.split() == [
        *("False", "False", "True", "True", "h", "()"),
        *("wrapper_descriptor", "CallEstimates", "0.0"),
    ]

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


def test_every_policy_module_the_simulator_runs_is_compiled() -> None:
    """A policy module added later and left out of `COMPILED` runs interpreted inside
    the compiled simulator, a few microseconds a call, millions of calls a run."""
    policy = native.libs_dir() / "plexrl/policy"
    modules = {f"plexrl/policy/{p.name}" for p in policy.glob("*.py")}
    left_out = modules - set(native.COMPILED)
    assert left_out == {"plexrl/policy/frozen.py", "plexrl/policy/follow.py"}


SHAPES = """
from dataclasses import dataclass, field
from typing import ClassVar

@dataclass
class Plain:
    a: int
    b: str = "b"
    c: list[int] = field(default_factory=list)
    d: float = field(default=2.5, repr=False)
    e: int = field(init=False, default=7)
    f: int = field(init=False)
    g: ClassVar[int] = 3

    def __post_init__(self) -> None:
        self.f = self.a + 1

@dataclass(unsafe_hash=True)
class Hashed:
    x: int
    y: tuple[int, ...] = ()

@dataclass(frozen=True)
class Frozen:
    z: int
"""


def test_each_plain_dataclass_gets_an_init_of_its_own_that_builds_what_the_generated_one_did() -> (
    None
):
    written = native.with_inits(SHAPES)
    assert written.count("def __init__(") == 2  # not the frozen one's
    made: list[dict[str, Any]] = []
    for source in (SHAPES, written):
        namespace: dict[str, Any] = {}
        exec(compile(source, "<shapes>", "exec", dont_inherit=True), namespace)
        made.append(namespace)
    generated, own = made
    assert "__init__" in own["Plain"].__dict__ and own["Plain"].__init__.__name__ == "__init__"
    for args, kwargs in (((1,), {}), ((1, "x", [2]), {"d": 0.5})):
        a, b = generated["Plain"](*args, **kwargs), own["Plain"](*args, **kwargs)
        assert dataclasses.astuple(a) == dataclasses.astuple(b) and (a.e, a.f) == (7, 2)
    assert own["Plain"](1).c is not own["Plain"](1).c  # a fresh list each
    assert hash(own["Hashed"](1, (2,))) == hash(generated["Hashed"](1, (2,)))
    assert dataclasses.replace(own["Hashed"](1), y=(3,)) == own["Hashed"](1, (3,))
    with pytest.raises(TypeError):
        own["Plain"]()  # `a` has no default


def test_a_dataclass_it_cannot_write_an_init_for_is_refused() -> None:
    for source, match in (
        ("@dataclass\nclass A:\n    x: int | None = field(default_factory=f)\n", "takes None"),
        ("@dataclass\nclass A:\n    x: int = field(kw_only=True)\n", "kw_only"),
        ("@dataclass\nclass A:\n    x: int = field(init=False)\n", "no default nor"),
        ("@dataclass\nclass A:\n    x: InitVar[int]\n", "InitVar"),
        ("@dataclass(kw_only=True)\nclass A:\n    x: int\n", "keyword-only"),
        ("@dataclass\nclass A(B):\n    x: int\n", "base class"),
        ("@dataclass\nclass A:\n    x: int\n    def __init__(self) -> None: ...\n", "its own"),
    ):
        with pytest.raises(ValueError, match=match):
            native.with_inits(source)
    assert set(native.INITS) <= set(native.COMPILED)
