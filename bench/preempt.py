"""Preemption, live: what it gives a short-call job and costs a long-rollout job on one
worker, against the same scheduler with preemption off, side by side in one run.

One local cluster (one worker, the tiny model, the `plexrl` policy), two LoRA jobs
through the unmodified tinker SDK:
- the *roller*: each step samples `--samples` × `--tokens` tokens (seeded) from its
  latest weights, then forward_backward + optim_step on them: long rollouts;
- the *trainer*: each step forward_backward + optim_step, then `--pause-s` idle (a
  reward stall): short calls that arrive while the roller samples.

Phases, each with fresh jobs of the same seeds: each job alone; then both together
under four schedulers, in turn, `--repeats` times (only the scheduler restarts between
phases): `PLEXRL_PREEMPT_RATIO` 0.5 (on) or 0 (off), each with the policy's
anticipation as deployed (`PLEXRL_HOLD_S` 0.1) and without it (0). Anticipation holds
the worker for a job in a burst of calls for up to a quantum (10 s), and the roller's
calls come back to back, so without preemption it keeps the trainer out for whole
quanta; the runs without it show what preemption adds over that too.

Per phase: each job's mean step time against its time alone (its slowdown), the
trainer's call latency p50/p99, and the preemptions the scheduler sent. Both jobs'
losses and samples must be the same in every phase (checked; preemption never changes
what a job computes). Ends with one JSON line.

    .venv/bin/python bench/preempt.py
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

KEY, TENANT, BASE = "tml-preempt-bench", "preempt", "plexrl/tiny-qwen3"
ADAM = types.AdamParams(learning_rate=1e-3)


def roller(service: tinker.ServiceClient, args: argparse.Namespace, out: dict[str, Any]) -> None:
    client = service.create_lora_training_client(base_model=BASE, rank=4, seed=1).result()
    prompt = types.ModelInput.from_ints([21, 22, 15, 9])
    steps: list[float] = []
    seen: list[Any] = []
    for step in range(args.steps):
        t0 = time.monotonic()
        sampler = client.save_weights_and_get_sampling_client()
        params = types.SamplingParams(max_tokens=args.tokens, temperature=1.0, seed=step)
        result = sampler.sample(prompt, args.samples, params).result()
        tokens = result.sequences[0].tokens
        seen.append(tokens[:8])
        fb = client.forward_backward(
            [tiny_cluster.datum([21, 22, 15, 9, *tokens[:24]])], "cross_entropy"
        )
        seen.append(fb.result().metrics["loss:sum"])
        client.optim_step(ADAM).result()
        steps.append(time.monotonic() - t0)
    out["roller"] = {"steps": steps, "seen": seen}


def trainer(service: tinker.ServiceClient, args: argparse.Namespace, out: dict[str, Any]) -> None:
    client = service.create_lora_training_client(base_model=BASE, rank=4, seed=2).result()
    datum = tiny_cluster.datum([5, 6, 7, 8, 9, 10, 11, 12])
    steps, calls, seen = [], [], []
    step = 0
    while step == 0 or (step < args.steps * 4 and "until" not in out):
        t0 = time.monotonic()
        seen.append(client.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"])
        calls.append(time.monotonic() - t0)
        client.optim_step(ADAM).result()
        steps.append(time.monotonic() - t0)
        time.sleep(args.pause_s)
        step += 1
    out["trainer"] = {"steps": steps, "calls": calls, "seen": seen}


def preempts(config: ClusterConfig) -> float:
    """The scheduler's plexrl_scheduler_preempts_total, summed over workers."""
    text = httpx.get(f"http://127.0.0.1:{config.scheduler_port}/metrics", timeout=30).text
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("plexrl_scheduler_preempts_total{")
    )


MODES = {"on": (0.5, 0.1), "off": (0.0, 0.1), "on_no_hold": (0.5, 0.0), "off_no_hold": (0.0, 0.0)}
"""Name: (PLEXRL_PREEMPT_RATIO, PLEXRL_HOLD_S)."""


