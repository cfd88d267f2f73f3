"""Chaos: kill -9 each kind of process at random points of a multi-job LoRA run.

One local cluster (two workers) on a Kafka broker and a Redis of its own (the shared
pair is never touched), one undisturbed run of the fixed workload of
`plexrl_tools.faults` as the reference, then, per process kind, N runs of it with one
process killed (SIGKILL) at a random moment and restarted with the same id (the broker
and Redis on the same data). Two more kinds are not kills:

- `hung-worker`: the job's home is SIGSTOPped (a hung process, a long GC pause, a VM
  stall) for twice the heartbeat timeout, so its jobs are re-homed, then continued:
  whatever it does late, under its old leases, must change nothing (the pause may fall
  in the final `save_state`);
- `store-outage-delete`: the state-store is killed, a checkpoint of another job is
  deleted through the SDK while it is down, and it is restarted: the checkpoint must
  stay deleted (listing, record and blob), counted as `resurrected` otherwise.

Each run is compared to the reference: calls lost (the client saw an error), optimizer
steps applied twice (or skipped), jobs not bit-identical (losses or checkpoint bytes).

Recovery time of an injection: from the kill to the moment every job has finished a
training step that was still to come at the kill, minus that step's undisturbed
duration — the stall a job saw. Ends with one JSON line.

    .venv/bin/python bench/chaos.py --injections 3 \
        --kinds worker,scheduler,gateway,state-store,broker,redis,hung-worker,store-outage-delete

With `--hosts` (root) it runs on the host bed instead (plexrl_tools.hostbed: six network
namespaces, three Kafka brokers, Redis with Sentinels, SeaweedFS, two of every service)
and injects host and link faults (plexrl_tools.host_faults: a worker's host cut off, the
leading scheduler's host cut off, a lossy slow link for `--lossy-s`, a broker's host
killed, the Redis primary's host killed or cut off) `--injections` times each, in a random order at
random points of the run; per kind it reports the stall and the failover time. Before
that, unless `--no-main`, the main job (examples/rlvr.py's RLVR jobs, as scripts/demo.sh
runs them) runs once on one host (a LocalCluster over its own broker and Redis) and once
across the bed's hosts, with the same workers, policy and device budget: makespan,
device-seconds, savings and whether every job learned the same, side by side.

    sudo .venv/bin/python bench/chaos.py --hosts --injections 2 --lossy-s 60
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import tinker

from plexrl.models import init_tiny
from plexrl_tools.cluster import ClusterConfig, LocalCluster
from plexrl_tools.faults import JobOutcome, Workload, compare, run_workload
from plexrl_tools.private_infra import Part, PrivateInfra

KEY, TENANT = "tml-chaos", "chaos"
MAIN_KEY = "tml-main"
ROOT = Path(__file__).resolve().parent.parent
KINDS = {
    "worker": "worker-0",
    "scheduler": "scheduler",
    "gateway": "gateway",
    "state-store": "state-store",
    "broker": "broker",
    "redis": "redis",
    "hung-worker": "worker-0",
    "store-outage-delete": "state-store",
}
"""Process kind -> what is killed (for a worker: the one the first job runs on)."""
HANGS = {"hung-worker"}
"""Kinds whose victim is paused (SIGSTOP, then SIGCONT), not killed."""
INFRA_PARTS: dict[str, Part] = {"broker": "broker", "redis": "redis"}
# Service start-up imports torch and transformers: minutes on a busy 2-core machine.
START_TIMEOUT_S = 600.0


def inject(
    cluster: LocalCluster,
    infra: PrivateInfra,
    service: Any,
    workload: Workload,
    blobs: Path,
    kind: str,
    rng: random.Random,
    step_s: float,
    hang_s: float,
    doomed: str,
) -> tuple[list[JobOutcome], float, str, int]:
    """One disturbed run; returns its outcomes, the recovery time, who was hit and how
    many deleted checkpoints came back (`doomed`: the one `store-outage-delete` deletes)."""
    done_at: dict[int, list[float]] = {s: [] for s in workload.seeds}
    # A pause may also fall after the last step: in the job's final save_state.
    kill_step = rng.randrange(1, workload.steps + (kind in HANGS))
    delay_s = rng.uniform(0.0, step_s)
    lock = threading.Lock()
    killed: dict[str, Any] = {}

    def kill(victim: str) -> None:
        time.sleep(delay_s)  # somewhere in the job's next step
        with lock:
            killed["before"] = {s: len(t) for s, t in done_at.items()}
            killed["at"] = time.monotonic()
            killed["victim"] = victim
        if kind in HANGS:
            pid = cluster.pid(victim)
            os.kill(pid, signal.SIGSTOP)
            try:
                time.sleep(hang_s)
            finally:
                os.kill(pid, signal.SIGCONT)
        elif victim in INFRA_PARTS:
            infra.kill(INFRA_PARTS[victim])
            infra.up()
        else:
            cluster.kill(victim)
            if kind == "store-outage-delete":
                service.create_rest_client().delete_checkpoint_from_tinker_path(doomed).result(
                    timeout=120
                )
            cluster.restart(victim, START_TIMEOUT_S)

    def on_step(job: JobOutcome, step: int) -> None:
        with lock:
            done_at[job.seed].append(time.monotonic())
        if job.seed == workload.seeds[0] and step == kill_step:
            victim = KINDS[kind]
            if kind in ("worker", "hung-worker"):  # the worker this job runs on
                victim = cluster_home(cluster, job.model_id) or victim
            killed["thread"] = threading.Thread(target=kill, args=(victim,))
            killed["thread"].start()

    outcomes = run_workload(service, workload, blobs, TENANT, on_step)
    if "thread" in killed:
        killed["thread"].join()
    if "at" not in killed:
        return outcomes, 0.0, "nobody (the run ended first)", 0
    resurrected = 0
    if kind == "store-outage-delete":
        time.sleep(3.0)  # past the restarted store's first rebuild rounds
        resurrected = int(checkpoint_listed(service, doomed))
    before, at = killed["before"], killed["at"]
    # The stall: the first step each job finished after the kill, less an ordinary step.
    stalls = [
        done_at[s][before[s]] - at - step_s for s in workload.seeds if len(done_at[s]) > before[s]
    ]
    return outcomes, max(0.0, max(stalls, default=0.0)), str(killed["victim"]), resurrected


def checkpoint_listed(service: Any, path: str) -> bool:
    """Whether the SDK still lists the checkpoint at `path`."""
    model_id = path.removeprefix("tinker://").split("/", 1)[0]
    listing = service.create_rest_client().list_checkpoints(model_id).result(timeout=120)
    return any(c.tinker_path == path for c in listing.checkpoints)


def doomed_checkpoints(service: Any, workload: Workload, n: int) -> list[str]:
    """`n` checkpoints of a job of its own, for `store-outage-delete` to delete."""
    from tinker import types

    client = service.create_lora_training_client(
        base_model=workload.base_model, rank=workload.rank, seed=99
    )
    client.optim_step(types.AdamParams(learning_rate=workload.learning_rate)).result()
    return [client.save_state(f"doomed-{i}").result().path for i in range(n)]


def cluster_home(cluster: LocalCluster, model_id: str) -> str | None:
    """The worker the job is homed on (from Redis)."""
    import redis

    url = cluster.config.env["PLEXRL_REDIS_URL"]
    with redis.Redis.from_url(url) as store:
        raw = store.get(f"{cluster.config.cluster_id}:home:{model_id}")
    return None if raw is None else raw.decode() if isinstance(raw, bytes) else str(raw)


def main_job(args: argparse.Namespace, gateway_url: str, which: int) -> dict[str, Any]:
    """The main job's RLVR jobs at once through `gateway_url`: their results and accounting."""
    sys.path.insert(0, str(ROOT / "examples"))
    import httpx
    from rlvr import RlvrConfig, RlvrJob

    def one(i: int) -> Any:
        config = RlvrConfig(
            sft_steps=args.main_sft_steps, rl_steps=args.main_rl_steps, reward_stall_s=1.0, seed=i
        )
        with tinker.ServiceClient(base_url=gateway_url, api_key=MAIN_KEY) as service:
            return RlvrJob(service, config).run()

    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=which) as pool:
        results = list(pool.map(one, range(which)))
    makespan = time.monotonic() - start
    device_s = dedicated_s = 0.0
    with httpx.Client(base_url=gateway_url, headers={"X-API-Key": MAIN_KEY}, timeout=60) as http:
        for r in results:
            acct = http.get(f"/plexrl/v1/jobs/{r.model_id}").json()["accounting"]
            device_s += acct["device_s"]
            dedicated_s += acct["dedicated_device_s"]
    return {
        "makespan_s": round(makespan, 2),
        "mean_job_wall_s": round(statistics.mean(r.wall_s for r in results), 2),
        "device_s": round(device_s, 2),
        "savings_fraction": round(1 - device_s / dedicated_s, 4) if dedicated_s else None,
        "rewards": [r.rewards for r in results],
        "sft_losses": [r.sft_losses for r in results],
    }


