"""Control-plane latency and throughput: one NOOP call gateway → Kafka → scheduler → worker → back.

    .venv/bin/python bench/control_plane.py [--calls 300] [--clients 16] [--previous REV]

Starts a local cluster (one worker), measures `POST /plexrl/v1/echo` one at a time
(p50/p99 latency) and with many concurrent clients (calls/s), and, side by side, a
plain HTTP round trip to the gateway (`POST /api/v1/client/config`, no I/O behind
it) so the Kafka path's added cost is visible. The same clients also run the plain route
concurrently (the gateway's HTTP layers alone) and a bare ASGI server on uvicorn that
answers at once (`BARE_APP`: no framework, no I/O): the calls/s this machine's HTTP
stack and client allow before any service does anything, with the clients' own CPU per
call.

With `--previous REV` a second cluster runs the services of git revision REV (checked
out in a `git worktree` under the system temp directory, imported through PYTHONPATH
ahead of this checkout's editable install, with the same `.venv`), beside the first,
on the same Kafka and Redis. The two are measured in alternating rounds (`--rounds`),
so a machine that is busier at one moment than the next weighs on both alike; the
figures pool every round's calls. CPU per echo is the services' own (gateway,
scheduler, worker, state-store; not Kafka's or Redis's) during the sequential echo
calls, less what they burn idle at the same time (measured just before): the figure a
busy shared machine blurs least. With `--uvloop DIR` (uvloop installed there: `pip
install --target DIR uvloop`; not a dependency) a cluster of this revision runs every
service on uvloop's event loop beside the plain one, measured the same way. Ends with
one JSON line of figures (the current revision's at the top level, the previous one's
under "previous", the uvloop cluster's under "uvloop", and the ratios).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from plexrl_tools.cluster import ClusterConfig, LocalCluster

KEY = "tml-bench"
IDLE_S = 1.5
"""Before each round's echo calls: how long the services' idle CPU rate is measured."""
REPO = Path(__file__).resolve().parent.parent
# Where each package of the services lives in a checkout (PYTHONPATH entries).
SOURCE_DIRS = (
    "libs",
    "services/gateway",
    "services/scheduler",
    "services/gpu-worker",
    "services/state-store",
)


def service_pids(cluster_id: str) -> dict[str, int]:
    """The processes of one local cluster's services by name (Linux: read from /proc)."""
    mark = f"PLEXRL_CLUSTER_ID={cluster_id}".encode()
    pids: dict[str, int] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if mark in env:
            names = [e[len(b"OTEL_SERVICE_NAME=") :] for e in env if e.startswith(b"OTEL_SERVICE")]
            if names:
                pids[names[0].decode().removeprefix("plexrl-")] = int(proc.name)
    return pids


def infra_pids() -> dict[str, int]:
    """The Kafka broker's and Redis's processes on this machine (the shared ones the
    bench's clusters use), where exactly one of each runs."""
    found = {}
    for name, pattern in (("broker", "kafka.Kafka"), ("redis", "redis-server")):
        out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout
        if len(out.split()) == 1:
            found[name] = int(out)
    return found


def cpu_s(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds (user + system) each process used so far; 0 for one that is gone."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for name, pid in pids.items():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            out[name] = (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            out[name] = 0.0
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def sequential(http: httpx.AsyncClient, method: str, path: str, n: int) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        response = await http.request(method, path)
        response.raise_for_status()
        out.append(time.perf_counter() - start)
    return out


async def concurrent(
    http: httpx.AsyncClient, clients: int, n: int, path: str = "/plexrl/v1/echo"
) -> tuple[float, float]:
    """Calls per second with `clients` callers issuing `n` POSTs of `path` in total, and
    the CPU seconds this process (the clients) spent per call."""
    remaining = n

    async def caller() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            (await http.post(path)).raise_for_status()

    start, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(caller() for _ in range(clients)))
    return n / (time.perf_counter() - start), (time.process_time() - cpu) / n


