"""Client of the state-store's HTTP API (the disk tier and checkpoint records)."""

from __future__ import annotations

import httpx
import msgspec

from plexrl import tracing
from plexrl.service_auth import auth_headers
from plexrl.stores import CheckpointRecord


class StateStoreError(RuntimeError):
    pass


class StateStoreClient:
    def __init__(self, base_url: str, timeout_s: float = 120.0, token: str | None = None) -> None:
        # Every request carries the cluster's service token (PLEXRL_SERVICE_TOKEN).
        self._http = httpx.AsyncClient(
            base_url=base_url.rstrip("/"), timeout=timeout_s, headers=auth_headers(token)
        )
        # Each request continues the caller's trace (the state-store hop of a call).
        tracing.instrument_client(self._http)

    async def close(self) -> None:
        await self._http.aclose()

    # `tenant`: the tenant a call acts for; required for a checkpoint's blob
    # (`ckpt/<tenant>/...`), which the state-store serves to that tenant only.

    async def put_blob(self, key: str, data: bytes, tenant: str | None = None) -> int:
        response = await self._http.put(
            f"/v1/blobs/{key}", content=data, headers=auth_headers(None, tenant)
        )
        _check(response, f"storing blob {key}")
        return int(response.json()["size_bytes"])

    async def get_blob(self, key: str, tenant: str | None = None) -> bytes:
        response = await self._http.get(f"/v1/blobs/{key}", headers=auth_headers(None, tenant))
        _check(response, f"reading blob {key}")
        return response.content

    async def delete_blob(self, key: str, tenant: str | None = None) -> None:
        response = await self._http.delete(f"/v1/blobs/{key}", headers=auth_headers(None, tenant))
        _check(response, f"deleting blob {key}")

    async def put_checkpoint(self, record: CheckpointRecord) -> None:
        response = await self._http.post(
            "/v1/checkpoints",
            content=msgspec.json.encode(record),
            headers={"content-type": "application/json", **auth_headers(None, record.tenant)},
        )
        _check(response, f"recording checkpoint {record.path}")

    async def delete_checkpoint(self, path: str, tenant: str) -> bool:
        """Delete a checkpoint's record and blob; False if there was none."""
        response = await self._http.delete(
            "/v1/checkpoints", params={"path": path}, headers=auth_headers(None, tenant)
        )
        if response.status_code == 404:
            return False
        _check(response, f"deleting checkpoint {path}")
        return True

    async def healthy(self) -> bool:
        try:
            response = await self._http.get("/healthz")
        except httpx.HTTPError:
            return False
        return response.status_code == 200


def _check(response: httpx.Response, doing: str) -> None:
    if response.status_code >= 400:
        raise StateStoreError(f"state-store failed {doing}: {response.status_code} {response.text}")
