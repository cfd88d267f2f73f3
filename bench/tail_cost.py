"""What a rollout's straggling tail costs when the worker runs another job beside it:
the live measurement the simulator's tail model (`tail_min_share`, `tail_contention`)
is calibrated from.

On one engine (the tiny model, CPU), in one run, side by side:
- the tail alone: one sequence decoding `--tail-tokens` tokens;
- the other job alone: `--calls` forward_backward calls of a LoRA job (or, with
  `--other sample`, sample calls of another job, co-batched with the tail);
- both at once, as the worker runs them after a tail release: the tail's decode steps
  and the other job's calls interleave on the one engine thread.
It prints the tail's slowdown beside the other job, over the whole tail and per decode
step while the other job's calls are in flight (what the simulator's and the policy's
`tail_contention` means: the worker's meter, `plexrl_worker.sharing`, measures it so)
and the share of the device the tail took while they shared (`tail share`: the other
job's extra seconds over the shared span; the simulator's floor is `tail_min_share`).
And the engine switch (`switch_s`, the scheduler's `PLEXRL_SHARING_SWITCH_S`): the
same `forward_backward` calls of two jobs, each job's in a run, then taking turns
call by call; the extra seconds per change of job. Ends with one JSON line.

    .venv/bin/python bench/tail_cost.py
    .venv/bin/python bench/tail_cost.py --other sample --repeats 3
    .venv/bin/python bench/tail_cost.py --device cuda --layers 16 --hidden 2048   # a GPU
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import bench_model
import torch

from plexrl.messages import (
    Datum,
    ForwardBackwardInput,
    JobSpec,
    LoraSpec,
    LossFn,
    SampleInput,
    SamplingParams,
    TensorArray,
)
from plexrl.models import ModelRegistry, init_tiny
from plexrl_worker.engine import EngineConfig, TorchEngine
from plexrl_worker.engine_thread import EngineThread

MODEL = "plexrl/tiny-qwen3"
BIGGER = "plexrl/bench-qwen3"


def _fb(seed: int) -> ForwardBackwardInput:
    rng = random.Random(seed)
    data = []
    for _ in range(8):
        seq = [rng.randrange(5, 700) for _ in range(33)]
        data.append(
            Datum(
                tokens=seq[:-1],
                loss_fn_inputs={"target_tokens": TensorArray.from_list(seq[1:], "int64")},
            )
        )
    return ForwardBackwardInput(data=data, loss_fn=LossFn.CROSS_ENTROPY)


def _sample(seed: int, samples: int, tokens: int) -> SampleInput:
    params = SamplingParams(max_tokens=tokens, seed=seed, stop_at_eos=False)
    return SampleInput(prompt=[21, 22, 15, 27], num_samples=samples, params=params)


class _Steps:
    """The tail's decode steps, by whether the other job's calls were in flight at both
    ends of the step (`beside`) or at neither (`alone`)."""

    def __init__(self) -> None:
        self.other_running = False
        self.beside: list[float] = []
        self.alone: list[float] = []


async def _tail(engine: TorchEngine, thread: EngineThread, tokens: int, steps: _Steps) -> float:
    t0 = time.perf_counter()
    call = await thread.call(engine.begin_sample, "tail", _sample(1, 1, tokens))
    while not call.done:
        before, s0 = steps.other_running, time.perf_counter()
        await thread.call(engine.sample_step)
        if before == steps.other_running:
            (steps.beside if before else steps.alone).append(time.perf_counter() - s0)
    return time.perf_counter() - t0


async def _other(
    engine: TorchEngine, thread: EngineThread, kind: str, calls: int, steps: _Steps
) -> float:
    t0 = time.perf_counter()
    steps.other_running = True
    try:
        for i in range(calls):
            if kind == "forward_backward":
                await thread.call(engine.forward_backward, "other", _fb(i))
            else:
                call = await thread.call(engine.begin_sample, "other", _sample(100 + i, 4, 16))
                while not call.done:
                    await thread.call(engine.sample_step)
    finally:
        steps.other_running = False
    return time.perf_counter() - t0


async def _switch_s(engine: TorchEngine, thread: EngineThread, calls: int) -> float:
    """Seconds one change of job adds to a call: `calls` calls of each of two jobs run
    job by job (one change), then in turns (one change per call)."""

    async def run(order: list[str]) -> float:
        t0 = time.perf_counter()
        for i, job in enumerate(order):
            await thread.call(engine.forward_backward, job, _fb(i))
        return time.perf_counter() - t0

    grouped = await run(["tail"] * calls + ["other"] * calls)
    turns = await run(["tail", "other"] * calls)
    return (turns - grouped) / (2 * calls - 2)


async def _round(
    engine: TorchEngine, thread: EngineThread, args: argparse.Namespace
) -> dict[str, float]:
    switch_s = await _switch_s(engine, thread, args.calls)
    alone_steps, steps = _Steps(), _Steps()
    tail_alone = await _tail(engine, thread, args.tail_tokens, alone_steps)
    other_alone = await _other(engine, thread, args.other, args.calls, _Steps())
    t0 = time.perf_counter()
    tail_shared, other_shared = await asyncio.gather(
        _tail(engine, thread, args.tail_tokens, steps),
        _other(engine, thread, args.other, args.calls, steps),
    )
    in_flight = statistics.mean(steps.beside) if steps.beside else 0.0
    span = time.perf_counter() - t0
    overlap = min(tail_shared, other_shared)
    return {
        "tail_alone_s": tail_alone,
        "other_alone_s": other_alone,
        "tail_shared_s": tail_shared,
        "other_shared_s": other_shared,
        "span_s": span,
        "tail_contention": tail_shared / tail_alone,
        # Per decode step while the other job's calls were in flight: what the policy's
        # `tail_contention` means (the worker's meter measures it so).
        "tail_contention_in_flight": (
            in_flight / statistics.mean(alone_steps.alone) if alone_steps.alone else 0.0
        ),
        # While both ran, the other job lost this fraction of the device to the tail.
        "tail_share": max(0.0, other_shared - other_alone) / overlap if overlap > 0 else 0.0,
        "switch_s": switch_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tail-tokens", type=int, default=64)
    parser.add_argument("--calls", type=int, default=6)
    parser.add_argument(
        "--other", choices=["forward_backward", "sample"], default="forward_backward"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu", help="the engine's device: cpu, cuda")
    parser.add_argument(
        "--layers",
        type=int,
        default=None,
        help="a bigger model, this many layers deep and --hidden wide (default: the tiny one)",
    )
    parser.add_argument("--hidden", type=int, default=512)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = MODEL
        if args.layers is None:
            init_tiny(Path(tmp) / "tiny-qwen3")
        else:
            model = bench_model.build(Path(tmp) / "bench-qwen3", BIGGER, args).name
        engine = TorchEngine(ModelRegistry(Path(tmp)), EngineConfig(device=args.device))
        engine.create("tail", JobSpec(base_model=model, lora=LoraSpec(rank=8), seed=1))
        engine.create("other", JobSpec(base_model=model, lora=LoraSpec(rank=8), seed=2))

        async def run() -> list[dict[str, float]]:
            thread = EngineThread()
            try:
                await _round(engine, thread, args)  # warm up
                return [await _round(engine, thread, args) for _ in range(args.repeats)]
            finally:
                thread.shutdown()

        rounds = asyncio.run(run())
    summary = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    print(
        f"tail alone {summary['tail_alone_s']:.2f} s, beside {args.other} "
        f"{summary['tail_shared_s']:.2f} s: contention {summary['tail_contention']:.2f}x "
        f"over the tail, {summary['tail_contention_in_flight']:.2f}x per step while "
        f"{args.other} ran; "
        f"{args.other} alone {summary['other_alone_s']:.2f} s, beside the tail "
        f"{summary['other_shared_s']:.2f} s: the tail took {summary['tail_share']:.0%} "
        f"of the device while they shared; a change of job cost "
        f"{summary['switch_s'] * 1000:.1f} ms (medians of {args.repeats})"
    )
    print(
        json.dumps(
            {"bench": "tail_cost", "workload": vars(args), "median": summary, "rounds": rounds}
        )
    )


if __name__ == "__main__":
    main()
