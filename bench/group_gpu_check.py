"""A worker group's rank side end to end on one device, for a machine with a GPU.

One rank on `cuda:0` (NCCL, the command channel on gloo) — or, to check the script
itself where there is no GPU, one CPU rank (gloo): a full fine-tuning job and a LoRA
job of a locally built Qwen3 each run forward_backward and optim_step, then their
state makes the round trip device → host → disk → device (each rank its own shard:
`offload`, `spill`, `fetch`, `onload`), and must come back bit for bit (the whole state
gathered before and after, compared tensor by tensor, and the shard's digest); the
next forward_backward must give the same loss as it gives without a swap. Then the
per-shard swap bandwidth: device → host and host → device, median of `--swaps` round
trips of the full job (weights, gradients and both Adam moments).

    .venv/bin/python bench/group_gpu_check.py                 # cuda:0 (exits 2 without one)
    .venv/bin/python bench/group_gpu_check.py --device cpu    # the same checks on a CPU rank
    .venv/bin/python bench/group_gpu_check.py --layers 8 --hidden 1024

Exits 1 when a check fails; ends with one JSON line of its figures.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import bench_model
import torch

from plexrl.messages import (
    AdamParams,
    JobSpec,
    LoraSpec,
    OptimStepInput,
)
from plexrl_worker import stored
from plexrl_worker.engine import EngineConfig
from plexrl_worker.engine.state import JobTensors, state_to_bytes
from plexrl_worker.group import GroupConfig, Leader, start_group
from plexrl_worker.group import calls as group_calls
from plexrl_worker.group.blobs import BlobPlace

GB = 1e9
NAME = "plexrl/gpu-check-qwen3"


def _same(a: JobTensors, b: JobTensors) -> bool:
    return a.tensors.keys() == b.tensors.keys() and all(
        torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors
    )


def _round_trip(leader: Leader, job: str, key: str) -> tuple[list[str], list[str]]:
    """Device → host → disk → device; each rank's shard digest out and back in."""
    out = leader.offload(job)
    spilled = leader.call(group_calls.SpillCall(job, key))
    leader.write_manifest(key, spilled)
    leader.call(group_calls.FetchCall(job, key))
    back = leader.onload(job)
    return [r.digest for r in out], [r.digest for r in back]


def check(leader: Leader, vocab: int, args: argparse.Namespace) -> dict[str, object]:
    """Every check on a running group; the figures, with `failures` listing what failed."""
    failures: list[str] = []
    batch = bench_model.batch(vocab, args.rows, args.length)
    adam = OptimStepInput(adam=AdamParams(learning_rate=1e-4))
    specs = {
        "full": JobSpec(base_model=NAME, seed=1),
        "lora": JobSpec(base_model=NAME, lora=LoraSpec(rank=8), seed=1),
    }
    figures: dict[str, object] = {}
    for job, spec in specs.items():
        leader.create(job, spec)
        first = leader.forward_backward(job, batch).metrics["loss:sum"]
        leader.optim_step(job, adam)
        leader.forward_backward(job, batch)  # gradients live: the round trip moves them too
        before = leader.gather(job)
        out, back = _round_trip(leader, job, stored.set_key(f"check/{job}", 1))
        after = leader.gather(job)
        if not _same(before, after):
            failures.append(
                f"{job}: the state changed in the round trip device->host->disk->device"
            )
        if out != back:
            failures.append(
                f"{job}: the shard's digest changed in the round trip ({out} != {back})"
            )
        leader.optim_step(job, adam)
        swapped = leader.forward_backward(job, batch).metrics["loss:sum"]
        figures[f"{job}_loss_first"] = round(first, 4)
        figures[f"{job}_loss_after_round_trip"] = round(swapped, 4)
        figures[f"{job}_state_sha256"] = hashlib.sha256(state_to_bytes(after)).hexdigest()[:16]
        if not swapped < first:
            failures.append(f"{job}: the loss did not fall ({first} -> {swapped})")
    # The swap bandwidth: the full job's shard, out and back in, repeatedly.
    d2h_gbps, h2d_gbps, nbytes = [], [], 0
    for _ in range(args.swaps):
        out = leader.offload("full")
        back = leader.onload("full")
        nbytes = sum(r.nbytes for r in out)
        d2h_gbps.append(nbytes / max(r.seconds for r in out) / GB)
        h2d_gbps.append(nbytes / max(r.seconds for r in back) / GB)
    figures.update(
        swap_bytes=nbytes,
        d2h_GBps=round(statistics.median(d2h_gbps), 3),
        h2d_GBps=round(statistics.median(h2d_gbps), 3),
        failures=failures,
    )
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    bench_model.add_shape_args(parser, layers=4)
    parser.add_argument("--rows", type=int, default=4, help="datums per forward_backward")
    parser.add_argument("--length", type=int, default=64, help="tokens per datum")
    parser.add_argument("--swaps", type=int, default=5)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here; run with --device cpu to check the script", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        info = bench_model.build(root / "models" / "check", NAME, args)
        config = GroupConfig(
            world_size=1,
            device_type=args.device,
            start_method="spawn",
            collective_timeout_s=600.0,
        )
        start = time.perf_counter()
        with start_group(
            config, root / "models", EngineConfig(), BlobPlace(directory=root / "blobs")
        ) as leader:
            up_s = time.perf_counter() - start
            figures = check(leader, info.vocab_size, args)
    line = {
        "benchmark": "group_gpu_check",
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "params": info.num_params,
        "group_start_s": round(up_s, 2),
        **figures,
    }
    for failure in figures["failures"]:  # type: ignore[attr-defined]
        print(f"FAILED: {failure}", file=sys.stderr)
    print(json.dumps(line))
    return 1 if figures["failures"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
