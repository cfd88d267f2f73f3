"""The scheduler's own Python per call, in process: a call through it, against a direct one.

    .venv/bin/python bench/scheduler_cpu.py [--calls 4000] [--batch 16] [--repeat 5]

The scheduler's receiver, cluster view, policy, actuator and direct-lease component run
as in the service, over one worker and one job; only the edges are stood in for
(Kafka's producer and the offsets' commit record what they are given; Redis's usage
write is a no-op). Per call:

- *scheduler path*: the request taken in, a decision pass (snapshot, policy), the
  dispatch built and handed to the producer (its span; a NOOP is not numbered), its
  completions taken in and their usage summed and flushed (once per dispatch);
- *direct*: only the completion of a call that went straight to the worker under a
  direct lease, taken in, and the usage flushed once per `--batch`.

`--batch` is how many calls one Kafka poll brings (1: one at a time; a dispatch holds
at most the policy's `max_calls_per_run`, 8). The figure is the
minimum over `--repeat` runs (the machine's load only ever adds). What it leaves out is
the Kafka client's own work per record (fetch, decode, the instrumentation's span) and
the socket writes: `bench/load.py` measures the scheduler's whole CPU per call. Ends
with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from typing import Any

import redis.asyncio as aioredis

from plexrl import direct
from plexrl.kafka import Delivery
from plexrl.ledger import Ledger
from plexrl.messages import (
    CompletionStatus,
    Function,
    JobSpec,
    NoopInput,
    PhaseCompletion,
    PhaseRequest,
    Timings,
    WorkerHeartbeat,
)
from plexrl.policy import PolicyConfig
from plexrl.topics import Topics
from plexrl_scheduler.actuator import Actuator
from plexrl_scheduler.main import Pace, decide_and_act
from plexrl_scheduler.receiver import Receiver
from plexrl_scheduler.state import ClusterState

JOB, WORKER = "job", "w0"


class Edge:
    """Kafka's producer, Redis's usage write, the jobs store: recorded, not sent."""

    def __init__(self) -> None:
        self.sent = 0

    async def publish(self, topic: str, key: Any, message: Any, headers: Any = None) -> None:
        self.sent += 1

    async def add_usages(self, usages: Any) -> None:
        pass

    async def get_job(self, job_id: str) -> None:
        return None


def beat() -> WorkerHeartbeat:
    return WorkerHeartbeat(
        worker_id=WORKER,
        device="cpu",
        device_bytes=1 << 30,
        host_bytes=1 << 30,
        base_models=["m"],
        resident=[],
        busy=False,
        started_at=0.0,
        sent_at=time.time(),
    )


def request(n: int) -> PhaseRequest:
    return PhaseRequest(
        request_id=f"r{n}",
        job_id=JOB,
        tenant="t",
        function=Function.NOOP,
        payload=NoopInput(),
        arrival_time=time.time(),
    )


def completion(n: int, dispatch_id: str) -> PhaseCompletion:
    return PhaseCompletion(
        request_id=f"r{n}",
        job_id=JOB,
        tenant="t",
        worker_id=WORKER,
        function=Function.NOOP,
        status=CompletionStatus.OK,
        timings=Timings(queue_s=0.001, compute_s=0.0001),
        dispatch_id=dispatch_id,
        finished_at=time.time(),
    )


def scheduler() -> tuple[ClusterState, Receiver, Actuator, Edge]:
    edge = Edge()
    state = ClusterState(worker_timeout_s=60.0)
    state.on_heartbeat(beat())
    state.add_job(JOB, "t", JobSpec(base_model="m"), WORKER)
    state.apply_admit(JOB, WORKER, epoch=1)
    receiver = Receiver(state, edge, edge)  # type: ignore[arg-type]
    actuator = Actuator(
        state,
        edge,  # type: ignore[arg-type]
        edge,  # type: ignore[arg-type]
        edge,  # type: ignore[arg-type]
        Topics("bench"),
        finished=receiver.finished,
        ledger=Ledger(aioredis.Redis(), "bench"),  # NOOPs: never numbered
    )
    receiver.use(actuator)
    return state, receiver, actuator, edge


async def through_the_scheduler(calls: int, batch: int) -> float:
    state, receiver, actuator, _ = scheduler()
    policy, pace = PolicyConfig(name="plexrl"), Pace()
    start = time.process_time()
    for first in range(0, calls, batch):
        for n in range(first, min(first + batch, calls)):
            await receiver.on_request(request(n), Delivery("requests", 0, n))
        while state.pending:  # a pass dispatches at most `max_calls_per_run` of them
            await decide_and_act(state, policy, actuator, pace)
            running = state.inflight[WORKER]
            for p in running.calls:
                n = int(p.request.request_id[1:])
                await receiver.on_completion(completion(n, running.dispatch_id), None)  # type: ignore[arg-type]
            await receiver.flush_usage()
    return (time.process_time() - start) / calls


async def direct_calls(calls: int, batch: int) -> float:
    _, receiver, _, _ = scheduler()
    start = time.process_time()
    for first in range(0, calls, batch):
        for n in range(first, min(first + batch, calls)):
            dispatch_id = direct.dispatch_id(1, f"r{n}")
            await receiver.on_completion(completion(n, dispatch_id), None)  # type: ignore[arg-type]
        await receiver.flush_usage()
    return (time.process_time() - start) / calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--calls", type=int, default=4000)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    load = os.getloadavg()
    result: dict[str, Any] = {"benchmark": "scheduler_cpu", "calls": args.calls}
    for batch in sorted({1, args.batch}):
        via = min(asyncio.run(through_the_scheduler(args.calls, batch)) for _ in range(args.repeat))
        straight = min(asyncio.run(direct_calls(args.calls, batch)) for _ in range(args.repeat))
        result[f"batch_{batch}"] = {
            "scheduler_path_us": round(via * 1e6, 1),
            "direct_us": round(straight * 1e6, 1),
        }
        print(
            f"{batch} per poll: {via * 1e6:.1f} µs per call through the scheduler, "
            f"{straight * 1e6:.1f} µs per direct call"
        )
    result["load_average_before"] = [round(v, 2) for v in load]
    result["load_average_after"] = [round(v, 2) for v in os.getloadavg()]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