def main_hosts(args: argparse.Namespace, rng: random.Random, seed: int) -> dict[str, Any]:
    """The host bed: the main job on one host and across hosts, then the host faults."""
    from plexrl_tools.faults import StoreCheckpoints
    from plexrl_tools.host_faults import KINDS as HOST_KINDS
    from plexrl_tools.host_faults import FaultConfig, HostFaults
    from plexrl_tools.hostbed import HostBed

    sys.path.insert(0, str(ROOT / "examples"))
    from rlvr_demo import ensure_model

    from plexrl.models import ModelRegistry

    kinds = [k for k in args.host_kinds.split(",") if k]
    unknown = [k for k in kinds if k not in HOST_KINDS]
    if unknown:
        sys.exit(f"unknown host fault kinds {unknown}; choose from {list(HOST_KINDS)}")
    registry = args.registry
    ensure_model(registry)
    job_bytes = ModelRegistry(registry).info("plexrl/tiny-qwen3").state_bytes(16)
    device = {"PLEXRL_WORKER_DEVICE_BYTES": str(int(job_bytes * 1.5))}
    line: dict[str, Any] = {"benchmark": "chaos-hosts", "seed": seed, "steps": args.steps}
    keys = f"{KEY}={TENANT},{MAIN_KEY}=main"
    with work_dir(args.keep, "plexrl-chaos-hosts-") as root:
        one_host = None
        if not args.no_main:
            infra = PrivateInfra()
            print("the main job on one host: starting its own broker and Redis", flush=True)
            infra.up()
            config = ClusterConfig.on_free_ports(
                registry,
                root / "one-host",
                "mainone",
                workers=2,
                api_keys=keys,
                worker_threads=1,
                env={**infra.env(), **device},
            )
            try:
                with LocalCluster(config) as cluster:
                    one_host = main_job(args, cluster.config.gateway_url, args.main_jobs)
            finally:
                infra.down()
                infra.remove()
            print(f"one host: {summary(one_host)}", flush=True)
        env = {"PLEXRL_WORKER_TIMEOUT_S": str(args.worker_timeout_s), **device}
        bed = HostBed(root / "bed", registry, api_keys=keys, env=env)
        print(f"the host bed {bed.bed_id}: starting (minutes)", flush=True)
        started = time.monotonic()
        bed.up(START_TIMEOUT_S)
        line["bed_start_s"] = round(time.monotonic() - started, 1)
        try:
            if one_host is not None:
                hosts = main_job(args, bed.gateway_url, args.main_jobs)
                print(f"across hosts: {summary(hosts)}", flush=True)
                line["main"] = {
                    "jobs": args.main_jobs,
                    "one_host": {
                        k: v for k, v in one_host.items() if k not in ("rewards", "sft_losses")
                    },
                    "hosts": {k: v for k, v in hosts.items() if k not in ("rewards", "sft_losses")},
                    "makespan_ratio": round(hosts["makespan_s"] / one_host["makespan_s"], 3),
                    "same_learning": hosts["rewards"] == one_host["rewards"]
                    and hosts["sft_losses"] == one_host["sft_losses"],
                }
            service = tinker.ServiceClient(base_url=bed.gateway_url, api_key=KEY)
            checkpoints = StoreCheckpoints(bed.urls("state-store"), bed.cluster.service_token)
            workload = Workload(steps=args.steps)
            reference = run_workload(service, workload, checkpoints, TENANT)
            if any(o.errors for o in reference):
                sys.exit(f"the undisturbed run failed: {[o.errors for o in reference]}")
            faults = HostFaults(
                bed,
                service,
                checkpoints,
                TENANT,
                workload,
                reference,
                FaultConfig(hold_s=2 * args.worker_timeout_s + 2, lossy_s=args.lossy_s),
            )
            plan = [k for k in kinds for _ in range(args.injections)]
            rng.shuffle(plan)
            runs: dict[str, list[Any]] = {k: [] for k in kinds}
            for n, kind in enumerate(plan):
                run = faults.run(
                    kind,
                    at_step=rng.randrange(1, args.steps),
                    delay_s=rng.uniform(0.0, faults.step_s),
                    revive=n < len(plan) - 1,
                )
                runs[kind].append(run)
                print(
                    f"{kind} #{len(runs[kind])} on {run.host}: {run.comparison}, stall "
                    f"{run.stall_s:.1f}s, failover {run.failover_s}, {run.notes}",
                    flush=True,
                )
        finally:
            bed.down()
    line["kinds"] = {k: host_figures(v) for k, v in runs.items()}
    for total in ("lost", "duplicated", "not_identical"):
        line[total] = sum(r[total] for r in line["kinds"].values())
    return line


