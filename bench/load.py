"""Load on the control plane: N jobs × M NOOP calls through one and several gateways.

    .venv/bin/python bench/load.py [--jobs 8] [--calls 100] [--clients 16]
        [--gateways 1,2] [--workers 1] [--previous REV] [--rounds 2]

Starts a Kafka broker and a Redis of its own (`plexrl_tools.private_infra`: their CPU is this
run's alone) and a local cluster with `max(--gateways)` gateways and `--workers`
workers. Each job is a tenant's echo job (`POST /plexrl/v1/echo`: a NOOP through
gateway → Kafka → scheduler or, under a direct lease, straight → worker → gateway; the
worker does nothing for it). Per gateway count G, in each round:

- *sequential*: one client, one job: a plain HTTP round trip to the gateway
  (`POST /api/v1/client/config`, no I/O behind it) and echo calls one at a time; the
  echo's p50/p99 and what the control plane adds to the plain round trip (p50);
- *load*: `--clients` clients spread over the N jobs, N × M calls; job j's calls go to
  gateway j mod G (a job's calls reach one gateway, as the gateways require for
  sequenced calls); calls/s, p50/p99 latency under load, and the CPU per call of
  every process: each gateway, the scheduler, each worker, the state-store, the broker,
  Redis, and this client; each less what it burns idle (measured just before).

With `--previous REV` a second cluster runs the services of git revision REV (a `git
worktree` under the temp directory, imported through PYTHONPATH ahead of this
checkout's install, same `.venv`) beside the first, on the same broker and Redis; the
two are measured in alternating rounds and the ratios printed. With `--uvloop DIR`
(uvloop installed there: `pip install --target DIR uvloop`) a cluster of this revision
runs every service on uvloop beside the plain one, measured the same way; both are the
services' defaults now (uvloop as `PLEXRL_EVENT_LOOP`, uvicorn's httptools parser
always), so the comparison means something only with `PLEXRL_EVENT_LOOP=asyncio`.
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from control_plane import SOURCE_DIRS, cpu_s, percentile, service_pids, worktree

from plexrl_tools.cluster import ClusterConfig, LocalCluster
from plexrl_tools.private_infra import PrivateInfra

IDLE_S = 1.5
"""Before each measured phase: how long every process's idle CPU rate is measured."""


def key(job: int) -> str:
    return f"tml-load-{job}"


@dataclass
class Phase:
    """One kind of measurement of one cluster at one gateway count, over every round."""

    latencies: list[float] = field(default_factory=list)
    plain: list[float] = field(default_factory=list)
    calls: int = 0
    wall_s: float = 0.0
    rates: list[float] = field(default_factory=list)
    cpu: dict[str, float] = field(default_factory=dict)
    routed: dict[str, float] = field(default_factory=dict)
    """Calls the scheduler counted over the phase: `direct` (under a lease), `dispatched`."""

    def add_routed(self, before: dict[str, float], after: dict[str, float]) -> None:
        for name in after:
            self.routed[name] = self.routed.get(name, 0.0) + after[name] - before.get(name, 0.0)

    def add_cpu(self, spent: dict[str, float]) -> None:
        for name, seconds in spent.items():
            self.cpu[name] = self.cpu.get(name, 0.0) + seconds

    def figures(self) -> dict[str, Any]:
        ms = 1000.0
        per_call = {k: round(v / max(self.calls, 1) * ms, 3) for k, v in sorted(self.cpu.items())}
        out: dict[str, Any] = {
            "calls": self.calls,
            "p50_ms": round(statistics.median(self.latencies) * ms, 3),
            "p99_ms": round(percentile(self.latencies, 0.99) * ms, 3),
            "cpu_ms_per_call": per_call,
            "cpu_ms_per_call_services": round(
                sum(v for k, v in per_call.items() if k not in ("broker", "redis", "client")), 3
            ),
            "cpu_ms_per_call_all": round(sum(per_call.values()), 3),
        }
        if self.plain:
            out["plain_p50_ms"] = round(statistics.median(self.plain) * ms, 3)
            out["added_p50_ms"] = round(out["p50_ms"] - out["plain_p50_ms"], 3)
        if self.routed:
            direct, dispatched = self.routed.get("direct", 0.0), self.routed.get("dispatched", 0.0)
            out["direct_calls"] = int(direct)
            out["direct_share"] = round(direct / max(direct + dispatched, 1.0), 3)
        if self.rates:
            out["calls_per_s"] = round(self.calls / self.wall_s, 1)
            out["calls_per_s_by_round"] = [round(r, 1) for r in self.rates]
        return out


