"""The simulator compiled to C with mypyc: the same code, about half the CPU.

A 2,048-GPU, three-month trace makes millions of policy decisions, each a few dozen
small Python functions; compiling the hot modules (the event loop, the group executor,
the replay and the policy's own code) with mypyc takes about 45 s of CPU once and makes
every run after it cheaper, figure for figure the same (`bench/sim_native.py` runs both
side by side and compares every output file).

`plexrl sim-build` copies `plexrl` and `plexrl_sim` into `.plexrl/sim-native/<digest>/`
and compiles `COMPILED` there; the digest covers every source file of both packages,
the Python and the mypy versions, so an edited source never runs as a stale build.
`plexrl sim` finds a build for the current digest and runs itself again with it first
on PYTHONPATH (worker processes of `--parallel` inherit it); `PLEXRL_SIM_NATIVE=0`
keeps it interpreted. Nothing else ever imports the build: services and tests run
the sources.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

PACKAGES = ("plexrl", "plexrl_sim")
"""Copied whole into a build (the compiled modules import the rest from beside them)."""

COMPILED = (
    "plexrl_sim/accounting.py",
    "plexrl_sim/dedicated.py",
    "plexrl_sim/events.py",
    "plexrl_sim/executor.py",
    "plexrl_sim/multiplexed.py",
    "plexrl_sim/replay.py",
    "plexrl_sim/results.py",
    "plexrl/policy/__init__.py",
    "plexrl/policy/actions.py",
    "plexrl/policy/anticipate.py",
    "plexrl/policy/backfill.py",
    "plexrl/policy/common.py",
    "plexrl/policy/config.py",
    "plexrl/policy/cosample.py",
    "plexrl/policy/costs.py",
    "plexrl/policy/defer.py",
    "plexrl/policy/fifo.py",
    "plexrl/policy/history.py",
    "plexrl/policy/pack.py",
    "plexrl/policy/plexrl_policy.py",
    "plexrl/policy/preempt.py",
    "plexrl/policy/rehome.py",
    "plexrl/policy/roam.py",
    "plexrl/policy/share.py",
    "plexrl/policy/snapshot.py",
    "plexrl/policy/spread.py",
)
"""The hot modules: the simulator and every policy module it runs. Left interpreted:
`frozen.py` (it writes `__init__`s with `exec`), `follow.py` (the live scheduler's
only), the workload loader, the report and the command line (not hot)."""

THAWED = ("plexrl/policy/snapshot.py", "plexrl/policy/actions.py", "plexrl/policy/history.py")
"""Compiled with their frozen dataclasses as plain ones (`thaw`): the snapshot's types,
which the policy reads millions of times a run, and the actions and the history's
types, which it builds as often (each with an `__init__` of its own, `INITS`, which a
frozen class cannot have). Compiled as they are, they are native
classes whose frozen `__init__` sets each field through `object.__setattr__` (a
`JobView` 4.2 µs against 1.3 interpreted, `quick_init` cannot apply to a native
class); plain, they build in 1.2 µs and the compiled policy reads their fields
directly. Nothing assigns to them: mypy checks that on the source, where they stay
frozen (and the live scheduler, which runs the source, enforces it)."""


INITS = (*THAWED, "plexrl_sim/executor.py")
"""Compiled with an `__init__` of their own in each plain dataclass (`with_inits`): the
types the simulator builds per decision and per Run (views, actions, the history's
descriptions, runs in flight). Not the results, which go back from the deployments'
processes pickled: a native class with its own `__init__` cannot be made without its
arguments, as unpickling and `copy.copy` make one."""


def thaw(source: str) -> str:
    """`source` with each `@dataclass(frozen=True)` a plain dataclass hashed and
    compared as before (`unsafe_hash=True`, which hashes the same fields a frozen one
    does) and without `@quick_init`. Raises ValueError where there is nothing to thaw,
    so a change to the source cannot turn it off unnoticed."""
    frozen = "@dataclass(frozen=True)\n"
    if frozen not in source:
        raise ValueError("nothing to thaw: no @dataclass(frozen=True) in the source")
    return source.replace("@quick_init\n", "").replace(frozen, "@dataclass(unsafe_hash=True)\n")


def with_inits(source: str) -> str:
    """`source` with an `__init__` of its own written into each plain (not frozen)
    dataclass, as the dataclass's would be: a parameter per field in order (its
    default, a `default_factory` called when it is left out, an `init=False` field set
    to its default or left to `__post_init__`), then `__post_init__` if the class has
    one. `dataclasses` leaves a class's own `__init__` in place, and mypyc compiles it;
    the one `dataclasses` generates is made with `exec` at import and stays interpreted,
    a Python frame for every view, action and run the simulator builds. A frozen
    dataclass's fields cannot be set this way (`thaw` it first, or it keeps the
    generated one). Raises ValueError for a dataclass it cannot write one for (one with
    a base class, keyword-only or init-only fields, or an `__init__` of its own)."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    inserts: list[tuple[int, str]] = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and any(_plain_dataclass(d) for d in node.decorator_list):
            inserts.append((_end_line(node), _init_of(node, source)))
    for end, init in sorted(inserts, reverse=True):
        lines.insert(end, init)
    return "".join(lines)


