"""Sampling throughput: K LoRA jobs sampling at once on one worker's engine, their calls
run one at a time (time-sliced, what a worker did before co-batching) or in one running
batch (co-batched), side by side in one run.

Each job sends `--prompts` sample calls of `--samples` samples × `--tokens` tokens (the
GRPO-style workload of issue 8: 8 prompts × 4 samples × 16 tokens, LoRA rank 8), all at
t = 0. Per mode and K: total sampled tokens/s and each call's latency from t = 0 to its
answer (p50/p99). Co-batched outputs are checked bit-identical to the time-sliced ones.
With `--previous REV` a third column: the decode loop the worker had at git revision REV
(`engine/sampling.py`'s `generate`, one call at a time), loaded from git into this run,
so co-batching is also set beside what the worker did before it existed (c4c759d^).
Ends with one JSON line.

    .venv/bin/python bench/sampling.py --threads 1        # K = 1, 2, 4, 8 on the tiny model
    .venv/bin/python bench/sampling.py --threads 1 --previous c4c759d^
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch

from plexrl.messages import JobSpec, LoraSpec, SampleInput, SampleOutput, SamplingParams
from plexrl.models import ModelRegistry, init_tiny
from plexrl_worker.engine import EngineConfig, TorchEngine


def workload(jobs: int, prompts: int, samples: int, tokens: int) -> list[tuple[str, SampleInput]]:
    rng = random.Random(0)
    calls = []
    for p in range(prompts):
        for j in range(jobs):
            prompt = [rng.randrange(5, 700) for _ in range(rng.randrange(6, 14))]
            params = SamplingParams(max_tokens=tokens, seed=1000 * j + p, stop_at_eos=False)
            calls.append(
                (f"job-{j}", SampleInput(prompt=prompt, num_samples=samples, params=params))
            )
    return calls


def time_sliced(
    engine: TorchEngine, calls: list[tuple[str, SampleInput]]
) -> tuple[list[SampleOutput], list[float]]:
    t0 = time.perf_counter()
    outs, done = [], []
    for weights_id, inp in calls:
        outs.append(engine.sample(weights_id, inp))
        done.append(time.perf_counter() - t0)
    return outs, done


def co_batched(
    engine: TorchEngine, calls: list[tuple[str, SampleInput]]
) -> tuple[list[SampleOutput], list[float]]:
    t0 = time.perf_counter()
    joined = [engine.begin_sample(w, inp) for w, inp in calls]
    finished_at: dict[int, float] = {}
    while len(finished_at) < len(joined):
        for call in engine.sample_step():
            finished_at[id(call)] = time.perf_counter() - t0
    return [c.output() for c in joined], [finished_at[id(c)] for c in joined]


def previous_loop(
    rev: str,
) -> Callable[[TorchEngine, list[tuple[str, SampleInput]]], tuple[list[SampleOutput], list[float]]]:
    """Time-sliced sampling through the decode loop of git revision `rev`."""
    path = "services/gpu-worker/plexrl_worker/engine/sampling.py"
    source = subprocess.run(
        ["git", "show", f"{rev}:{path}"], check=True, capture_output=True, text=True
    ).stdout
    module = types.ModuleType("previous_sampling")
    sys.modules[module.__name__] = module  # its dataclasses look their module up
    exec(compile(source, f"{rev}:{path}", "exec"), module.__dict__)  # our own code, from git

    def run(
        engine: TorchEngine, calls: list[tuple[str, SampleInput]]
    ) -> tuple[list[SampleOutput], list[float]]:
        t0 = time.perf_counter()
        outs, done = [], []
        for weights_id, inp in calls:
            model = engine.jobs.trainable(weights_id).weights.module()
            stop = module.StopRule(token_ids=frozenset(), strings=(), decode=None)
            outs.append(
                module.generate(
                    model, inp, stop, device=torch.device("cpu"), max_batch_tokens=16384
                )
            )
            done.append(time.perf_counter() - t0)
        return outs, done

    return run


def measure(
    run: Callable[
        [TorchEngine, list[tuple[str, SampleInput]]], tuple[list[SampleOutput], list[float]]
    ],
    engine: TorchEngine,
    calls: list[tuple[str, SampleInput]],
    repeats: int,
) -> tuple[list[SampleOutput], dict[str, float]]:
    best: dict[str, float] | None = None
    outs: list[SampleOutput] = []
    for _ in range(repeats):
        outs, done = run(engine, calls)
        wall = max(done)
        tokens = sum(len(s.tokens) for o in outs for s in o.sequences)
        figures = {
            "tokens_per_s": tokens / wall,
            "wall_s": wall,
            "p50_s": statistics.median(done),
            "p99_s": sorted(done)[max(0, round(0.99 * len(done)) - 1)],
        }
        if best is None or figures["tokens_per_s"] > best["tokens_per_s"]:
            best = figures
    assert best is not None
    return outs, best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2, help="best of N per cell")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--previous", default=None, help="git revision of a decode loop to compare")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        init_tiny(Path(tmp) / "tiny-qwen3")
        registry = ModelRegistry(Path(tmp))
        for k in args.jobs:
            engine = TorchEngine(registry, EngineConfig())
            for j in range(k):
                spec = JobSpec(
                    base_model="plexrl/tiny-qwen3", lora=LoraSpec(rank=args.rank), seed=j
                )
                engine.create(f"job-{j}", spec)
            calls = workload(k, args.prompts, args.samples, args.tokens)
            engine.sample(*calls[0])  # warm up
            sliced_out, sliced = measure(time_sliced, engine, calls, args.repeats)
            batched_out, batched = measure(co_batched, engine, calls, args.repeats)
            identical = sliced_out == batched_out
            previous = None
            if args.previous:
                _, previous = measure(previous_loop(args.previous), engine, calls, args.repeats)
            row = {
                "jobs": k,
                "calls": len(calls),
                "time_sliced": sliced,
                "co_batched": batched,
                "speedup": batched["tokens_per_s"] / sliced["tokens_per_s"],
                "identical": identical,
                "previous_loop": previous,
                "speedup_vs_previous": (
                    batched["tokens_per_s"] / previous["tokens_per_s"] if previous else None
                ),
            }
            results.append(row)
            print(
                f"K={k}: time-sliced {sliced['tokens_per_s']:8.0f} tok/s "
                f"(p50 {sliced['p50_s']:.2f} s, p99 {sliced['p99_s']:.2f} s) | "
                f"co-batched {batched['tokens_per_s']:8.0f} tok/s "
                f"(p50 {batched['p50_s']:.2f} s, p99 {batched['p99_s']:.2f} s) | "
                f"{row['speedup']:.2f}x, identical: {identical}"
                + (
                    f" | previous loop {previous['tokens_per_s']:8.0f} tok/s: co-batched "
                    f"{row['speedup_vs_previous']:.2f}x it"
                    if previous
                    else ""
                ),
                flush=True,
            )
    print(json.dumps({"bench": "sampling", "workload": vars(args), "results": results}))


if __name__ == "__main__":
    main()
