"""The shared runtime library stays below the services: nothing under libs/plexrl imports a
service package or the tooling (libs/plexrl_tools), so a service never drags in another
service, the command line or the test infrastructure. Read from the source (the AST), so
an import inside a function counts too."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNTIME = ROOT / "libs" / "plexrl"
SERVICES = frozenset(init.parent.name for init in ROOT.glob("services/*/*/__init__.py"))


def imported_packages(path: Path) -> set[str]:
    """The top-level package of every absolute import in one module."""
    packages: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            packages.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            packages.add(node.module.split(".")[0])
    return packages


def test_the_service_packages_are_found() -> None:
    assert {"plexrl_gateway", "plexrl_scheduler", "plexrl_worker", "plexrl_state_store"} <= (
        SERVICES
    )


def test_no_runtime_module_imports_a_service_or_the_tooling() -> None:
    forbidden = SERVICES | {"plexrl_tools"}
    offenders = {
        str(path.relative_to(ROOT)): sorted(imported_packages(path) & forbidden)
        for path in sorted(RUNTIME.rglob("*.py"))
    }
    offenders = {path: packages for path, packages in offenders.items() if packages}
    assert not offenders, (
        f"libs/plexrl is the runtime the services share and must not import them: {offenders}."
        " Move a module that needs a service to libs/plexrl_tools."
    )


def test_the_walk_sees_imports_inside_functions(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from plexrl_scheduler.state import JobState\n")
    assert "plexrl_scheduler" in imported_packages(module)
