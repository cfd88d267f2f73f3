"""Fair share between tenants, live: a light tenant's short training steps alone, then
beside a heavy tenant's two trainers, with the tenants' share on and off, side by side
in one run.

One local cluster (two workers, the tiny model, the `plexrl` policy), two tenants
through the unmodified tinker SDK:
- the *light* tenant: one LoRA job whose step is forward_backward + optim_step on one
  short datum, then `--pause-s` idle;
- the *heavy* tenant: two LoRA trainers whose step sends `--heavy-accum`
  forward_backward calls on `--heavy-tokens` tokens each (long calls) and an optim_step
  at once, as a client accumulating gradients does, and waits for them; back to back.

Phases, each with fresh jobs (unloaded at its end, and gone from the scheduler before
the next begins); only the scheduler restarts between them, with `PLEXRL_FAIR_SHARE` as
the phase says:
- `alone`: the light job by itself (then one heavy call's seconds alone, the targets'
  unit);
- `control`: share off, and the heavy trainers homed on the light job's worker (worker-1
  is away while they are admitted and back before they run, so a worker stands free
  beside them): the tenant-blind scheduler where placement stacked;
- `fair`: share on, both workers there: the placement and the dispatch as deployed;
- `fair_stacked`: share on, the trainers homed as in `control`: what the dispatch share
  alone gives where the stacking cannot be avoided (no worker free).

Per phase: the light job's step and forward_backward latency (p50 / p99), as ratios to
`alone`, the heavy trainers' step seconds and steps, and where each job was homed.
Targets, with the share on: the light tenant's step p99 within one heavy call (alone)
of its p99 alone (`fair`), and its forward_backward p99 within one heavy call of its
p99 alone where it shares the worker (`fair_stacked`). Ends with one JSON line.

    .venv/bin/python bench/fairness.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import tinker
import tiny_cluster
from tinker import types

from plexrl_tools.cluster import ClusterConfig, LocalCluster

LIGHT_KEY, HEAVY_KEY, BASE = "tml-fair-light", "tml-fair-heavy", "plexrl/tiny-qwen3"
ADAM = types.AdamParams(learning_rate=1e-3)

PHASES = {"control": (False, True), "fair": (True, False), "fair_stacked": (True, True)}
"""Name: (PLEXRL_FAIR_SHARE, heavy trainers homed on the light job's worker)."""


def heavy_batch(tokens: int, row: int = 128) -> list[types.Datum]:
    """`tokens` tokens in rows of `row` (at least one row): one long forward_backward."""
    rows = max(1, tokens // row)
    return [tiny_cluster.datum([5 + (i * 7 + j) % 200 for j in range(row)]) for i in range(rows)]


def percentile(xs: list[float], q: float) -> float:
    """The q-quantile by rank (the value at index floor(q * n), capped at the last)."""
    if not xs:
        raise ValueError("no samples: raise --steps")
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(steps: list[float], calls: list[float]) -> dict[str, float]:
    """The light job's figures of one phase (its first step warms up)."""
    steps, calls = steps[1:] or steps, calls[1:] or calls
    return {
        "step_p50_s": percentile(steps, 0.5),
        "step_p99_s": percentile(steps, 0.99),
        "fb_p50_s": percentile(calls, 0.5),
        "fb_p99_s": percentile(calls, 0.99),
    }


def ratios(alone: dict[str, float], beside: dict[str, float]) -> dict[str, float]:
    """Each of the light job's figures beside the heavy tenant over the same alone."""
    return {f"{k[:-2]}_x": round(beside[k] / alone[k], 2) for k in alone if alone[k] > 0}


def within_one_call(alone_s: float, beside_s: float, heavy_call_s: float) -> bool:
    """The target: `beside_s` at most one heavy call longer than `alone_s`."""
    return beside_s <= alone_s + heavy_call_s


class Heavy:
    """The heavy tenant's trainers, calling until `stop` is set."""

    def __init__(self, service: tinker.ServiceClient, tokens: int, accum: int) -> None:
        self.clients = [
            service.create_lora_training_client(base_model=BASE, rank=4, seed=10 + i).result()
            for i in range(2)
        ]
        self.batch = heavy_batch(tokens)
        self.accum = accum
        self.stop = threading.Event()
        self.step_s: list[float] = []
        self._threads = [threading.Thread(target=self._loop, args=(c,)) for c in self.clients]
        self._lock = threading.Lock()

    def _loop(self, client: tinker.TrainingClient) -> None:
        while not self.stop.is_set():
            t0 = time.monotonic()
            futures = [
                client.forward_backward(self.batch, "cross_entropy") for _ in range(self.accum)
            ]
            optim = client.optim_step(ADAM)
            for future in futures:
                future.result()
            optim.result()
            with self._lock:
                self.step_s.append(time.monotonic() - t0)

    def start(self) -> None:
        for t in self._threads:
            t.start()
        while len(self.step_s) < 2:  # warm: long calls in flight
            time.sleep(0.1)

    def join(self) -> None:
        self.stop.set()
        for t in self._threads:
            t.join()


def light_steps(
    client: tinker.TrainingClient, steps: int, pause_s: float
) -> tuple[list[float], list[float]]:
    datum = tiny_cluster.datum([5, 6, 7, 8, 9, 10, 11, 12])
    step_s, fb_s = [], []
    for _ in range(steps):
        t0 = time.monotonic()
        client.forward_backward([datum], "cross_entropy").result()
        fb_s.append(time.monotonic() - t0)
        client.optim_step(ADAM).result()
        step_s.append(time.monotonic() - t0)
        time.sleep(pause_s)
    return step_s, fb_s


def scheduler_jobs(config: ClusterConfig) -> int:
    url = f"http://127.0.0.1:{config.scheduler_port}/healthz"
    return int(httpx.get(url, timeout=10).json().get("jobs", 0))


def wait_unloaded(config: ClusterConfig, timeout_s: float) -> None:
    """Until the scheduler holds no job: the last phase's unloads are done, so its jobs
    weigh on no placement of the next."""
    deadline = time.monotonic() + timeout_s
    while scheduler_jobs(config) > 0:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the scheduler still holds jobs after {timeout_s:.0f} s")
        time.sleep(0.2)


def home(config: ClusterConfig, key: str, model_id: str) -> str | None:
    url = f"{config.gateway_url}/plexrl/v1/jobs/{model_id}"
    answer = httpx.get(url, headers={"X-API-Key": key}, timeout=30).json()
    return answer.get("home")


def scheduler_sees(config: ClusterConfig, worker: str, healthy: bool, timeout_s: float) -> None:
    url = f"http://127.0.0.1:{config.scheduler_port}/healthz"
    deadline = time.monotonic() + timeout_s
    while bool(httpx.get(url, timeout=10).json().get("workers", {}).get(worker)) != healthy:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the scheduler does not see {worker} healthy={healthy}")
        time.sleep(0.2)


def phase(
    cluster: LocalCluster, args: argparse.Namespace, fair: bool | None, stacked: bool
) -> dict[str, Any]:
    config = cluster.config
    if fair is not None:
        cluster.kill("scheduler", graceful=True)
        cluster.restart("scheduler", env={"PLEXRL_FAIR_SHARE": "1" if fair else "0"})
        scheduler_sees(config, "worker-1", True, 60)
    if stacked:  # worker-1 away while the jobs are admitted: all go to worker-0
        cluster.kill("worker-1", graceful=True)
        scheduler_sees(config, "worker-1", False, 60)
    out: dict[str, Any] = {}
    with (
        tinker.ServiceClient(base_url=config.gateway_url, api_key=LIGHT_KEY) as light_service,
        tinker.ServiceClient(base_url=config.gateway_url, api_key=HEAVY_KEY) as heavy_service,
    ):
        light = light_service.create_lora_training_client(base_model=BASE, rank=4, seed=1).result()
        heavy = None
        if fair is not None:
            heavy = Heavy(heavy_service, args.heavy_tokens, args.heavy_accum)
        if stacked:
            cluster.restart("worker-1")
            scheduler_sees(config, "worker-1", True, 60)
        out["homes"] = {"light": home(config, LIGHT_KEY, light.model_id)}
        if heavy is not None:
            out["homes"]["heavy"] = [home(config, HEAVY_KEY, c.model_id) for c in heavy.clients]
            heavy.start()
        try:
            steps, calls = light_steps(light, args.steps, args.pause_s)
        finally:
            if heavy is not None:
                heavy.join()
        if heavy is None:  # one heavy call's seconds, alone: the targets' unit
            alone = heavy_service.create_lora_training_client(base_model=BASE, rank=4).result()
            batch, took = heavy_batch(args.heavy_tokens), []
            for _ in range(4):
                t0 = time.monotonic()
                alone.forward_backward(batch, "cross_entropy").result()
                took.append(time.monotonic() - t0)
            out["heavy_fb_s"] = round(statistics.median(took[1:]), 4)
    wait_unloaded(config, 120)
    out["light"] = summary(steps, calls)
    if heavy is not None:
        out["heavy_step_p50_s"] = round(statistics.median(heavy.step_s), 4)
        out["heavy_steps"] = len(heavy.step_s)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="light steps per phase")
    parser.add_argument("--pause-s", type=float, default=0.05, help="light idle per step")
    parser.add_argument("--heavy-tokens", type=int, default=16384, help="per heavy call")
    parser.add_argument("--heavy-accum", type=int, default=2, help="heavy calls per step")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="plexrl-fair-") as tmp:
        root = Path(tmp)
        config = tiny_cluster.config(root, "fair", 2, f"{LIGHT_KEY}=light,{HEAVY_KEY}=heavy")
        with LocalCluster(config) as cluster:
            alone = phase(cluster, args, None, False)
            print(f"alone: {alone['light']}", flush=True)
            runs: dict[str, dict[str, Any]] = {}
            for name, (fair, stacked) in PHASES.items():
                got = phase(cluster, args, fair, stacked)
                got["ratios"] = ratios(alone["light"], got["light"])
                runs[name] = got
                print(f"{name}: {got}", flush=True)

    base, heavy_s = alone["light"], alone["heavy_fb_s"]
    targets = {
        "fair_step_p99_within_one_heavy_call": within_one_call(
            base["step_p99_s"], runs["fair"]["light"]["step_p99_s"], heavy_s
        ),
        "fair_stacked_fb_p99_within_one_heavy_call": within_one_call(
            base["fb_p99_s"], runs["fair_stacked"]["light"]["fb_p99_s"], heavy_s
        ),
    }
    line = {
        "benchmark": "fairness",
        "steps": args.steps,
        "pause_s": args.pause_s,
        "heavy_tokens": args.heavy_tokens,
        "heavy_accum": args.heavy_accum,
        "alone": {k: round(v, 4) for k, v in base.items()},
        "heavy_fb_alone_s": heavy_s,
        **{
            name: {
                "light": {k: round(v, 4) for k, v in got["light"].items()},
                "ratios": got["ratios"],
                "heavy_step_p50_s": got["heavy_step_p50_s"],
                "heavy_steps": got["heavy_steps"],
                "homes": got["homes"],
            }
            for name, got in runs.items()
        },
        "targets": targets,
        "targets_met": all(targets.values()),
    }
    print(json.dumps(line))


if __name__ == "__main__":
    main()