@contextlib.contextmanager
def work_dir(keep: Path | None, prefix: str) -> Iterator[Path]:
    """Where a run's clusters write (their logs among it): `keep` if given, left there
    for reading afterwards; otherwise a temporary directory removed at the end."""
    if keep is None:
        with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
            yield Path(tmp)
        return
    keep.mkdir(parents=True, exist_ok=True)
    print(f"keeping the run's logs under {keep}", flush=True)
    yield keep


def host_figures(runs: list[Any]) -> dict[str, Any]:
    stalls = [r.stall_s for r in runs]
    failovers = [r.failover_s for r in runs if r.failover_s is not None]
    return {
        "injections": len(runs),
        "lost": sum(r.comparison.lost for r in runs),
        "duplicated": sum(r.comparison.duplicated for r in runs),
        "not_identical": sum(r.comparison.not_identical for r in runs),
        "stall_p50_s": round(statistics.median(stalls), 2),
        "stall_max_s": round(max(stalls), 2),
        "failover_p50_s": round(statistics.median(failovers), 2) if failovers else None,
        "failover_max_s": round(max(failovers), 2) if failovers else None,
    }


def figures_of(run: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in run.items() if k not in ("rewards", "sft_losses")}


def summary(run: dict[str, Any]) -> str:
    return (
        f"makespan {run['makespan_s']}s, mean job {run['mean_job_wall_s']}s, device "
        f"{run['device_s']}s, saved {run['savings_fraction']}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--injections", type=int, default=3, help="kills per process kind")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--steps", type=int, default=4, help="training steps per job")
    parser.add_argument("--seed", type=int, default=None, help="seed of the kill points")
    parser.add_argument("--worker-timeout-s", type=float, default=3.0)
    parser.add_argument(
        "--hang-s", type=float, default=None, help="hung-worker pause (2x the timeout)"
    )
    parser.add_argument("--hosts", action="store_true", help="host and link faults on the bed")
    parser.add_argument(
        "--host-kinds",
        default="worker-partition,leader-partition,lossy-link,"
        "broker-host-kill,redis-primary-host-kill,redis-primary-partition",
    )
    parser.add_argument("--lossy-s", type=float, default=60.0, help="how long a link is lossy")
    parser.add_argument("--no-main", action="store_true", help="skip the main job's runs")
    parser.add_argument(
        "--keep",
        type=Path,
        default=None,
        help="write the clusters (their logs) under this directory and leave it there",
    )
    parser.add_argument("--main-jobs", type=int, default=4)
    parser.add_argument("--main-sft-steps", type=int, default=10)
    parser.add_argument("--main-rl-steps", type=int, default=8)
    parser.add_argument(
        "--registry",
        type=Path,
        default=Path(__file__).resolve().parent.parent / ".plexrl" / "models",
    )
    args = parser.parse_args()
    if args.hosts:
        seed = args.seed if args.seed is not None else random.randrange(2**31)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        print(json.dumps(main_hosts(args, random.Random(seed), seed)))
        return
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        sys.exit(f"unknown kinds {unknown}; choose from {sorted(KINDS)}")
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    rng = random.Random(seed)
    workload = Workload(steps=args.steps)
    hang_s = args.hang_s if args.hang_s is not None else 2 * args.worker_timeout_s
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    infra = PrivateInfra()
    print(f"private kafka {infra.bootstrap}, redis {infra.redis_url}: starting", flush=True)
    infra.up()
    with work_dir(args.keep, "plexrl-chaos-") as root:
        init_tiny(root / "models" / "tiny-qwen3")
        config = ClusterConfig.on_free_ports(
            root / "models",
            root / "cluster",
            "chaos",
            workers=2,
            api_keys=f"{KEY}={TENANT}",
            worker_threads=1,
            env={"PLEXRL_WORKER_TIMEOUT_S": str(args.worker_timeout_s), **infra.env()},
        )
        blobs = config.state_dir / "blobs"
        cluster = LocalCluster(config)
        cluster.start(timeout_s=START_TIMEOUT_S)
        try:
            service = tinker.ServiceClient(base_url=config.gateway_url, api_key=KEY)
            start = time.monotonic()
            reference = run_workload(service, workload, blobs, TENANT)
            if any(o.errors for o in reference):
                sys.exit(f"the undisturbed run failed: {[o.errors for o in reference]}")
            step_s = statistics.median(s for o in reference for s in o.call_s)
            print(f"reference: {time.monotonic() - start:.1f}s, step {step_s:.3f}s", flush=True)
            doomed = (
                doomed_checkpoints(service, workload, args.injections)
                if "store-outage-delete" in kinds
                else []
            )
            results: dict[str, dict[str, Any]] = {}
            for kind in kinds:
                totals = {"lost": 0, "duplicated": 0, "not_identical": 0, "resurrected": 0}
                recovery: list[float] = []
                for i in range(args.injections):
                    outcomes, stall_s, victim, back = inject(
                        cluster,
                        infra,
                        service,
                        workload,
                        blobs,
                        kind,
                        rng,
                        step_s,
                        hang_s,
                        doomed[i] if doomed else "",
                    )
                    c = compare(reference, outcomes)
                    totals["lost"] += c.lost
                    totals["duplicated"] += c.duplicated
                    totals["not_identical"] += c.not_identical
                    totals["resurrected"] += back
                    recovery.append(stall_s)
                    print(
                        f"{kind} #{i + 1} ({victim}): {c}, resurrected {back}, "
                        f"recovery {stall_s:.2f}s",
                        flush=True,
                    )
                results[kind] = {
                    "injections": args.injections,
                    **totals,
                    "recovery_p50_s": round(statistics.median(recovery), 3),
                    "recovery_max_s": round(max(recovery), 3),
                }
        finally:
            cluster.stop()
            infra.down()
            infra.remove()
    line = {
        "benchmark": "chaos",
        "seed": seed,
        "steps": args.steps,
        "jobs": len(workload.seeds),
        "worker_timeout_s": args.worker_timeout_s,
        "hang_s": hang_s,
        "kinds": results,
        "lost": sum(r["lost"] for r in results.values()),
        "duplicated": sum(r["duplicated"] for r in results.values()),
        "not_identical": sum(r["not_identical"] for r in results.values()),
        "resurrected": sum(r["resurrected"] for r in results.values()),
    }
    print(json.dumps(line))


if __name__ == "__main__":
    main()
