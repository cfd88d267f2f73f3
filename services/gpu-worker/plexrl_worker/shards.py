"""A job's state cut into per-rank shards, and sharded snapshots on disk.

One layout for every tensor of a job (weights, gradients, Adam moments): rank r of N
holds rows [r * c, (r + 1) * c) of dim 0, where c = ceil(rows / N), which is FSDP2's
`Shard(0)` (the last ranks may hold fewer rows, or none). 0-dim tensors (Adam's step
count) are whole on every rank. Names and metadata are the engine's
(`plexrl_worker.engine.state`), so a shard is a `JobTensors` and its bytes are the
engine's safetensors bytes.

Stored, a sharded state is a blob set (`plexrl_worker.stored`): one
`rank-<r>-of-<N>.safetensors` per rank (each written by its own rank) and a manifest
(written by the leader once every rank has written). Any group size reads it: each new
rank takes only the rows it will hold.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from plexrl_worker.engine.state import JobTensors

_FORMAT = "plexrl.group_snapshot/1"


def row_range(rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """The dim-0 rows [lo, hi) that `rank` holds of a tensor with `rows` rows."""
    chunk = math.ceil(rows / world_size) if rows else 0
    lo = min(rank * chunk, rows)
    return lo, min(lo + chunk, rows)


def shard_of(full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """A view of `rank`'s rows of a whole tensor (the tensor itself if 0-dim)."""
    if full.dim() == 0:
        return full
    lo, hi = row_range(full.shape[0], rank, world_size)
    return full[lo:hi]


def merge(shards: list[JobTensors]) -> JobTensors:
    """The whole state from every rank's shard, in rank order."""
    first = shards[0]
    tensors: dict[str, torch.Tensor] = {}
    for key, t in first.tensors.items():
        if t.dim() == 0:
            tensors[key] = t.clone()
        else:
            tensors[key] = torch.cat([s.tensors[key] for s in shards], dim=0)
    meta = {k: v for k, v in first.metadata.items() if k != "shard"}
    return JobTensors(tensors, meta)


def shard_metadata(
    metadata: dict[str, Any], rank: int, world_size: int, shapes: dict[str, list[int]]
) -> dict[str, Any]:
    """A shard's metadata: the job's, plus where the shard sits in the whole."""
    return {**metadata, "shard": {"rank": rank, "world_size": world_size, "shapes": shapes}}


def shard_file(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}.safetensors"


def manifest_bytes(files: list[tuple[str, int, str]], metadata: dict[str, Any]) -> bytes:
    """A sharded state's manifest: `files` (name, bytes, sha256) in rank order, the
    whole shapes and the job's metadata from a shard's `metadata` (any rank's)."""
    meta = dict(metadata)
    place = meta.pop("shard")
    manifest = {
        "format": _FORMAT,
        "world_size": place["world_size"],
        "shapes": place["shapes"],
        "metadata": meta,
        "files": [{"name": n, "bytes": b, "sha256": d} for n, b, d in files],
    }
    return (json.dumps(manifest, indent=1) + "\n").encode()


def read_shard(
    manifest: dict[str, Any],
    load: Callable[[str], Mapping[str, torch.Tensor]],
    rank: int,
    world_size: int,
) -> JobTensors:
    """`rank`'s shard for a group of `world_size`, from a sharded state of any size;
    `load(file name)` gives that file's tensors by name (rows are sliced off them)."""
    if manifest.get("format") != _FORMAT:
        raise ValueError(f"sharded state format {manifest.get('format')!r} is not {_FORMAT!r}")
    old_world = int(manifest["world_size"])
    shapes: dict[str, list[int]] = manifest["shapes"]
    names = [f["name"] for f in manifest["files"]]
    tensors: dict[str, torch.Tensor] = {}
    for key, shape in shapes.items():
        if not shape:
            tensors[key] = load(names[0])[key].clone()
            continue
        lo, hi = row_range(shape[0], rank, world_size)
        pieces = []
        for old_rank, name in enumerate(names):
            old_lo, old_hi = row_range(shape[0], old_rank, old_world)
            a, b = max(lo, old_lo), min(hi, old_hi)
            if a < b:
                pieces.append(load(name)[key][a - old_lo : b - old_lo])
        if not pieces:  # this rank holds no rows of it: an empty tensor of its kind
            pieces.append(load(names[0])[key][0:0])
        tensors[key] = torch.cat(pieces, dim=0)
    meta = shard_metadata(manifest["metadata"], rank, world_size, shapes)
    return JobTensors(tensors, meta)
