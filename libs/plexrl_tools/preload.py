"""Service processes forked from one that has already imported the service's modules.

A gpu-worker spends 15-20 s of CPU importing torch, transformers and peft before it
answers; on two cores a cluster start is mostly that, and a test suite starts and
restarts services dozens of times. A `Preloader` runs one process per service module
that imports `<package>.main` once and then forks a fresh service from itself on each
`spawn`: the child sets the environment, working directory and log it was asked for and
runs `python -m <package>` from there, exactly as a new interpreter would after the same
imports. Each child is a real, separate process: it is killed, paused and restarted by
pid like any other, and exits with its own status (read back from the preloading
process, which is its parent).

Not for production: services there start once and the import cost does not matter. A
spawn whose environment differs from the preloader's in a variable that a library reads
at import time (`IMPORT_TIME_ENV`) gets a plain subprocess instead, so no setting is ever
silently ignored.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib
import json
import os
import runpy
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

IMPORT_TIME_ENV = (
    "HF_",
    "TRANSFORMERS_",
    "TORCH",
    "OMP_",
    "MKL_",
    "OPENBLAS_",
    "CUDA_",
    "PYTHON",
    "LD_",
    "OTEL_PROPAGATORS",
    "OTEL_PYTHON_",
)
"""Environment variables (by prefix) that torch, transformers, huggingface_hub, the BLAS
libraries, OpenTelemetry or Python itself read when imported: a child that needs other
values than the preloader's is started as a plain subprocess."""

PRELOAD_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
"""What every local cluster sets (`LocalCluster._env`), so its children match."""

_POLL_S = 0.05


@dataclass(frozen=True)
class _Spawn:
    """One request to fork a service."""

    module: str
    env: dict[str, str]
    cwd: str
    log: str
    netns: str | None = None
    """A network namespace (`ip netns` name) the child enters first: a host of the
    host bed."""


def _import_time_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_ENV)}


