"""What the training benchmarks run on: a locally built Qwen3 of a chosen size (random
init), a seeded batch of random tokens for it, and a worker group of CPU ranks."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from plexrl.messages import Datum, ForwardBackwardInput, LossFn, TensorArray
from plexrl.models import BaseModelInfo, ModelRegistry, TinyShape, init_tiny
from plexrl_worker.group import GroupConfig


def add_shape_args(parser: argparse.ArgumentParser, layers: int) -> None:
    """`--layers` (default `layers`) and `--hidden` (default 512): the model's size."""
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--hidden", type=int, default=512)


def build(folder: Path, name: str, args: argparse.Namespace) -> BaseModelInfo:
    """Build `name` in `folder` of a registry (its parent), `--layers` deep and `--hidden`
    wide, with 8 query heads, 4 KV heads and an MLP 3 x as wide."""
    shape = TinyShape(
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_layers=args.layers,
        num_heads=8,
        num_kv_heads=4,
    )
    init_tiny(folder, name=name, shape=shape)
    return ModelRegistry(folder.parent).info(name)


def batch(vocab: int, rows: int, length: int) -> ForwardBackwardInput:
    """`rows` cross-entropy datums of `length` random tokens, the same on every run."""
    g = torch.Generator().manual_seed(0)
    data = []
    for _ in range(rows):
        seq = torch.randint(5, vocab - 1, (length + 1,), generator=g).tolist()
        target = TensorArray.from_list(seq[1:], "int64")
        data.append(Datum(tokens=seq[:-1], loss_fn_inputs={"target_tokens": target}))
    return ForwardBackwardInput(data=data, loss_fn=LossFn.CROSS_ENTROPY)


def add_threads_arg(parser: argparse.ArgumentParser) -> None:
    """`--threads`: each rank's intra-op threads (0, the default: see `cpu_group`)."""
    parser.add_argument(
        "--threads", type=int, default=0, help="threads per rank (0: cores // ranks)"
    )


def cpu_group(ranks: int, threads: int) -> GroupConfig:
    """A group of `ranks` CPU ranks (FSDP2 over gloo), each with `threads` intra-op
    threads, or with 0 an equal share of the cores: 1 rank and 2 ranks use the same cores."""
    cores = os.cpu_count() or 1
    return GroupConfig(
        world_size=ranks,
        start_method="forkserver",
        num_threads=threads or max(1, cores // ranks),
        collective_timeout_s=300.0,
    )