def phase(
    cluster: LocalCluster,
    args: argparse.Namespace,
    who: str,
    mode: tuple[float, float] | None,
) -> dict[str, Any]:
    if mode is not None:
        cluster.kill("scheduler", graceful=True)
        env = {"PLEXRL_PREEMPT_RATIO": str(mode[0]), "PLEXRL_HOLD_S": str(mode[1])}
        cluster.restart("scheduler", env=env)
    service = tinker.ServiceClient(base_url=cluster.config.gateway_url, api_key=KEY)
    out: dict[str, Any] = {}
    before = preempts(cluster.config)
    threads = []
    if who in ("roller", "both"):
        threads.append(threading.Thread(target=roller, args=(service, args, out)))
    if who in ("trainer", "both"):
        threads.append(threading.Thread(target=trainer, args=(service, args, out)))
    for t in threads:
        t.start()
    if who == "both":  # the trainer stops with the roller
        threads[0].join()
        out["until"] = time.monotonic()
    for t in threads:
        t.join()
    out["preempts"] = preempts(cluster.config) - before
    return out


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs[1:] or xs)  # the first step warms up


def _pct(xs: list[float], q: float) -> float:
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="roller steps per phase")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--pause-s", type=float, default=0.2, help="trainer idle per step")
    parser.add_argument("--repeats", type=int, default=2, help="on/off pairs")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="plexrl-preempt-") as tmp:
        root = Path(tmp)
        config = tiny_cluster.config(root, "pre", 1, f"{KEY}={TENANT}")
        with LocalCluster(config) as cluster:
            alone_r = phase(cluster, args, "roller", None)["roller"]
            print(f"roller alone: {_mean(alone_r['steps']):.3f} s/step", flush=True)
            alone_t = phase(cluster, args, "trainer", None)["trainer"]
            print(f"trainer alone: {_mean(alone_t['steps']):.3f} s/step", flush=True)
            runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
            for _ in range(args.repeats):
                for mode, settings in MODES.items():
                    got = phase(cluster, args, "both", settings)
                    r, t = got["roller"], got["trainer"]
                    same = (
                        r["seen"] == alone_r["seen"]
                        and t["seen"] == alone_t["seen"][: len(t["seen"])]
                    )
                    row = {
                        "roller_slowdown": _mean(r["steps"]) / _mean(alone_r["steps"]),
                        "trainer_slowdown": _mean(t["steps"]) / _mean(alone_t["steps"]),
                        "trainer_call_p50_s": _pct(t["calls"], 0.5),
                        "trainer_call_p99_s": _pct(t["calls"], 0.99),
                        "trainer_steps": len(t["steps"]),
                        "preempts": got["preempts"],
                        "identical": same,
                    }
                    runs[mode].append(row)
                    print(
                        f"{mode}: roller x{row['roller_slowdown']:.3f}, trainer "
                        f"x{row['trainer_slowdown']:.3f}, trainer fb p50 "
                        f"{row['trainer_call_p50_s'] * 1000:.0f} ms p99 "
                        f"{row['trainer_call_p99_s'] * 1000:.0f} ms, "
                        f"{row['preempts']:.0f} preempts, identical={same}",
                        flush=True,
                    )

    def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
        keys = [k for k in rows[0] if k != "identical"]
        return {k: round(statistics.fmean(r[k] for r in rows), 4) for k in keys} | {
            "identical": all(r["identical"] for r in rows)
        }

    summaries = {m: summary(rows) for m, rows in runs.items()}
    line = {
        "benchmark": "preempt",
        "steps": args.steps,
        "samples": args.samples,
        "tokens": args.tokens,
        "pause_s": args.pause_s,
        "repeats": args.repeats,
        "roller_alone_s": round(_mean(alone_r["steps"]), 4),
        "trainer_alone_s": round(_mean(alone_t["steps"]), 4),
        **summaries,
        "mean_slowdown": {
            m: round((s["roller_slowdown"] + s["trainer_slowdown"]) / 2, 4)
            for m, s in summaries.items()
        },
    }
    print(json.dumps(line))


if __name__ == "__main__":
    main()
