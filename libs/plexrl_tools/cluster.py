"""Start the four services as local processes, wait until healthy, stop them cleanly.

Used by the main job, the integration tests and the benchmarks; `docker compose`
runs the same topology in containers.
"""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from plexrl.service_auth import new_token
from plexrl_tools.preload import ForkedProcess, Preloader, start_logged


@dataclass(frozen=True)
class ClusterTls:
    """HTTPS for a local cluster: every service serves it with one certificate."""

    certfile: Path
    """The services' certificate (PEM), naming the cluster's host address."""
    keyfile: Path
    cafile: Path
    """The CA that signed it: what the services (SSL_CERT_FILE) and this process's
    health checks trust."""

    def client_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.cafile))


@dataclass(frozen=True)
class ClusterConfig:
    """One local cluster: its id, ports, directories and worker count."""

    model_registry: Path
    """Directory of local base models."""
    state_dir: Path
    """Blobs and service logs go under here."""
    cluster_id: str = "plexrl"
    """Prefix of Kafka topics, consumer groups and Redis keys."""
    host: str = "127.0.0.1"
    """The address every service binds (`PLEXRL_*_HOST`) and the others reach it at
    (`PLEXRL_STATE_STORE_URL`, `PLEXRL_SCHEDULER_URL`): loopback on one machine."""
    workers: int = 1
    """Worker groups to start (`worker-0`, `worker-1`, ...)."""
    gateways: int = 1
    """Gateways to start: `gateway` on `gateway_port`, then `gateway-1`, ... on
    `gateway_ports` (stateless; a model's calls must all reach the same one)."""
    gateway_port: int = 8000
    gateway_ports: tuple[int, ...] = ()
    """Ports of the gateways after the first."""
    scheduler_port: int = 8100
    worker_port_base: int = 8200
    """Worker i listens on worker_port_base + i, unless worker_ports names its port."""
    worker_ports: tuple[int, ...] = ()
    """Port of each worker, where the ports need not be consecutive."""
    state_store_port: int = 8300
    api_keys: str = "tml-dev=dev"
    """PLEXRL_API_KEYS for the gateway."""
    worker_device_bytes: int | None = None
    """Device-tier budget of each worker for job states; None keeps the worker default."""
    worker_host_bytes: int | None = None
    worker_threads: int | None = None
    """Torch threads per worker (per rank of a group); None lets torch use every core."""
    worker_ranks: int | tuple[int, ...] = 1
    """Ranks of each worker group (PLEXRL_WORKER_RANKS): one number for every worker,
    or one per worker."""
    policy: str = "plexrl"
    service_token: str | None = None
    """PLEXRL_SERVICE_TOKEN the services share; None makes a fresh one per cluster."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment for every service (e.g. OTEL_EXPORTER_OTLP_ENDPOINT)."""
    tls: ClusterTls | None = None
    """HTTPS between the services and to the gateways; None: plain HTTP."""

    @property
    def scheme(self) -> str:
        return "http" if self.tls is None else "https"

    @property
    def gateway_url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.gateway_port}"

    @property
    def gateway_urls(self) -> list[str]:
        """Every gateway's URL, the first one's first."""
        ports = [self.gateway_port, *self.gateway_ports[: self.gateways - 1]]
        return [f"{self.scheme}://127.0.0.1:{p}" for p in ports]

    def worker_port(self, i: int) -> int:
        return self.worker_ports[i] if i < len(self.worker_ports) else self.worker_port_base + i

    def ranks_of(self, i: int) -> int:
        """Ranks of worker i's group."""
        if isinstance(self.worker_ranks, int):
            return self.worker_ranks
        return self.worker_ranks[i] if i < len(self.worker_ranks) else 1

    @classmethod
    def on_free_ports(
        cls, model_registry: Path, state_dir: Path, id_prefix: str, **fields: Any
    ) -> ClusterConfig:
        """A cluster with a fresh id (its own topics, groups and keys) on ports free now:
        for tests and benchmarks that run beside other clusters on one machine."""
        workers = int(fields.get("workers", cls.workers))
        gateways = int(fields.get("gateways", cls.gateways))
        gateway, scheduler, state_store, *ports = free_ports(2 + workers + gateways)
        worker_ports, gateway_ports = ports[:workers], ports[workers:]
        return cls(
            model_registry=model_registry,
            state_dir=state_dir,
            cluster_id=id_prefix + uuid.uuid4().hex[:8],
            gateway_port=gateway,
            gateway_ports=tuple(gateway_ports),
            scheduler_port=scheduler,
            worker_port_base=worker_ports[0],
            worker_ports=tuple(worker_ports),
            state_store_port=state_store,
            **fields,
        )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """n distinct TCP ports on 127.0.0.1 that nothing listens on right now (each one
    the kernel's own pick: a port next to a free one may be some client's source port)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


SERVICE_MODULES = ("plexrl_state_store", "plexrl_scheduler", "plexrl_worker", "plexrl_gateway")
"""What `python -m` runs for each of the four services."""

_preloader: Preloader | None = None
_NETNS_EXEC = ("ip", "netns", "exec")


def preload_services(preloader: Preloader | None) -> None:
    """Fork this process's later service starts from `preloader` (their modules imported
    once: a test suite's many starts cost seconds, not a worker's 15-20 s of imports
    each), or None to start each as a new interpreter again. A service run under
    `ip netns exec NAME` (a host of the host bed) is forked into that namespace; one
    under another command prefix, or another Python, is always a new interpreter."""
    global _preloader
    _preloader = preloader


@dataclass
class _Proc:
    name: str
    process: subprocess.Popen[bytes] | ForkedProcess
    health_url: str
    log: Path
    module: str
    port: int
    extra: dict[str, str]
    host: str
    prefix: tuple[str, ...]


class LocalCluster:
    """`with LocalCluster(config) as cluster:` runs the services for the block."""

    def __init__(self, config: ClusterConfig, python: str = sys.executable) -> None:
        self.config = config
        self._python = python
        # Internal calls (the state-store's) are authenticated even on one machine.
        self.service_token = config.service_token or new_token()
        self._procs: list[_Proc] = []

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _env(self, extra: dict[str, str]) -> dict[str, str]:
        c = self.config
        env = {
            **os.environ,
            "PLEXRL_CLUSTER_ID": c.cluster_id,
            "PLEXRL_MODEL_REGISTRY": str(c.model_registry),
            "PLEXRL_STATE_STORE_URL": f"{c.scheme}://{c.host}:{c.state_store_port}",
            "PLEXRL_SCHEDULER_URL": f"{c.scheme}://{c.host}:{c.scheduler_port}",
            "PLEXRL_GATEWAY_HOST": c.host,
            "PLEXRL_SCHEDULER_HOST": c.host,
            "PLEXRL_WORKER_HOST": c.host,
            "PLEXRL_STATE_STORE_HOST": c.host,
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "PLEXRL_SERVICE_TOKEN": self.service_token,
            **self._tls_env(),
            **c.env,
            **extra,
        }
        return env

    def _tls_env(self) -> dict[str, str]:
        tls = self.config.tls
        if tls is None:
            return {}
        return {
            "PLEXRL_HTTP_TLS_CERTFILE": str(tls.certfile),
            "PLEXRL_HTTP_TLS_KEYFILE": str(tls.keyfile),
            "SSL_CERT_FILE": str(tls.cafile),
        }

    def _http(self) -> httpx.Client:
        """A client for the services' health checks (trusting the cluster's CA)."""
        tls = self.config.tls
        return httpx.Client(timeout=2.0, verify=True if tls is None else tls.client_context())

    def _spawn(
        self,
        name: str,
        module: str,
        port: int,
        extra: dict[str, str],
        host: str | None = None,
        prefix: tuple[str, ...] = (),
    ) -> None:
        """Start one service; `host`: the address it answers at (the cluster's by
        default), `prefix`: a command to run it under (`ip netns exec HOST` on the
        host bed)."""
        host = host or self.config.host
        logs = self.config.state_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log = logs / f"{name}.log"
        env = self._env({"OTEL_SERVICE_NAME": f"plexrl-{name}", **extra})
        process: subprocess.Popen[bytes] | ForkedProcess
        netns = prefix[3] if len(prefix) == 4 and prefix[:3] == _NETNS_EXEC else None
        if _preloader is not None and self._python == sys.executable and (not prefix or netns):
            process = _preloader.spawn(module, env, log, netns)
        else:
            process = start_logged([*prefix, self._python, "-m", module], env, log)
        health = f"{self.config.scheme}://{host}:{port}/healthz"
        self._procs.append(_Proc(name, process, health, log, module, port, extra, host, prefix))

    def start(self, timeout_s: float = 600.0) -> None:
        c = self.config
        self._spawn(
            "state-store",
            "plexrl_state_store",
            c.state_store_port,
            {
                "PLEXRL_STATE_STORE_PORT": str(c.state_store_port),
                "PLEXRL_STATE_STORE_DIR": str(c.state_dir / "blobs"),
            },
        )
        self._spawn(
            "scheduler",
            "plexrl_scheduler",
            c.scheduler_port,
            {
                "PLEXRL_SCHEDULER_PORT": str(c.scheduler_port),
                "PLEXRL_POLICY": c.policy,
            },
        )
        for i in range(c.workers):
            extra = {
                "PLEXRL_WORKER_ID": f"worker-{i}",
                "PLEXRL_WORKER_PORT": str(c.worker_port(i)),
            }
            if c.worker_device_bytes is not None:
                extra["PLEXRL_WORKER_DEVICE_BYTES"] = str(c.worker_device_bytes)
            if c.worker_threads is not None:
                extra["PLEXRL_WORKER_THREADS"] = str(c.worker_threads)
            if c.worker_host_bytes is not None:
                extra["PLEXRL_WORKER_HOST_BYTES"] = str(c.worker_host_bytes)
            if c.ranks_of(i) > 1:
                extra["PLEXRL_WORKER_RANKS"] = str(c.ranks_of(i))
            self._spawn(f"worker-{i}", "plexrl_worker", c.worker_port(i), extra)
        for i, url in enumerate(c.gateway_urls):
            port = int(url.rsplit(":", 1)[1])
            self._spawn(
                "gateway" if i == 0 else f"gateway-{i}",
                "plexrl_gateway",
                port,
                {"PLEXRL_GATEWAY_PORT": str(port), "PLEXRL_API_KEYS": c.api_keys},
            )
        try:
            self.wait_healthy(timeout_s)
            self.wait_workers_known(timeout_s)
        except BaseException:
            self.stop()
            raise

    def wait_healthy(self, timeout_s: float, names: list[str] | None = None) -> None:
        """Until every service (or those `names`) answers its health check."""
        deadline = time.monotonic() + timeout_s
        waiting = [p for p in self._procs if names is None or p.name in names]
        with self._http() as http:
            while waiting:
                for proc in list(waiting):
                    if proc.process.poll() is not None:
                        raise RuntimeError(
                            f"{proc.name} exited with {proc.process.returncode} while starting; "
                            f"see {proc.log}:\n{_tail(proc.log)}"
                        )
                    try:
                        if http.get(proc.health_url).status_code == 200:
                            waiting.remove(proc)
                    except httpx.HTTPError:
                        pass
                if waiting and time.monotonic() > deadline:
                    late = ", ".join(p.name for p in waiting)
                    raise TimeoutError(f"not healthy after {timeout_s:.0f}s: {late}")
                time.sleep(0.2)

    def wait_workers_known(self, timeout_s: float) -> None:
        """Until the scheduler has heard every worker's heartbeat (so jobs can be placed)."""
        deadline = time.monotonic() + timeout_s
        url = f"{self.config.scheme}://{self.config.host}:{self.config.scheduler_port}/healthz"
        with self._http() as http:
            while True:
                workers = http.get(url).json().get("workers", {})
                if sum(bool(v) for v in workers.values()) >= self.config.workers:
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError(f"scheduler knows workers {workers} after {timeout_s}s")
                time.sleep(0.2)

    def stop(self, timeout_s: float = 30.0) -> dict[str, int | None]:
        """SIGTERM in reverse start order; returns each exit code (None: had to be killed)."""
        codes: dict[str, int | None] = {}
        for proc in reversed(self._procs):
            if proc.process.poll() is None:
                proc.process.send_signal(signal.SIGTERM)
        for proc in reversed(self._procs):
            try:
                codes[proc.name] = proc.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.process.kill()
                proc.process.wait()
                codes[proc.name] = None
        self._procs.clear()
        return codes

    def names(self) -> list[str]:
        """The services of this cluster: `state-store`, `scheduler`, `worker-<i>`, `gateway`."""
        return [p.name for p in self._procs]

    def pid(self, name: str) -> int:
        """The process id of one service (e.g. to watch its memory)."""
        return self._proc(name).process.pid

    def exited(self, name: str) -> bool:
        """Whether the service's process has ended (killed, crashed, or stopped)."""
        return self._proc(name).process.poll() is not None

    def kill(self, name: str, *, graceful: bool = False) -> None:
        """SIGKILL one service (`kill -9`: no clean-up, as in a crash), or with `graceful`
        SIGTERM it and wait for its clean shutdown; `restart` revives it."""
        proc = self._proc(name)
        if graceful:
            proc.process.terminate()
        else:
            proc.process.kill()
        proc.process.wait()

    def wait_exit(self, name: str, timeout_s: float) -> int:
        """Until a service exits on its own (a worker that lost a rank of its group, say);
        its exit status. TimeoutError if it is still running after `timeout_s`."""
        try:
            return self._proc(name).process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            raise TimeoutError(f"{name} still runs after {timeout_s:.0f}s") from exc

    def exit_code(self, name: str) -> int | None:
        """A service's exit status, or None while it runs."""
        return self._proc(name).process.poll()

    def restart(
        self, name: str, timeout_s: float = 180.0, env: dict[str, str] | None = None
    ) -> None:
        """Start a killed service again with the same id, port and environment (`env`
        changes some of it from now on), and wait until it answers its health check."""
        proc = self._proc(name)
        if proc.process.poll() is None:
            raise RuntimeError(f"{name} is still running; kill it first")
        self._procs.remove(proc)
        extra = {**proc.extra, **(env or {})}
        self._spawn(proc.name, proc.module, proc.port, extra, proc.host, proc.prefix)
        self.wait_healthy(timeout_s, [name])

    def _proc(self, name: str) -> _Proc:
        for proc in self._procs:
            if proc.name == name:
                return proc
        raise KeyError(f"no service {name!r} in this cluster; it has {self.names()}")

    def logs(self) -> dict[str, Path]:
        return {p.name: p.log for p in self._procs}


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
