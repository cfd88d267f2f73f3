"""Decision latency of the live policy on a 2,048-GPU cluster snapshot.

The snapshot is real, not synthetic: the three-month trace is simulated under the
policy (on the engine with the early tail release, so groups hold several jobs) up to
`--at-days`, by when the cluster is full and jobs wait for admission, and three
snapshots of that moment are timed:

- `cluster`: the simulator's whole-cluster snapshot as it is (what the live scheduler
  hands the policy: every worker, every job, every pending call);
- `cluster_all_free`: the same with every group free and every homed job holding a
  pending call, so one decision must admit and dispatch the whole cluster (worst case);
- `group`: one group free with a pending call from each of its jobs (the simulator's
  per-event dispatch decision).

And the live scheduler's own decision at 1,000 jobs on 256 groups (`--live-jobs`,
`--live-workers`): a `ClusterState` fed as the scheduler's receiver feeds it (heartbeats,
requests, a step's completions per job, 20 tenants, 300 calls waiting, the groups the
policy dispatched to running), timed as the scheduler decides:

- `live_whole`: `ClusterState.snapshot()` of the whole cluster and `decide` on it
  (the whole decision the scheduler makes at most 5% of its time);
- `live_event`: one request arrives, then the decision on the groups it touched
  (`take_touched`, `snapshot(groups)`, `decide`): what each event costs between
  whole decisions.

    .venv/bin/python bench/policy_latency.py [--policy plexrl] [--at-days 30] [--repeat 300]
        [--snapshot PATH]

With `--snapshot`, the whole-cluster snapshot is written there after the simulation, or,
if the file exists, read from it instead of simulating: so two revisions of the policy
can be timed on the same snapshot without simulating a month twice (a snapshot holds
only the policy's own types).

Ends with one JSON line: p50 / p99 / mean milliseconds per `plan` call.
"""

from __future__ import annotations

import argparse
import json
import pickle
import random
import statistics
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

from plexrl.messages import Function, JobSpec, NoopInput, PhaseRequest, WorkerHeartbeat
from plexrl.policy import ClusterSnapshot, PendingCall, PolicyConfig, Run, decide, plan

ROOT = Path(__file__).resolve().parent.parent


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def time_plan(snapshot: ClusterSnapshot, config: PolicyConfig, repeat: int) -> list[float]:
    samples: list[float] = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        plan(snapshot, config)
        samples.append((time.perf_counter() - t0) * 1e3)
    return samples


def summary(samples: list[float]) -> dict[str, float]:
    return {
        "p50": percentile(samples, 50),
        "p99": percentile(samples, 99),
        "mean": statistics.fmean(samples),
        "n": len(samples),
    }


def all_free(snapshot: ClusterSnapshot) -> ClusterSnapshot:
    """Every group free, every homed job with one pending call (plus the waiting jobs')."""
    workers = {wid: replace(w, running=None) for wid, w in snapshot.workers.items()}
    calls = list(snapshot.pending)
    for job in snapshot.jobs.values():
        if job.home is not None and not snapshot.calls_of(job.job_id):
            calls.append(
                PendingCall(f"{job.job_id}/bench", job.job_id, Function.SAMPLE, snapshot.now)
            )
    calls.sort(key=lambda c: c.arrival_time)
    return replace(snapshot, workers=workers, pending=tuple(calls))


def group_of(snapshot: ClusterSnapshot, worker_id: str) -> ClusterSnapshot:
    jobs = {j.job_id: j for j in snapshot.homed(worker_id)}
    return replace(
        snapshot,
        workers={worker_id: snapshot.workers[worker_id]},
        jobs=jobs,
        pending=tuple(c for c in snapshot.pending if c.job_id in jobs),
    )


class _Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


_STEP = {Function.SAMPLE: 4.0, Function.FORWARD_BACKWARD: 1.5, Function.OPTIM_STEP: 0.2}


