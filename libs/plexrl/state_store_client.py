"""Client of the state-store's HTTP API (the disk tier and checkpoint records)."""

from __future__ import annotations

import httpx
import msgspec

from plexrl.meta import CheckpointRecord


class StateStoreError(RuntimeError):
    pass


class StateStoreClient:
    def __init__(self, base_url: str, timeout_s: float = 120.0) -> None:
        self._http = httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=timeout_s)

    async def close(self) -> None:
        await self._http.aclose()

    async def put_blob(self, key: str, data: bytes) -> int:
        response = await self._http.put(f"/v1/blobs/{key}", content=data)
        _check(response, f"storing blob {key}")
        return int(response.json()["size_bytes"])

    async def get_blob(self, key: str) -> bytes:
        response = await self._http.get(f"/v1/blobs/{key}")
        _check(response, f"reading blob {key}")
        return response.content

    async def delete_blob(self, key: str) -> None:
        response = await self._http.delete(f"/v1/blobs/{key}")
        _check(response, f"deleting blob {key}")

    async def put_checkpoint(self, record: CheckpointRecord) -> None:
        response = await self._http.post(
            "/v1/checkpoints",
            content=msgspec.json.encode(record),
            headers={"content-type": "application/json"},
        )
        _check(response, f"recording checkpoint {record.path}")

    async def healthy(self) -> bool:
        try:
            response = await self._http.get("/healthz")
        except httpx.HTTPError:
            return False
        return response.status_code == 200


def _check(response: httpx.Response, doing: str) -> None:
    if response.status_code >= 400:
        raise StateStoreError(f"state-store failed {doing}: {response.status_code} {response.text}")