@dataclass
class Cluster:
    config: ClusterConfig
    pids: dict[str, int]
    http: list[httpx.AsyncClient]

    async def routed(self) -> dict[str, float]:
        """The scheduler's own counts of calls so far: under a direct lease, and dispatched."""
        url = f"http://127.0.0.1:{self.config.scheduler_port}/metrics"
        async with httpx.AsyncClient(timeout=10) as http:
            text = (await http.get(url)).text
        out = {"direct": 0.0, "dispatched": 0.0}
        for line in text.splitlines():
            for name, metric in (
                ("direct", "plexrl_scheduler_direct_calls_total{"),
                ("dispatched", "plexrl_scheduler_dispatched_calls_total{"),
            ):
                if line.startswith(metric):
                    out[name] += float(line.rsplit(" ", 1)[1])
        return out


class Meter:
    """CPU seconds each process spent over a phase, less its idle rate."""

    def __init__(self, pids: dict[str, int]) -> None:
        self._pids = pids
        self._idle: dict[str, float] = {}

    def _now(self) -> dict[str, float]:
        out = cpu_s(self._pids)
        times = os.times()
        out["client"] = times.user + times.system
        return out

    async def measure_idle(self, seconds: float = IDLE_S) -> None:
        before, start = self._now(), time.perf_counter()
        await asyncio.sleep(seconds)
        elapsed = time.perf_counter() - start
        self._idle = {k: (v - before.get(k, 0.0)) / elapsed for k, v in self._now().items()}
        self._idle["client"] = 0.0

    @contextlib.contextmanager
    def phase(self, into: Phase) -> Any:
        before, start = self._now(), time.perf_counter()
        yield
        elapsed = time.perf_counter() - start
        into.add_cpu(
            {
                k: v - before.get(k, 0.0) - self._idle.get(k, 0.0) * elapsed
                for k, v in self._now().items()
            }
        )


async def sequential(cluster: Cluster, calls: int, into: Phase) -> None:
    http = cluster.http[0]
    for _ in range(calls):
        start = time.perf_counter()
        (await http.post("/api/v1/client/config", headers={"X-API-Key": key(0)})).raise_for_status()
        into.plain.append(time.perf_counter() - start)
    meter = Meter(cluster.pids)
    await meter.measure_idle()
    routed = await cluster.routed()
    with meter.phase(into):
        for _ in range(calls):
            start = time.perf_counter()
            (await http.post("/plexrl/v1/echo", headers={"X-API-Key": key(0)})).raise_for_status()
            into.latencies.append(time.perf_counter() - start)
    into.add_routed(routed, await cluster.routed())
    into.calls += calls


async def load(
    cluster: Cluster, jobs: int, calls: int, clients: int, gateways: int, into: Phase
) -> None:
    todo = [j for _ in range(calls) for j in range(jobs)]  # jobs interleaved
    todo.reverse()

    async def client() -> None:
        while todo:
            job = todo.pop()
            http = cluster.http[job % gateways]
            start = time.perf_counter()
            response = await http.post("/plexrl/v1/echo", headers={"X-API-Key": key(job)})
            response.raise_for_status()
            into.latencies.append(time.perf_counter() - start)

    meter = Meter(cluster.pids)
    await meter.measure_idle()
    routed = await cluster.routed()
    start = time.perf_counter()
    with meter.phase(into):
        await asyncio.gather(*(client() for _ in range(clients)))
    wall = time.perf_counter() - start
    into.add_routed(routed, await cluster.routed())
    into.wall_s += wall
    into.calls += jobs * calls
    into.rates.append(jobs * calls / wall)


