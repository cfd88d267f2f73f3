"""Checkpoint records kept beside their blobs, so Redis can lose them and get them back.

Redis holds the records the gateway lists and loads from; a Redis that restarted
without its append-only file (or lost its last second) would leave the blobs orphaned.
So the state-store writes each record it accepts next to its blob, under a directory
no blob key can name (`#` is not allowed in keys), and puts back any record Redis
lacks: at start, then every few seconds. A deleted checkpoint's record goes with it.

A delete made while this store was away left only a tombstone in Redis (the record
is gone there, blob and copy are still here): each round deletes tombstoned blobs and
their copies first, so what was deleted stays deleted however the services restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import msgspec

from plexrl.stores import CheckpointRecord, CheckpointStore, FencedWriteError
from plexrl_state_store.blobs import BlobStore

log = logging.getLogger(__name__)


class CheckpointRecords:
    def __init__(self, blobs: BlobStore, store: CheckpointStore) -> None:
        self._blobs = blobs
        self._store = store

    def _name(self, blob_key: str) -> str:
        self._blobs.validate(blob_key)  # refuses keys that could name something else
        return f"{blob_key}.json"

    def keep(self, record: CheckpointRecord) -> None:
        """Write the record beside its blob (atomically: a crash leaves old or new);
        DiskFullError when there is no room for it."""
        self._blobs.put_record(self._name(record.blob_key), msgspec.json.encode(record))

    def forget(self, blob_key: str) -> None:
        """Delete a checkpoint's blob and the copy of its record (the copy first: a copy
        without its blob is never restored)."""
        self._blobs.delete_record(self._name(blob_key))
        self._blobs.delete(blob_key)

    def kept(self) -> list[CheckpointRecord]:
        """Every record kept whose blob is still there."""
        records: list[CheckpointRecord] = []
        for name, data in self._blobs.records():
            try:
                record = msgspec.json.decode(data, type=CheckpointRecord)
            except (msgspec.DecodeError, msgspec.ValidationError):
                log.warning("skipping unreadable checkpoint record %s", name)
                continue
            if self._blobs.size(record.blob_key) is not None:
                records.append(record)
        return records

    async def bury(self) -> int:
        """Delete the blobs (and copies) of checkpoints deleted while this store was away;
        returns how many."""
        tombstones = await self._store.tombstones()
        for blob_key in tombstones:
            try:
                self.forget(blob_key)
            except ValueError:  # a key no blob can have: nothing of it is here
                log.warning("tombstone of an invalid blob key %r dropped", blob_key)
        await self._store.buried(list(tombstones))
        return len(tombstones)

    async def rebuild(self) -> int:
        """Finish deletes, then put back the records Redis lacks; returns how many."""
        await self.bury()
        restored = 0
        for record in self.kept():
            standing = await self._store.get_checkpoint(record.path)
            if standing is not None and standing.blob_key != record.blob_key:
                # Replaced by a later save (the store died before forgetting it): its
                # blob is referenced by nothing and can never be again (keys are unique).
                self.forget(record.blob_key)
                continue
            if standing is None:
                try:
                    await self._store.put_checkpoint(record)
                except FencedWriteError:  # deleted since `bury` read the tombstones
                    continue
                restored += 1
        if restored:
            log.warning("restored %d checkpoint records Redis had lost", restored)
        return restored

    async def run(self, stop: asyncio.Event, interval_s: float, temp_age_s: float) -> None:
        """Rebuild at start and every `interval_s` until `stop` (Redis may restart anytime);
        each round also removes temp files of writes that died over `temp_age_s` ago."""
        while not stop.is_set():
            try:
                await asyncio.to_thread(self._blobs.sweep_temp, temp_age_s)
                await self.rebuild()
            except Exception:  # Redis away: the next round tries again
                log.warning("rebuilding checkpoint records failed", exc_info=True)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)
