"""A worker group's step time on 1 and 2 ranks, and its per-shard swap bandwidth.

One full fine-tuning job of a locally built Qwen3 (random init; 8 layers x 512 wide,
~26 M parameters, so a step is compute-dominated) trains `forward_backward` +
`optim_step` on a group of 1 rank, then of 2 ranks (FSDP2 over gloo, CPU). Then each
rank swaps its own shard out to host memory and back (`offload` / `onload`), all ranks
at once: bandwidth is the group's bytes over the slowest rank's copy time (the
onload's module rebuild is reported apart, as the call's wall time).

On a machine with fewer cores than ranks x threads the ranks share cores: there the
1-vs-2 step ratio shows the group's overhead (collectives, idle micro-batches), not a
speedup. Each rank gets cores // ranks intra-op threads (`--threads` fixes it instead).

    .venv/bin/python bench/group_step.py
    .venv/bin/python bench/group_step.py --steps 5 --rows 8 --length 128

Ends with one JSON line of its figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import bench_model

from plexrl.messages import (
    AdamParams,
    JobSpec,
    OptimStepInput,
)
from plexrl.models import ModelRegistry
from plexrl_worker.engine import EngineConfig
from plexrl_worker.group import start_group

GB = 1e9
NAME = "plexrl/bench-qwen3-26m"


def run(world_size: int, root: Path, args: argparse.Namespace) -> dict[str, float]:
    config = bench_model.cpu_group(world_size, args.threads)
    vocab = ModelRegistry(root).info(NAME).vocab_size
    batch = bench_model.batch(vocab, args.rows, args.length)
    adam = OptimStepInput(adam=AdamParams(learning_rate=1e-4))
    with start_group(config, root, EngineConfig()) as leader:
        leader.create("job", JobSpec(base_model=NAME))
        times = []
        for i in range(args.steps + 1):  # the first is a warm-up
            start = time.perf_counter()
            leader.forward_backward("job", batch)
            leader.optim_step("job", adam)
            if i:
                times.append(time.perf_counter() - start)
        leader.forward_backward("job", batch)  # gradients live: a swap moves them too
        d2h, h2d, onload_wall, nbytes = [], [], [], 0
        for _ in range(args.swaps):
            out = leader.offload("job")
            start = time.perf_counter()
            back = leader.onload("job")
            onload_wall.append(time.perf_counter() - start)
            nbytes = sum(r.nbytes for r in out)
            d2h.append(nbytes / max(r.seconds for r in out))
            h2d.append(nbytes / max(r.seconds for r in back))
    return {
        "step_s": statistics.median(times),
        "swap_bytes": float(nbytes),
        "d2h_GBps": statistics.median(d2h) / GB,
        "h2d_GBps": statistics.median(h2d) / GB,
        "onload_wall_s": statistics.median(onload_wall),
    }


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench_model.add_shape_args(parser, layers=8)
    parser.add_argument("--rows", type=int, default=4, help="datums per forward_backward")
    parser.add_argument("--length", type=int, default=128, help="tokens per datum")
    parser.add_argument("--steps", type=int, default=3, help="timed steps (after a warm-up)")
    parser.add_argument("--swaps", type=int, default=3)
    bench_model.add_threads_arg(parser)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        params = bench_model.build(root / "bench", NAME, args).num_params
        per_size = {n: run(n, root, args) for n in (1, 2)}
    figures: dict[str, object] = {
        "benchmark": "group_step",
        "params": params,
        "cores": os.cpu_count(),
        "tokens_per_step": args.rows * args.length,
        **{f"{k}_{n}rank": round(v, 4) for n, fig in per_size.items() for k, v in fig.items()},
        "step_ratio_2_over_1": round(per_size[2]["step_s"] / per_size[1]["step_s"], 3),
    }
    for n, fig in per_size.items():
        print(
            f"{n} rank(s): step {fig['step_s']:.3f} s, swap {fig['swap_bytes'] / 1e6:.0f} MB "
            f"d2h {fig['d2h_GBps']:.2f} GB/s h2d {fig['h2d_GBps']:.2f} GB/s "
            f"(onload call {fig['onload_wall_s']:.3f} s)"
        )
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