def live_state(jobs: int, workers: int, seed: int) -> tuple[Any, _Clock, PolicyConfig]:
    """A scheduler's ClusterState at `jobs` jobs on `workers` groups, in steady state."""
    from plexrl_scheduler.state import ClusterState

    rng = random.Random(seed)
    clock = _Clock()
    state = ClusterState(clock=clock, burst_gap_s=0.1)
    config = PolicyConfig(name="plexrl", pack=False, hold_s=0.1)
    for w in range(workers):
        state.on_heartbeat(
            WorkerHeartbeat(
                worker_id=f"w{w}",
                device="cuda",
                device_bytes=80 * 2**30,
                host_bytes=400 * 2**30,
                base_models=[],
                resident=[],
                busy=False,
                started_at=0.0,
                sent_at=clock.t,
            )
        )
    for j in range(jobs):
        spec = JobSpec(base_model="m", state_bytes=rng.choice([2, 4, 8]) * 2**30)
        job = state.add_job(f"j{j}", f"t{j % 20}", spec, f"w{j % workers}")
        job.history.homed(clock.t - 3600)
        for k in range(7):  # two steps and a sample: durations and the step's calls
            function = list(_STEP)[k % 3]
            job.history.arrived(function)
            job.history.observe(function, _STEP[function] * rng.uniform(0.8, 1.2), 0.1, 0.5)
        job.last_active = clock.t - rng.uniform(0, 30)
    for j in rng.sample(range(jobs), 300):
        state.on_request(live_request(state, j, Function.SAMPLE), None)
    clock.t += 1.0
    decided = decide(state.snapshot(state.take_touched(True)), config)
    for action in decided.plan:  # the groups dispatched to run now, as the actuator records it
        if isinstance(action, Run):
            taken = state.take_pending(action.request_ids)
            state.apply_run(uuid.uuid4().hex, action.worker_id, action.job_id, taken, ())
    for j in rng.sample(range(jobs), 300):
        state.on_request(live_request(state, j, Function.FORWARD_BACKWARD), None)
    clock.t += 0.2
    state.take_touched(True)
    return state, clock, config


def live_request(state: Any, job: int, function: Function) -> PhaseRequest:
    return PhaseRequest(
        request_id=uuid.uuid4().hex,
        job_id=f"j{job}",
        tenant=f"t{job % 20}",
        function=function,
        payload=NoopInput(),
        arrival_time=state.snapshot(set()).now,
    )


