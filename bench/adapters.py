"""Does sampling slow down as a worker holds more adapters on one base?

An RL loop saves new sampler weights every step, and a worker keeps up to
`max_samplers` (64) sets installed beside its jobs' own adapters, all on one shared
base model. On one engine (the tiny model, CPU, one thread), in one run: a LoRA call of
`--samples` × `--tokens` with one adapter installed, then with `--installed` more, then
with `--jobs` more LoRA jobs created too. A decode step used to walk and patch every
adapter's layers, so sampling slowed with them (0.30 s → 0.81 s with 64 installed, at
the commit before the fix); it should not. Ends with one JSON line.

    .venv/bin/python bench/adapters.py
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from plexrl.messages import JobSpec, LoraSpec, SampleInput, SamplingParams
from plexrl.models import ModelRegistry, init_tiny
from plexrl_worker.engine import EngineConfig, TorchEngine

BASE = "plexrl/tiny-qwen3"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--installed", type=int, default=63)
    parser.add_argument("--jobs", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3, help="best of")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="plexrl-adapters-"))
    init_tiny(root / "tiny")
    engine = TorchEngine(ModelRegistry(root), EngineConfig(num_threads=1))
    engine.create("j0", JobSpec(base_model=BASE, lora=LoraSpec(rank=4), seed=1))
    state = engine.export_state("j0", optimizer=False, gradients=False)
    engine.install_sampler("s0", state)
    params = SamplingParams(max_tokens=args.tokens, seed=1, stop_at_eos=False)
    inp = SampleInput(prompt=[21, 22, 15, 9], num_samples=args.samples, params=params)

    def best() -> float:
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            engine.sample("s0", inp)
            times.append(time.perf_counter() - t0)
        return min(times)

    engine.sample("s0", inp)  # warm-up
    one = best()
    print(f"1 adapter installed: {one:.3f} s", flush=True)
    for i in range(1, args.installed + 1):
        engine.install_sampler(f"s{i}", state)
    many = best()
    print(f"{args.installed + 1} installed: {many:.3f} s", flush=True)
    for i in range(1, args.jobs + 1):
        engine.create(f"j{i}", JobSpec(base_model=BASE, lora=LoraSpec(rank=4), seed=1 + i))
    more = best()
    print(f"{args.installed + 1} installed and {args.jobs + 1} jobs: {more:.3f} s", flush=True)
    line = {
        "benchmark": "adapters",
        "samples": args.samples,
        "tokens": args.tokens,
        "one_s": round(one, 4),
        "installed": args.installed + 1,
        "installed_s": round(many, 4),
        "jobs": args.jobs + 1,
        "installed_and_jobs_s": round(more, 4),
        "ratio": round(more / one, 3),
    }
    print(json.dumps(line))


if __name__ == "__main__":
    main()