class ForkedProcess:
    """The handle of one forked service: the subset of `subprocess.Popen` that
    `LocalCluster` uses (pid, poll, wait, signals, returncode)."""

    def __init__(self, pid: int, parent: _Zygote, args: list[str]) -> None:
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self._parent = parent

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._parent.status(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(_POLL_S)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # ended since
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Zygote:
    """One preloading process (for one service module) and the way to ask it."""

    def __init__(self, python: str, module: str, path: Path) -> None:
        self.module, self.path = module, path
        env = {**os.environ, **PRELOAD_ENV}
        self.env = _import_time_env(env)
        self.process = subprocess.Popen(
            [python, "-m", __name__, module, str(path)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        self._ready: bool | None = None
        self._lock = threading.Lock()

    def ready(self) -> bool:
        """Wait until it has imported and listens; False if it failed (its error is on
        the caller's stderr)."""
        with self._lock:
            if self._ready is None:
                assert self.process.stdout is not None
                self._ready = self.process.stdout.readline().strip() == b"ready"
                self.process.stdout.close()
            return self._ready and self.process.poll() is None

    def spawn(
        self, env: dict[str, str], log: Path, args: list[str], netns: str | None
    ) -> ForkedProcess:
        request = _Spawn(self.module, env, os.getcwd(), str(log), netns)
        reply = self._ask({"op": "spawn", **request.__dict__})
        return ForkedProcess(int(reply["pid"]), self, args)

    def status(self, pid: int) -> int | None:
        code = self._ask({"op": "status", "pid": pid}).get("code")
        return None if code is None else int(code)

    def _ask(self, request: dict[str, object]) -> dict[str, Any]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(30.0)
            conn.connect(str(self.path))
            conn.sendall(json.dumps(request).encode() + b"\n")
            reply: dict[str, Any] = json.loads(_read_line(conn))
        if "error" in reply:
            raise RuntimeError(f"the preloader of {self.module}: {reply['error']}")
        return reply

    def close(self) -> None:
        # Nothing to save: what it forked runs on by itself (still importing, it would
        # not read a closed stdin for seconds).
        self.process.kill()
        self.process.wait()
        if self.process.stdin is not None:
            self.process.stdin.close()


class Preloader:
    """One preloading process per service module, started on first use (or by `warm`)."""

    def __init__(self, python: str = sys.executable) -> None:
        self._python = python
        self._dir = Path(tempfile.mkdtemp(prefix="plexrl-preload-"))
        self._zygotes: dict[str, _Zygote] = {}
        self._lock = threading.Lock()

    def warm(self, modules: list[str]) -> None:
        """Start the preloading processes of `modules` now, to import in the background;
        `spawn` waits for one that is still importing."""
        for module in modules:
            self._zygote(module)

    def _zygote(self, module: str) -> _Zygote:
        with self._lock:
            if module not in self._zygotes:
                path = self._dir / f"{module}.sock"
                self._zygotes[module] = _Zygote(self._python, module, path)
            return self._zygotes[module]

    def spawn(
        self, module: str, env: Mapping[str, str], log: Path, netns: str | None = None
    ) -> ForkedProcess | subprocess.Popen[bytes]:
        """Start `python -m module` with `env`, its output appended to `log` (in network
        namespace `netns`, if given): forked from the module's preloader, or a plain
        subprocess where that cannot match it."""
        args = [self._python, "-m", module]
        zygote = self._zygote(module)
        wanted = _import_time_env(env)
        if zygote.ready() and wanted == zygote.env:
            return zygote.spawn(dict(env), log, args, netns)
        prefix = ["ip", "netns", "exec", netns] if netns is not None else []
        differ = sorted(
            k for k in wanted.keys() | zygote.env.keys() if wanted.get(k) != zygote.env.get(k)
        )
        why = f"its environment differs in {differ}" if differ else "no preloader answered"
        return start_logged([*prefix, *args], env, log, note=f"[preload] a new interpreter: {why}")

    def close(self) -> None:
        """Stop every preloading process (the services they forked keep running)."""
        with self._lock:
            zygotes, self._zygotes = list(self._zygotes.values()), {}
        for zygote in zygotes:
            zygote.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def start_logged(
    command: list[str], env: Mapping[str, str], log: Path, note: str | None = None
) -> subprocess.Popen[bytes]:
    """Start `command` as a new process, no stdin, its output (after `note`, a line)
    appended to `log`."""
    with log.open("ab") as out:
        if note is not None:
            out.write(f"{note}\n".encode())
            out.flush()
        return subprocess.Popen(
            command, env=dict(env), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )


_shared: Preloader | None = None
_shared_lock = threading.Lock()


def shared() -> Preloader:
    """This process's preloader (created on first use; closed at its exit)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = Preloader()
            atexit.register(_shared.close)
        return _shared


def _serve(module: str, path: str) -> _Spawn | None:
    """The preloading process: import, then answer requests until stdin closes. Returns
    the request in a forked child (which then runs it), None in the parent at the end."""
    importlib.import_module(f"{module}.main")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    codes: dict[int, int | None] = {}
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(sys.stdin.fileno(), selectors.EVENT_READ)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    # Nobody reads the pipe after this line: later output goes nowhere, not to a
    # closed pipe.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)
    while True:
        _reap(codes)
        for key, _ in selector.select(timeout=0.1):
            if key.fileobj != listener:
                if not os.read(sys.stdin.fileno(), 4096):
                    selector.close()
                    listener.close()
                    os.unlink(path)
                    return None
                continue
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(5.0)
                try:
                    request = json.loads(_read_line(conn))
                except (OSError, ValueError) as exc:
                    conn.sendall(json.dumps({"error": repr(exc)}).encode() + b"\n")
                    continue
                if request.get("op") == "status":
                    _reap(codes)
                    pid = int(request["pid"])
                    reply = {"known": pid in codes, "code": codes.get(pid)}
                    conn.sendall(json.dumps(reply).encode() + b"\n")
                    continue
                spawn = _Spawn(
                    request["module"],
                    request["env"],
                    request["cwd"],
                    request["log"],
                    request.get("netns"),
                )
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    listener.close()
                    os.close(conn.detach())
                    return spawn
                codes[pid] = None
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")


def _read_line(conn: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def _reap(codes: dict[int, int | None]) -> None:
    """Record the status of every child that has ended (so none stays a zombie)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        codes[pid] = os.waitstatus_to_exitcode(status)


def _become(spawn: _Spawn) -> None:
    """In the forked child: take the service's environment, directory and log, then run
    the module as `python -m` would (exit status, atexit handlers and all)."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    log = os.open(spawn.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(devnull, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(devnull)
    os.close(log)
    if spawn.netns is not None:
        _enter_netns(spawn.netns)
    os.environ.clear()
    os.environ.update(spawn.env)
    os.chdir(spawn.cwd)
    sys.argv = [spawn.module]
    runpy.run_module(spawn.module, run_name="__main__", alter_sys=True)


def _enter_netns(name: str) -> None:
    """Move this (single-threaded) process into network namespace `name`, as
    `ip netns exec` does for its program: every socket it opens from now on, and every
    thread and child it starts, is on that host."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"entering network namespace {name}: {os.strerror(errno)}")
    finally:
        os.close(fd)


_CLONE_NEWNET = 0x40000000


def main() -> None:
    module, path = sys.argv[1], sys.argv[2]
    spawn = _serve(module, path)
    if spawn is not None:
        _become(spawn)


if __name__ == "__main__":
    main()
