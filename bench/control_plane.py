"""Control-plane latency and throughput: one NOOP call gateway → Kafka → scheduler → worker → back.

    .venv/bin/python bench/control_plane.py [--calls 300] [--clients 16] [--previous REV]

Starts a local cluster (one worker), measures `POST /plexrl/v1/echo` one at a time
(p50/p99 latency) and with many concurrent clients (calls/s), and, side by side, a
plain HTTP round trip to the gateway (`POST /api/v1/client/config`, no I/O behind
it) so the Kafka path's added cost is visible.

With `--previous REV` a second cluster runs the services of git revision REV (checked
out in a `git worktree` under the system temp directory, imported through PYTHONPATH
ahead of this checkout's editable install, with the same `.venv`), beside the first,
on the same Kafka and Redis. The two are measured in alternating rounds (`--rounds`),
so a machine that is busier at one moment than the next weighs on both alike; the
figures pool every round's calls. CPU per echo is the services' own (gateway,
scheduler, worker, state-store; not Kafka's or Redis's) during the sequential echo
calls, less what they burn idle at the same time (measured just before): the figure a
busy shared machine blurs least. Ends with one JSON line of figures (the current
revision's at the top level, the previous one's under "previous", and the ratios).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
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


async def concurrent(http: httpx.AsyncClient, clients: int, n: int) -> float:
    """Calls per second with `clients` callers issuing `n` echo calls in total."""
    remaining = n

    async def caller() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            (await http.post("/plexrl/v1/echo")).raise_for_status()

    start = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(clients)))
    return n / (time.perf_counter() - start)


@dataclass
class Samples:
    """Every round's measurements of one cluster."""

    http: list[float] = field(default_factory=list)
    echo: list[float] = field(default_factory=list)
    rates: list[float] = field(default_factory=list)
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
            # Each round's own figures: how much the machine moved under the run.
            "echo_p50_ms_by_round": [round(v * ms, 2) for v in self.round_p50s],
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


async def measure(
    clusters: dict[str, ClusterConfig], calls: int, clients: int, rounds: int
) -> dict[str, Samples]:
    """`rounds` rounds; in each, every cluster in turn: plain HTTP, echo, concurrent echo."""
    per_round = max(1, calls // rounds)
    samples = {name: Samples() for name in clusters}
    urls = {name: c.gateway_url for name, c in clusters.items()}
    pids = {name: service_pids(c.cluster_id) for name, c in clusters.items()}
    async with contextlib.AsyncExitStack() as stack:
        https = {
            name: await stack.enter_async_context(client(url, clients))
            for name, url in urls.items()
        }
        for http in https.values():
            await sequential(http, "POST", "/plexrl/v1/echo", 20)  # warm up every hop
        for n in range(rounds):
            # Alternate who goes first, so neither always follows the other's burst.
            order = list(https) if n % 2 == 0 else list(reversed(https))
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
                before, start = cpu_s(pids[name]), time.perf_counter()
                s.rates.append(await concurrent(http, clients, per_round * 2))
                elapsed = time.perf_counter() - start
                for service, used in cpu_s(pids[name]).items():
                    spent = used - before.get(service, 0.0) - idle.get(service, 0.0) * elapsed
                    s.cpu_concurrent[service] = s.cpu_concurrent.get(service, 0.0) + spent
                s.concurrent_calls += per_round * 2
    return samples


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
        f"{f['calls_per_s']} calls/s with {f['clients']} clients; services' CPU "
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
    args = p.parse_args()
    rounds = args.rounds if args.previous else 1
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
        for config in configs.values():
            stack.enter_context(LocalCluster(config))
        samples = asyncio.run(measure(configs, args.calls, args.clients, rounds))
    figures = {name: s.figures(args.calls, args.clients) for name, s in samples.items()}
    result: dict[str, Any] = {"benchmark": "control_plane", **figures["current"]}
    print(line("this revision", figures["current"]))
    if commit is not None:
        prev = figures["previous"]
        cur = figures["current"]
        result["rounds"] = rounds
        result["previous"] = {"rev": commit, **prev}
        result["echo_p50_ratio"] = round(cur["echo_p50_ms"] / prev["echo_p50_ms"], 3)
        result["added_p50_ratio"] = round(cur["added_p50_ms"] / prev["added_p50_ms"], 3)
        result["calls_per_s_ratio"] = round(cur["calls_per_s"] / prev["calls_per_s"], 3)
        result["cpu_per_echo_ratio"] = round(cur["cpu_ms_per_echo"] / prev["cpu_ms_per_echo"], 3)
        result["scheduler_cpu_ratio"] = ratio(cur, prev, "cpu_ms_per_echo_by_service")
        result["scheduler_cpu_concurrent_ratio"] = ratio(
            cur, prev, "cpu_ms_per_call_concurrent_by_service"
        )
        print(line(f"previous {commit[:10]}", prev))
        print(
            f"this / previous: echo p50 x{result['echo_p50_ratio']}, added p50 "
            f"x{result['added_p50_ratio']}, calls/s x{result['calls_per_s_ratio']}, "
            f"CPU per echo x{result['cpu_per_echo_ratio']}; the scheduler's CPU per echo "
            f"x{result['scheduler_cpu_ratio']}, per call with {args.clients} clients "
            f"x{result['scheduler_cpu_concurrent_ratio']} ({rounds} alternating rounds)"
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