def time_live(jobs: int, workers: int, repeat: int, seed: int) -> dict[str, Any]:
    state, clock, config = live_state(jobs, workers, seed)
    sizes = {
        "live_jobs": len(state.jobs),
        "live_workers": len(state.workers),
        "live_pending_calls": len(state.pending),
        "live_busy_groups": len(state.inflight),
    }
    rng = random.Random(seed + 1)
    whole: list[float] = []
    for _ in range(max(1, repeat // 10)):
        t0 = time.perf_counter()
        decide(state.snapshot(), config)
        whole.append((time.perf_counter() - t0) * 1e3)
    event: list[float] = []
    for _ in range(repeat):
        request = live_request(state, rng.randrange(jobs), Function.FORWARD_BACKWARD)
        clock.t += 0.001
        t0 = time.perf_counter()
        state.on_request(request, None)
        decide(state.snapshot(state.take_touched(False)), config)
        event.append((time.perf_counter() - t0) * 1e3)
    return {
        **sizes,
        "live_whole_ms": summary(whole),
        "live_event_ms": summary(event),
    }


def simulate(args: argparse.Namespace) -> tuple[int, PolicyConfig, ClusterSnapshot, float]:
    """The trace under the policy up to `--at-days`: (GPUs, config, snapshot, seconds)."""
    from plexrl_sim.multiplexed import MultiplexedSim
    from plexrl_sim.run import policy_config, prepare
    from plexrl_sim.workload import TAIL_RELEASE

    setup = prepare(args.workload, seed=args.seed, gpus=args.gpus)
    config = policy_config(setup, args.policy, {})
    factory = setup.factory.with_tail_release(TAIL_RELEASE if args.tail_release else None)
    layout = setup.groups_for(args.policy, factory)
    sim = MultiplexedSim(factory, setup.jobs, layout, config, setup.gpus)
    t0 = time.perf_counter()
    sim.run(until_s=args.at_days * 86400)
    return setup.gpus, config, sim.full_snapshot(), time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default=str(ROOT / "workloads" / "trace-3mo.yaml"))
    parser.add_argument("--policy", default="plexrl")
    parser.add_argument("--gpus", type=int, default=2048)
    parser.add_argument("--at-days", type=float, default=30.0)
    parser.add_argument("--repeat", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tail-release",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="warm up on the engine with the early tail release (denser groups)",
    )
    parser.add_argument("--snapshot", type=Path, help="read the snapshot here, or save it")
    parser.add_argument("--live-jobs", type=int, default=1000)
    parser.add_argument("--live-workers", type=int, default=256)
    parser.add_argument("--live-only", action="store_true", help="only the live scheduler's")
    args = parser.parse_args()

    live = time_live(args.live_jobs, args.live_workers, args.repeat, args.seed)
    print(
        f"live scheduler, {live['live_jobs']} jobs on {live['live_workers']} groups "
        f"({live['live_busy_groups']} busy, {live['live_pending_calls']} calls pending before the "
        "events):"
    )
    for key in ("live_whole_ms", "live_event_ms"):
        f = live[key]
        print(f"  {key[:-3]:17s} p50 {f['p50']:.3f} ms  p99 {f['p99']:.3f} ms  (n={f['n']})")
    if args.live_only:
        print(json.dumps({"bench": "policy_latency", **live}, separators=(",", ":")))
        return

    if args.snapshot is not None and args.snapshot.exists():
        gpus, config, full = pickle.loads(args.snapshot.read_bytes())
        warmup_s = 0.0
    else:
        gpus, config, full, warmup_s = simulate(args)
        if args.snapshot is not None:
            args.snapshot.write_bytes(pickle.dumps((gpus, config, replace(full))))
    stress = all_free(full)
    per_group = [group_of(stress, wid) for wid in stress.workers if stress.homed(wid)]
    full_ms = time_plan(full, config, args.repeat)
    stress_ms = time_plan(stress, config, args.repeat)
    group_ms: list[float] = []
    for _ in range(max(1, 20 * args.repeat // max(len(per_group), 1))):
        for snapshot in per_group:
            group_ms += time_plan(snapshot, config, 1)

    homed = sum(1 for j in full.jobs.values() if j.home is not None)
    figures = {
        "bench": "policy_latency",
        "policy": config.name,
        "gpus": gpus,
        "workers": len(full.workers),
        "jobs": len(full.jobs),
        "homed_jobs": homed,
        "waiting_jobs": len(full.jobs) - homed,
        "pending_calls": len(full.pending),
        "at_days": args.at_days,
        "tail_release": args.tail_release,
        "cluster_ms": summary(full_ms),
        "cluster_all_free_ms": summary(stress_ms),
        "group_ms": summary(group_ms),
        "warmup_sim_s": warmup_s,
        **live,
    }
    print(
        f"{config.name} on {gpus} GPUs, day {args.at_days:g}: {len(full.workers)} groups, "
        f"{homed} homed + {len(full.jobs) - homed} waiting jobs, {len(full.pending)} pending "
        f"calls"
    )
    for key in ("cluster_ms", "cluster_all_free_ms", "group_ms"):
        f = figures[key]
        print(f"  {key[:-3]:17s} p50 {f['p50']:.3f} ms  p99 {f['p99']:.3f} ms  (n={f['n']})")
    print(json.dumps(figures, separators=(",", ":")))


if __name__ == "__main__":
    main()
