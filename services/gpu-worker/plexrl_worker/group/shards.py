"""A job's state cut into per-rank shards, and sharded snapshots on disk.

One layout for every tensor of a job (weights, gradients, Adam moments): rank r of N
holds rows [r * c, (r + 1) * c) of dim 0, where c = ceil(rows / N), which is FSDP2's
`Shard(0)` (the last ranks may hold fewer rows, or none). 0-dim tensors (Adam's step
count) are whole on every rank. Names and metadata are the engine's
(`plexrl_worker.engine.state`), so a shard is a `JobTensors` and its bytes are the
engine's safetensors bytes.

A snapshot is a directory: one `rank-<r>-of-<N>.safetensors` per rank (each written by
its own rank) and `manifest.json` (written by the leader once every rank has written).
Any group size restores it: each new rank reads only the rows it will hold.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from plexrl_worker.engine.state import META_KEY, JobTensors, state_to_bytes

MANIFEST = "manifest.json"
"""Where `state_to_bytes` puts a state's metadata in the safetensors header."""
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


def write_shard(directory: Path, shard: JobTensors) -> tuple[str, int, str]:
    """Write one rank's shard; (file name, bytes, sha256)."""
    place = shard.metadata["shard"]
    name = shard_file(place["rank"], place["world_size"])
    data = state_to_bytes(shard)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{name}.tmp"
    tmp.write_bytes(data)
    tmp.replace(directory / name)
    return name, len(data), hashlib.sha256(data).hexdigest()


def write_manifest(directory: Path, files: list[tuple[str, int, str]]) -> None:
    """Mark the snapshot complete (after every rank wrote its file); the job's metadata
    and the whole tensors' shapes come from the first file's header."""
    with safe_open(str(directory / files[0][0]), framework="pt") as handle:
        header = handle.metadata()
    metadata: dict[str, Any] = json.loads(header[META_KEY])
    place = metadata.pop("shard")
    manifest = {
        "format": _FORMAT,
        "world_size": place["world_size"],
        "shapes": place["shapes"],
        "metadata": metadata,
        "files": [{"name": n, "bytes": b, "sha256": d} for n, b, d in files],
    }
    tmp = directory / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    tmp.replace(directory / MANIFEST)


def read_manifest(directory: Path) -> dict[str, Any]:
    """The snapshot's manifest; ValueError if there is no complete snapshot there."""
    try:
        manifest: dict[str, Any] = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"no complete group snapshot in {directory} ({exc}); save one there first"
        ) from exc
    if manifest.get("format") != _FORMAT:
        raise ValueError(f"snapshot format {manifest.get('format')!r} is not {_FORMAT!r}")
    return manifest


def read_shard(directory: Path, manifest: dict[str, Any], rank: int, world_size: int) -> JobTensors:
    """`rank`'s shard for a group of `world_size`, read from a snapshot of any size:
    only the rows this rank holds are read from each file."""
    old_world = int(manifest["world_size"])
    shapes: dict[str, list[int]] = manifest["shapes"]
    files = [directory / f["name"] for f in manifest["files"]]
    handles = [safe_open(str(f), framework="pt") for f in files]
    tensors: dict[str, torch.Tensor] = {}
    for key, shape in shapes.items():
        if not shape:
            tensors[key] = handles[0].get_tensor(key)
            continue
        lo, hi = row_range(shape[0], rank, world_size)
        pieces = []
        for old_rank, handle in enumerate(handles):
            old_lo, old_hi = row_range(shape[0], old_rank, old_world)
            a, b = max(lo, old_lo), min(hi, old_hi)
            if a < b:
                pieces.append(handle.get_slice(key)[a - old_lo : b - old_lo])
        if not pieces:  # this rank holds no rows of it: an empty tensor of its kind
            pieces.append(handles[0].get_slice(key)[0:0])
        tensors[key] = torch.cat(pieces, dim=0)
    meta = shard_metadata(manifest["metadata"], rank, world_size, shapes)
    return JobTensors(tensors, meta)
