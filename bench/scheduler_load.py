"""The scheduler service alone at pool rates: its CPU per call at thousands of calls a second.

    .venv/bin/python bench/scheduler_load.py [--workers 16] [--jobs 64] [--window 4]
        [--seconds 10] [--warmup-s 3] [--previous REV]

Runs the scheduler service (`python -m plexrl_scheduler`) on a Kafka broker and Redis of
its own (`plexrl_tools.private_infra`), and in this process the load around it, written
on the wire contracts:

- `--workers` worker groups, simulated: each announces itself with heartbeats on the
  events topic and answers every dispatch it is sent at once, one `PhaseCompletion` per
  call (what a worker in NOOP mode does, without its own work per call);
- `--jobs` echo jobs, each keeping `--window` NOOP calls outstanding: a `PhaseRequest`
  on the requests topic, with a sampled W3C trace context in its headers as a gateway's
  producer span writes, and the job's next call as soon as one is answered.

The gateways and workers are left out so that two cores can offer the scheduler
thousands of calls a second: what is measured is the scheduler's own CPU per call
(`/proc`, less its idle rate measured just before), with its Kafka clients, its
decisions, its Redis writes (usage, ledger, direct leases) and its commits, where each
poll brings it many calls; and its spans only where it exports them (the scheduler
inherits this process's environment: set OTEL_EXPORTER_OTLP_ENDPOINT to a collector
to measure it traced). Also reported: calls/s, the time from a
request's produce to its dispatch's arrival (two Kafka hops and the scheduler; p50,
p99), calls per dispatch, and the CPU per call of the broker, Redis and this process.

With `--previous REV` the scheduler of git revision REV (a `git worktree`, imported
through PYTHONPATH ahead of this checkout, same `.venv`) is measured the same way, in
alternating rounds (`--rounds`), on its own cluster id on the same broker and Redis,
and the ratios printed. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from control_plane import SOURCE_DIRS, percentile, worktree
from load import Meter, Phase

from plexrl.messages import (
    CompletionStatus,
    Dispatch,
    Function,
    JobSpec,
    NoopInput,
    PhaseCompletion,
    PhaseRequest,
    ResidentState,
    Tier,
    Timings,
    WorkerHeartbeat,
    decode,
    encode,
)
from plexrl.topics import Topics
from plexrl_tools.cluster import free_port
from plexrl_tools.preload import start_logged
from plexrl_tools.private_infra import PrivateInfra

MODEL = "bench-model"
IDLE_S = 3.0
"""How long each process's idle CPU rate is measured, after `SETTLE_S` of quiet."""
SETTLE_S = 5.0
TRACE_FLAGS = "01"  # sampled: the gateway's server span starts every call's trace


@dataclass
class Round:
    """What one measured round of one scheduler saw."""

    calls: int = 0
    dispatches: int = 0
    wall_s: float = 0.0
    latencies: list[float] = field(default_factory=list)
    cpu_s: dict[str, float] = field(default_factory=dict)
    """Each process's CPU seconds over the round, less its idle rate; `load`: this one."""


@dataclass
class Scheduler:
    """One scheduler service and the cluster id its topics and keys are under."""

    name: str
    cluster_id: str
    process: Any
    port: int
    rounds: list[Round] = field(default_factory=list)

    @property
    def topics(self) -> Topics:
        return Topics(self.cluster_id)


def start_scheduler(
    name: str, infra: PrivateInfra, tmp: Path, pythonpath: str | None, env: dict[str, str]
) -> Scheduler:
    port = free_port()
    cluster_id = f"schedload-{name}-{os.getpid()}"
    extra = {
        **os.environ,
        **infra.env(),
        "PLEXRL_CLUSTER_ID": cluster_id,
        "PLEXRL_SCHEDULER_HOST": "127.0.0.1",
        "PLEXRL_SCHEDULER_PORT": str(port),
        "PLEXRL_SERVICE_TOKEN": "bench",
        "OTEL_SERVICE_NAME": f"plexrl-scheduler-{name}",
        **env,
    }
    if pythonpath:
        extra["PYTHONPATH"] = pythonpath
    log = tmp / f"scheduler-{name}.log"
    process = start_logged([sys.executable, "-m", "plexrl_scheduler"], extra, log)
    return Scheduler(name, cluster_id, process, port)