def _plain_dataclass(decorator: ast.expr) -> bool:
    called = decorator.func if isinstance(decorator, ast.Call) else decorator
    if not (isinstance(called, ast.Name) and called.id == "dataclass"):
        return False
    keywords = decorator.keywords if isinstance(decorator, ast.Call) else []
    if any(k.arg == "kw_only" for k in keywords):
        raise ValueError("a keyword-only dataclass: not written")
    return not any(
        k.arg == "frozen" and not (isinstance(k.value, ast.Constant) and not k.value.value)
        for k in keywords
    )


def _end_line(node: ast.ClassDef) -> int:
    end = node.end_lineno
    assert end is not None  # (parsed from source)
    return end


def _init_of(node: ast.ClassDef, source: str) -> str:
    if node.bases or node.keywords:  # (a base's fields would come first)
        raise ValueError(f"{node.name} has a base class")
    if any(isinstance(i, ast.FunctionDef) and i.name == "__init__" for i in node.body):
        raise ValueError(f"{node.name} has an __init__ of its own already")
    params: list[str] = []
    body: list[str] = []
    post_init = any(isinstance(i, ast.FunctionDef) and i.name == "__post_init__" for i in node.body)
    for item in node.body:
        if not isinstance(item, ast.AnnAssign) or not isinstance(item.target, ast.Name):
            continue
        name, annotation = item.target.id, ast.get_source_segment(source, item.annotation)
        if annotation is None or annotation.startswith(("ClassVar", "typing.ClassVar")):
            continue
        if annotation.startswith(("InitVar", "KW_ONLY", "dataclasses.")):
            raise ValueError(f"{node.name}.{name}: {annotation}")
        default: str | None = None
        factory: str | None = None
        init = True
        value = item.value
        if (
            isinstance(value, ast.Call)
            and isinstance(value.func, ast.Name)
            and value.func.id == "field"
        ):
            for keyword in value.keywords:
                text = ast.get_source_segment(source, keyword.value)
                if keyword.arg == "default":
                    default = text
                elif keyword.arg == "default_factory":
                    factory = text
                elif keyword.arg == "init":
                    init = not (isinstance(keyword.value, ast.Constant) and not keyword.value.value)
                elif keyword.arg not in ("repr", "compare", "hash", "metadata"):
                    raise ValueError(f"{node.name}.{name}: field({keyword.arg}=...)")
            value = None
        if value is not None:
            default = ast.get_source_segment(source, value)
        if not init:
            if default is not None:
                body.append(f"        self.{name} = {default}")
            elif not post_init:
                raise ValueError(f"{node.name}.{name}: init=False, no default nor __post_init__")
        elif factory is not None:
            if "None" in annotation:
                raise ValueError(f"{node.name}.{name}: a factory's field that takes None")
            params.append(f"{name}: {annotation} | None = None")
            body.append(f"        self.{name} = ({factory})() if {name} is None else {name}")
        else:
            params.append(f"{name}: {annotation}" + ("" if default is None else f" = {default}"))
            body.append(f"        self.{name} = {name}")
    if post_init:
        body.append("        self.__post_init__()")
    signature = ", ".join(["self", *params])
    return (
        f"\n    def __init__({signature}) -> None:\n" + "\n".join(body or ["        pass"]) + "\n"
    )


