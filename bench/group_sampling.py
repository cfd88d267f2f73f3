"""Sampling on a worker group: data-parallel as built, against what tensor parallel would
cost, measured on this machine.

Data-parallel (what the group runs): each call's samples are split over the ranks, every
rank decodes its slice with the whole weights, and a decode step is one broadcast and
one gather on the command channel. Measured: the wall time of a batch of `--calls`
sample calls (`--samples` each, `--tokens` long) on a 1-rank and a 2-rank group of a
locally built Qwen3 (8 layers x 512 by default, about 26 M parameters).

Tensor parallel (not built for the torch sampler; SGLang's `--tp`): each rank would
multiply its half of every layer for every row, the same arithmetic per rank as
data-parallel's every layer for half the rows, and the ranks would then sum their
halves twice a layer, every decode step. Measured here: the gloo all-reduce of one
decode step's activations (rows x hidden, float32) between 2 processes. The estimate of
a tensor-parallel step is the measured data-parallel step plus 2 x layers of those
all-reduces (an assumption: its compute splits as well as data-parallel's, which
favours it: per-layer lock-step waits also stretch with a busy host).

    .venv/bin/python bench/group_sampling.py
    .venv/bin/python bench/group_sampling.py --calls 8 --samples 4 --tokens 32

Ends with one JSON line of its figures.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import bench_model
import torch
import torch.distributed as dist

from plexrl.messages import SampleInput, SamplingParams
from plexrl_tools.cluster import free_port
from plexrl_worker.engine import EngineConfig
from plexrl_worker.engine_thread import EngineThread
from plexrl_worker.group import start_group
from plexrl_worker.group.blobs import BlobPlace
from plexrl_worker.group.executor import GroupExecutor

NAME = "plexrl/bench-qwen3-26m"


def _calls(n: int, samples: int, tokens: int) -> list[SampleInput]:
    return [
        SampleInput(
            prompt=[21 + i, 22, 15, 9],
            num_samples=samples,
            params=SamplingParams(max_tokens=tokens, seed=i, stop_at_eos=False),
        )
        for i in range(n)
    ]


async def _batch_s(executor: GroupExecutor, calls: list[SampleInput]) -> float:
    """Wall seconds of the calls run as one co-batched batch, to their ends."""
    start = time.perf_counter()
    handles = [await executor.begin_sample(f"base:{NAME}", inp) for inp in calls]
    while not all(h.done for h in handles):
        await executor.sample_step()
    return time.perf_counter() - start


def data_parallel(ranks: int, root: Path, args: argparse.Namespace) -> dict[str, float]:
    config = bench_model.cpu_group(ranks, args.threads)
    calls = _calls(args.calls, args.samples, args.tokens)
    with start_group(config, root, EngineConfig(), BlobPlace(directory=root / "blobs")) as leader:
        thread = EngineThread()
        executor = GroupExecutor(leader, thread)
        try:
            asyncio.run(_batch_s(executor, calls[:1]))  # warm-up: the plain base loads
            times = [asyncio.run(_batch_s(executor, calls)) for _ in range(args.repeats)]
        finally:
            thread.shutdown()
    batch_s = statistics.median(times)
    steps = args.tokens
    return {"batch_s": batch_s, "step_s": batch_s / steps}


def _all_reduce_rank(
    rank: int, port: int, shape: tuple[int, int], repeats: int, out: mp.Queue
) -> None:  # type: ignore[type-arg]
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120)
    )
    t = torch.randn(shape)
    for _ in range(10):
        dist.all_reduce(t)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dist.all_reduce(t)
        times.append(time.perf_counter() - start)
    if rank == 0:
        out.put(statistics.median(times))
    dist.destroy_process_group()


def all_reduce_s(rows: int, hidden: int, repeats: int = 200) -> float:
    """Median seconds of one gloo all-reduce of a [rows, hidden] float32 tensor, 2 ranks."""
    context = mp.get_context("spawn")
    out: mp.Queue = context.Queue()  # type: ignore[type-arg]
    port = free_port()
    procs = [
        context.Process(target=_all_reduce_rank, args=(r, port, (rows, hidden), repeats, out))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    seconds = float(out.get(timeout=300))
    for p in procs:
        p.join()
    return seconds


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench_model.add_shape_args(parser, layers=8)
    parser.add_argument("--calls", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4, help="samples per call")
    parser.add_argument("--tokens", type=int, default=24, help="tokens per sample")
    parser.add_argument("--repeats", type=int, default=3)
    bench_model.add_threads_arg(parser)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        params = bench_model.build(root / "bench", NAME, args).num_params
        dp = {n: data_parallel(n, root, args) for n in (1, 2)}
    rows = args.calls * args.samples
    reduce_s = all_reduce_s(rows, args.hidden)
    tp_step = dp[2]["step_s"] + 2 * args.layers * reduce_s
    figures: dict[str, object] = {
        "benchmark": "group_sampling",
        "params": params,
        "cores": os.cpu_count(),
        "rows": rows,
        "tokens": args.tokens,
        "step_s_1rank": round(dp[1]["step_s"], 5),
        "step_s_2rank_data_parallel": round(dp[2]["step_s"], 5),
        "all_reduce_s": round(reduce_s, 6),
        "step_s_2rank_tensor_parallel_estimate": round(tp_step, 5),
        "dp_over_1": round(dp[2]["step_s"] / dp[1]["step_s"], 3),
        "tp_estimate_over_1": round(tp_step / dp[1]["step_s"], 3),
    }
    print(
        f"decode step, {rows} rows: 1 rank {dp[1]['step_s'] * 1e3:.1f} ms; 2 ranks data-parallel "
        f"{dp[2]['step_s'] * 1e3:.1f} ms; tensor-parallel estimate {tp_step * 1e3:.1f} ms "
        f"(that + {2 * args.layers} all-reduces of {reduce_s * 1e6:.0f} us)"
    )
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