class LeanClient:
    """HTTP/1.1 over one kept-alive connection per caller, a few lines of asyncio: far less
    CPU per call than httpx, so the servers' side of the calls/s shows. It sends one
    fixed POST and reads the status line, the headers and a `Content-Length` body."""

    def __init__(self, url: str, path: str) -> None:
        self._host, port = url.removeprefix("http://").rsplit(":", 1)
        self._port = int(port)
        self._request = (
            f"POST {path} HTTP/1.1\r\nhost: {self._host}\r\nx-api-key: {KEY}\r\n"
            "content-length: 0\r\n\r\n"
        ).encode()

    async def calls(self, clients: int, n: int) -> tuple[float, float]:
        """Calls/s with `clients` connections making `n` calls in all, and the CPU seconds
        this process spent per call."""
        remaining = n

        async def caller() -> None:
            nonlocal remaining
            reader, writer = await asyncio.open_connection(self._host, self._port)
            try:
                while remaining > 0:
                    remaining -= 1
                    writer.write(self._request)
                    head = await reader.readuntil(b"\r\n\r\n")
                    status = int(head[9:12])
                    if status != 200:
                        raise RuntimeError(f"{status}: {head[:200]!r}")
                    length = -1
                    for header in head.split(b"\r\n"):
                        if header[:15].lower() == b"content-length:":
                            length = int(header[15:])
                    if length < 0:
                        raise RuntimeError(f"no content-length: {head[:200]!r}")
                    await reader.readexactly(length)
            finally:
                writer.close()

        start, cpu = time.perf_counter(), time.process_time()
        await asyncio.gather(*(caller() for _ in range(clients)))
        return n / (time.perf_counter() - start), (time.process_time() - cpu) / n


BARE_ASGI = """
import sys, uvicorn

async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"{}"})
"""
"""An ASGI app `app` that answers every request at once: no framework, no I/O (the
source of a program's start, which serves it)."""

BARE_APP = (
    BARE_ASGI
    + """
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning",
            http="httptools", lifespan="off")
"""
)
"""`BARE_ASGI` on uvicorn as the services run it (httptools, one process). Its calls/s
with the same clients is what this machine's HTTP stack and client allow before any
service does anything."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def bare_server() -> Iterator[str]:
    """`BARE_APP` in a process of its own; its URL."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", BARE_APP, str(port)])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.post(url, timeout=1).raise_for_status()
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


@dataclass
class Samples:
    """Every round's measurements of one cluster."""

    http: list[float] = field(default_factory=list)
    echo: list[float] = field(default_factory=list)
    rates: list[float] = field(default_factory=list)
    plain_rates: list[float] = field(default_factory=list)
    """Calls/s of the plain HTTP route with the same clients: the gateway's HTTP layers
    alone, no Kafka, no Redis."""
    client_cpu: list[float] = field(default_factory=list)
    """CPU seconds the clients spent per concurrent echo."""
    lean_rates: list[float] = field(default_factory=list)
    """Calls/s of concurrent echoes from the lean client (`LeanClient`)."""
    lean_plain_rates: list[float] = field(default_factory=list)
    cpu_lean: dict[str, float] = field(default_factory=dict)
    """CPU seconds of every process (the broker and Redis too) during the lean client's
    echoes, not less any idle rate: all a call costs this machine."""
    lean_calls: int = 0
    lean_cpu_by_round: list[float] = field(default_factory=list)
    """Every process's CPU seconds per lean echo, round by round."""
    round_p50s: list[float] = field(default_factory=list)
    cpu: dict[str, float] = field(default_factory=dict)
    """CPU seconds each service spent on the sequential echo calls, less its idle rate."""
    cpu_concurrent: dict[str, float] = field(default_factory=dict)
    """The same during the concurrent calls, where a service handles several at once."""
    concurrent_calls: int = 0

    def figures(self, calls: int, clients: int) -> dict[str, Any]:
        ms = 1000.0
        echo_p50 = statistics.median(self.echo)
        http_p50 = statistics.median(self.http)
        per_call = {k: round(v / len(self.echo) * ms, 3) for k, v in sorted(self.cpu.items())}
        calls_16 = max(self.concurrent_calls, 1)
        lean = max(self.lean_calls, 1)
        per_call_16 = {
            k: round(v / calls_16 * ms, 3) for k, v in sorted(self.cpu_concurrent.items())
        }
        return {
            "calls": calls,
            "echo_p50_ms": round(echo_p50 * ms, 3),
            "echo_p99_ms": round(percentile(self.echo, 0.99) * ms, 3),
            "http_p50_ms": round(http_p50 * ms, 3),
            "added_p50_ms": round((echo_p50 - http_p50) * ms, 3),
            "clients": clients,
            "calls_per_s": round(statistics.median(self.rates), 1),
            "plain_http_calls_per_s": round(statistics.median(self.plain_rates), 1),
            "client_cpu_ms_per_call": round(statistics.median(self.client_cpu) * ms, 3),
            # The same clients' calls from a client of little CPU (`LeanClient`).
            "lean_calls_per_s": round(statistics.median(self.lean_rates), 1),
            "lean_plain_http_calls_per_s": round(statistics.median(self.lean_plain_rates), 1),
            "cpu_ms_per_call_lean": round(sum(self.cpu_lean.values()) / lean * ms, 3),
            "cpu_ms_per_call_lean_by_process": {
                k: round(v / lean * ms, 3) for k, v in sorted(self.cpu_lean.items())
            },
            # Each round's own figures: how much the machine moved under the run.
            "echo_p50_ms_by_round": [round(v * ms, 2) for v in self.round_p50s],
            "lean_calls_per_s_by_round": [round(v, 1) for v in self.lean_rates],
            "cpu_ms_per_call_lean_by_round": [round(v * ms, 3) for v in self.lean_cpu_by_round],
            "calls_per_s_by_round": [round(v, 1) for v in self.rates],
            # CPU is what a busy shared machine does not blur: the services' own work.
            "cpu_ms_per_echo": round(sum(per_call.values()), 3),
            "cpu_ms_per_echo_by_service": per_call,
            # With the clients' calls in flight together: what batching saves per call.
            "cpu_ms_per_call_concurrent": round(sum(per_call_16.values()), 3),
            "cpu_ms_per_call_concurrent_by_service": per_call_16,
        }