async def measure(
    clusters: dict[str, Cluster], args: argparse.Namespace, gateways: list[int]
) -> dict[str, dict[int, dict[str, Phase]]]:
    phases = {
        name: {g: {"sequential": Phase(), "load": Phase()} for g in gateways} for name in clusters
    }
    for cluster in clusters.values():  # every job admitted and granted, every hop warm
        for job in range(args.jobs):
            http = cluster.http[0]
            for _ in range(5):
                (
                    await http.post("/plexrl/v1/echo", headers={"X-API-Key": key(job)})
                ).raise_for_status()
    for n in range(args.rounds):
        order = list(clusters) if n % 2 == 0 else list(reversed(clusters))
        for name in order:
            for g in gateways:
                await sequential(clusters[name], args.sequential, phases[name][g]["sequential"])
                await load(
                    clusters[name], args.jobs, args.calls, args.clients, g, phases[name][g]["load"]
                )
    return phases


def config(
    tmp: Path, name: str, registry: Path, args: argparse.Namespace, env: dict[str, str]
) -> ClusterConfig:
    return ClusterConfig.on_free_ports(
        registry,
        tmp / name,
        f"load-{name}-",
        workers=args.workers,
        gateways=max(int(g) for g in args.gateways.split(",")),
        api_keys=",".join(f"{key(j)}=load-{j}" for j in range(args.jobs)),
        worker_threads=1,
        env=env,
    )


async def run(
    configs: dict[str, ClusterConfig], infra: PrivateInfra, args: argparse.Namespace
) -> dict[str, dict[int, dict[str, Phase]]]:
    gateways = [int(g) for g in args.gateways.split(",")]
    limits = httpx.Limits(max_connections=args.clients + 4, max_keepalive_connections=args.clients)
    async with contextlib.AsyncExitStack() as stack:
        clusters = {}
        for name, c in configs.items():
            pids = service_pids(c.cluster_id)
            for part in ("broker", "redis"):
                pid = infra.pid(part)  # type: ignore[arg-type]
                if pid is not None:
                    pids[part] = pid
            http = [
                await stack.enter_async_context(
                    httpx.AsyncClient(base_url=url, timeout=60, limits=limits)
                )
                for url in c.gateway_urls
            ]
            clusters[name] = Cluster(c, pids, http)
        return await measure(clusters, args, gateways)