async def wait_healthy(s: Scheduler, workers: int, timeout_s: float, beat: Any) -> None:
    """Until the scheduler answers and knows every simulated worker (heartbeats sent
    meanwhile: its events consumer starts at the latest offset)."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=2.0) as http:
        while True:
            if s.process.poll() is not None:
                raise RuntimeError(f"scheduler {s.name} exited with {s.process.returncode}")
            await beat()
            with contextlib.suppress(httpx.HTTPError, ValueError):
                body = (await http.get(f"http://127.0.0.1:{s.port}/healthz")).json()
                if sum(bool(v) for v in body.get("workers", {}).values()) >= workers:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"scheduler {s.name} not ready after {timeout_s:.0f}s")
            await asyncio.sleep(0.5)


class Load:
    """The simulated workers and jobs of one scheduler, on one producer and one consumer."""

    def __init__(self, s: Scheduler, bootstrap: str, workers: int, jobs: int, window: int):
        self.s = s
        self.workers = [f"w{i}" for i in range(workers)]
        self.jobs = [f"job-{i}" for i in range(jobs)]
        self.window = window
        self.bootstrap = bootstrap
        self.producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=1, acks=1)
        self.consumer: AIOKafkaConsumer | None = None
        self.started_at = time.time()
        self.homes: dict[str, str] = {}
        self.sent: dict[str, float] = {}
        self._ids = itertools.count()
        self.counting: Round | None = None
        self.running = False

    async def start(self) -> None:
        await self.producer.start()

    async def beat(self) -> None:
        now = time.time()
        for w in self.workers:
            resident = [
                ResidentState(job, Tier.DEVICE, 1 << 20, 1)
                for job, home in self.homes.items()
                if home == w
            ]
            beat = WorkerHeartbeat(
                worker_id=w,
                device="cpu",
                device_bytes=1 << 34,
                host_bytes=1 << 34,
                base_models=[MODEL],
                resident=resident,
                busy=False,
                started_at=self.started_at,
                sent_at=now,
            )
            await self.producer.send(self.s.topics.events, encode(beat), key=w.encode())

    async def subscribe(self) -> None:
        topics = [self.s.topics.dispatch(w) for w in self.workers]
        self.consumer = AIOKafkaConsumer(
            *topics,
            bootstrap_servers=self.bootstrap,
            group_id=None,
            auto_offset_reset="earliest",
            fetch_max_wait_ms=5,
        )
        await self.consumer.start()

    async def request(self, job: str) -> None:
        request_id = f"{job}-{next(self._ids)}"
        call = PhaseRequest(
            request_id=request_id,
            job_id=job,
            tenant=f"tenant-{job}",
            function=Function.NOOP,
            payload=NoopInput(),
            arrival_time=time.time(),
            spec=JobSpec(base_model=MODEL),
        )
        trace_id, span_id = os.urandom(16).hex(), os.urandom(8).hex()
        headers = [("traceparent", f"00-{trace_id}-{span_id}-{TRACE_FLAGS}".encode())]
        self.sent[request_id] = time.perf_counter()
        await self.producer.send(
            self.s.topics.requests, encode(call), key=job.encode(), headers=headers
        )

    async def run(self) -> None:
        """Every job's window of calls, then each answered call followed by the next."""
        assert self.consumer is not None
        self.running = True
        for job in self.jobs:
            for _ in range(self.window):
                await self.request(job)
        while self.running:
            polled = await self.consumer.getmany(timeout_ms=100, max_records=1000)
            now = time.perf_counter()
            for records in polled.values():
                for record in records:
                    await self.answer(decode(record.value, Dispatch), now)

    async def answer(self, dispatch: Dispatch, now: float) -> None:
        if self.counting is not None and dispatch.calls:
            self.counting.dispatches += 1
        for call in dispatch.calls:
            self.homes[call.job_id] = dispatch.worker_id
            sent = self.sent.pop(call.request_id, None)
            if self.counting is not None and sent is not None:
                self.counting.calls += 1
                self.counting.latencies.append(now - sent)
            done = PhaseCompletion(
                request_id=call.request_id,
                job_id=call.job_id,
                tenant=call.tenant,
                worker_id=dispatch.worker_id,
                function=call.function,
                status=CompletionStatus.OK,
                timings=Timings(queue_s=0.0, compute_s=0.0),
                dispatch_id=dispatch.dispatch_id,
                finished_at=time.time(),
            )
            await self.producer.send(
                self.s.topics.completions, encode(done), key=call.job_id.encode()
            )
            if self.running and sent is not None:
                await self.request(call.job_id)

    async def stop(self) -> None:
        self.running = False
        if self.consumer is not None:
            await self.consumer.stop()
        await self.producer.stop()


