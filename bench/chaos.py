"""Chaos: kill -9 each kind of process at random points of a multi-job LoRA run.

One local cluster (two workers) on a Kafka broker and a Redis of its own (the shared
pair is never touched), one undisturbed run of the fixed workload of
`plexrl.faults` as the reference, then, per process kind, N runs of it with one
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
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import tinker

from plexrl.cluster import ClusterConfig, LocalCluster
from plexrl.faults import JobOutcome, Workload, compare, run_workload
from plexrl.models import init_tiny
from plexrl.private_infra import Part, PrivateInfra

KEY, TENANT = "tml-chaos", "chaos"
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
    args = parser.parse_args()
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
    with tempfile.TemporaryDirectory(prefix="plexrl-chaos-") as tmp:
        root = Path(tmp)
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