def client(url: str, clients: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=clients + 4)
    return httpx.AsyncClient(base_url=url, headers={"X-API-Key": KEY}, timeout=60, limits=limits)


@dataclass
class Bare:
    """Every round's measurements of the bare server (`BARE_APP`)."""

    rates: list[float] = field(default_factory=list)
    client_cpu: list[float] = field(default_factory=list)
    lean_rates: list[float] = field(default_factory=list)
    lean_client_cpu: list[float] = field(default_factory=list)

    def figures(self) -> dict[str, float]:
        ms = 1000.0
        return {
            "calls_per_s": round(statistics.median(self.rates), 1),
            "client_cpu_ms_per_call": round(statistics.median(self.client_cpu) * ms, 3),
            "lean_calls_per_s": round(statistics.median(self.lean_rates), 1),
            "lean_client_cpu_ms_per_call": round(statistics.median(self.lean_client_cpu) * ms, 3),
        }


async def measure(
    clusters: dict[str, ClusterConfig], calls: int, clients: int, rounds: int, bare_url: str
) -> tuple[dict[str, Samples], Bare]:
    """`rounds` rounds; in each, every cluster in turn: plain HTTP, echo, concurrent plain
    HTTP, concurrent echo; then the bare server with the same clients."""
    per_round = max(1, calls // rounds)
    samples = {name: Samples() for name in clusters}
    bare = Bare()
    urls = {name: c.gateway_url for name, c in clusters.items()}
    pids = {name: service_pids(c.cluster_id) for name, c in clusters.items()}
    infra = infra_pids()
    async with contextlib.AsyncExitStack() as stack:
        https = {
            name: await stack.enter_async_context(client(url, clients))
            for name, url in {**urls, "bare": bare_url}.items()
        }
        for http in https.values():
            await sequential(http, "POST", "/plexrl/v1/echo", 20)  # warm up every hop
        for n in range(rounds):
            # Alternate who goes first, so neither always follows the other's burst.
            order = list(urls) if n % 2 == 0 else list(reversed(urls))
            for name in order:
                http, s = https[name], samples[name]
                s.http += await sequential(http, "POST", "/api/v1/client/config", per_round)
                # What the services burn idle (heartbeats, polls), to take off below: on a
                # busy machine each echo takes longer, and that would count as its cost.
                before, start = cpu_s(pids[name]), time.perf_counter()
                await asyncio.sleep(IDLE_S)
                idle = {
                    k: (v - before.get(k, 0.0)) / (time.perf_counter() - start)
                    for k, v in cpu_s(pids[name]).items()
                }
                before, start = cpu_s(pids[name]), time.perf_counter()
                echo = await sequential(http, "POST", "/plexrl/v1/echo", per_round)
                s.echo += echo
                s.round_p50s.append(statistics.median(echo))
                elapsed = time.perf_counter() - start
                for service, used in cpu_s(pids[name]).items():
                    spent = used - before.get(service, 0.0) - idle.get(service, 0.0) * elapsed
                    s.cpu[service] = s.cpu.get(service, 0.0) + spent
                rate, _ = await concurrent(http, clients, per_round * 2, "/api/v1/client/config")
                s.plain_rates.append(rate)
                before, start = cpu_s(pids[name]), time.perf_counter()
                rate, client_cpu = await concurrent(http, clients, per_round * 2)
                s.rates.append(rate)
                s.client_cpu.append(client_cpu)
                elapsed = time.perf_counter() - start
                for service, used in cpu_s(pids[name]).items():
                    spent = used - before.get(service, 0.0) - idle.get(service, 0.0) * elapsed
                    s.cpu_concurrent[service] = s.cpu_concurrent.get(service, 0.0) + spent
                s.concurrent_calls += per_round * 2
                lean = LeanClient(urls[name], "/api/v1/client/config")
                s.lean_plain_rates.append((await lean.calls(clients, per_round * 2))[0])
                lean = LeanClient(urls[name], "/plexrl/v1/echo")
                every = {**pids[name], **infra}
                before = cpu_s(every)
                rate, client_cpu = await lean.calls(clients, per_round * 2)
                s.lean_rates.append(rate)
                after = cpu_s(every)
                for process, used in after.items():
                    s.cpu_lean[process] = s.cpu_lean.get(process, 0.0) + used - before[process]
                s.cpu_lean["client"] = s.cpu_lean.get("client", 0.0) + client_cpu * per_round * 2
                spent = sum(after.values()) - sum(before.values()) + client_cpu * per_round * 2
                s.lean_cpu_by_round.append(spent / (per_round * 2))
                s.lean_calls += per_round * 2
            rate, client_cpu = await concurrent(https["bare"], clients, per_round * 2, "/")
            bare.rates.append(rate)
            bare.client_cpu.append(client_cpu)
            rate, client_cpu = await LeanClient(bare_url, "/").calls(clients, per_round * 2)
            bare.lean_rates.append(rate)
            bare.lean_client_cpu.append(client_cpu)
    return samples, bare


@contextlib.contextmanager
def worktree(rev: str) -> Iterator[tuple[str, Path]]:
    """A detached checkout of `rev` (its full commit id and path), removed afterwards."""
    commit = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--verify", f"{rev}^{{commit}}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    path = Path(tempfile.mkdtemp(prefix=f"plexrl-prev-{commit[:8]}-"))
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "--detach", "--force", str(path), commit],
        check=True,
        capture_output=True,
    )
    try:
        yield commit, path
    finally:
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "remove", "--force", str(path)],
            check=False,
            capture_output=True,
        )