async def measure_round(load: Load, meter: Meter, seconds: float) -> Round:
    """What `seconds` of load brought: calls, dispatches, latencies, and the CPU the
    scheduler, the broker, Redis and this process spent, each less its idle rate."""
    out, spent = Round(), Phase()
    start = time.perf_counter()
    load.counting = out
    with meter.phase(spent):
        await asyncio.sleep(seconds)
    load.counting = None
    out.wall_s = time.perf_counter() - start
    out.cpu_s = dict(spent.cpu)
    out.cpu_s["load"] = out.cpu_s.pop("client")
    return out


def figures(s: Scheduler) -> dict[str, Any]:
    calls = sum(r.calls for r in s.rounds)
    wall = sum(r.wall_s for r in s.rounds)
    latencies = [x for r in s.rounds for x in r.latencies]
    cpu: dict[str, float] = {}
    for r in s.rounds:
        for k, v in r.cpu_s.items():
            cpu[k] = cpu.get(k, 0.0) + v
    per_call = {k: round(v / max(calls, 1) * 1000.0, 3) for k, v in sorted(cpu.items())}
    return {
        "calls": calls,
        "calls_per_s": round(calls / max(wall, 1e-9), 1),
        "calls_per_s_by_round": [round(r.calls / r.wall_s, 1) for r in s.rounds],
        "calls_per_dispatch": round(calls / max(sum(r.dispatches for r in s.rounds), 1), 2),
        "dispatch_p50_ms": round(statistics.median(latencies) * 1000.0, 2) if latencies else None,
        "dispatch_p99_ms": round(percentile(latencies, 0.99) * 1000.0, 2) if latencies else None,
        "cpu_ms_per_call": per_call,
        "scheduler_cpu_ms_per_call_by_round": [
            round(r.cpu_s["scheduler"] / max(r.calls, 1) * 1000.0, 3) for r in s.rounds
        ],
    }


