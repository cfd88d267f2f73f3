"""Services forked from a preloading process behave as new interpreters would: their own
environment, directory, log and exit status, killed by pid; and a spawn the preloader
cannot match is a plain subprocess that says why (plexrl_tools.preload)."""

from __future__ import annotations

import os
import signal
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from plexrl_tools.preload import ForkedProcess, Preloader

MAIN = """
import os, sys, time
from toysvc.main import IMPORTED_IN
print(f"pid={os.getpid()} imported_in={IMPORTED_IN} cwd={os.getcwd()} "
      f"value={os.environ.get('TOY_VALUE')} argv0={sys.argv[0]}", flush=True)
if os.environ.get("TOY_SLEEP"):
    time.sleep(60)
sys.exit(int(os.environ.get("TOY_EXIT", "0")))
"""


@pytest.fixture()
def toy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Preloader]:
    """A package `toysvc` whose `main` records the pid that imported it."""
    package = tmp_path / "pkgs" / "toysvc"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "main.py").write_text("import os\nIMPORTED_IN = os.getpid()\n")
    (package / "__main__.py").write_text(textwrap.dedent(MAIN))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "pkgs"))
    preloader = Preloader()
    yield preloader
    preloader.close()


def _spawn(preloader: Preloader, log: Path, **env: str) -> ForkedProcess | subprocess.Popen[bytes]:
    return preloader.spawn("toysvc", {**os.environ, **env}, log)


def test_a_forked_service_has_its_own_environment_directory_log_and_status(
    toy: Preloader, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    first = _spawn(toy, tmp_path / "a.log", TOY_VALUE="a", TOY_EXIT="3")
    second = _spawn(toy, tmp_path / "b.log", TOY_VALUE="b")
    assert isinstance(first, ForkedProcess) and isinstance(second, ForkedProcess)
    assert first.wait(timeout=30) == 3 and second.wait(timeout=30) == 0
    a, b = (tmp_path / "a.log").read_text(), (tmp_path / "b.log").read_text()
    assert "value=a" in a and "value=b" in b
    assert f"cwd={tmp_path}" in a
    assert "argv0=" in a and "toysvc/__main__.py" in a
    # Imported once, by the preloading process: neither child imported it again.
    imported = {line.split("imported_in=")[1].split()[0] for line in (a, b)}
    assert len(imported) == 1 and f"pid={first.pid}" in a
    assert imported != {str(first.pid)} and imported != {str(second.pid)}


def test_a_killed_service_reports_the_signal_as_popen_does(toy: Preloader, tmp_path: Path) -> None:
    running = _spawn(toy, tmp_path / "k.log", TOY_SLEEP="1")
    with pytest.raises(subprocess.TimeoutExpired):
        running.wait(timeout=0.5)
    assert running.poll() is None
    running.kill()
    assert running.wait(timeout=30) == -signal.SIGKILL
    running.kill()  # ended: nothing to signal, no error


def test_an_environment_read_at_import_that_differs_gets_a_new_interpreter(
    toy: Preloader, tmp_path: Path
) -> None:
    log = tmp_path / "new.log"
    process = _spawn(toy, log, HF_HOME=str(tmp_path / "elsewhere"), TOY_VALUE="c")
    assert isinstance(process, subprocess.Popen)
    assert process.wait(timeout=60) == 0
    text = log.read_text()
    assert "a new interpreter: its environment differs in ['HF_HOME']" in text
    assert "value=c" in text
