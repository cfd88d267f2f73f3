"""Soak: several RLVR-shaped LoRA jobs for a long while; is every process's memory steady?

One local cluster (two workers, the shared Kafka and Redis), `--jobs` LoRA jobs through
the unmodified tinker SDK, each looping: forward_backward + optim_step, and every
`--sample-every` steps a sampler save and a sample call (4 × 16 tokens), and every
`--save-every` steps a `save_state`, then `--pause-s` idle (a reward stall: RL jobs wait
on rollouts and rewards; a soak that kept both cores busy would starve the services' own
loops rather than show their memory). Every `--every-s` seconds it records the resident
memory of each service, Redis's `used_memory`, and the bytes of this cluster's own Redis
keys by family (`future`, `payload`, `ledger:results`, ...; `MEMORY USAGE` over a scan),
so other runs that share the Redis do not blur the figure. Growth is the mean of the
last quarter of the samples against the mean of the second quarter (the first is
warm-up: imports, first allocations, caches filling). Errors seen by the clients are
counted. Ends with one JSON line.

Redis keeps some records for a while by design: futures, results, payloads and retry
keys for `PLEXRL_RECORD_TTL_S` (24 h in production, `--record-ttl-s` here, 300 s by
default, so that they reach their steady state inside the soak), and each job's call
results in its ledger for the job's lifetime (exactly-once answers). The JSON line gives
the growth of the bounded families apart from the ledger's, and the ledger's bytes per
call.

    .venv/bin/python bench/soak.py --minutes 30
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import redis
import tinker
from tinker import types

from plexrl.models import init_tiny
from plexrl_tools.cluster import ClusterConfig, LocalCluster
from plexrl_tools.faults import batch

KEY, TENANT, BASE = "tml-soak", "soak", "plexrl/tiny-qwen3"


def job_loop(
    service: tinker.ServiceClient,
    seed: int,
    until: float,
    args: argparse.Namespace,
    tally: dict[str, int],
) -> None:
    adam = types.AdamParams(learning_rate=1e-3)
    params = types.SamplingParams(max_tokens=16, temperature=1.0)
    prompt = types.ModelInput.from_ints([5, 17, 42, 99, 7])
    client = service.create_lora_training_client(base_model=BASE, rank=8, seed=seed).result()
    step = 0
    while time.monotonic() < until:
        try:
            fb = client.forward_backward(batch(seed, step), "cross_entropy")
            opt = client.optim_step(adam)
            fb.result(), opt.result()
            if step % args.sample_every == 0:
                sampler = client.save_weights_and_get_sampling_client()
                sampler.sample(prompt, 4, params).result()
                tally["samples"] += 1
            if step % args.save_every == args.save_every - 1:
                client.save_state(f"soak-{seed}-{step}").result()  # names are unique
                tally["saves"] += 1
            tally["steps"] += 1
            time.sleep(args.pause_s)
        except Exception as exc:  # the client saw an error: count it, keep going
            tally["errors"] += 1
            print(f"job {seed} step {step}: {type(exc).__name__}: {exc}", flush=True)
        step += 1


def rss(pid: int) -> int:
    """Resident bytes of a process and its children (a service may fork helpers)."""
    try:
        proc = psutil.Process(pid)
        return proc.memory_info().rss + sum(
            c.memory_info().rss for c in proc.children(recursive=True)
        )
    except psutil.NoSuchProcess:
        return 0


def key_bytes(store: redis.Redis, cluster_id: str) -> dict[str, int]:
    """Bytes of the cluster's Redis keys by family: the part after the cluster id
    (`future`, `payload`, `job`, ...), the ledger's hashes as `ledger:log`,
    `ledger:results`, `ledger:ids` and `ledger` (its head)."""
    keys = [k.decode() for k in store.scan_iter(match=f"{cluster_id}:*", count=1000)]
    with store.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.memory_usage(key, samples=0)
        sizes = pipe.execute()
    out: dict[str, int] = {}
    for key, size in zip(keys, sizes, strict=True):
        parts = key.split(":")
        family = parts[1] if len(parts) > 1 else key
        if family == "ledger" and parts[-1] in ("ids", "log", "results"):
            family = f"ledger:{parts[-1]}"
        out[family] = out.get(family, 0) + int(size or 0)
    return out


EXPIRING = frozenset({"future", "done", "payload", "idem", "seq"})
"""Key families written with PLEXRL_RECORD_TTL_S."""
GROUPS = ("expiring", "ledger", "timeline", "records")
"""expiring: the families above; ledger: each job's call numbers, log and results (its
lifetime); timeline: a stream capped at 100,000 entries; records: jobs, sessions,
checkpoints, residency, usage (what they describe lives on)."""


def group_bytes(families: dict[str, int], group: str) -> int:
    def of(family: str) -> str:
        if family in EXPIRING:
            return "expiring"
        if family.startswith("ledger"):
            return "ledger"
        return "timeline" if family == "timeline" else "records"

    return sum(v for f, v in families.items() if of(f) == group)


def growth(series: list[float]) -> float:
    """Mean of the last quarter against the mean of the second quarter, in percent."""
    q = max(1, len(series) // 4)
    base = statistics.fmean(series[q : 2 * q] or series[:1])
    last = statistics.fmean(series[-q:])
    return 100.0 * (last - base) / base if base else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--jobs", type=int, default=3)
    parser.add_argument("--sample-every", type=int, default=4, help="steps between samples")
    parser.add_argument("--save-every", type=int, default=10, help="steps between save_state")
    parser.add_argument("--pause-s", type=float, default=1.0, help="idle seconds per step")
    parser.add_argument("--every-s", type=float, default=30.0, help="seconds between readings")
    parser.add_argument(
        "--record-ttl-s", type=int, default=300, help="PLEXRL_RECORD_TTL_S of the services"
    )
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    redis_url = os.environ.get("PLEXRL_REDIS_URL", "redis://127.0.0.1:6379/0")

    with tempfile.TemporaryDirectory(prefix="plexrl-soak-") as tmp:
        root = Path(tmp)
        init_tiny(root / "models" / "tiny-qwen3")
        config = ClusterConfig.on_free_ports(
            root / "models",
            root / "cluster",
            "soak",
            workers=2,
            api_keys=f"{KEY}={TENANT}",
            worker_threads=1,
            env={"PLEXRL_RECORD_TTL_S": str(args.record_ttl_s)},
        )
        with LocalCluster(config) as cluster, redis.Redis.from_url(redis_url) as store:
            service = tinker.ServiceClient(base_url=config.gateway_url, api_key=KEY)
            names = cluster.names()
            memory: dict[str, list[float]] = {n: [] for n in [*names, "redis"]}
            families: list[dict[str, int]] = []
            tally = {"steps": 0, "samples": 0, "saves": 0, "errors": 0}
            start = time.monotonic()
            until = start + args.minutes * 60
            threads = [
                threading.Thread(target=job_loop, args=(service, seed, until, args, tally))
                for seed in range(1, args.jobs + 1)
            ]
            for t in threads:
                t.start()
            while time.monotonic() < until:
                for name in names:
                    memory[name].append(rss(cluster.pid(name)) / 2**20)
                info: Any = store.info("memory")
                memory["redis"].append(float(info["used_memory"]) / 2**20)
                families.append(key_bytes(store, config.cluster_id))
                elapsed = (time.monotonic() - start) / 60
                now = ", ".join(f"{n} {v[-1]:.0f}" for n, v in memory.items())
                print(f"{elapsed:5.1f} min, {tally['steps']} steps: MiB {now}", flush=True)
                time.sleep(args.every_s)
            for t in threads:
                t.join()
    growths = {n: round(growth(v), 2) for n, v in memory.items() if len(v) >= 4}
    groups = {g: [float(group_bytes(r, g)) for r in families] for g in GROUPS}
    ledger = groups["ledger"]
    # numbered calls, the ones the ledger keeps: forward_backward and optim_step per
    # step, a sampler save per sample, a save_state per save (sample itself is not)
    calls = tally["steps"] * 2 + tally["samples"] + tally["saves"]
    line = {
        "benchmark": "soak",
        "minutes": args.minutes,
        "jobs": args.jobs,
        "pause_s": args.pause_s,
        **tally,
        "readings": len(memory["gateway"]),
        "rss_mib_last": {n: round(v[-1], 1) for n, v in memory.items() if v},
        "growth_pct": growths,
        "max_growth_pct": max(growths.values(), default=0.0),
        "record_ttl_s": args.record_ttl_s,
        "cluster_keys_mib_last": {f: round(v / 2**20, 2) for f, v in sorted(families[-1].items())}
        if families
        else {},
        "cluster_keys_growth_pct": {
            g: round(growth(v), 2) for g, v in groups.items() if len(v) >= 4
        },
        "ledger_bytes_per_call": round(ledger[-1] / calls) if ledger and calls else None,
    }
    print(json.dumps(line))
    if tally["errors"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