async def bench(args: argparse.Namespace, infra: PrivateInfra, tmp: Path) -> dict[str, Any]:
    schedulers: list[Scheduler] = []
    with contextlib.ExitStack() as stack:
        env = {"PLEXRL_DIRECT_LEASE_S": str(args.direct_lease_s)}
        schedulers.append(start_scheduler("this", infra, tmp, None, env))
        if args.previous:
            rev, path = stack.enter_context(worktree(args.previous))
            pythonpath = os.pathsep.join(str(path / d) for d in SOURCE_DIRS)
            schedulers.append(start_scheduler("previous", infra, tmp, pythonpath, env))
            schedulers[-1].name = f"previous ({rev[:10]})"
        for s in schedulers:
            stack.callback(s.process.kill)
        loads = {}
        for s in schedulers:
            load = Load(s, infra.bootstrap, args.workers, args.jobs, args.window)
            await load.start()
            await wait_healthy(s, args.workers, 180.0, load.beat)
            await load.subscribe()
            loads[s.name] = load
        await asyncio.sleep(SETTLE_S)  # the topics' creation and the groups' joins done
        meters = {s.name: Meter(pids_of(s, infra)) for s in schedulers}
        for meter in meters.values():
            await meter.measure_idle(IDLE_S)
        for number in range(args.rounds):
            for s in schedulers:
                load = loads[s.name]
                task = asyncio.create_task(load.run())
                beats = asyncio.create_task(beat_every(load, 0.5))
                await asyncio.sleep(args.warmup_s)
                r = await measure_round(load, meters[s.name], args.seconds)
                s.rounds.append(r)
                load.running = False
                await task
                beats.cancel()
                await settle(load)
                print(
                    f"round {number + 1} {s.name}: {r.calls / r.wall_s:.0f} calls/s, "
                    f"scheduler {r.cpu_s['scheduler'] / max(r.calls, 1) * 1e3:.3f} ms CPU "
                    f"per call",
                    flush=True,
                )
        for load in loads.values():
            await load.stop()
        out = {s.name: figures(s) for s in schedulers}
    return out


async def beat_every(load: Load, seconds: float) -> None:
    while True:
        await load.beat()
        await asyncio.sleep(seconds)


async def settle(load: Load) -> None:
    """Answer what is still in flight (no new calls), so the next round starts clean."""
    assert load.consumer is not None
    deadline = time.monotonic() + 5.0
    while load.sent and time.monotonic() < deadline:
        polled = await load.consumer.getmany(timeout_ms=100, max_records=1000)
        now = time.perf_counter()
        for records in polled.values():
            for record in records:
                await load.answer(decode(record.value, Dispatch), now)
    load.sent.clear()


def pids_of(s: Scheduler, infra: PrivateInfra) -> dict[str, int]:
    pids = {"scheduler": s.process.pid}
    for part in ("broker", "redis"):
        pid = infra.pid(part)
        if pid is not None:
            pids[part] = pid
    return pids


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--jobs", type=int, default=64)
    p.add_argument("--window", type=int, default=4, help="calls each job keeps outstanding")
    p.add_argument("--seconds", type=float, default=10.0, help="measured per round")
    p.add_argument("--warmup-s", type=float, default=3.0, help="unmeasured, before each round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--previous", help="also measure this git revision's scheduler")
    p.add_argument(
        "--direct-lease-s", type=float, default=3.0, help="PLEXRL_DIRECT_LEASE_S (0: no leases)"
    )
    args = p.parse_args()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="plexrl-schedload-") as tmp:
        infra = PrivateInfra()
        infra.up()
        try:
            result = asyncio.run(bench(args, infra, Path(tmp)))
        finally:
            infra.down()
    summary: dict[str, Any] = {
        "benchmark": "scheduler_load",
        "workers": args.workers,
        "jobs": args.jobs,
        "window": args.window,
        "seconds": args.seconds,
        "rounds": args.rounds,
        **result,
    }
    names = list(result)
    if len(names) == 2:
        now, before = result[names[0]], result[names[1]]
        summary["scheduler_cpu_ratio"] = round(
            now["cpu_ms_per_call"]["scheduler"] / before["cpu_ms_per_call"]["scheduler"], 3
        )
        summary["calls_per_s_ratio"] = round(now["calls_per_s"] / before["calls_per_s"], 3)
    summary["load_average_before"] = [round(v, 2) for v in load_before]
    summary["load_average_after"] = [round(v, 2) for v in os.getloadavg()]
    for name, f in result.items():
        print(
            f"{name}: {f['calls_per_s']} calls/s, {f['calls_per_dispatch']} calls per dispatch, "
            f"dispatch p50 {f['dispatch_p50_ms']} ms (p99 {f['dispatch_p99_ms']}); CPU ms per "
            f"call {f['cpu_ms_per_call']}"
        )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
