"""The main job: several RLVR jobs share a small pool through PlexRL; savings printed.

    scripts/demo.sh            # installs what is missing, starts everything, runs this
    scripts/demo.sh --realistic --policy fifo,plexrl   # six busier jobs on two workers

It builds (once) a tiny local base model, starts Kafka/Redis-backed PlexRL services
(state-store, scheduler, gpu-workers, gateway) as local processes, runs the jobs
concurrently through the unmodified `tinker` SDK, and prints each job's reward
(first steps vs last steps) and the device-time saved against giving every job a
device of its own. Ends with one JSON line of its figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import uuid
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rlvr import CLEAR_GAIN, SOLVED, JobResult, RlvrConfig, RlvrJob, learned

from plexrl_tools.cluster import ClusterConfig, LocalCluster

ROOT = Path(__file__).resolve().parent.parent
API_KEY = "tml-demo"


def ensure_model(registry: Path) -> Path:
    """The warmed tiny base model, built once (a minute on 2 cores)."""
    from plexrl import hf_cache
    from plexrl.models import init_tiny
    from plexrl_tools.pretrain import COPY_MAX, WARM_STEPS, pretrain

    path = registry / "tiny-qwen3"
    done = path / ".warmed"
    # Rebuilt whenever the warm-up recipe changes, so no run uses a stale base.
    recipe = f"steps={WARM_STEPS} copy_max={COPY_MAX}\n"
    if not done.exists() or done.read_text() != recipe:
        print(f"building the tiny base model in {path} (a few minutes, once) ...", flush=True)
        init_tiny(path)
        pretrain(path)
        done.write_text(recipe)
    hf_cache.register(path, "plexrl/tiny-qwen3")
    return path


REALISTIC = {"jobs": 6, "stall": 0.6}
"""`--realistic`: six jobs whose stall per RL step keeps each job's worker busy a fifth
to a quarter of the time alone (the reference's 70-81% bubble ratios; 22-28% measured
on this recipe), on two workers."""


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--jobs", type=int, default=None, help="RLVR jobs to run at once (4)")
    p.add_argument("--workers", type=int, default=2, help="worker groups in the pool")
    p.add_argument(
        "--ranks",
        type=int,
        default=1,
        help="ranks (devices) per worker group: 2 runs every phase on groups of two CPU\n"
        "ranks (FSDP2 over gloo); device-seconds count every rank",
    )
    p.add_argument("--sft-steps", type=int, default=RlvrConfig.sft_steps)
    p.add_argument("--rl-steps", type=int, default=RlvrConfig.rl_steps)
    p.add_argument(
        "--stall", type=float, default=None, help="reward/tool stall per RL step, s (2.0)"
    )
    p.add_argument(
        "--realistic",
        action="store_true",
        help=f"{REALISTIC['jobs']} jobs with a {REALISTIC['stall']} s stall: each alone keeps\n"
        "its worker busy about a quarter of the time, as the reference's bubble ratios\n"
        "imply (the default jobs: about 15%%); --jobs and --stall still override",
    )
    p.add_argument(
        "--device-jobs",
        type=float,
        default=1.5,
        help="device memory per worker, in job states (forces swapping below 2)",
    )
    p.add_argument(
        "--policy",
        default="plexrl",
        help="the scheduler's policy (fifo, pack, spread, spread-backfill, plexrl), or a\n"
        "comma list (fifo,plexrl): the shared run once per policy, each on a fresh\n"
        "cluster, against the one dedicated baseline, side by side. A policy may\n"
        "carry scheduler settings after colons, to switch its moves off one at a\n"
        "time: plexrl:hold_s=0, plexrl:preempt_ratio=0:roam_samples=false",
    )
    p.add_argument(
        "--no-control",
        action="store_true",
        help="skip the control phase (every job at once, each on a worker of its own):\n"
        "it measures what sharing this host costs the jobs, apart from sharing the pool",
    )
    p.add_argument(
        "--free-ports",
        action="store_true",
        help="run each phase's services on ports free now (beside another cluster on this\n"
        "machine) instead of 8000, 8100, 8200.. and 8300",
    )
    p.add_argument(
        "--stuck-s",
        type=float,
        default=300.0,
        help="give up (exit 1, saying where each job was) when no job finished a step\n"
        "for this long",
    )
    p.add_argument("--state-dir", type=Path, default=ROOT / ".plexrl" / "demo")
    p.add_argument("--registry", type=Path, default=ROOT / ".plexrl" / "models")
    args = p.parse_args()
    preset = REALISTIC if args.realistic else {"jobs": 4, "stall": 2.0}
    args.jobs = args.jobs if args.jobs is not None else preset["jobs"]
    args.stall = args.stall if args.stall is not None else preset["stall"]
    return args


def main() -> int:
    args = parse()
    try:
        policies = [policy_variant(p) for p in args.policy.split(",") if p.strip()]
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    if not policies:
        print("--policy names no policy", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    ensure_model(args.registry)

    everyone = list(range(args.jobs))
    total = 1 + (not args.no_control) + len(policies)
    print(f"\n[1/{total}] dedicated baseline: each job alone, one worker to itself", flush=True)
    with start_cluster(args, policies[0].name, "dedicated") as cluster:
        alone = [run_jobs(cluster, args, [i])[0][0] for i in everyone]
        busy_alone = busy_fractions(cluster, alone)
    print(
        "each job alone kept its worker busy "
        + ", ".join(f"{b:.0%}" for b in busy_alone)
        + " of its run",
        flush=True,
    )
    control: Control | None = None
    if not args.no_control:
        print(
            f"\n[2/{total}] control: {args.jobs} jobs at once, each on a worker of its own "
            "(the host shared, the pool not)",
            flush=True,
        )
        with start_cluster(args, "fifo", "control", workers=args.jobs) as cluster:
            results, _ = run_jobs(cluster, args, everyone)
            control = Control(results, workers_per_job(cluster, results))
    summaries = []
    for n, variant in enumerate(policies, start=total - len(policies) + 1):
        print(
            f"\n[{n}/{total}] PlexRL, policy {variant.label}: {args.jobs} jobs at once on "
            f"{args.workers} workers (a fresh cluster)",
            flush=True,
        )
        phase = f"shared-{n}"
        with start_cluster(args, variant.name, phase, env=variant.env) as cluster:
            shared, makespan = run_jobs(cluster, args, everyone)
            summary = summarize(cluster, alone, control, shared, makespan, args, variant.label)
            summary["busy_alone"] = [round(b, 3) for b in busy_alone]
            summaries.append(summary)
    if len(summaries) > 1:
        side_by_side(summaries)
    line = dict(summaries[0])
    if len(summaries) > 1:
        line["runs"] = [{k: v for k, v in s.items() if k != "jobs"} for s in summaries]
    print(json.dumps(line))
    problems = [p for s in summaries for p in verdict(s)]
    if control is not None:
        problems += control.problems(alone)
    for problem in problems:
        print(f"FAILED: {problem}", file=sys.stderr)
    return 1 if problems else 0


class Control:
    """The control phase: every job at once, each on a worker of its own. Against the
    jobs alone it measures what sharing this host (its cores carry every client, the
    services, Kafka and Redis) costs; against it, a shared run's slowdown is what
    sharing the pool costs. The control shares no device, but runs a worker process
    per job where a shared run has `--workers`: when jobs' calls coincide it is the
    more crowded of the two, so it errs towards blaming the host."""

    def __init__(self, results: list[JobResult], workers: dict[str, set[str]]) -> None:
        self.results = results
        self.workers = workers

    def own_worker_each(self) -> bool:
        """Whether every job ran on one worker, no two jobs on the same one."""
        homes = [self.workers.get(r.model_id, set()) for r in self.results]
        return all(len(h) == 1 for h in homes) and len(set().union(*homes)) == len(homes)

    def problems(self, alone: list[JobResult]) -> list[str]:
        found = []
        for i, (a, r) in enumerate(zip(alone, self.results, strict=True)):
            if r.rewards != a.rewards or r.sft_losses != a.sft_losses:
                found.append(f"control: job {i}'s rewards or losses differ from its run alone")
        return found

    def figures(self, alone: list[JobResult]) -> dict[str, Any]:
        ratios = [r.wall_s / a.wall_s for a, r in zip(alone, self.results, strict=True)]
        return {
            "jobs_wall_s": [round(r.wall_s, 2) for r in self.results],
            "mean_slowdown": round(sum(ratios) / len(ratios), 3),
            "own_worker_each": self.own_worker_each(),
        }


def busy_fractions(cluster: LocalCluster, results: list[JobResult]) -> list[float]:
    """Per job run alone: the device-seconds its calls used over its wall time."""
    url = cluster.config.gateway_url
    with httpx.Client(base_url=url, headers={"X-API-Key": API_KEY}, timeout=30) as http:
        used = [
            http.get(f"/plexrl/v1/jobs/{r.model_id}").json()["accounting"]["device_s"]
            for r in results
        ]
    return [u / r.wall_s for u, r in zip(used, results, strict=True)]


def workers_per_job(cluster: LocalCluster, results: list[JobResult]) -> dict[str, set[str]]:
    """Which workers ran each job's calls, read from the cluster's timeline."""
    ids = {r.model_id for r in results}
    url = cluster.config.gateway_url
    with httpx.Client(base_url=url, headers={"X-API-Key": API_KEY}, timeout=30) as http:
        entries = http.get("/plexrl/v1/timeline", params={"limit": 10000}).json()
    homes: dict[str, set[str]] = {i: set() for i in ids}
    for e in entries:
        if e["job_id"] in ids:
            homes[e["job_id"]].add(e["worker_id"])
    return homes


@dataclass(frozen=True)
class PolicyVariant:
    """A policy of `--policy`, with the scheduler settings it runs under."""

    label: str
    name: str
    env: dict[str, str]


def policy_variant(text: str) -> PolicyVariant:
    """`plexrl:hold_s=0:roam_samples=false`: the policy `plexrl` with the scheduler's
    settings `hold_s` and `roam_samples` (`plexrl.settings.SchedulerSettings`) set."""
    from plexrl.policy import POLICIES
    from plexrl.settings import SchedulerSettings

    name, *pairs = [part.strip() for part in text.strip().split(":")]
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r} in {text!r}; choose from {sorted(POLICIES)}")
    env = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or key not in SchedulerSettings.model_fields or key == "policy":
            raise ValueError(
                f"{pair!r} in {text!r} is not a scheduler setting as key=value; the "
                f"settings are {sorted(set(SchedulerSettings.model_fields) - {'policy'})}"
            )
        env[f"PLEXRL_{key.upper()}"] = value
    return PolicyVariant(text.strip(), name, env)


def start_cluster(
    args: argparse.Namespace,
    policy: str,
    phase: str,
    workers: int | None = None,
    env: dict[str, str] | None = None,
) -> LocalCluster:
    """A fresh cluster of `workers` (default `args.workers`) workers under `policy` (one
    per phase, so no phase's jobs, history or placement carry into the next); `env`: the
    services' extra settings."""
    from plexrl.models import ModelRegistry

    job_bytes = ModelRegistry(args.registry).info("plexrl/tiny-qwen3").state_bytes(16)
    fields: dict[str, Any] = dict(
        workers=workers or args.workers,
        api_keys=f"{API_KEY}=demo",
        # Per rank: a LoRA job's adapter is whole on every rank of a group.
        worker_device_bytes=int(job_bytes * args.device_jobs),
        worker_threads=1,
        worker_ranks=args.ranks,
        policy=policy,
        env=env or {},
    )
    state_dir, prefix = args.state_dir / phase, f"demo-{phase}-"
    if args.free_ports:
        config = ClusterConfig.on_free_ports(args.registry, state_dir, prefix, **fields)
    else:
        cluster_id = prefix + uuid.uuid4().hex[:8]
        config = ClusterConfig(args.registry, state_dir, cluster_id, **fields)
    print(
        f"starting PlexRL: {config.workers} workers of {args.ranks} rank(s), policy {policy}, "
        f"gateway {config.gateway_url}",
        flush=True,
    )
    cluster = LocalCluster(config)
    print(
        f"watch it live: {config.gateway_url}/dashboard?key={API_KEY}  or  "
        f".venv/bin/plexrl top --url {config.gateway_url} --key {API_KEY}",
        flush=True,
    )
    return cluster


def side_by_side(summaries: list[dict[str, Any]]) -> None:
    print()
    w = max(16, *(len(s["policy"]) for s in summaries))
    print(
        f"{'policy':>{w}} {'saved':>7} {'mean slowdown':>14} {'makespan s':>11} "
        f"{'busy device-s':>14} {'swapped calls':>14} {'same as alone':>14} {'vs control':>11}"
    )
    for s in summaries:
        same = f"{sum(j['same_as_alone'] for j in s['jobs'])} of {len(s['jobs'])}"
        print(
            f"{s['policy']:>{w}} {s['savings_fraction']:>7.1%} {s['mean_slowdown']:>14.3f} "
            f"{s['makespan_s']:>11.1f} {s['busy_device_s']:>14.1f} {s['swapped_calls']:>14} "
            f"{same:>14} {vs_control(s):>11}"
        )


def vs_control(summary: dict[str, Any]) -> str:
    host = summary["control"]
    return "-" if host is None else f"{host['shared_mean_slowdown_vs_control']:.3f}"


def verdict(summary: dict[str, Any]) -> list[str]:
    """Why the run does not show what it should, one line each; empty when it does."""
    problems = []
    for j in summary["jobs"]:
        if not learned(j["reward_first"], j["reward_last"]):
            problems.append(
                f"{summary['policy']}: job {j['job']}'s reward neither rose by {CLEAR_GAIN} nor "
                f"held at {SOLVED} or more ({j['reward_first']:.3f} in its first RL steps, "
                f"{j['reward_last']:.3f} in its last): the recipe did not learn here; "
                "bench/demo_robustness.py checks it across seeds"
            )
        if not j["same_as_alone"]:
            problems.append(
                f"{summary['policy']}: job {j['job']}'s rewards or losses differ from its run "
                "alone: multiplexing changed what it learned"
            )
    return problems


def run_jobs(
    cluster: LocalCluster, args: argparse.Namespace, which: list[int]
) -> tuple[list[JobResult], float]:
    """Run the jobs in `which` at once; returns their results and the wall time of all."""
    import tinker
    from tqdm import tqdm

    url = cluster.config.gateway_url
    http = httpx.Client(base_url=url, headers={"X-API-Key": API_KEY}, timeout=30)
    lock = threading.Lock()
    progress = [time.monotonic()]  # when a job last finished a step
    steps = args.sft_steps + args.rl_steps
    bars = {
        i: tqdm(total=steps, desc=f"job {i}", position=n, leave=True, dynamic_ncols=True)
        for n, i in enumerate(which)
    }

    def idle(model_id: str, seconds: float) -> None:
        with lock:
            http.post(f"/plexrl/v1/jobs/{model_id}/idle", json={"seconds": seconds})

    def one(i: int) -> JobResult:
        def step(phase: str, stats: dict[str, float]) -> None:
            progress[0] = time.monotonic()
            bars[i].update(1)
            bars[i].set_postfix({"phase": phase, **{k: f"{v:.3f}" for k, v in stats.items()}})

        config = RlvrConfig(
            sft_steps=args.sft_steps, rl_steps=args.rl_steps, reward_stall_s=args.stall, seed=i
        )
        # Closing the client finishes its session: the job's model is unloaded (its
        # accounting stays), as a user's finished run would leave it.
        with tinker.ServiceClient(base_url=url, api_key=API_KEY) as service:
            return RlvrJob(service, config, on_step=step, on_idle=idle).run()

    start = progress[0] = time.monotonic()
    pool = ThreadPoolExecutor(max_workers=len(which))
    running = [pool.submit(one, i) for i in which]
    while not all(f.done() for f in running):
        wait(running, timeout=1.0, return_when=FIRST_EXCEPTION)
        if any(f.done() and f.exception() is not None for f in running):
            break
        quiet = time.monotonic() - progress[0]
        if quiet > args.stuck_s:
            pool.shutdown(wait=False, cancel_futures=True)
            where = ", ".join(f"job {i} at step {bars[i].n} of {steps}" for i in which)
            raise Stuck(
                f"no job finished a step in {quiet:.0f} s ({where}); the cluster's logs are "
                f"under {cluster.config.state_dir / 'logs'}"
            )
    pool.shutdown(wait=True)
    results = [f.result() for f in running]
    wall = time.monotonic() - start
    for bar in bars.values():
        bar.close()
    http.close()
    return results, wall


def summarize(
    cluster: LocalCluster,
    alone: list[JobResult],
    control: Control | None,
    shared: list[JobResult],
    makespan: float,
    args: argparse.Namespace,
    policy: str,
) -> dict[str, Any]:
    url = cluster.config.gateway_url
    jobs: list[dict[str, Any]] = []
    with httpx.Client(base_url=url, headers={"X-API-Key": API_KEY}, timeout=30) as http:
        for i, (a, r) in enumerate(zip(alone, shared, strict=True)):
            acct = http.get(f"/plexrl/v1/jobs/{r.model_id}").json()["accounting"]
            jobs.append(
                {
                    "job": i,
                    "reward_first": round(r.mean_reward(first=True), 4),
                    "reward_last": round(r.mean_reward(first=False), 4),
                    "same_as_alone": r.rewards == a.rewards and r.sft_losses == a.sft_losses,
                    "alone_wall_s": round(a.wall_s, 2),
                    "shared_wall_s": round(r.wall_s, 2),
                    "slowdown": round(r.wall_s / a.wall_s, 3),
                    "control_wall_s": round(control.results[i].wall_s, 2) if control else None,
                    "slowdown_vs_control": (
                        round(r.wall_s / control.results[i].wall_s, 3) if control else None
                    ),
                    "device_s": round(acct["device_s"], 2),
                    "swap_s": round(acct["swap_s"], 3),
                }
            )
        entries = http.get("/plexrl/v1/timeline", params={"limit": 10000}).json()
        scheduler = http.get("/plexrl/v1/cluster").json().get("scheduler") or {}
    sharing = scheduler.get("sharing") or {}
    shared_ids = {r.model_id for r in shared}
    swaps = sum(1 for e in entries if e["job_id"] in shared_ids and e["swap_s"] > 0)
    # Device-seconds count every rank: a group of N ranks holds N devices.
    pool = args.workers * args.ranks * makespan
    dedicated = sum(j["alone_wall_s"] for j in jobs) * args.ranks
    busy = sum(j["device_s"] for j in jobs)
    print()
    print(
        f"{'job':>4} {'reward first 5':>15} {'reward last 5':>14} {'same as alone':>14} "
        f"{'alone s':>8} {'shared s':>9} {'slowdown':>9}"
    )
    for j in jobs:
        print(
            f"{j['job']:>4} {j['reward_first']:>15.3f} {j['reward_last']:>14.3f} "
            f"{'yes' if j['same_as_alone'] else 'NO':>14} {j['alone_wall_s']:>8.1f} "
            f"{j['shared_wall_s']:>9.1f} {j['slowdown']:>9.3f}"
        )
    print()
    print(
        f"dedicated: one worker of {args.ranks} rank(s) per job for its own run = "
        f"{dedicated:.1f} device-s"
    )
    print(
        f"PlexRL:    {args.workers} workers x {args.ranks} rank(s) x {makespan:.1f} s = "
        f"{pool:.1f} device-s "
        f"(busy {busy:.1f} device-s, {busy / pool:.0%}; {swaps} calls swapped a state in)"
    )
    print(f"savings:   {1 - pool / dedicated:.1%} of device-time, same training steps")
    costs = sharing.get("predicted")
    if costs:
        source = "as set" if costs == sharing.get("set") else "as the workers measured them"
        print(
            f"sharing:   the policy predicted with a {1000 * costs['switch_s']:.1f} ms switch, "
            f"stragglers holding >= {costs['tail_min_share']:.0%} and decoding "
            f"{costs['tail_contention']:.2f}x slower beside a call ({source})"
        )
    host: dict[str, Any] | None = None
    if control is not None:
        host = control.figures(alone)
        pooled = sum(j["slowdown_vs_control"] for j in jobs) / len(jobs)
        host["shared_mean_slowdown_vs_control"] = round(pooled, 3)
        print(
            f"control:   every job at once on a worker of its own ran {host['mean_slowdown']:.3f}x "
            f"its time alone (the host shared, no device); against that, sharing the pool "
            f"cost {pooled:.3f}x"
            + ("" if host["own_worker_each"] else " (NOT one job per worker: read with care)")
        )
    return {
        "benchmark": "rlvr_demo",
        "policy": policy,
        "jobs": jobs,
        "workers": args.workers,
        "ranks": args.ranks,
        "makespan_s": round(makespan, 2),
        "pool_device_s": round(pool, 2),
        "dedicated_device_s": round(dedicated, 2),
        "busy_device_s": round(busy, 2),
        "savings_fraction": round(1 - pool / dedicated, 4),
        "mean_slowdown": round(sum(j["slowdown"] for j in jobs) / len(jobs), 3),
        "swapped_calls": swaps,
        "sharing_costs": sharing.get("predicted"),
        "all_same_as_alone": all(j["same_as_alone"] for j in jobs),
        "control": host,
    }


class Stuck(RuntimeError):
    """The jobs stopped making progress (`--stuck-s`)."""


def entry() -> int:
    try:
        return main()
    except Stuck as stuck:
        print(f"\nFAILED: {stuck}", file=sys.stderr, flush=True)
        # The jobs' threads still wait on calls of a cluster now stopped: leave them.
        os._exit(1)


if __name__ == "__main__":
    raise SystemExit(entry())
