"""Checkpoints past their TTL are deleted, and the copies of changed records follow them.

Readers already treat an expired record as gone (`CheckpointRecord.readable_by`); this
sweep frees what it holds. An expired checkpoint goes the way a user's delete goes: its
record is removed with a tombstone for its blob in one Redis script, then the blob and
the copy of the record kept beside it are deleted here. The tombstone is left for the
rebuild's next round to drop (`CheckpointRecords.bury`), so a rebuild that listed the
copy just before it was deleted cannot put the record back: the tombstone refuses it.
The expiry index (`ckpt-expiry`) lives in Redis with the records, so an expiry survives
a restart of any service, and one that passed while the state-store was down is swept
at its first round.

A TTL or publication changed after the save (and a save's own TTL, taken by its record
in Redis) leaves the copy beside the blob stale; each round rewrites the copies of the
records named in `ckpt-changed`, so a record rebuilt after Redis lost its data keeps
its expiry and publication.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from plexrl.state_store_client import blob_tenant
from plexrl.stores.checkpoints import CheckpointStore
from plexrl_state_store.records import CheckpointRecords

log = logging.getLogger(__name__)

BATCH = 100
"""Records handled per Redis read; a round reads until none is left."""


class ExpirySweeper:
    def __init__(
        self,
        store: CheckpointStore,
        records: CheckpointRecords,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._records = records
        self._clock = clock

    async def copy_changed(self) -> int:
        """Rewrite the copies of records changed since they were kept; returns how many."""
        done = 0
        while paths := await self._store.changed(BATCH):
            # Unmarked first: a change made while its copy is written marks it again.
            await self._store.copied(paths)
            for path in paths:
                record = await self._store.get_checkpoint(path)
                if record is not None:  # deleted since: its copy went with it
                    await asyncio.to_thread(self._records.keep, record)
                    done += 1
        return done

    async def sweep(self) -> list[str]:
        """Delete every checkpoint whose expiry has passed; returns their paths."""
        now = self._clock()
        deleted: list[str] = []
        while due := await self._store.due(now, BATCH):
            settled = 0
            for path in due:
                record = await self._store.get_checkpoint(path)
                if record is not None and not record.expired(now):
                    continue  # its TTL was renewed as it came due: the index has it later
                if record is not None:
                    await self._store.delete_checkpoint(record)  # also leaves the index
                    if blob_tenant(record.blob_key) == record.tenant:
                        await asyncio.to_thread(self._records.forget, record.blob_key)
                    deleted.append(path)
                else:  # deleted by its owner since
                    await self._store.not_due([path])
                settled += 1
            if settled < len(due):
                break
        if deleted:
            log.info("deleted %d expired checkpoints", len(deleted))
        return deleted

    async def run(self, stop: asyncio.Event, interval_s: float) -> None:
        """A round at start and every `interval_s` until `stop`; a failed round (Redis
        away, a full disk) is logged and the next one tries again."""
        while not stop.is_set():
            try:
                await self.copy_changed()
                await self.sweep()
            except Exception:
                log.warning("sweeping expired checkpoints failed", exc_info=True)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)
