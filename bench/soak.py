"""Soak: several RLVR-shaped LoRA jobs for a long while; is every process's memory steady?

One local cluster (two workers, the shared Kafka and Redis), `--jobs` LoRA jobs through
the unmodified tinker SDK, each looping: forward_backward + optim_step, and every
`--sample-every` steps a sampler save and a sample call (4 × 16 tokens), and every
`--save-every` steps a `save_state`, then `--pause-s` idle (a reward stall: RL jobs wait
on rollouts and rewards; a soak that kept both cores busy would starve the services' own
loops rather than show their memory). Every `--every-s` seconds it records the resident
memory of each service (and of Redis: `used_memory`). Growth is the mean of the last
quarter of the samples against the mean of the second quarter (the first is warm-up:
imports, first allocations, caches filling). Errors seen by the clients are counted.
Ends with one JSON line.

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

from plexrl.cluster import ClusterConfig, LocalCluster
from plexrl.faults import batch
from plexrl.models import init_tiny

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
        )
        with LocalCluster(config) as cluster, redis.Redis.from_url(redis_url) as store:
            service = tinker.ServiceClient(base_url=config.gateway_url, api_key=KEY)
            names = cluster.names()
            memory: dict[str, list[float]] = {n: [] for n in [*names, "redis"]}
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
                elapsed = (time.monotonic() - start) / 60
                now = ", ".join(f"{n} {v[-1]:.0f}" for n, v in memory.items())
                print(f"{elapsed:5.1f} min, {tally['steps']} steps: MiB {now}", flush=True)
                time.sleep(args.every_s)
            for t in threads:
                t.join()
    growths = {n: round(growth(v), 2) for n, v in memory.items() if len(v) >= 4}
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
    }
    print(json.dumps(line))
    if tally["errors"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
