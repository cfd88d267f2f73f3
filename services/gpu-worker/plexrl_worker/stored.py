"""A job's state on the disk tier, as any executor writes and reads it.

One rank writes one safetensors blob (`<prefix>.safetensors`, `engine.state`'s format).
A group of N ranks writes a blob set: each rank its own rows
(`<prefix>.ranks<N>/rank-<r>-of-<N>.safetensors`, `shards`' layout) and then the
leader a manifest (`<prefix>.ranks<N>/manifest.json`: the whole shapes, the job's
metadata, each file's bytes and sha256), whose key names the set. Every member's key
follows from the manifest's, so a set is deleted by its key even when its writer died
before the manifest. Any group size reads either form: each rank only its own rows.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch

from plexrl.state_store_client import StateStoreClient
from plexrl_worker import shards
from plexrl_worker.engine.state import JobTensors, state_from_bytes

Buffer = bytes | bytearray | memoryview

MANIFEST = "manifest.json"
_SET = re.compile(r"^(?P<dir>.*\.ranks(?P<n>[1-9][0-9]*))/manifest\.json$")


def set_key(prefix: str, world_size: int) -> str:
    """The key (its manifest's) of the blob set a group of `world_size` writes."""
    return f"{prefix}.ranks{world_size}/{MANIFEST}"


def is_set(key: str) -> bool:
    return _SET.match(key) is not None


def member_key(key: str, rank: int) -> str:
    """Rank `rank`'s blob in the set named by `key`."""
    found = _SET.match(key)
    if found is None:
        raise ValueError(f"{key!r} names no blob set")
    return f"{found['dir']}/{shards.shard_file(rank, int(found['n']))}"


def members(key: str) -> list[str]:
    """Every blob a state stored under `key` consists of, the manifest last."""
    found = _SET.match(key)
    if found is None:
        return [key]
    return [member_key(key, r) for r in range(int(found["n"]))] + [key]


def rows_of(key: str, read: Callable[[str], Buffer], rank: int, world_size: int) -> JobTensors:
    """Rank `rank`'s rows (of a group of `world_size`) of the state stored under `key`,
    whatever size of group wrote it; `read(key)` gives a blob's bytes."""
    if not is_set(key):
        whole = state_from_bytes(read(key))
        if world_size == 1:
            return whole
        shapes = {k: list(t.shape) for k, t in whole.tensors.items()}
        tensors = {
            k: shards.shard_of(t, rank, world_size).clone() for k, t in whole.tensors.items()
        }
        meta = shards.shard_metadata(whole.metadata, rank, world_size, shapes)
        return JobTensors(tensors, meta)
    listing: dict[str, Any] = json.loads(bytes(read(key)))
    loaded: dict[str, Mapping[str, torch.Tensor]] = {}

    def load(name: str) -> Mapping[str, torch.Tensor]:
        if name not in loaded:
            loaded[name] = state_from_bytes(read(f"{key.rpartition('/')[0]}/{name}")).tensors
        return loaded[name]

    return shards.read_shard(listing, load, rank, world_size)


async def read_whole(store: StateStoreClient, key: str) -> JobTensors:
    """The whole state stored under `key` (one blob or a set), parsed off the loop."""
    blobs = {name: await store.get_blob(name) for name in members(key)}
    whole = await asyncio.to_thread(rows_of, key, lambda name: blobs[name], 0, 1)
    whole.metadata.pop("shard", None)  # the whole state, as one device's engine names it
    return whole


async def delete(store: StateStoreClient, key: str, tenant: str | None = None) -> None:
    """Delete every blob of the state stored under `key` (one already gone is fine)."""
    for name in members(key):
        await store.delete_blob(name, tenant)
