"""Checkpoint records kept beside their blobs, so Redis can lose them and get them back.

Redis holds the records the gateway lists and loads from; a Redis that restarted
without its append-only file (or lost its last second) would leave the blobs orphaned.
So the state-store writes each record it accepts next to its blob, under a directory
no blob key can name (`#` is not allowed in keys), and puts back any record Redis
lacks: at start, then every few seconds. A deleted checkpoint's record goes with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
from pathlib import Path

import msgspec

from plexrl.stores import CheckpointRecord, CheckpointStore
from plexrl_state_store.blobs import BlobDir

log = logging.getLogger(__name__)

RECORDS_DIR = "#records"


class CheckpointRecords:
    def __init__(self, blobs: BlobDir, store: CheckpointStore) -> None:
        self._blobs = blobs
        self._store = store
        self._root = blobs.root / RECORDS_DIR

    def _file(self, record: CheckpointRecord) -> Path:
        self._blobs.path(record.blob_key)  # refuses keys that could leave the directory
        return self._root / f"{record.blob_key}.json"

    def keep(self, record: CheckpointRecord) -> None:
        """Write the record beside its blob (atomically: a crash leaves old or new)."""
        target = self._file(record)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(msgspec.json.encode(record))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def forget(self, record: CheckpointRecord) -> None:
        self._file(record).unlink(missing_ok=True)

    def kept(self) -> list[CheckpointRecord]:
        """Every record kept whose blob is still there."""
        records: list[CheckpointRecord] = []
        for path in sorted(self._root.rglob("*.json")) if self._root.is_dir() else []:
            try:
                record = msgspec.json.decode(path.read_bytes(), type=CheckpointRecord)
            except (OSError, msgspec.DecodeError, msgspec.ValidationError):
                log.warning("skipping unreadable checkpoint record %s", path)
                continue
            if self._blobs.size(record.blob_key) is not None:
                records.append(record)
        return records

    async def rebuild(self) -> int:
        """Put back the records Redis lacks; returns how many."""
        restored = 0
        for record in self.kept():
            if await self._store.get_checkpoint(record.path) is None:
                await self._store.put_checkpoint(record)
                restored += 1
        if restored:
            log.warning("restored %d checkpoint records Redis had lost", restored)
        return restored

    async def run(self, stop: asyncio.Event, interval_s: float) -> None:
        """Rebuild at start and every `interval_s` until `stop` (Redis may restart anytime)."""
        while not stop.is_set():
            try:
                await self.rebuild()
            except Exception:  # Redis away: the next round tries again
                log.warning("rebuilding checkpoint records failed", exc_info=True)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)