def cluster_config(tmp: Path, name: str, registry: Path, env: dict[str, str]) -> ClusterConfig:
    return ClusterConfig.on_free_ports(
        registry,
        tmp / name,
        f"bench-{name}-",
        api_keys=f"{KEY}=bench",
        worker_threads=1,
        env=env,
    )


def line(name: str, f: dict[str, Any]) -> str:
    return (
        f"{name}: echo p50 {f['echo_p50_ms']} ms, p99 {f['echo_p99_ms']} ms "
        f"(plain HTTP p50 {f['http_p50_ms']} ms; added {f['added_p50_ms']} ms); "
        f"{f['calls_per_s']} calls/s with {f['clients']} clients (the plain HTTP route "
        f"{f['plain_http_calls_per_s']}; the clients' CPU {f['client_cpu_ms_per_call']} ms "
        f"per echo; from the lean client {f['lean_calls_per_s']}, the plain route "
        f"{f['lean_plain_http_calls_per_s']}; every process's CPU per lean echo "
        f"{f['cpu_ms_per_call_lean']} ms {f['cpu_ms_per_call_lean_by_process']}); services' CPU "
        f"{f['cpu_ms_per_echo']} ms per echo {f['cpu_ms_per_echo_by_service']}, "
        f"{f['cpu_ms_per_call_concurrent']} ms per call with {f['clients']} clients "
        f"{f['cpu_ms_per_call_concurrent_by_service']}"
    )