ENV = "PLEXRL_SIM_NATIVE"
"""'0': never use a build. Set to 'active' in the process a build runs in."""


def libs_dir() -> Path:
    """The directory holding the `plexrl` and `plexrl_sim` packages."""
    return Path(__file__).resolve().parent.parent


def digest(libs: Path, modules: Sequence[str] = COMPILED) -> str:
    """Of every source file of both packages, the module list and the toolchain."""
    h = hashlib.sha256()
    h.update(sys.version.encode())
    h.update(_mypy_version().encode())
    h.update("\n".join(modules).encode())
    for package in PACKAGES:
        for path in sorted((libs / package).rglob("*.py")):
            h.update(str(path.relative_to(libs)).encode() + b"\0")
            h.update(path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def build_dir(root: Path, libs: Path, modules: Sequence[str] = COMPILED) -> Path:
    """Where the build for these sources lives under `root` (`.plexrl/sim-native`)."""
    return root / digest(libs, modules)


def default_root() -> Path:
    """`PLEXRL_SIM_NATIVE_DIR`, else `.plexrl/sim-native` in the checkout the packages
    run from, else `~/.cache/plexrl/sim-native` (an installed, read-only copy)."""
    if configured := os.environ.get("PLEXRL_SIM_NATIVE_DIR"):
        return Path(configured)
    checkout = libs_dir().parent
    if (checkout / "pyproject.toml").is_file():
        return checkout / ".plexrl" / "sim-native"
    return Path.home() / ".cache" / "plexrl" / "sim-native"


def current_build(root: Path, libs: Path, modules: Sequence[str] = COMPILED) -> Path | None:
    """The build for these sources, if one was made (`ok` is written last)."""
    target = build_dir(root, libs, modules)
    return target if (target / "ok").is_file() else None


def build(root: Path, libs: Path, modules: Sequence[str] = COMPILED) -> Path:
    """Compile `modules` of these sources (or return the build there). Raises
    RuntimeError with mypyc's output when it fails."""
    target = build_dir(root, libs, modules)
    if (target / "ok").is_file():
        return target
    work = root / f".building-{target.name}-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    skip = shutil.ignore_patterns("__pycache__", "*.so", "*.c")
    for package in PACKAGES:
        shutil.copytree(libs / package, work / package, ignore=skip)
    for module in (m for m in modules if m in INITS):
        copy = work / module
        source = copy.read_text()
        copy.write_text(with_inits(thaw(source) if module in THAWED else source))
    env = {**os.environ, "MYPYPATH": str(work)}
    done = subprocess.run(
        [sys.executable, "-m", "mypyc", *modules],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        shutil.rmtree(work, ignore_errors=True)
        tail = (done.stdout + done.stderr)[-4000:]
        raise RuntimeError(f"mypyc failed (exit {done.returncode}):\n{tail}")
    for scratch in ("build", ".mypy_cache"):
        shutil.rmtree(work / scratch, ignore_errors=True)
    (work / "ok").write_text(target.name + "\n")
    shutil.rmtree(target, ignore_errors=True)
    os.replace(work, target)
    return target


def rerun_env(target: Path, environ: dict[str, str]) -> dict[str, str]:
    """The environment of `plexrl sim` run again over a build."""
    path = environ.get("PYTHONPATH", "")
    return {
        **environ,
        ENV: "active",
        "PYTHONPATH": str(target) + (os.pathsep + path if path else ""),
    }


def wanted(environ: dict[str, str], argv: Sequence[str]) -> bool:
    """Whether this process should run itself again over a build: not turned off, not
    already in one, and started as `plexrl sim ...` (not, say, from a test runner)."""
    return environ.get(ENV, "") not in ("0", "active") and list(argv[1:2]) == ["sim"]


def rerun_over(target: Path) -> None:
    """Replace this process by `python -m plexrl_tools.cli sim ...` over the build."""
    argv = [sys.executable, "-m", "plexrl_tools.cli", *sys.argv[1:]]
    os.execve(sys.executable, argv, rerun_env(target, dict(os.environ)))


def active() -> bool:
    return os.environ.get(ENV, "") == "active"


def _mypy_version() -> str:
    try:
        return importlib.metadata.version("mypy")
    except importlib.metadata.PackageNotFoundError:
        return "none"