def summary(name: str, g: int, f: dict[str, dict[str, Any]]) -> str:
    seq, lo = f["sequential"], f["load"]
    cpu = lo["cpu_ms_per_call"]
    return (
        f"{name}, {g} gateway(s): {lo['calls_per_s']} calls/s, p50 {lo['p50_ms']} ms, p99 "
        f"{lo['p99_ms']} ms under load; one at a time p50 {seq['p50_ms']} ms (added "
        f"{seq['added_p50_ms']} ms over plain HTTP {seq['plain_p50_ms']} ms); CPU ms per call "
        f"under load {lo['cpu_ms_per_call_all']} in all, services {lo['cpu_ms_per_call_services']}"
        f", {cpu}; under a direct lease {seq.get('direct_share')} of calls one at a time, "
        f"{lo.get('direct_share')} under load"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--jobs", type=int, default=8, help="echo jobs (tenants)")
    p.add_argument("--calls", type=int, default=100, help="calls per job per round under load")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--gateways", default="1,2", help="gateway counts to measure")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--sequential", type=int, default=100, help="one-at-a-time calls per round")
    p.add_argument("--previous", default=None, help="git revision to measure beside this one")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds")
    p.add_argument("--uvloop", default=None, help="a directory with uvloop")
    args = p.parse_args()
    load_avg = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp_dir, contextlib.ExitStack() as stack:
        tmp = Path(tmp_dir)
        from plexrl.models import init_tiny

        registry = tmp / "models"
        init_tiny(registry / "tiny-qwen3")
        infra = PrivateInfra()
        infra.up()
        stack.callback(infra.remove)
        stack.callback(infra.down)
        configs = {"current": config(tmp, "current", registry, args, infra.env())}
        commit = None
        if args.previous:
            commit, path = stack.enter_context(worktree(args.previous))
            paths = [str(path / d) for d in SOURCE_DIRS]
            if os.environ.get("PYTHONPATH"):
                paths.append(os.environ["PYTHONPATH"])
            env = {**infra.env(), "PYTHONPATH": os.pathsep.join(paths)}
            configs["previous"] = config(tmp, "previous", registry, args, env)
        if args.uvloop:
            site = tmp / "uvloop-site"
            site.mkdir()
            (site / "sitecustomize.py").write_text("import uvloop\n\nuvloop.install()\n")
            paths = [str(site), args.uvloop, *filter(None, [os.environ.get("PYTHONPATH")])]
            env = {**infra.env(), "PYTHONPATH": os.pathsep.join(paths)}
            configs["uvloop"] = config(tmp, "uvloop", registry, args, env)
        for c in configs.values():
            stack.enter_context(LocalCluster(c))
        phases = asyncio.run(run(configs, infra, args))
    figures = {
        name: {g: {kind: ph.figures() for kind, ph in by_kind.items()} for g, by_kind in gs.items()}
        for name, gs in phases.items()
    }
    result: dict[str, Any] = {
        "benchmark": "load",
        "jobs": args.jobs,
        "calls_per_job": args.calls,
        "clients": args.clients,
        "workers": args.workers,
        "rounds": args.rounds,
        "load_average_before": [round(v, 2) for v in load_avg],
        "load_average_after": [round(v, 2) for v in os.getloadavg()],
        "current": {str(g): f for g, f in figures["current"].items()},
    }
    for g, f in figures["current"].items():
        print(summary("this revision", g, f))
    if commit is not None:
        result["previous"] = {"rev": commit} | {str(g): f for g, f in figures["previous"].items()}
        ratios = {}
        for g in figures["current"]:
            cur, prev = figures["current"][g], figures["previous"][g]
            print(summary(f"previous {commit[:10]}", g, prev))
            ratios[str(g)] = {
                "calls_per_s": round(cur["load"]["calls_per_s"] / prev["load"]["calls_per_s"], 3),
                "p50_under_load": round(cur["load"]["p50_ms"] / prev["load"]["p50_ms"], 3),
                "added_p50": round(
                    cur["sequential"]["added_p50_ms"] / prev["sequential"]["added_p50_ms"], 3
                ),
                "cpu_per_call_all": round(
                    cur["load"]["cpu_ms_per_call_all"] / prev["load"]["cpu_ms_per_call_all"], 3
                ),
                "scheduler_cpu_per_call": round(
                    cur["load"]["cpu_ms_per_call"].get("scheduler", 0.0)
                    / max(prev["load"]["cpu_ms_per_call"].get("scheduler", 0.0), 1e-9),
                    3,
                ),
            }
            print(f"{g} gateway(s), this / previous: {ratios[str(g)]}")
        result["ratios"] = ratios
    if "uvloop" in figures:
        result["uvloop"] = {str(g): f for g, f in figures["uvloop"].items()}
        for g in figures["uvloop"]:
            cur, fast = figures["current"][g]["load"], figures["uvloop"][g]["load"]
            print(summary("this revision on uvloop", g, figures["uvloop"][g]))
            result.setdefault("uvloop_ratios", {})[str(g)] = {
                "calls_per_s": round(fast["calls_per_s"] / cur["calls_per_s"], 3),
                "p50_under_load": round(fast["p50_ms"] / cur["p50_ms"], 3),
                "cpu_per_call_services": round(
                    fast["cpu_ms_per_call_services"] / cur["cpu_ms_per_call_services"], 3
                ),
            }
        print(f"uvloop / plain: {result['uvloop_ratios']}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