def ratio(cur: dict[str, Any], prev: dict[str, Any], key: str) -> float | None:
    """This revision's scheduler figure over the previous one's (None: one is missing)."""
    now, before = cur[key].get("scheduler"), prev[key].get("scheduler")
    return round(now / before, 3) if now and before else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--calls", type=int, default=300, help="sequential calls per cluster")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--previous", default=None, help="git revision to measure beside this one")
    p.add_argument("--rounds", type=int, default=4, help="alternating rounds (with --previous)")
    p.add_argument("--uvloop", default=None, help="a directory with uvloop installed")
    args = p.parse_args()
    rounds = args.rounds if args.previous or args.uvloop else 1
    with tempfile.TemporaryDirectory() as tmp_dir, contextlib.ExitStack() as stack:
        tmp = Path(tmp_dir)
        from plexrl.models import init_tiny

        registry = tmp / "models"
        init_tiny(registry / "tiny-qwen3")
        configs = {"current": cluster_config(tmp, "current", registry, {})}
        commit = None
        if args.previous:
            commit, path = stack.enter_context(worktree(args.previous))
            paths = [str(path / d) for d in SOURCE_DIRS]
            if os.environ.get("PYTHONPATH"):
                paths.append(os.environ["PYTHONPATH"])
            env = {"PYTHONPATH": os.pathsep.join(paths)}
            configs["previous"] = cluster_config(tmp, "previous", registry, env)
        if args.uvloop:
            site = tmp / "uvloop-site"
            site.mkdir()
            (site / "sitecustomize.py").write_text("import uvloop\n\nuvloop.install()\n")
            paths = [str(site), args.uvloop, *filter(None, [os.environ.get("PYTHONPATH")])]
            configs["uvloop"] = cluster_config(
                tmp, "uvloop", registry, {"PYTHONPATH": os.pathsep.join(paths)}
            )
        for config in configs.values():
            stack.enter_context(LocalCluster(config))
        bare_url = stack.enter_context(bare_server())
        samples, bare = asyncio.run(measure(configs, args.calls, args.clients, rounds, bare_url))
    figures = {name: s.figures(args.calls, args.clients) for name, s in samples.items()}
    result: dict[str, Any] = {"benchmark": "control_plane", **figures["current"]}
    result["bare_http"] = bare.figures()
    print(line("this revision", figures["current"]))
    print(
        f"bare HTTP server (no framework, no I/O; {args.clients} clients): "
        f"{result['bare_http']['calls_per_s']} calls/s, the clients' CPU "
        f"{result['bare_http']['client_cpu_ms_per_call']} ms per call; from the lean client "
        f"{result['bare_http']['lean_calls_per_s']} calls/s at "
        f"{result['bare_http']['lean_client_cpu_ms_per_call']} ms"
    )
    if commit is not None:
        prev = figures["previous"]
        cur = figures["current"]
        result["rounds"] = rounds
        result["previous"] = {"rev": commit, **prev}
        result["echo_p50_ratio"] = round(cur["echo_p50_ms"] / prev["echo_p50_ms"], 3)
        result["added_p50_ratio"] = round(cur["added_p50_ms"] / prev["added_p50_ms"], 3)
        result["calls_per_s_ratio"] = round(cur["calls_per_s"] / prev["calls_per_s"], 3)
        result["cpu_per_echo_ratio"] = round(cur["cpu_ms_per_echo"] / prev["cpu_ms_per_echo"], 3)
        result["lean_calls_per_s_ratio"] = round(
            cur["lean_calls_per_s"] / prev["lean_calls_per_s"], 3
        )
        result["cpu_per_call_lean_ratio"] = round(
            cur["cpu_ms_per_call_lean"] / prev["cpu_ms_per_call_lean"], 3
        )
        result["scheduler_cpu_ratio"] = ratio(cur, prev, "cpu_ms_per_echo_by_service")
        result["scheduler_cpu_concurrent_ratio"] = ratio(
            cur, prev, "cpu_ms_per_call_concurrent_by_service"
        )
        print(line(f"previous {commit[:10]}", prev))
        print(
            f"this / previous: echo p50 x{result['echo_p50_ratio']}, added p50 "
            f"x{result['added_p50_ratio']}, calls/s x{result['calls_per_s_ratio']}, "
            f"CPU per echo x{result['cpu_per_echo_ratio']}; from the lean clients calls/s "
            f"x{result['lean_calls_per_s_ratio']}, every process's CPU per call "
            f"x{result['cpu_per_call_lean_ratio']}; the scheduler's CPU per echo "
            f"x{result['scheduler_cpu_ratio']}, per call with {args.clients} clients "
            f"x{result['scheduler_cpu_concurrent_ratio']} ({rounds} alternating rounds)"
        )
    if "uvloop" in figures:
        fast, cur = figures["uvloop"], figures["current"]
        result["uvloop"] = fast
        result["uvloop_ratios"] = {
            key: round(fast[key] / cur[key], 3)
            for key in (
                "added_p50_ms",
                "lean_calls_per_s",
                "cpu_ms_per_call_lean",
                "calls_per_s",
                "cpu_ms_per_echo",
            )
            if cur[key]
        }
        print(line("this revision on uvloop", fast))
        print(f"uvloop / plain: {result['uvloop_ratios']}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
