"""Deleting a checkpoint: through the state-store, which owns the blob and its record."""

from __future__ import annotations

import logging

import httpx

from plexrl import tracing
from plexrl.endpoints import failover_client
from plexrl.service_auth import auth_headers
from plexrl.stores import CheckpointRecord, CheckpointStore

log = logging.getLogger(__name__)


class CheckpointRemover:
    def __init__(
        self, records: CheckpointStore, state_store_url: str, token: str | None = None
    ) -> None:
        self._records = records
        # Several replicas may be listed (comma separated): plexrl.endpoints.
        self._http = failover_client(state_store_url, timeout=10.0)
        # A delete_checkpoint call's state-store hop stays in the call's trace.
        tracing.instrument_client(self._http)
        self._token = token

    async def close(self) -> None:
        await self._http.aclose()

    async def delete(self, record: CheckpointRecord) -> bool:
        """Forget the checkpoint; True when its blob was deleted too.

        When the state-store cannot be reached, the record is removed here with a
        tombstone for its blob (the path stops resolving at once); the state-store
        deletes the blob and its copy of the record when it is back, before it would
        restore any record, so the delete lasts across its restart.
        """
        try:
            response = await self._http.delete(
                "/v1/checkpoints",
                params={"path": record.path},
                headers=auth_headers(self._token, record.tenant),
            )
            if response.status_code < 300:
                return True
            reason = f"{response.status_code} {response.text[:200]}"
        except httpx.HTTPError as exc:
            reason = repr(exc)
        await self._records.delete_checkpoint(record)
        log.warning(
            "state-store did not delete %s (%s): record removed, blob %s tombstoned for "
            "the state-store to delete when it is back",
            record.path,
            reason,
            record.blob_key,
        )
        return False
